"""Whole model on the kernel path: a tiny Q4_K_M Gemma-4 with GGUF-quantized weights, every op the
CUDA path fuses run as its Triton kernel (`kernels_on_cpu()`: the interpreter on the CPU) —
quantized matmuls, the fused attention prologue storing K/V into the pooled slabs, decode
attention, the fused residual norms, GELU·mul, softcap, the embedding rows dequantized by the
kernel — through the Engine (prefill chunks through the runner, decode through the batched
decoder) gives the reference path's logits and greedy tokens."""
from __future__ import annotations

import contextlib
import os
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the kernel path needs triton")

from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import Engine, EngineConfig  # noqa: E402
from kernels.triton.launch import kernels_on_cpu  # noqa: E402
from models.kv_cache import DenseKVCache  # noqa: E402
from models.loader import load_model  # noqa: E402
from models.formats import QuantWeight  # noqa: E402
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4  # noqa: E402

# 4 layers (S, F, S, F), the last two KV-shared, PLE 64 (so L*P = 256 quantizes to K-quants).
# Q4_K_M gives layer 1 a Q6_K attn_v beside Q4_K q/k: a q+k attn_qkv plus a separate attn_v.
SPEC = TinySpec(n_layer=4, pattern=[True, False, True, False], n_kv_shared=2, ple_width=64, n_head=4,
                n_kv_head=2, sliding_window=6)
# Every kernel of the CUDA decode/prefill path. (kv_store is not among them: with the triton
# backend the attention prologue stores K/V itself; nor gelu_tanh_mul: the GELU·mul of the MLP and
# of the per-layer-input gate are GEMV epilogues.)
KERNELS = {"_gemv_kernel", "_qkv_norm_rope_store_kernel", "_rms_norm_rope_kernel", "_add_rms_norm_kernel",
           "_softcap_kernel", "_qdequant_kernel", "_decode_split_kernel",
           "_extend_kernel"}


@contextlib.contextmanager
def launched_kernels():
    """Counts every Triton launch by kernel name (and runs it)."""
    from triton.runtime.jit import KernelInterface

    names: Counter = Counter()
    original = KernelInterface.__getitem__

    def getitem(self, grid):
        names[getattr(getattr(self, "fn", self), "__name__", repr(self))] += 1
        return original(self, grid)

    KernelInterface.__getitem__ = getitem
    try:
        yield names
    finally:
        KernelInterface.__getitem__ = original


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    d = tmp_path_factory.mktemp("kmodel")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", SPEC, seed=13), d / "q4.gguf")


def _run(model, backend: str, kv: str, prompt: list[int]):
    """Greedy tokens and every logits row the engine computed (prefill's last row, then decode)."""
    eng = Engine(model, None, EngineConfig(full_tokens=64, window_tokens=64, prefill_chunk=6, kv_cache_dtype=kv,
                                           swa_kv_cache_dtype=kv, attention_backend=backend, batched_decode=True))
    assert eng.status()["attention_backend"] == backend
    req = eng.add(prompt, SamplingParams(max_tokens=3))
    logits = []
    runner_forward, decoder_forward = eng.runner.forward, eng.decoder.forward

    def spy_runner(*a, **k):
        out = runner_forward(*a, **k)
        if out is not None:
            logits.append(out.double().reshape(-1, out.shape[-1]))
        return out

    def spy_decoder(*a, **k):
        out = decoder_forward(*a, **k)
        logits.append(out[0].double().reshape(-1, out[0].shape[-1]))
        return out

    eng.runner.forward, eng.decoder.forward = spy_runner, spy_decoder
    eng.run_to_completion()
    return req.output_ids, torch.cat(logits)


@pytest.mark.parametrize("kv", ["fp32", "int8_per_token_head"])
def test_kernel_path_matches_reference(q4, kv):
    ref = load_model(q4).model
    fast = load_model(q4, quantized=True).model
    kinds = {type(w).__name__ for w in fast.w.values()}
    assert "QuantWeight" in kinds and isinstance(fast.head_w, QuantWeight)
    assert {"blk.1.attn_qkv.weight", "blk.1.attn_v.weight", "blk.0.attn_qkv.weight"} <= set(fast.w)
    assert "blk.0.attn_v.weight" not in fast.w and "blk.0.ffn_gate_up.weight" in fast.w
    prompt = [2] + np.random.default_rng(3).integers(11, 384, size=10).tolist()  # longer than window 6
    want_ids, want = _run(ref, "torch", kv, prompt)
    with kernels_on_cpu(), launched_kernels() as names:
        got_ids, got = _run(fast, "triton", kv, prompt)
    assert KERNELS <= set(names), f"kernels never launched: {KERNELS - set(names)}"
    assert "_kv_store_kernel" not in names, names
    assert got_ids == want_ids
    assert got.shape == want.shape == (1 + 2, 384)  # prefill's last row, then two decode steps
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.9999, cos


