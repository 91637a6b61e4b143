"""kernels.triton.qpack + kernels.triton.qmatmul: the load-time repack is bit-exact, and the Triton GEMV / prefill
kernels on the repacked planes match ``qmatmul_ref`` and ``x @ models.quant.dequantize(...)^T``.
kernels.triton.qdequant (GGUF rows, for embedding gathers) against the same oracle.

Runs the kernels on the CPU under the Triton interpreter: TRITON_INTERPRET=1 is set here, before
anything imports triton.  On a CUDA machine, ``TRITON_INTERPRET=0 pytest tests/kernels/triton/test_kernels_qmatmul.py``
runs the same tests on the GPU.  Shapes are tiny and odd (5 or 37 output rows, a partial 256-value
step for the 32-value types); M covers the GEMV (1, 2), the multi-row GEMV (3), two GEMV launches
(9 > GEMV_MAX_M) and the prefill path (19).
"""
from triton_env import DEVICE, INTERPRET  # first: sets TRITON_INTERPRET before triton is imported

import numpy as np
import pytest
import torch

from kernels.triton.qmatmul import (
    DECODE_MAX_M,
    GEMV_MAX_M,
    gemv_blocks,
    gemv_config,
    gemv_split,
    qdequantize,
    qdequantize_packed,
    qdequantize_ref,
    qmatmul,
    qmatmul_ref,
)
from kernels.triton.launch import triton_interpret
from kernels.triton.qpack import PLANE_BYTES, PackedQuant, dequantize_packed_ref, pack
from models.quant import GGMLType, block_size, dequantize, row_bytes

TYPES = [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_0]
# Byte offsets of the float16 scale fields inside one block (as in tests/models/test_quant.py).
F16_FIELDS = {
    GGMLType.Q4_0: (0,), GGMLType.Q5_0: (0,), GGMLType.Q8_0: (0,),
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}
# Tolerance: |got - want| <= rtol * (|x| @ |W|^T) + 1e-30, i.e. relative to the largest the error
# can get from rounding each term: fp32 summation order (the GEMV's 1 + q/16 trick cancels the
# ones exactly up to a few ulp of sum |x|); fp16/bf16 the output's rounding, and on the prefill
# path one rounding of each weight to x's dtype.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MS = [1, 2, 3, 9, 19]
assert MS[3] > GEMV_MAX_M and MS[3] <= DECODE_MAX_M < MS[4]
DTYPE_MS = [(d, m) for d in DTYPES for m in MS]


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


def packed_weight(t: GGMLType, n_out: int, n_in: int, seed: int) -> tuple[torch.Tensor, PackedQuant]:
    raw = random_weight(t, n_out, n_in, seed)
    return raw, pack(raw, t, (n_out, n_in))


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


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_repack_dequantizes_bit_exactly(case):
    """The repacked planes hold the GGUF values exactly: same bytes, same floats (bit for bit)."""
    t, n_out, n_in = case
    raw, p = packed_weight(t, n_out, n_in, seed=int(t) * 31 + n_out)
    assert p.nbytes == raw.numel()
    nb = n_in // block_size(t)[0]
    for plane, per_block in zip((p.q, p.h, p.s, p.d), PLANE_BYTES[int(t)]):
        assert (plane is None) == (per_block == 0)
        if plane is not None:
            assert tuple(plane.shape) == (n_out, nb * per_block) and plane.dtype == torch.uint8
    assert p.q.shape[1] % 16 == 0 or block_size(t)[0] == 32   # 16-byte quant rows for the K-quants
    W = dequantize(raw, t, (n_out, n_in))
    got = dequantize_packed_ref(p)
    assert torch.equal(got.view(torch.int32), W.view(torch.int32))


