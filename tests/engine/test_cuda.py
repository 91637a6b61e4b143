"""GPU checks (`TRITON_INTERPRET=0 pytest -m cuda` on a machine with CUDA): the compiled kernel path
gives the CPU reference's greedy tokens on a tiny Gemma-4 and on Gemma 3 270M (bf16 tolerance on
logits), and the CUDA-graph replay of the batched decode equals its eager run. Deselected by
default (`-m 'not cuda'` in pyproject) and skipped without a GPU."""
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
    """Against the CPU reference with the same KV format: on this model the first token's top two
    logits are 0.04 apart and int8 KV moves them by up to 0.1 (fp32 KV: 120, int8: 190 first, on
    the CPU as on the GPU), so the format, not the device, decides that token."""
    q4 = quantize_gguf(write_tiny_gemma4(tmp_path / "f.gguf", TinySpec(), seed=17), tmp_path / "q.gguf")
    prompt = [2] + np.random.default_rng(0).integers(11, 384, size=30).tolist()
    cpu = _greedy(load_model(q4), prompt, 16, "torch", "fp32" if kv == "bf16" else kv)
    gpu_lm = load_model(q4, dtype=torch.float32, device="cuda", quantized=True, host_embeddings=True)
    assert _greedy(gpu_lm, prompt, 16, "triton", kv) == cpu
    ref = load_model(q4).model.forward(torch.tensor(prompt)).double()
    got = gpu_lm.model.forward(torch.tensor(prompt)).double().cpu()
    assert torch.nn.functional.cosine_similarity(ref, got, dim=-1).min() > 0.999


def test_gemma3_270m_gpu_greedy_equals_cpu(gemma3_270m_path):
    from gemma3_text import PROMPTS

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


@pytest.mark.parametrize("kv,quantized", [("bf16", False), ("int8_per_token_head", True)])
def test_cuda_graph_replay_equals_eager(tmp_path, kv, quantized):
    """engine/batch_decode.py: the captured forward of B = 1, 2, 4 sequences (decode, and a T = 3
    verify for B = 2) replays to the eager static-buffer forward's logits, with host embedding
    tables (gathered outside the graph); the engine's greedy tokens do not depend on graphs."""
    from engine.batch_decode import BatchDecoder
    from engine.kv import SequenceKV

    path = write_tiny_gemma4(tmp_path / "f.gguf", TinySpec(), seed=17)
    if quantized:
        path = quantize_gguf(path, tmp_path / "q.gguf")
    lm = load_model(path, dtype=torch.float32, device="cuda", quantized=quantized, host_embeddings=True)
    model = lm.model
    eng = Engine(model, None, EngineConfig(full_tokens=1024, attention_backend="triton", kv_cache_dtype=kv,
                                           swa_kv_cache_dtype=kv, batched_decode=False))
    graphs, eager = BatchDecoder(model, eng.pools, eng.attention_backend), \
        BatchDecoder(model, eng.pools, eng.attention_backend, graphs=False)
    assert graphs.use_graphs and not eager.use_graphs
    rng = np.random.default_rng(1)
    for n, T in ((1, 1), (2, 1), (4, 1), (2, 3)):
        kvs = []
        for i in range(n):
            kv_i = SequenceKV(eng.pools, eng.window, model.dtype, backend=eng.attention_backend)
            prompt = [2] + rng.integers(11, 384, size=9 + 5 * i).tolist()
            eng.runner.forward(kv_i, prompt, 0, want_logits=False)
            kvs.append(kv_i)
        for step in range(3):  # the first captures, the next ones replay with new tables
            rows = [rng.integers(11, 384, size=T).tolist() for _ in range(n)]
            out = []
            for dec in (graphs, eager):
                for s, toks in zip(kvs, rows):
                    s.begin(torch.arange(len(s), len(s) + T))
                logits, _ = dec.forward(kvs, rows, T)
                for s in kvs:
                    s.end()
                out.append(logits.double().cpu())
                if dec is graphs:
                    for s in kvs:
                        s.truncate(len(s) - T)  # the eager run recomputes the same positions
            cos = torch.nn.functional.cosine_similarity(out[0], out[1], dim=-1)
            assert cos.min() > 0.99999, (n, T, step, cos)
            assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))
        assert graphs.statics[(n, T)].graph is not None
        for s in kvs:
            s.release()
    assert graphs.replays == 4 * 3

    prompts = [[2] + rng.integers(11, 384, size=m).tolist() for m in (20, 13, 31, 8)]
    ids = []
    for use in (True, False):
        e = Engine(model, None, EngineConfig(full_tokens=1024, attention_backend="triton", kv_cache_dtype=kv,
                                             swa_kv_cache_dtype=kv, batched_decode=True, cuda_graphs=use))
        reqs = [e.add(p, SamplingParams(temperature=0.0, max_tokens=16)) for p in prompts]
        e.run_to_completion()
        assert e.decoder.use_graphs == use
        ids.append([r.output_ids for r in reqs])
    assert ids[0] == ids[1]
