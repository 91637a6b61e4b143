"""GPU checks (`TRITON_INTERPRET=0 pytest -m cuda` on a machine with CUDA): the compiled kernel path
gives the CPU reference's greedy tokens on a tiny Gemma-4 and on Gemma 3 270M (bf16 tolerance on
logits). Deselected by default (`-m 'not cuda'` in pyproject) and skipped without a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import Engine, EngineConfig  # noqa: E402
from models.loader import load_model  # noqa: E402
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4  # noqa: E402


def _greedy(lm, prompt, n, backend, kv="auto"):
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(full_tokens=4096, prefill_chunk=256, attention_backend=backend,
                                                      kv_cache_dtype=kv, swa_kv_cache_dtype=kv))
    req = eng.add(prompt, SamplingParams(temperature=0.0, max_tokens=n))
    eng.run_to_completion()
    return req.output_ids


@pytest.mark.parametrize("kv", ["bf16", "int8_per_token_head"])
def test_tiny_gemma4_gpu_greedy_equals_cpu(tmp_path, kv):
    q4 = quantize_gguf(write_tiny_gemma4(tmp_path / "f.gguf", TinySpec(), seed=17), tmp_path / "q.gguf")
    prompt = [2] + np.random.default_rng(0).integers(11, 384, size=30).tolist()
    cpu = _greedy(load_model(q4), prompt, 16, "torch", "fp32")
    gpu_lm = load_model(q4, dtype=torch.float32, device="cuda", quantized=True, host_embeddings=True)
    assert _greedy(gpu_lm, prompt, 16, "triton", kv) == cpu
    ref = load_model(q4).model.forward(torch.tensor(prompt)).double()
    got = gpu_lm.model.forward(torch.tensor(prompt)).double().cpu()
    assert torch.nn.functional.cosine_similarity(ref, got, dim=-1).min() > 0.999


def test_gemma3_270m_gpu_greedy_equals_cpu(gemma3_270m_path):
    from test_gemma3_real import PROMPTS

    cpu_lm = load_model(gemma3_270m_path)
    gpu_lm = load_model(gemma3_270m_path, dtype=torch.bfloat16, device="cuda", quantized=True,
                        host_embeddings=True)
    for prompt in PROMPTS:
        ids = cpu_lm.tokenizer.encode(prompt)
        cpu = _greedy(cpu_lm, ids, 16, "torch", "fp32")
        gpu = _greedy(gpu_lm, ids, 16, "triton", "bf16")
        # bf16 activations: equal at least until the first near-tie
        same = next((i for i, (a, b) in enumerate(zip(cpu, gpu)) if a != b), len(cpu))
        assert same >= 8, (prompt, cpu, gpu)
