"""Our Gemma-4 forward against llama.cpp (the oracle) and against a float64 run of itself.

Tiny random models written with the gguf writer, F32 and quantized to Q4_K_M by llama.cpp's own
quantizer. Prompts run past the sliding window so masking, KV sharing and proportional RoPE all
show up in the logits.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.gemma4 import Gemma4Config, load_gemma4
from models.kv_cache import DenseKVCache
from models.gguf import GGUFFile
from tiny_models import TinySpec, llama_cpp_logits, quantize_gguf, write_tiny_gemma4

SPECS = {
    # E-series-like: PLE, KV sharing, sliding + full layers with different head dims, 2x FFN.
    "e-series-8L": TinySpec(),
    "e-series-5L-2kv": TinySpec(n_layer=5, pattern=[True, True, False, True, False], n_kv_shared=2,
                                n_head=4, n_kv_head=2, ple_width=0, sliding_window=5, double_wide=False),
    # llama.cpp maps shared layers to first-2 (sliding) / first-1 (full); keep layouts it can load.
    "e-series-12L": TinySpec(n_layer=12, n_kv_shared=6, sliding_window=11, ple_width=64,
                             pattern=[(i + 1) % 6 != 0 for i in range(12)]),
    # 26B-A4B shape: MoE block on every layer, per-layer KV heads, no attn_v on full layers (V = K).
    "moe-26b-like": TinySpec(n_layer=4, pattern=[True, True, True, False], n_kv_shared=0, ple_width=0,
                             n_head=4, n_kv_head=[2, 2, 2, 1], n_expert=4, n_expert_used=2, expert_ffn=256,
                             double_wide=False, v_on_full_layers=False),
    # 31B shape: dense, no PLE, no KV sharing, per-layer KV heads, V = raw K on full layers.
    "dense-31b-like": TinySpec(n_layer=6, pattern=[True, True, False, True, True, False], n_kv_shared=0,
                               ple_width=0, n_head=4, n_kv_head=[2, 2, 1, 2, 2, 1], double_wide=False,
                               v_on_full_layers=False),
    # A converter-fused attn_qkv tensor instead of separate q/k/v.
    "fused-qkv": TinySpec(n_layer=4, pattern=[True, False, True, False], n_kv_shared=2, ple_width=0,
                          double_wide=False, fused_qkv=True),
}


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _prompt(n_vocab: int, n: int, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return [2] + rng.integers(5, n_vocab, size=n - 1).tolist()


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    f32 = write_tiny_gemma4(d / "f32.gguf", SPECS[request.param], seed=7)
    q4 = quantize_gguf(f32, d / "q4km.gguf")
    return request.param, f32, q4


def _ours(path, tokens, dtype=torch.float32, cfg_patch=None) -> np.ndarray:
    f = GGUFFile(path)
    model = load_gemma4(f, dtype=dtype)
    if cfg_patch:
        cfg_patch(model)
    return model.forward(torch.tensor(tokens)).double().numpy()


@pytest.mark.parametrize("quant", ["f32", "q4km"])
def test_logits_match_llama_cpp(tiny, quant):
    name, f32, q4 = tiny
    path = f32 if quant == "f32" else q4
    tokens = _prompt(SPECS[name].n_vocab, 40)
    ref = llama_cpp_logits(path, tokens)
    ours = _ours(path, tokens)
    cos = _cosines(ours, ref)
    top1 = (ours.argmax(-1) == ref.argmax(-1)).mean()
    print(f"{name}/{quant}: min cosine {cos.min():.5f}, top-1 agreement {top1:.3f}")
    assert cos.min() >= 0.99, f"worst position {cos.argmin()}: cosine {cos.min():.5f}"
    assert top1 >= 0.9


def test_float32_equals_float64_reference(tiny):
    name, _, q4 = tiny
    tokens = _prompt(SPECS[name].n_vocab, 40, seed=3)
    c = _cosines(_ours(q4, tokens), _ours(q4, tokens, dtype=torch.float64))
    assert c.min() >= 0.99999, c.min()


def test_fast_cpu_weights_match_exact(tiny):
    """The float16 runtime format (fused q/k/v and gate/up, models/weights.py) vs the exact path."""
    name, _, q4 = tiny
    tokens = _prompt(SPECS[name].n_vocab, 20, seed=5)
    exact = load_gemma4(GGUFFile(q4))
    fast = load_gemma4(GGUFFile(q4), weight_dtype=torch.float16)
    cache_e, cache_f = DenseKVCache(), DenseKVCache()
    # prefill (float32 GEMM on upcast weights), then single-token decode steps (float16 GEMV)
    a = [exact.forward(torch.tensor(tokens[:12]), cache=cache_e)]
    b = [fast.forward(torch.tensor(tokens[:12]), cache=cache_f)]
    for p in range(12, 20):
        a.append(exact.forward(torch.tensor(tokens[p:p + 1]), torch.tensor([p]), cache_e))
        b.append(fast.forward(torch.tensor(tokens[p:p + 1]), torch.tensor([p]), cache_f))
    c = _cosines(torch.cat(a).double().numpy(), torch.cat(b).double().numpy())
    assert c.min() >= 0.9999, c.min()


def test_quantized_file_really_holds_k_quants(tiny):
    _, _, q4 = tiny
    types = {t.type_name for t in GGUFFile(q4)}
    assert {"Q4_K", "Q6_K"} & types, types


def test_wrong_kv_source_is_caught(tmp_path):
    """The comparison above must go red if a shared layer reads the wrong source layer's KV."""
    spec = TinySpec()
    path = write_tiny_gemma4(tmp_path / "m.gguf", spec, seed=11)
    cfg = Gemma4Config.from_gguf(GGUFFile(path))
    assert cfg.kv_shared_layers == ((4, 2), (5, 2), (6, 2), (7, 3))
    tokens = _prompt(spec.n_vocab, 24)
    ref = llama_cpp_logits(path, tokens)
    good = _cosines(_ours(path, tokens), ref)
    assert good.min() >= 0.99

    def misroute(model):
        c = model.cfg
        # Same-type but wrong source: sliding shared layers read layer 0 instead of the last one.
        wrong = tuple((layer, 0 if c.is_sliding[layer] else src) for layer, src in c.kv_shared_layers)
        bad = dataclasses.replace(c)
        object.__setattr__(bad, "kv_shared_layers", wrong)
        model.cfg = bad

    bad = _cosines(_ours(path, tokens, cfg_patch=misroute), ref)
    assert bad.min() < 0.99, f"a misrouted KV source went unnoticed (min cosine {bad.min():.4f})"


def test_trace_hook_names_every_layer(tmp_path):
    path = write_tiny_gemma4(tmp_path / "t.gguf", TinySpec(n_layer=4, pattern=[True, False, True, False],
                                                          n_kv_shared=2, ple_width=0, double_wide=False))
    seen = []
    model = load_gemma4(GGUFFile(path))
    model.forward(torch.tensor([2, 40, 41]), trace=lambda name, layer, t: seen.append((name, layer, tuple(t.shape))))
    names = [(n, layer) for n, layer, _ in seen]
    assert names[0] == ("inp_scaled", -1) and names[-1] == ("result_norm", -1)
    assert [layer for n, layer in names if n == "l_out"] == [0, 1, 2, 3]
    assert ("attn_out", 3) in names and all(s[0] == 3 for _, _, s in seen)
