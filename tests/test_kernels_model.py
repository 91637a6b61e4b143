"""Whole model on the kernel path: a tiny Q4_K_M Gemma-4 with GGUF-quantized weights through
`kernels.qmatmul` and pooled KV through `kernels.kv_store` / `kernels.attention` (Triton's
interpreter on the CPU) gives the reference path's logits and greedy tokens."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the kernel path needs triton")

from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import Engine, EngineConfig  # noqa: E402
from models.loader import load_model  # noqa: E402
from models.weights import QuantWeight  # noqa: E402
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4  # noqa: E402

# 4 layers (S, F, S, F), the last two KV-shared, PLE 64 (so L*P = 256 quantizes to K-quants).
SPEC = TinySpec(n_layer=4, pattern=[True, False, True, False], n_kv_shared=2, ple_width=64, n_head=4,
                n_kv_head=2, sliding_window=6)


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    d = tmp_path_factory.mktemp("kmodel")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", SPEC, seed=13), d / "q4.gguf")


@pytest.mark.parametrize("kv", ["fp32", "int8_per_token_head"])
def test_kernel_path_matches_reference(q4, kv):
    ref = load_model(q4)
    fast = load_model(q4, quantized=True)
    kinds = {type(w).__name__ for w in fast.model.w.values()}
    assert "QuantWeight" in kinds and isinstance(fast.model.head_w, QuantWeight)
    prompt = [2] + np.random.default_rng(3).integers(11, 384, size=10).tolist()  # longer than window 6
    params = SamplingParams(max_tokens=3)
    outs = {}
    for name, lm, backend in (("ref", ref, "torch"), ("kernels", fast, "triton")):
        eng = Engine(lm.model, None, EngineConfig(full_tokens=64, window_tokens=64, prefill_chunk=6,
                                                  kv_cache_dtype=kv, swa_kv_cache_dtype=kv,
                                                  attention_backend=backend))
        assert eng.status()["attention_backend"] == backend
        req = eng.add(prompt, params)
        logits = []
        runner_forward = eng.runner.forward

        def spy(*a, **k):
            out = runner_forward(*a, **k)
            if out is not None:
                logits.append(out.double())
            return out

        eng.runner.forward = spy
        eng.run_to_completion()
        outs[name] = (req.output_ids, torch.stack(logits))
    assert outs["kernels"][0] == outs["ref"][0]
    cos = torch.nn.functional.cosine_similarity(outs["kernels"][1], outs["ref"][1], dim=-1)
    assert cos.min() > 0.9999, cos
