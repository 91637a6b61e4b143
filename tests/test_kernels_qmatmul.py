"""kernels.qmatmul: Triton kernels vs ``qmatmul_ref`` vs ``x @ models.quant.dequantize(...)^T``.

Runs the kernels on the CPU under the Triton interpreter: TRITON_INTERPRET=1 is set here, before
anything imports triton.  On a CUDA machine, ``TRITON_INTERPRET=0 pytest tests/test_kernels_qmatmul.py``
runs the same tests on the GPU, with bf16 on every path (the interpreter's bf16 ``tl.dot`` is wrong,
so there bf16 runs only through the GEMV and the prefill path).
Shapes are tiny and odd (5 or 37 output rows, a partial 256-value step for the 32-value types).
"""
from triton_env import DEVICE, INTERPRET  # first: sets TRITON_INTERPRET before triton is imported

import numpy as np
import pytest
import torch

from kernels.qmatmul import (
    DECODE_MAX_M,
    qdequantize,
    qdequantize_ref,
    qmatmul,
    qmatmul_ref,
)
from models.quant import GGMLType, block_size, dequantize, row_bytes

TYPES = [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_0]
# Byte offsets of the float16 scale fields inside one block (as in tests/test_quant.py).
F16_FIELDS = {
    GGMLType.Q4_0: (0,), GGMLType.Q5_0: (0,), GGMLType.Q8_0: (0,),
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}
# x dtypes; bf16 only on a GPU.  Tolerance: |got - want| <= rtol * (|x| @ |W|^T) + 1e-30, i.e.
# relative to the largest the error can get from rounding each term: fp32 summation order;
# fp16/bf16 one rounding of each weight (the dot path casts W to x's dtype) plus the output's.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MS = [1, 3, 19]        # GEMV, dot decode path (M padded to 16), prefill (dequantize + matmul)
assert MS[1] <= DECODE_MAX_M < MS[2]
# The interpreter's bf16 tl.dot is wrong: bf16 there only on the paths without tl.dot.
DTYPE_MS = [(d, m) for d in DTYPES for m in MS
            if not (INTERPRET and d == torch.bfloat16 and 1 < m <= DECODE_MAX_M)]


def _shapes(t):
    """(n_out, n_in): one K step and two; 96 / 288 values leave a partial step for 32-blocks."""
    return [(5, 256), (37, 512)] if block_size(t)[0] == 256 else [(5, 96), (37, 288)]


CASES = [(t, n_out, n_in) for t in TYPES for n_out, n_in in _shapes(t)]


def _case_id(case):
    t, n_out, n_in = case
    return f"{t.name}-{n_out}x{n_in}"


def _finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random float16 bit patterns with |x| < 2 (subnormals included)."""
    sign = rng.integers(0, 2, n, dtype=np.uint16) << 15
    exp = rng.integers(0, 16, n, dtype=np.uint16) << 10
    mant = rng.integers(0, 1 << 10, n, dtype=np.uint16)
    return sign | exp | mant


def random_weight(t: GGMLType, n_out: int, n_in: int, seed: int) -> torch.Tensor:
    """Random quantized rows uint8 [n_out, row_bytes] with finite float16 scale fields."""
    rng = np.random.default_rng(seed)
    bv, bb = block_size(t)
    n_blocks = n_out * n_in // bv
    blocks = rng.integers(0, 256, (n_blocks, bb), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        blocks[:, off:off + 2] = _finite_f16_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return torch.from_numpy(blocks.reshape(n_out, row_bytes(t, n_in)))


def random_x(shape, dtype, seed: int) -> torch.Tensor:
    # Scaled so |y| stays far below the float16 maximum (weights reach ~4000).
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 0.01).to(dtype)


def assert_close_bound(got, want, bound, rtol: float, what: str) -> None:
    """|got - want| <= rtol * bound elementwise; on failure list the worst elements."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w, b = got.double().cpu(), want.double().cpu(), bound.double().cpu()
    err = (g - w).abs()
    ratio = err / (rtol * b + 1e-30)
    ratio = torch.where(torch.isnan(err), torch.full_like(ratio, float("inf")), ratio)
    if bool((ratio <= 1).all()):
        return
    bad = int((~(ratio <= 1)).sum())
    order = ratio.reshape(-1).argsort(descending=True)[:8]
    lines = []
    for flat in order.tolist():
        idx = tuple(int(i) for i in np.unravel_index(flat, tuple(got.shape)))
        lines.append(f"  {idx}: got {g[idx].item():.6g} want {w[idx].item():.6g} |diff| {err[idx].item():.3g}"
                     f" allowed {rtol * b[idx].item():.3g}")
    pytest.fail(f"{what}: {bad}/{g.numel()} elements beyond rtol={rtol} x (|x|@|W|^T); worst:\n" + "\n".join(lines))


