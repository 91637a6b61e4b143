"""`edgegem kv-check` (engine/bench/kv_quality.py, app/cli_kvcheck.py): every KV format but the reference is
measured, in chunks that read stored KV; figures are KL divergences and agreement rates; the CLI
prints them as JSON or a table and caches them per model file."""
from __future__ import annotations

import json
import os

import pytest

from app.cli import main
from engine.bench import kv_quality as kvc
from engine.kv import FormatUnsupported, resolve_format
from models.loader import load_model
from tiny_models import TinySpec, write_tiny_gemma4

TOKENS, CHUNK = 40, 8  # 5 chunks, 5x the tiny model's 8-token sliding window


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("kvcheck") / "tiny-q8.gguf", TinySpec())


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_model(tiny_path)


@pytest.fixture(scope="module")
def result(tiny):
    seen = []
    r = kvc.kv_check(tiny, n_tokens=TOKENS, chunk=CHUNK, progress=lambda f, m: seen.append((f, m)))
    return r, seen


def test_every_format_but_the_reference_is_measured(result):
    r, _ = result
    assert r["reference"] == "fp32" and r["device"] == "cpu"
    assert list(r["formats"]) == ["bf16", "fp16", "int8_per_token_head", "fp8_per_token_head"]
    assert r["skipped"] == {}
    assert r["tokens"] == TOKENS > r["sliding_window"] == 8 and r["chunk"] == CHUNK
    assert r["model"]["file"] == "tiny-q8.gguf" and r["model"]["arch"] == "gemma4" and r["model"]["size"] > 0
    assert r["text"] == kvc.DEFAULT_TEXT_NAME


def test_figures_are_kl_divergences_and_agreement_rates(result):
    r, _ = result
    for name, f in r["formats"].items():
        assert -1e-9 < f["mean_kld"] <= f["p99_kld"] + 1e-12 and f["p99_kld"] <= f["max_kld"] + 1e-12, name
        assert 0.0 <= f["top1_agreement"] <= 1.0
    int8, fp16 = r["formats"]["int8_per_token_head"], r["formats"]["fp16"]
    assert 0 < int8["mean_kld"] < 0.05 and int8["top1_agreement"] >= 0.8
    assert fp16["mean_kld"] < int8["mean_kld"]  # 10 mantissa bits round less than 127 steps per head
    # bytes per context token of the full pool: the tiny model has one full KV layer, 1 head x 128
    assert int8["bytes_per_token"] == resolve_format("int8_per_token_head").unit_bytes(1, 128) == 264
    assert r["reference_bytes_per_token"] == 2 * 128 * 4


def test_reference_against_itself_is_exactly_zero(tiny):
    tokens = tiny.tokenizer.encode("It is a truth universally acknowledged, that a single man")[:24]
    r = kvc.measure(tiny.model, tokens, chunk=CHUNK, formats=["fp32"])
    assert r["formats"]["fp32"]["max_kld"] == 0.0 and r["formats"]["fp32"]["top1_agreement"] == 1.0


def test_progress_reports_each_chunk(result):
    _, seen = result
    assert [f for f, _ in seen] == [(i + 1) / 5 for i in range(5)]
    assert seen[-1][1] == f"{TOKENS}/{TOKENS} tokens, 5 KV formats"


def test_should_stop_cancels_between_chunks(tiny):
    calls = []
    with pytest.raises(kvc.KVCheckCancelled):
        kvc.kv_check(tiny, n_tokens=TOKENS, chunk=CHUNK, formats=["int8_per_token_head"],
                     progress=lambda f, m: calls.append(f), should_stop=lambda: len(calls) >= 2)
    assert len(calls) == 2


def test_formats_the_device_refuses_are_skipped(monkeypatch):
    real = kvc.resolve_format

    def refuse_fp8(name, device="cpu"):
        if name == "fp8_per_token_head":
            raise FormatUnsupported("fp8_per_token_head KV cache needs an sm_80 or newer GPU")
        return real(name, device)
    monkeypatch.setattr(kvc, "resolve_format", refuse_fp8)
    fmts, skipped = kvc.formats_to_check("cpu")
    assert fmts == ["bf16", "fp16", "int8_per_token_head"] and list(skipped) == ["fp8_per_token_head"]
    assert "sm_80" in skipped["fp8_per_token_head"]


def test_the_reference_is_bf16_on_cuda():
    assert kvc.reference_format("cuda") == "bf16"
    assert "bf16" not in kvc.formats_to_check("cuda", ("bf16", "fp32", "int8_per_token_head"))[0]