def test_decode_with_gemvs_split_over_k_keeps_the_reference_tokens(q4, monkeypatch):
    """EDGEGEM_GEMV_SPLIT=3 (the quick GPU check's split rerun): every one-row decode GEMV of the
    tiny model split over K, the GLU and per-layer-input epilogues in the reduction launch; the
    greedy tokens and logits of the reference, as without the split."""
    from kernels.env import reload

    ref = load_model(q4).model
    prompt = [2] + np.random.default_rng(4).integers(11, 384, size=10).tolist()
    want_ids, want = _run(ref, "torch", "fp32", prompt)
    monkeypatch.setenv("EDGEGEM_GEMV_SPLIT", "3")
    reload()
    with kernels_on_cpu(), launched_kernels() as names:
        got_ids, got = _run(load_model(q4, quantized=True).model, "triton", "fp32", prompt)
    assert names["_gemv_reduce_kernel"] > 0 and got_ids == want_ids
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.9999


def test_kernel_path_without_attn_v_and_dense_cache(tmp_path):
    """31B-style layers without attn_v (V = the raw K) and a plain DenseKVCache (no slabs: the
    prologue kernel returns K/V and the cache stores them), through `forward`."""
    spec = TinySpec(n_layer=4, pattern=[True, False, True, False], n_kv_shared=2, ple_width=64,
                    v_on_full_layers=False)
    path = quantize_gguf(write_tiny_gemma4(tmp_path / "f32.gguf", spec, seed=5), tmp_path / "q4.gguf")
    fast = load_model(path, quantized=True).model
    assert "blk.1.attn_v.weight" not in fast.w
    tokens = torch.tensor([2, 17, 99, 200, 5, 383, 64, 9])
    want = load_model(path).model.forward(tokens)
    with kernels_on_cpu(), launched_kernels() as names:
        cache = DenseKVCache()
        got = fast.forward(tokens, cache=cache)
    assert names["_qkv_norm_rope_store_kernel"] == 2 and len(cache) == len(tokens)
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert cos.min() > 0.9999, cos


def test_embedding_rows_dequantized_on_the_device(q4):
    """Kernel path of `embed`: the quantized rows of both tables (token_embd, per_layer_token_embd)
    are gathered as bytes and dequantized by a Triton kernel (GGUF rows, or the tied head's
    repacked planes); x and the per-layer inputs equal
    the CPU path's (host dequantization, models.quant), also when written into given buffers."""
    from models.ops import quant_rows_to_device

    model = load_model(q4, quantized=True).model
    ids = torch.tensor([5, 0, 383, 5, 77])
    tables = [model.w["token_embd.weight"], model.w["per_layer_token_embd.weight"]]
    want_x, want_pl = model.embed(ids)
    with kernels_on_cpu(), launched_kernels() as names:
        rows = quant_rows_to_device(tables, ids, torch.device("cpu"), torch.float32)
        got_x, got_pl = model.embed(ids)
        x_buf, pl_buf = torch.empty_like(want_x), torch.empty_like(want_pl)
        model.embed_into(ids, x_buf, pl_buf)
    # the PLE table's GGUF rows (qdequant); the tied head's repacked rows (its own dequant kernel)
    assert names["_qdequant_kernel"] == 3 and names["_dequant_packed_kernel"] == 3
    assert names["_add_rms_norm_kernel"] == 2
    for r, t in zip(rows, tables):  # dequantization is exact
        assert torch.equal(r, t.rows(ids))
    assert torch.equal(got_x, want_x) and torch.equal(x_buf, want_x)
    assert got_pl.shape == want_pl.shape == (5, SPEC.n_layer, SPEC.ple_width)
    torch.testing.assert_close(got_pl, want_pl, rtol=1e-5, atol=1e-5)
    assert torch.equal(pl_buf, got_pl)


def test_gemma3_kernel_path():
    """Gemma 3 on the kernel path (fused norms, residual updates carrying the next norm, fp32 RoPE
    tables, a Q8_0 token table dequantized by the kernel) gives the reference logits."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from models.gemma3 import Gemma3Model
    from tiny_models import tiny_gemma3

    dense = tiny_gemma3()
    emb = dense.w["token_embd.weight"]
    q8 = QuantWeight(torch.from_numpy(quantize(emb.numpy(), GGMLQuantizationType.Q8_0)),
                     int(GGMLQuantizationType.Q8_0), tuple(emb.shape), lookup=True)
    model = Gemma3Model(dense.cfg, {**dense.w, "token_embd.host": q8})  # lookups from the Q8_0 rows
    tokens = torch.tensor([2, 17, 99, 200, 5, 383, 64, 9, 1, 300])  # longer than window 6
    want = model.forward(tokens)
    with kernels_on_cpu(), launched_kernels() as names:
        got = model.forward(tokens)
    assert names["_qdequant_kernel"] == 1 and names["_add_rms_norm_kernel"] == 2 * dense.cfg.n_layer
    assert names["_rms_norm_rope_kernel"] == 1 + 2 * dense.cfg.n_layer  # layer 0's norm, then q and k
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert cos.min() > 0.9999, cos