def test_packed_rows_and_cat():
    t = GGMLType.Q6_K
    raw_a, a = packed_weight(t, 5, 512, seed=1)
    raw_b, b = packed_weight(t, 3, 512, seed=2)
    both = PackedQuant.cat([a, b])
    want = torch.cat([dequantize(raw_a, t, (5, 512)), dequantize(raw_b, t, (3, 512))])
    assert torch.equal(dequantize_packed_ref(both), want)
    ids = torch.tensor([7, 0, 7, 4])
    assert torch.equal(dequantize_packed_ref(both.rows(ids)), want[ids])
    with pytest.raises(ValueError, match="different types"):
        PackedQuant.cat([a, pack(random_weight(GGMLType.Q4_K, 2, 512, 0), GGMLType.Q4_K, (2, 512))])


@pytest.mark.parametrize("dtype_m", DTYPE_MS, ids=lambda dm: f"{str(dm[0]).removeprefix('torch.')}-M{dm[1]}")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_qmatmul_matches_ref_and_oracle(case, dtype_m):
    dtype, m = dtype_m
    t, n_out, n_in = case
    w, p = packed_weight(t, n_out, n_in, seed=int(t) * 1000 + n_out)
    x = random_x((m, n_in), dtype, seed=m * 7 + n_out)
    W = dequantize(w, t, (n_out, n_in))                       # the oracle's float32 W
    oracle = (x.float() @ W.T).to(dtype)
    bound = x.float().abs() @ W.abs().T
    ref = qmatmul_ref(x, p)
    got = qmatmul(x.to(DEVICE), p.to(DEVICE))
    assert got.dtype == dtype and ref.dtype == dtype
    assert tuple(got.shape) == (m, n_out)
    assert_close_bound(ref, oracle, bound, RTOL[dtype], f"{t.name} ref vs oracle")
    assert_close_bound(got.cpu(), ref, bound, RTOL[dtype], f"{t.name} kernel vs ref")


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_qdequantize_packed_matches_oracle(t):
    n_out, n_in = _shapes(t)[1]
    w, p = packed_weight(t, n_out, n_in, seed=int(t) + 5)
    W = dequantize(w, t, (n_out, n_in))
    got = qdequantize_packed(p.to(DEVICE), torch.float32).cpu()
    if INTERPRET:
        assert torch.equal(got, W), f"{t.name}: {(got != W).sum()} values differ"
    else:  # the GPU may fuse (d*sc)*q - dmin*mn into one FMA: 1 rounding fewer
        assert_close_bound(got, W, W.abs().amax().expand_as(W), 1e-6, f"{t.name} dequant")
    out = torch.full((n_out, 2 * n_in), 7.0, dtype=torch.float16, device=DEVICE)
    qdequantize_packed(p.to(DEVICE), out=out[:, :n_in])           # into a strided scratch view
    assert_close_bound(out[:, :n_in].cpu(), W, W.abs(), 2 ** -11, f"{t.name} fp16 dequant")
    assert bool((out[:, n_in:] == 7.0).all())


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
    w, p = packed_weight(t, n_out, n_in, seed=3)
    x = random_x((m, 1, n_in), torch.float16, seed=m)
    W = dequantize(w, t, (n_out, n_in))
    got = qmatmul(x.to(DEVICE), p.to(DEVICE), out_dtype=torch.float32).cpu()
    assert got.dtype == torch.float32 and tuple(got.shape) == (m, 1, n_out)
    want = x.float() @ W.T
    assert_close_bound(got, want, x.float().abs() @ W.abs().T, RTOL[torch.float16], "fp32 out")
    ref = qmatmul_ref(x, p, out_dtype=torch.float32)
    assert_close_bound(ref, want, x.float().abs() @ W.abs().T, RTOL[torch.float32], "fp32 out ref")


def test_empty_x():
    t, n_out, n_in = GGMLType.Q8_0, 5, 96
    _, p = packed_weight(t, n_out, n_in, seed=1)
    assert qmatmul(torch.zeros(0, n_in, device=DEVICE), p.to(DEVICE)).shape == (0, n_out)