def test_text_shorter_than_tokens_caps_the_count(tiny):
    r = kvc.kv_check(tiny, text="Mr. Bennet made no answer.", n_tokens=1000, chunk=CHUNK,
                     formats=["int8_per_token_head"])
    assert r["tokens"] == len(tiny.tokenizer.encode("Mr. Bennet made no answer.")) < 1000


def test_builtin_text_is_long_enough_for_the_default():
    text = kvc.DEFAULT_TEXT.read_text(encoding="utf-8")
    assert text.startswith("PRIDE AND PREJUDICE") and len(text.split()) > 3000  # ~4260 Gemma tokens


# --- the cache ------------------------------------------------------------------------------------

def test_cache_round_trip_and_invalidation(result, tmp_path):
    r, _ = result
    assert kvc.load_result(r["model"]["path"], "cpu", tmp_path) is None
    path = kvc.save_result(r, tmp_path)
    assert path.parent == tmp_path / "kv-check" and path.name.endswith("-cpu.json")
    assert kvc.load_result(r["model"]["path"], "cpu", tmp_path) == json.loads(json.dumps(r))
    assert kvc.load_result(r["model"]["path"], "cuda", tmp_path) is None  # other device, other figures
    path.write_text("{not json")
    assert kvc.load_result(r["model"]["path"], "cpu", tmp_path) is None


def test_cache_key_changes_with_the_file(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    before = kvc.cache_path(model, "cpu", tmp_path)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # replaced in place: new mtime
    assert kvc.cache_path(model, "cpu", tmp_path) != before


# --- the CLI --------------------------------------------------------------------------------------

def test_cli_json_keys_and_cache(tiny_path, tmp_path, capsys):
    args = ["kv-check", "--model", str(tiny_path), "--tokens", "24", "--chunk", "8", "--device", "cpu",
            "--data-dir", str(tmp_path), "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert {"reference", "formats", "skipped", "tokens", "chunk", "sliding_window", "device", "model", "text",
            "seconds", "measured", "cache"} <= set(r)
    assert r["tokens"] == 24 and r["chunk"] == 8 and r["reference"] == "fp32"
    assert set(r["formats"]["int8_per_token_head"]) == {"mean_kld", "p99_kld", "max_kld", "top1_agreement",
                                                        "bytes_per_token"}
    cached = kvc.load_result(tiny_path, "cpu", tmp_path)
    assert cached is not None and cached["formats"] == r["formats"]


def test_cli_table(tiny_path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune")
    assert main(["kv-check", "--model", str(tiny_path), "--text", str(text), "--tokens", "16", "--chunk", "8",
                 "--device", "cpu", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("kv-check: tiny-q8.gguf") and "16 tokens of t.txt in 8-token chunks" in out[1]
    rows = {line.split()[0]: line.split() for line in out[3:] if line.startswith("  ") and line.split()}
    assert rows["fp32"][2] == "reference" and rows["int8_per_token_head"][-1].endswith("%")


@pytest.mark.parametrize("extra, message", [
    (["--model", "/nonexistent/model.gguf"], "model.gguf: no such file"),
    (["--text", "/nonexistent/book.txt"], "book.txt"),
    (["--tokens", "1"], "--tokens must be at least 2"),
])
def test_cli_errors_are_one_line_exit_2(tiny_path, tmp_path, capsys, extra, message):
    args = ["kv-check", "--model", str(tiny_path), "--device", "cpu", "--data-dir", str(tmp_path)]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgegem: error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "kv-check").exists()


# --- the demo model -------------------------------------------------------------------------------

@pytest.mark.slow
def test_demo_model_int8_costs_a_little(gemma3_270m_path):
    """Gemma 3 270M, 128 tokens of the book in 64-token chunks (the second reads the first's stored
    KV): int8's mean KLD is near the 4.8e-3 of docs/benchmarks.md#the-8-bit-formats-in-the-test, top-1
    agreement near 95 %."""
    lm = load_model(gemma3_270m_path)
    r = kvc.kv_check(lm, n_tokens=128, formats=["int8_per_token_head"])
    f = r["formats"]["int8_per_token_head"]
    assert r["tokens"] == 128 and r["model"]["arch"] == "gemma3" and r["sliding_window"] == 512
    assert 1e-4 < f["mean_kld"] < 0.03 and f["max_kld"] < 0.5 and f["top1_agreement"] >= 0.85, f
