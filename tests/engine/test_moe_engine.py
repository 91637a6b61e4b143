"""The 26B-A4B-shaped MoE model through the engine: prefill in chunks (every chunk one MoE graph a
layer), the radix prefix cache serving a second turn, and a KV file restoring a conversation after a
restart, each with the continuation of a cold prefill of the same tokens (tiny random model, both
the float reference and llama.cpp's kernels)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig
from kernels import ggml
from models.loader import load_model
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4

MOE = TinySpec(n_layer=3, pattern=[True, True, False], n_kv_shared=0, ple_width=0, n_head=4, n_kv_head=[2, 2, 1],
               n_expert=5, n_expert_used=3, expert_ffn=160, double_wide=False, v_on_full_layers=False, tied=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
RUNTIMES = ["reference", pytest.param("ggml", marks=pytest.mark.skipif(not ggml.available(), reason="no ggml"))]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-engine")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", MOE, seed=3), d / "q.gguf", "Q4_K_M")


_loaded: dict = {}


def _model(path, runtime: str):
    if runtime not in _loaded:
        kw = dict(dtype=torch.float32) if runtime == "reference" else dict(weight_dtype=torch.float16, cpu_quant=True)
        _loaded[runtime] = load_model(path, with_tokenizer=False, **kw)
        assert _loaded[runtime].model.runtime.value == runtime
    return _loaded[runtime]


def _engine(lm, **kw):
    return Engine(lm.model, None, EngineConfig(full_tokens=256, window_tokens=256, **kw), model_id="moe")


def _ask(eng, prompt, **kw):
    req = eng.add(list(prompt), GREEDY, **kw)
    eng.run_to_completion()
    assert req.finish_reason in ("stop", "length"), req.finish_reason
    return req


def _prompt(seed, n):
    return [2] + np.random.default_rng(seed).integers(11, 300, size=n).tolist()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_chunked_prefill_gives_the_one_chunk_continuation(moe_path, runtime, monkeypatch):
    from models import gemma4_ggml

    lm, p = _model(moe_path, runtime), _prompt(1, 40)
    rows = []
    run = gemma4_ggml.moe_ffn
    monkeypatch.setattr(gemma4_ggml, "moe_ffn", lambda r, *a: (rows.append(r.shape[0]), run(r, *a))[1])
    whole = _ask(_engine(lm, prefill_chunk=64), p)
    rows.clear()
    chunked = _ask(_engine(lm, prefill_chunk=16), p)
    assert chunked.output_ids == whole.output_ids
    if runtime == "ggml":  # each chunk's rows go through the block as one graph run a layer (the
        L = MOE.n_layer    # prompt's last token, a forward of its own, and decode: the token graph)
        assert rows[:2 * L] == [16] * 2 * L and max(rows) <= 16 and sum(rows) == (len(p) - 1) * L


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_second_turn_prefills_only_its_new_tokens(moe_path, runtime):
    lm = _model(moe_path, runtime)
    eng = _engine(lm)
    first = _ask(eng, _prompt(2, 30))
    turn2 = first.all_ids[:-1] + _prompt(3, 7)[1:]
    second = _ask(eng, turn2)
    assert second.cached_len == len(first.all_ids) - 1
    assert second.stats()["prefilled_tokens"] == len(turn2) - second.cached_len
    assert second.output_ids == _ask(_engine(lm), turn2).output_ids  # a cold prefill of the same tokens


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_kv_file_restores_a_conversation_after_a_restart(moe_path, runtime, tmp_path):
    lm, f = _model(moe_path, runtime), tmp_path / "conv.safetensors"
    a = _engine(lm)
    first = _ask(a, _prompt(4, 30), kv_session=str(f))
    a.sessions.flush()
    turn2 = first.all_ids[:-1] + _prompt(5, 6)[1:]
    b = _engine(lm)  # empty pools and cache
    again = _ask(b, turn2, kv_session=str(f))
    assert again.kv_error is None and again.restored_len == len(first.all_ids) - 1
    assert again.stats()["prefilled_tokens"] == len(turn2) - again.restored_len
    assert again.output_ids == _ask(_engine(lm), turn2).output_ids
