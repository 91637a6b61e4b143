"""Concurrent requests on the CPU decode together: one token graph of B rows a step
(models/token_graph.py via ModelRunner.decode_together), each weight read once for all of them,
and each request's tokens and log-probabilities bit for bit those it gets alone (attention stays
per sequence; products of up to MAX_ROWS rows take the one-row kernels). The demo model (Gemma 3
270M Q4_K_M) and a tiny E2B-like Gemma-4 (per-layer inputs, KV-shared layers)."""
from __future__ import annotations

import pytest

from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig
from kernels import ggml
from models import token_graph
from tests.models.test_ggml_layer import picked_logprobs

pytestmark = pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")


def _run(model, prompts, n, seeds):
    """Tokens and log-probabilities of `prompts` sampled (seeds[i]) on one engine, all added at once."""
    eng = Engine(model, None, EngineConfig(full_tokens=2048))
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=n, logprobs=1) for s in seeds]
    reqs = [eng.add(list(p), sp) for p, sp in zip(prompts, params)]
    eng.run_to_completion()
    eng.check()
    return [(r.output_ids, picked_logprobs(r)) for r in reqs]


def _alone(model, prompts, n):
    return [_run(model, [p], n, [11 + i])[0] for i, p in enumerate(prompts)]


def _rows_seen(monkeypatch) -> list[int]:
    seen: list[int] = []
    step = token_graph.fused_decode_step

    def spy(model, x, *a):
        out = step(model, x, *a)
        if out is not None:
            seen.append(x.shape[0])
        return out
    for mod in ("models.gemma3", "models.gemma4"):
        monkeypatch.setattr(f"{mod}.fused_decode_step", spy)
    return seen


def test_demo_requests_decoded_together_match_each_alone(gemma3_270m_path, monkeypatch):
    from engine.api import open_model

    lm = open_model(gemma3_270m_path, exact=False)
    enc = lm.tokenizer.encode
    prompts = [[2] + enc("The lighthouse keeper climbed the stairs and"), [2] + enc("Rain fell on the"),
               [2] + enc("A short history of clocks:") + [236743] * 50]  # the last crosses a 64-key bucket
    seen = _rows_seen(monkeypatch)
    together = _run(lm.model, prompts, 16, [11, 12, 13])
    assert max(seen) == 3  # the three decoded in one graph
    assert together == _alone(lm.model, prompts, 16)


def test_tiny_gemma4_requests_decoded_together_match_each_alone(tmp_path, monkeypatch):
    import numpy as np
    import torch

    from models.loader import load_model
    from tests.models.test_gemma4_step import SHAPES
    from tiny_models import quantize_gguf, write_tiny_gemma4

    path = quantize_gguf(write_tiny_gemma4(tmp_path / "f32.gguf", SHAPES["e2b"], seed=9), tmp_path / "q.gguf")
    model = load_model(path, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
    rng = np.random.default_rng(4)
    prompts = [[2] + rng.integers(11, 300, size=n).tolist() for n in (5, 19, 12, 7)]
    seen = _rows_seen(monkeypatch)
    together = _run(model, prompts, 10, [11, 12, 13, 14])
    assert max(seen) == 4
    assert together == _alone(model, prompts, 10)