def _bad_calls():
    """(name, call, message pattern) for each launcher validation error."""
    t, n_out, n_in = GGMLType.Q4_K, 5, 256
    raw, p = packed_weight(t, n_out, n_in, seed=0)
    p = p.to(DEVICE)
    x = random_x((2, n_in), torch.float32, seed=0).to(DEVICE)
    return [
        ("not packed", lambda f: f(x, raw.to(DEVICE)), "kernels.triton.qpack.PackedQuant"),
        ("x dtype", lambda f: f(x.to(torch.int32), p), "float16, bfloat16 or float32"),
        ("x shape", lambda f: f(x[:, :255].contiguous(), p), r"x must be \[\.\.\., n_in=256\]"),
        ("out dtype", lambda f: f(x, p, out_dtype=torch.bfloat16), "out_dtype"),
    ]


@pytest.mark.parametrize("fn", [qmatmul, qmatmul_ref], ids=lambda f: f.__name__)
def test_launcher_validation(fn):
    for name, call, pattern in _bad_calls():
        with pytest.raises(ValueError, match=pattern) as info:
            call(fn)
        assert "\n" not in str(info.value), f"{name}: message is not one line"
        assert str(info.value).startswith(fn.__name__ + ":"), name


def test_pack_validation():
    with pytest.raises(ValueError, match="unsupported GGML type"):
        pack(torch.zeros(5, 40, dtype=torch.uint8), GGMLType.Q4_1, (5, 64))
    with pytest.raises(ValueError, match=r"needs uint8 rows of 144 bytes"):
        pack(torch.zeros(5, 143, dtype=torch.uint8), GGMLType.Q4_K, (5, 256))


def test_gemv_config_gives_narrow_matrices_programs():
    """Decode GEMV blocks follow the matrix: >= 32 programs for E2B's narrowest (256 rows),
    two rows a thread for one x row, four for the vocabulary head, one for 3..8 x rows."""
    cuda = torch.device("cuda")
    for n_out in (256, 1536, 2048, 6144, 262144):
        block_m, block_n, warps = gemv_config(1, n_out, cuda)
        assert block_m == 1 and -(-n_out // block_n) >= 32
        assert block_n == 4 * warps * (4 if n_out >= 65536 else 2)
    assert gemv_config(3, 1536, cuda) == (4, 16, 4) and gemv_config(8, 1536, cuda)[0] == GEMV_MAX_M


def test_qdequantize_validation():
    w = random_weight(GGMLType.Q6_K, 5, 256, seed=0).to(DEVICE)
    with pytest.raises(ValueError, match="dtype must be"):
        qdequantize(w, GGMLType.Q6_K, 5, 256, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"shape \(5, 420\)"):
        qdequantize(w, GGMLType.Q6_K, 5, 512)


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors only matter under the interpreter")
def test_cpu_tensors_need_the_interpreter():
    t, n_out, n_in = GGMLType.Q4_0, 5, 96
    (_, p), x = packed_weight(t, n_out, n_in, seed=0), random_x((1, n_in), torch.float32, seed=0)
    with triton_interpret(False), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        qmatmul(x, p)


@pytest.mark.parametrize("m", [1, 3, 19], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q5_0], ids=lambda t: t.name)
def test_gelu_mul_epilogue(t, m):
    """gelu_tanh(x W^T) * e in the GEMV's epilogue (e a strided slice, as Gemma-4's per-layer inputs
    [T, L, P][:, i] are) equals the torch composition; the prefill path applies it after the GEMM."""
    n_out, n_in = 37, 512 if block_size(t)[0] == 256 else 288
    w, p = packed_weight(t, n_out, n_in, seed=11)
    x = random_x((m, n_in), torch.float32, seed=m) * 30       # |y| ~ 1: both gelu branches
    e = torch.randn(m, 3, n_out, generator=torch.Generator().manual_seed(m))[:, 1]
    W = dequantize(w, t, (n_out, n_in))
    y = x @ W.T
    want = torch.nn.functional.gelu(y, approximate="tanh") * e
    bound = (x.abs() @ W.abs().T) * (e.abs() * 1.2) + 1e-6
    got = qmatmul(x.to(DEVICE), p.to(DEVICE), gelu_mul=e.to(DEVICE)).cpu()
    ref = qmatmul_ref(x, p, gelu_mul=e)
    assert_close_bound(ref, want, bound, 1e-5, "gelu_mul ref")
    assert_close_bound(got, want, bound, 1e-5, "gelu_mul kernel")
    with pytest.raises(ValueError, match="gelu_mul must be"):
        qmatmul(x.to(DEVICE), p.to(DEVICE), gelu_mul=e[:, :5].to(DEVICE))


