"""The `edgegem` command line: score / tokenize / run / info, and one-line errors with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from models.loader import load_model
from tiny_models import TinySpec, write_tiny_gemma4


def edgegem(*args, ok=True):
    r = subprocess.run([sys.executable, "-m", "app.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("cli") / "tiny.gguf", TinySpec(), seed=3)


def test_score_writes_every_position(tiny, tmp_path):
    out = tmp_path / "L.npy"
    edgegem("score", "--model", tiny, "--tokens", "2,17,300,45", "--out", out)
    logits = np.load(out)
    assert logits.shape == (4, 384) and logits.dtype == np.float32
    ref = load_model(tiny).model.forward(torch.tensor([2, 17, 300, 45])).numpy()
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


def test_tokenize_prints_json_ids(tiny):
    ids = json.loads(edgegem("tokenize", "--model", tiny, "--text", "the cat").stdout)
    lm = load_model(tiny)
    assert ids == lm.tokenizer.encode("the cat") and ids[0] == 2


def test_run_json_is_deterministic_and_complete(tiny):
    args = ("run", "--model", tiny, "--prompt", "the", "--max-tokens", "6", "--temperature", "0", "--json")
    a = json.loads(edgegem(*args).stdout.strip().splitlines()[-1])
    b = json.loads(edgegem(*args).stdout.strip().splitlines()[-1])
    assert a["ids"] == b["ids"] and a["text"] == b["text"]
    assert a["prompt_ids"][:2] == [2, 5]  # <bos><|turn>: the built-in Gemma-4 chat format
    assert set(a["timings"]) >= {"prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s"}
    raw = json.loads(edgegem(*args, "--raw").stdout.strip().splitlines()[-1])
    assert raw["prompt_ids"] == load_model(tiny).tokenizer.encode("the")


def test_run_sampling_is_seeded(tiny):
    args = ("run", "--model", tiny, "--prompt", "the", "--max-tokens", "8", "--temperature", "1.0",
            "--top-k", "50", "--json", "--raw")
    a = json.loads(edgegem(*args, "--seed", 1).stdout.splitlines()[-1])
    b = json.loads(edgegem(*args, "--seed", 1).stdout.splitlines()[-1])
    assert a["ids"] == b["ids"]


def test_dry_and_xtc_flags_reach_the_sampler():
    from app.cli import _parser
    from app.cli_options import _params

    a = _parser().parse_args(["run", "--prompt", "x", "--dry-multiplier", "0.8", "--dry-base", "2",
                              "--dry-allowed-length", "3", "--dry-penalty-last-n", "-1",
                              "--dry-sequence-breaker", "###", "--dry-sequence-breaker", "\n",
                              "--xtc-probability", "0.5", "--xtc-threshold", "0.2"])
    p = _params(a)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.8, 2.0, 3, -1)
    assert p.dry_sequence_breakers == ("###", "\n") and (p.xtc_probability, p.xtc_threshold) == (0.5, 0.2)
    default = _params(_parser().parse_args(["chat"]))
    assert default.dry_multiplier == 0.0 and default.dry_sequence_breakers == ("\n", ":", "\"", "*")
    assert default.xtc_probability == 0.0  # llama.cpp's defaults: both off
    none = _params(_parser().parse_args(["run", "--prompt", "x", "--dry-sequence-breaker", "none"]))
    assert none.dry_sequence_breakers == ()


def test_run_with_dry_and_xtc_is_the_engines_seeded_run(tiny):
    from engine import api

    args = ("run", "--model", tiny, "--prompt", "the", "--max-tokens", "12", "--temperature", "1.0", "--json",
            "--raw", "--seed", 4, "--dry-multiplier", "0.8", "--xtc-probability", "0.5")
    out = json.loads(edgegem(*args).stdout.splitlines()[-1])
    lm = api.open_model(tiny, exact=False)
    client = api.start_client(lm, api.EngineOptions())
    try:
        params = api.SamplingParams(max_tokens=12, temperature=1.0, seed=4, dry_multiplier=0.8, xtc_probability=0.5)
        ran = api.run_prompt(client, lm, "the", api.GenerationParams(params), raw=True)
    finally:
        client.close()
    assert out["ids"] == ran["ids"] and out["ids"]


def test_info_shows_layer_plan(tiny):
    text = edgegem("info", tiny).stdout
    assert "architecture gemma4" in text and "layer 2" in text and "Q4_K" not in text
    d = json.loads(edgegem("info", tiny, "--json").stdout)
    assert d["n_layer"] == 8 and d["layers"][5]["kv_source"] == 2 and d["layers"][7]["kv_source"] == 3
    assert d["tensor_types"]["F32"]["tensors"] > 50


@pytest.mark.parametrize("args,needle", [
    (("info", "/nonexistent/model.gguf"), "model.gguf: no such file"),
    (("score", "--model", "{tiny}", "--tokens", "2,99999", "--out", "x.npy"), "out of range"),
    (("score", "--model", "{tiny}", "--tokens", "2,x", "--out", "x.npy"), "comma-separated integers"),
    (("run", "--model", "{tiny}", "--prompt", "hi", "--top-p", "0"), "invalid sampling parameters"),
    (("run", "--model", "{tiny}", "--prompt", "hi", "--dry-base", "0.5"), "invalid sampling parameters"),
])
def test_bad_input_is_one_line_exit_2(tiny, tmp_path, args, needle):
    args = [a.replace("{tiny}", str(tiny)) for a in args]
    r = edgegem(*args, ok=False)
    assert r.returncode == 2
    assert r.stderr.startswith("edgegem: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_debug_shows_traceback():
    r = edgegem("--debug", "info", "/nonexistent/model.gguf", ok=False)
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_run_on_demo_model_by_default():
    r = edgegem("run", "--prompt", "The capital of France is", "--raw", "--max-tokens", "4", "--json")
    out = json.loads(r.stdout.splitlines()[-1])
    assert len(out["ids"]) == 4 and out["prompt_ids"][0] == 2


def test_run_kv_session_restores_the_prompt_and_refuses_a_damaged_file(tiny, tmp_path):
    """`run --kv-session F` twice: the second run reads the prompt's KV from F (restored_tokens) and
    prefills one token, with the same answer; a damaged F is one stderr line and a normal prefill."""
    f = tmp_path / "s.safetensors"
    args = ("run", "--model", tiny, "--prompt", "the cat sat on the mat and", "--max-tokens", "5", "--json",
            "--kv-session", f)
    first = edgegem(*args)
    a = json.loads(first.stdout.strip().splitlines()[-1])
    assert f.exists() and a["timings"]["restored_tokens"] == 0 and first.stderr == ""
    b = json.loads(edgegem(*args).stdout.strip().splitlines()[-1])
    n = len(a["prompt_ids"])
    assert b["timings"]["restored_tokens"] == n - 1 and b["timings"]["prefilled_tokens"] == 1
    assert b["ids"] == a["ids"]
    data = bytearray(f.read_bytes())
    data[-64] ^= 0x01
    f.write_bytes(bytes(data))
    r = edgegem(*args)
    c = json.loads(r.stdout.strip().splitlines()[-1])
    assert c["ids"] == a["ids"] and c["timings"]["restored_tokens"] == 0
    assert r.stderr.count("\n") == 1 and "checksum" in r.stderr and r.stderr.startswith("edgegem: KV session")