@pytest.mark.parametrize("dtype_m", DTYPE_MS, ids=lambda dm: f"{str(dm[0]).removeprefix('torch.')}-M{dm[1]}")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_qmatmul_matches_ref_and_oracle(case, dtype_m):
    dtype, m = dtype_m
    t, n_out, n_in = case
    w = random_weight(t, n_out, n_in, seed=int(t) * 1000 + n_out)
    x = random_x((m, n_in), dtype, seed=m * 7 + n_out)
    W = dequantize(w, t, (n_out, n_in))                       # the oracle's float32 W
    oracle = (x.float() @ W.T).to(dtype)
    bound = x.float().abs() @ W.abs().T
    ref = qmatmul_ref(x, w, t, n_out, n_in)
    got = qmatmul(x.to(DEVICE), w.to(DEVICE), t, n_out, n_in)
    assert got.dtype == dtype and ref.dtype == dtype
    assert tuple(got.shape) == (m, n_out)
    assert_close_bound(ref, oracle, bound, RTOL[dtype], f"{t.name} ref vs oracle")
    assert_close_bound(got.cpu(), ref, bound, RTOL[dtype], f"{t.name} kernel vs ref")


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_qdequantize_matches_oracle(t):
    n_out, n_in = _shapes(t)[1]
    w = random_weight(t, n_out, n_in, seed=int(t))
    W = dequantize(w, t, (n_out, n_in))
    assert torch.equal(qdequantize_ref(w, t, n_out, n_in), W)  # same float32 ops, same order
    got = qdequantize(w.to(DEVICE), t, n_out, n_in, dtype=torch.float32).cpu()
    if INTERPRET:
        assert torch.equal(got, W), f"{t.name}: {(got != W).sum()} values differ"
    else:  # the GPU may fuse (d*sc)*q - dmin*mn into one FMA: 1 rounding fewer
        assert_close_bound(got, W, W.abs().amax().expand_as(W), 1e-6, f"{t.name} dequant")
    half = qdequantize(w.to(DEVICE), t, n_out, n_in).cpu()
    assert half.dtype == torch.float16
    assert_close_bound(half, W, W.abs(), 2 ** -11, f"{t.name} fp16 dequant")


@pytest.mark.parametrize("m", MS, ids=lambda m: f"M{m}")
def test_fp32_output_and_leading_dims(m):
    t, n_out, n_in = GGMLType.Q4_K, 37, 256
    w = random_weight(t, n_out, n_in, seed=3)
    x = random_x((m, 1, n_in), torch.float16, seed=m)
    W = dequantize(w, t, (n_out, n_in))
    got = qmatmul(x.to(DEVICE), w.to(DEVICE), t, n_out, n_in, out_dtype=torch.float32).cpu()
    assert got.dtype == torch.float32 and tuple(got.shape) == (m, 1, n_out)
    want = x.float() @ W.T
    assert_close_bound(got, want, x.float().abs() @ W.abs().T, RTOL[torch.float16], "fp32 out")
    ref = qmatmul_ref(x, w, t, n_out, n_in, out_dtype=torch.float32)
    assert_close_bound(ref, want, x.float().abs() @ W.abs().T, RTOL[torch.float32], "fp32 out ref")


def test_empty_x():
    t, n_out, n_in = GGMLType.Q8_0, 5, 96
    w = random_weight(t, n_out, n_in, seed=1).to(DEVICE)
    assert qmatmul(torch.zeros(0, n_in, device=DEVICE), w, t, n_out, n_in).shape == (0, n_out)


def _bad_calls():
    """(name, call, message pattern) for each launcher validation error."""
    t, n_out, n_in = GGMLType.Q4_K, 5, 256
    w = random_weight(t, n_out, n_in, seed=0).to(DEVICE)
    x = random_x((2, n_in), torch.float32, seed=0).to(DEVICE)
    wide = torch.zeros(n_out, w.shape[1] + 2, dtype=torch.uint8, device=DEVICE)
    return [
        ("type", lambda f: f(x, w, GGMLType.Q4_1, n_out, n_in), "unsupported GGML type"),
        ("n_in", lambda f: f(x[:, :128].contiguous(), w[:, :72].contiguous(), t, n_out, 128),
         "multiple of the Q4_K block"),
        ("w dtype", lambda f: f(x, w.to(torch.int8), t, n_out, n_in), "uint8"),
        ("row bytes", lambda f: f(x, w[:, :-1].contiguous(), t, n_out, n_in), r"shape \(5, 144\)"),
        ("n_out", lambda f: f(x, w, t, n_out + 1, n_in), r"shape \(6, 144\)"),
        ("w strides", lambda f: f(x, wide[:, :w.shape[1]], t, n_out, n_in), "contiguous"),
        ("x dtype", lambda f: f(x.to(torch.int32), w, t, n_out, n_in), "float16, bfloat16 or float32"),
        ("x shape", lambda f: f(x[:, :255].contiguous(), w, t, n_out, n_in), r"x must be \[\.\.\., n_in=256\]"),
        ("x strides", lambda f: f(torch.cat([x, x], 1)[:, ::2], w, t, n_out, n_in), "x must be contiguous"),
        ("out dtype", lambda f: f(x, w, t, n_out, n_in, out_dtype=torch.bfloat16), "out_dtype"),
    ]


@pytest.mark.parametrize("fn", [qmatmul, qmatmul_ref], ids=lambda f: f.__name__)
def test_launcher_validation(fn):
    for name, call, pattern in _bad_calls():
        with pytest.raises(ValueError, match=pattern) as info:
            call(fn)
        assert "\n" not in str(info.value), f"{name}: message is not one line"
        assert str(info.value).startswith(fn.__name__ + ":"), name


def test_qdequantize_validation():
    w = random_weight(GGMLType.Q6_K, 5, 256, seed=0).to(DEVICE)
    with pytest.raises(ValueError, match="dtype must be"):
        qdequantize(w, GGMLType.Q6_K, 5, 256, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"shape \(5, 420\)"):
        qdequantize(w, GGMLType.Q6_K, 5, 512)


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors only matter under the interpreter")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    t, n_out, n_in = GGMLType.Q4_0, 5, 96
    w, x = random_weight(t, n_out, n_in, seed=0), random_x((1, n_in), torch.float32, seed=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        qmatmul(x, w, t, n_out, n_in)