@pytest.mark.parametrize("m", [1, 2, 3, 19], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_glu_epilogue(t, m):
    """gate/up stacked and row-interleaved: the GEMV's GLU epilogue gives gelu_tanh(x G^T) * (x U^T)
    ([.., n/2] out, Gemma's MLP activation); the prefill path does it after the GEMM."""
    f, n_in = 19, 512 if block_size(t)[0] == 256 else 288
    (wg, pg), (wu, pu) = packed_weight(t, f, n_in, seed=5), packed_weight(t, f, n_in, seed=6)
    p = PackedQuant.cat([pg, pu]).interleave_rows()
    x = random_x((m, n_in), torch.float32, seed=m) * 30
    G, U = dequantize(wg, t, (f, n_in)), dequantize(wu, t, (f, n_in))
    want = torch.nn.functional.gelu(x @ G.T, approximate="tanh") * (x @ U.T)
    bound = (x.abs() @ G.abs().T) * (x.abs() @ U.abs().T) * 1.2 + 1e-6
    got = qmatmul(x.to(DEVICE), p.to(DEVICE), glu=True).cpu()
    assert got.shape == (m, f)
    assert_close_bound(qmatmul_ref(x, p, glu=True), want, bound, 1e-5, "glu ref")
    assert_close_bound(got, want, bound, 1e-5, "glu kernel")


BLOCKS = [(4, 1), (8, 1), (8, 2), (16, 4)]  # the GEMV table's occupancy variants (engine/bench/gemv.py)


@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_one_row_gemv_at_other_blocks_matches_ref(t, blocks):
    """`gemv_blocks(block_n, warps)`: BLOCK_N rows a program at one, two or four rows a thread, on
    37 rows (a tail program) of two K steps; the GLU epilogue too (interleaved rows per program)."""
    n_out, n_in = _shapes(t)[1]
    w, p = packed_weight(t, n_out, n_in, seed=int(t) + 3)
    x = random_x((1, n_in), torch.float32, seed=2)
    bound = x.abs() @ dequantize(w, t, (n_out, n_in)).abs().T
    with gemv_blocks(*blocks):
        assert gemv_config(1, n_out, torch.device("cuda")) == (1, *blocks)
        assert gemv_config(2, n_out, torch.device("cuda")) != (1, *blocks)  # one x row only
        got = qmatmul(x.to(DEVICE), p.to(DEVICE)).cpu()
        glu = qmatmul(x.to(DEVICE), PackedQuant.cat([p, p]).interleave_rows().to(DEVICE), glu=True).cpu()
    assert_close_bound(got, qmatmul_ref(x, p), bound, RTOL[torch.float32], f"{t.name} at {blocks}")
    y = qmatmul_ref(x, p)
    assert_close_bound(glu, torch.nn.functional.gelu(y, approximate="tanh") * y, bound * (bound + 1) * 1.2 + 1e-6,
                       1e-5, f"{t.name} glu at {blocks}")


def test_gemv_blocks_refuses_a_tile_the_kernel_has_no_layout_for():
    for block_n, warps in ((6, 1), (4, 3), (64, 2), (2, 1)):
        with pytest.raises(ValueError, match="block_n must be 4 x warps"):
            with gemv_blocks(block_n, warps):
                pass
    assert gemv_config(1, 1536, torch.device("cuda")) == (1, 16, 2)  # nothing left set


@pytest.mark.parametrize("splits", [2, 3, 8], ids=lambda n: f"split{n}")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_one_row_gemv_split_over_k_matches_ref_with_every_epilogue(t, splits):
    """`gemv_split(n)`: K in runs of whole 256-value steps over n programs a row block (8 asks more
    than the 5 steps there are: 5 splits), the partial step of a 32-value type in the last one,
    fp32 partial sums added in split order by one reduction launch, which also runs the GLU and
    GELU_MUL epilogues; a second run gives the same bits."""
    n_out, n_in = 37, 1280 + (0 if block_size(t)[0] == 256 else 96)
    w, p = packed_weight(t, n_out, n_in, seed=int(t) + 11)
    x = random_x((1, n_in), torch.float32, seed=5)
    bound = x.abs() @ dequantize(w, t, (n_out, n_in)).abs().T
    e = random_x((1, n_out), torch.float32, seed=6) * 100
    pp = PackedQuant.cat([p, p]).interleave_rows()
    with gemv_split(splits):
        got = qmatmul(x.to(DEVICE), p.to(DEVICE)).cpu()
        again = qmatmul(x.to(DEVICE), p.to(DEVICE)).cpu()
        gm = qmatmul(x.to(DEVICE), p.to(DEVICE), gelu_mul=e.to(DEVICE)).cpu()
        glu = qmatmul(x.to(DEVICE), pp.to(DEVICE), glu=True).cpu()
        two = qmatmul(torch.cat([x, x]).to(DEVICE), p.to(DEVICE)).cpu()  # 2 rows of x: never split
    y = qmatmul_ref(x, p)
    assert torch.equal(got, again)
    assert_close_bound(got, y, bound, RTOL[torch.float32], f"{t.name} split {splits}")
    assert_close_bound(two, torch.cat([y, y]), torch.cat([bound, bound]), RTOL[torch.float32], "two rows")
    g = torch.nn.functional.gelu(y, approximate="tanh")
    assert_close_bound(gm, g * e, bound * e.abs() * 1.2 + 1e-6, 1e-5, f"{t.name} gelu_mul split")
    assert_close_bound(glu, g * y, bound * (bound + 1) * 1.2 + 1e-6, 1e-5, f"{t.name} glu split")


def test_gemv_split_needs_at_least_one_split():
    for bad in (0, 65):
        with pytest.raises(ValueError, match="splits must be 1..64"):
            with gemv_split(bad):
                pass


def test_edgegem_gemv_split_sets_the_split_of_one_row_gemvs(monkeypatch):
    """EDGEGEM_GEMV_SPLIT (read once, kernels/env.py) splits every one-row GEMV as `gemv_split`
    does (5 K steps in 3 splits of 2, 2, 1 steps; the context manager still wins); rows of more
    than one x row never split."""
    from kernels.env import reload
    from kernels.triton.qmatmul import _splits

    assert _splits(1, 1280) == (1, 5)
    monkeypatch.setenv("EDGEGEM_GEMV_SPLIT", "3")
    reload()
    assert _splits(1, 1280) == (3, 2) and _splits(2, 1280) == (1, 5) and _splits(1, 256) == (1, 1)
    with gemv_split(5):
        assert _splits(1, 1280) == (5, 1)
    t, n_in = GGMLType.Q4_K, 1280
    w, p = packed_weight(t, 37, n_in, seed=4)
    x = random_x((1, n_in), torch.float32, seed=8)
    bound = x.abs() @ dequantize(w, t, (37, n_in)).abs().T
    assert_close_bound(qmatmul(x.to(DEVICE), p.to(DEVICE)).cpu(), qmatmul_ref(x, p), bound, RTOL[torch.float32],
                       "split by the variable")
