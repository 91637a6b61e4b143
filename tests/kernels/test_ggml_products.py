"""llama.cpp's CPU products through edgegem's ggml binding (kernels/ggml/lib.py).

Every GGUF matrix type against the float64 reference (gguf-py's dequantization, which is ggml's
own, times x) on odd shapes and row counts; the repack placement table against ggml's own
answer; and the products inside llama.cpp's forward of a tiny Q4_K_M Gemma-4 recomputed through
the binding, bit for bit.

Bounds, per element and rigorous: ggml rounds the activations to the weight type's `vec_dot_type`
before the dot products (the weights are exact). 8-bit block formats (Q8_K: blocks of 256, for the
K-quants and IQ4_XS; Q8_0/Q8_1: blocks of 32, the rest) round x_j to a step of amax_b/127 (Q8_K:
amax_b/128), so |dx_j| <= amax_b/254 and |dy_i| <= sum_b (amax_b/254) sum_{j in b} |W_ij|; F16
weights take f16 activations (|dx_j| <= 2^-11 |x_j|), BF16 bf16 (2^-8 |x_j|), F32 none. On top,
float32 accumulation in another order than the float64 reference: k·2^-24 · sum_j |W_ij x_j|.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from kernels import ggml

pytestmark = pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")

Q8_32 = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}  # activations in Q8_0/Q8_1 (32 values a block)
RELATIVE = {"F16": 2.0 ** -11, "BF16": 2.0 ** -8, "F32": 0.0}  # activation rounding of the dense types
# byte offsets of each block's f16 scale fields (ggml-common.h), set to small positive values
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def error_bound(raw: torch.Tensor, tn: str, shape, x: torch.Tensor) -> torch.Tensor:
    """The per-element bound [rows, n] of the module doc for ggml's x W^T."""
    from gguf.quants import dequantize

    n, k = shape
    w = torch.from_numpy(dequantize(raw.numpy(), T[tn]).astype(np.float64)).reshape(n, k).abs()
    xa = x.double().abs()
    accumulate = k * 2.0 ** -24 * (xa @ w.t())
    if tn in RELATIVE:
        return RELATIVE[tn] * (xa @ w.t()) + accumulate
    block = 32 if tn in Q8_32 else 256
    amax = xa.view(x.shape[0], k // block, block).amax(-1)  # [rows, blocks]
    wsum = w.view(n, k // block, block).sum(-1)  # [n, blocks]
    return (amax / 254) @ wsum.t() + accumulate


def random_matrix(tn: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row bytes] of random blocks of type `tn` with sane scales (weights ~1e-2)."""
    g = torch.Generator().manual_seed(seed)
    if tn in ("F16", "BF16", "F32"):
        dt = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[tn]
        return (torch.randn(n, k, generator=g) * 0.05).to(dt).view(torch.uint8).reshape(n, -1)
    bv, bb = GGML_QUANT_SIZES[T[tn]]
    blocks = torch.randint(0, 256, (n * k // bv, bb), dtype=torch.uint8, generator=g)
    for off in F16_FIELDS[tn]:
        d = (torch.rand(blocks.shape[0], generator=g) * 2e-3 + 5e-4).half()
        blocks[:, off:off + 2] = d.view(torch.uint8).view(-1, 2)
    return blocks.reshape(n, -1)


CASES = [("Q4_K", 45, 512), ("Q4_K", 48, 256), ("Q5_K", 77, 256), ("Q6_K", 45, 768), ("Q6_K", 40, 256),
         ("Q8_0", 61, 96), ("Q5_0", 33, 160), ("Q4_0", 70, 64), ("Q4_0", 72, 64), ("Q4_1", 7, 96),
         ("Q5_1", 9, 64), ("Q2_K", 24, 256), ("Q3_K", 9, 512), ("IQ4_NL", 16, 96), ("IQ4_XS", 5, 256),
         ("F16", 37, 64), ("BF16", 19, 96), ("F32", 11, 40)]


@pytest.mark.parametrize("tn,n,k", CASES, ids=[f"{t}-{n}x{k}" for t, n, k in CASES])
def test_every_type_matches_the_dequantized_reference(tn, n, k):
    raw = random_matrix(tn, n, k)
    m = ggml.Matrix(raw, int(T[tn]), (n, k))
    assert m.repacked == ggml.repacks(int(T[tn]), n)
    for rows in (1, 3, 8, 70):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        y = m.mul(x)
        ref = ggml.mul_mat_ref(raw, int(T[tn]), (n, k), x)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        excess = ((y.double() - ref).abs() / error_bound(raw, tn, (n, k), x)).max()
        assert excess <= 1.0, f"{tn} rows {rows}: error {float(excess):.3g}x its bound"


def test_products_are_deterministic_and_write_into_out():
    raw = random_matrix("Q4_K", 64, 256)
    m = ggml.Matrix(raw, int(T.Q4_K), (64, 256))
    x = torch.randn(5, 256)
    out = torch.full((5, 64), float("nan"))
    assert m.mul(x, out=out) is out
    assert torch.equal(out, m.mul(x))
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        m.mul(x.double())
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        m.mul(torch.randn(5, 255))
    with pytest.raises(ValueError, match="bytes, expected"):
        ggml.Matrix(raw[:-1], int(T.Q4_K), (64, 256))


def test_repack_table_is_what_ggml_decides():
    """`ggml.REPACK` (the pinned version's table) against the CPU backend's own answer: a mul_mat
    whose weight sits in the CPU_REPACK buffer is supported exactly when ggml has a repacked
    layout for that type and row count on this CPU (the check llama.cpp places weights by)."""
    lib = ggml.library()
    if lib.repack_buft is None:
        pytest.skip("this ggml build has no CPU_REPACK buffer")
    supports = lib.declare(lib.base, "ggml_backend_dev_supports_op", ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p)
    dev = lib.reg_dev_get(lib.cpu_reg(), 0)
    for tn in sorted(F16_FIELDS):
        bv = GGML_QUANT_SIZES[T[tn]][0]
        for rows in (8, 12, 16, 20):
            ctx = lib.context(3)
            try:
                w = lib.new_tensor_2d(ctx, int(T[tn]), max(bv, 256), rows)
                buf = lib.alloc_ctx_tensors(ctx, lib.repack_buft)  # init only: no data is set (no repack)
                x = lib.new_tensor_2d(ctx, ggml.F32, max(bv, 256), 1)
                y = lib.mul_mat(ctx, w, x)
                assert supports(dev, y) == ggml.repacks(int(T[tn]), rows), f"{tn} rows {rows}"
                lib.buffer_free(buf)
            finally:
                lib.free(ctx)


def test_cpu_features_and_threads():
    feats = ggml.cpu_features()
    flags = set(open("/proc/cpuinfo").read().split("flags", 2)[1].split("\n", 1)[0].split())
    assert feats["avx2"] == ("avx2" in flags) and feats["avx512"] == ("avx512f" in flags)
    before = ggml.threads()
    try:
        ggml.set_threads(1)
        raw = random_matrix("Q6_K", 40, 256)
        x = torch.randn(3, 256)
        one = ggml.Matrix(raw, int(T.Q6_K), (40, 256)).mul(x)
        ggml.set_threads(2)
        assert ggml.threads() == 2
        assert torch.equal(one, ggml.Matrix(raw, int(T.Q6_K), (40, 256)).mul(x))  # threads split rows, not sums
    finally:
        ggml.set_threads(before)


@pytest.fixture(scope="module")
def tiny_q4km(tmp_path_factory):
    from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4

    d = tmp_path_factory.mktemp("ggmlq")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", TinySpec(), seed=7), d / "q4km.gguf")


def test_products_equal_llama_cpps_bit_for_bit(tiny_q4km):
    """Every weight product llama.cpp computes in a prefill of 9 tokens and a decode of 1 (its own
    eval callback captures x and x W^T) recomputed through the binding on the file's bytes, with
    the same placement and row count: identical bits."""
    types = _recompute_captured(tiny_q4km, [[2, 5, 17, 33, 40, 61, 99, 120, 7], [300]])
    assert {t for t, _, _ in types} >= {"Q4_K", "Q6_K"}
    assert any(r for _, r, _ in types) or not ggml.cpu_features()["avx2"]  # a repacked Q4_K on x86


def _recompute_captured(path, batches) -> set:
    """Capture llama.cpp's weight products over `batches` and recompute each through the binding:
    identical bits required. Returns the (type, repacked, rows) seen."""
    from ggml_capture import capture_mul_mats
    from models.gguf import GGUFFile

    f = GGUFFile(path)
    names = {n for n, t in f.tensors.items() if len(t.shape) == 2}
    seen, matrices = set(), {}
    for name, x, y in capture_mul_mats(path, batches, names):
        info = f.tensor(name)
        n, k = info.shape  # torch order [out, in]
        if name not in matrices:
            matrices[name] = ggml.Matrix(torch.from_numpy(info.read()).reshape(n, -1), info.ggml_type, (n, k))
        m, xs = matrices[name], torch.from_numpy(x).view(-1, k)
        assert np.array_equal(m.mul(xs).numpy().reshape(-1), y), f"{name} ({ggml.TYPES[info.ggml_type]}, {xs.shape[0]} rows)"
        seen.add((ggml.TYPES[info.ggml_type], m.repacked, xs.shape[0]))
    return seen


def test_real_gemma3_products_equal_llama_cpps_bit_for_bit(gemma3_270m_path):
    """The demo model's own types (Q4_K repacked, Q5_0, Q6_K, the Q8_0 head) in a 13-token prefill
    and a 1-token decode."""
    seen = _recompute_captured(gemma3_270m_path, [[2, 651, 1370, 4, 9, 27, 1010, 88, 5, 6, 7, 8, 9], [4110]])
    assert {t for t, _, _ in seen} >= {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert {r for _, _, r in seen} == {1, 13}
