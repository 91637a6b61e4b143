"""kernels.triton.kv_store and kernels.triton.attention: Triton kernels vs their torch refs vs models.ops.attention.

Runs the kernels on the CPU under the Triton interpreter: TRITON_INTERPRET=1 is set here, before
anything imports triton. On a CUDA machine, `TRITON_INTERPRET=0 pytest tests/kernels/triton/test_kernels_attention.py`
runs the same tests on the GPU, adding bf16 queries (the interpreter's bf16 tl.dot is wrong, so there
bf16 appears only as a KV slab format read with fp32 queries) and bit-exact bf16 slab stores (the
interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even).

Slabs have capacity 200 with a sequence's keys on random scattered slots; shapes are small and odd
(hd 40 and 64, S 37 and 130, n_h 4 over n_kv 1 and 2); hd 256 and 512 appear in one case each.
"""
from triton_env import DEVICE, INTERPRET  # first: sets TRITON_INTERPRET before triton is imported

import functools

import pytest
import torch

from engine.kv import resolve_format
from kernels.arch import assume_gpu
from kernels.triton.attention import (
    decode_attention,
    decode_attention_ref,
    extend_attention,
    extend_attention_ref,
)
from kernels.triton.kv_store import kv_store, kv_store_ref
from models.ops import attention
from tensor_close import assert_close as _assert_close

# the kernels' outputs against references that may be computed in another dtype
assert_close = functools.partial(_assert_close, check_dtype=False)

CAPACITY = 200
SCALED = (torch.int8, torch.float8_e4m3fn)
FORMAT_OF = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
             torch.int8: "int8_per_token_head", torch.float8_e4m3fn: "fp8_per_token_head"}
# Kernel vs ref, by query dtype: the kernel's dot inputs are q's dtype (8-bit K/V values are exact
# there), so fp16 adds one rounding of the probabilities and of the output; fp32 differs only in
# summation order.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2.5e-2, 2.5e-2)}
# (KV slab dtype, query dtype) pairs; bf16 queries only where tl.dot is not interpreted.
KV_Q = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
        (torch.int8, torch.float16), (torch.int8, torch.float32), (torch.float8_e4m3fn, torch.float16)]
if not INTERPRET:
    KV_Q += [(torch.bfloat16, torch.bfloat16), (torch.int8, torch.bfloat16), (torch.float8_e4m3fn, torch.bfloat16)]


def _name(d) -> str:
    return str(d).removeprefix("torch.")


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality (fp8 compared as bytes); lists the first differing elements."""
    g, w = got.cpu(), want.cpu()
    if g.element_size() == 1:
        g, w = g.view(torch.uint8), w.view(torch.uint8)
    diff = g != w
    if not bool(diff.any()):
        return
    idx = diff.nonzero()[:8].tolist()
    gf, wf = got.cpu().float(), want.cpu().float()
    lines = [f"  {tuple(i)}: got {gf[tuple(i)].item():.6g} want {wf[tuple(i)].item():.6g}" for i in idx]
    pytest.fail(f"{what}: {int(diff.sum())}/{g.numel()} elements differ; first:\n" + "\n".join(lines))


def _slabs(n_kv: int, hd: int, dtype):
    k = torch.zeros(CAPACITY, n_kv, hd, dtype=dtype, device=DEVICE)
    v = torch.zeros_like(k)
    if dtype in SCALED:
        return k, v, torch.zeros(CAPACITY, n_kv, device=DEVICE), torch.zeros(CAPACITY, n_kv, device=DEVICE)
    return k, v, None, None


def _filled_slabs(S: int, n_kv: int, hd: int, dtype, gen):
    """Slabs holding S random tokens at scattered slots; returns (k, v, k_scale, v_scale, slots)."""
    k, v, ks, vs = _slabs(n_kv, hd, dtype)
    slots = torch.randperm(CAPACITY, generator=gen)[:S].to(DEVICE)
    kv_store_ref(torch.randn(S, n_kv, hd, generator=gen).to(DEVICE),
                 torch.randn(S, n_kv, hd, generator=gen).to(DEVICE), k, v, slots, ks, vs)
    return k, v, ks, vs, slots


def _direct(q, k_slab, v_slab, ks, vs, slots, k_pos, q_pos, scale, window):
    """models.ops.attention over the dequantized (engine KVFormat) gathered K/V: [T, n_h, hd]."""
    fmt = resolve_format(FORMAT_OF[k_slab.dtype])
    s = slots.cpu()
    k = fmt.dequantize(k_slab.cpu()[s], ks.cpu()[s] if ks is not None else None, torch.float32)
    v = fmt.dequantize(v_slab.cpu()[s], vs.cpu()[s] if vs is not None else None, torch.float32)
    T, n_h, hd = q.shape
    return attention(q.float().cpu(), k, v, q_pos.cpu(), k_pos.cpu(), window, scale).reshape(T, n_h, hd)


# --- kv_store ------------------------------------------------------------------------------------

def _store_input(T, n_kv, hd, dtype, gen):
    """[T, n_kv, hd] with a zero token-head, a -0.0 row, tiny and huge rows and an outlier."""
    x = torch.randn(T, n_kv, hd, generator=gen)
    x[0, 0] = 0.0
    x[1, n_kv - 1] = -0.0
    x[2] *= 1e-3
    x[3, 0] *= 300.0
    x[4, 0, 5] = -40.0
    x[5, 0] = torch.linspace(-1, 1, hd)
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_name)
@pytest.mark.parametrize("slab_dtype", list(FORMAT_OF), ids=_name)
def test_kv_store_matches_ref(slab_dtype, x_dtype):
    gen = torch.Generator().manual_seed(1)
    T, n_kv, hd = 9, 2, 40
    k, v = _store_input(T, n_kv, hd, x_dtype, gen), _store_input(T, n_kv, hd, x_dtype, gen).flip(0)
    slots = torch.randperm(CAPACITY, generator=gen)[:T].to(DEVICE)
    slots[6] = -1  # a padding row: nothing written
    got, want = _slabs(n_kv, hd, slab_dtype), _slabs(n_kv, hd, slab_dtype)
    for g, w in zip(got, want):
        if g is not None:
            g.fill_(7)  # untouched slots must keep their contents
            w.fill_(7)
    kv_store(k, v, got[0], got[1], slots, got[2], got[3])
    kv_store_ref(k, v, want[0], want[1], slots, want[2], want[3])
    for i, what in enumerate(("k", "v", "k_scale", "v_scale")):
        if got[i] is None:
            continue
        if INTERPRET and slab_dtype == torch.bfloat16 and x_dtype != torch.bfloat16:
            # The interpreter's fp32 -> bf16 cast truncates: allow one bf16 ulp (2**-7 relative).
            assert_close(got[i].float(), want[i].float(), 0.0, 2.0 ** -7, what)
        else:
            assert_same_bits(got[i], want[i], what)
    # The ref is the engine's format definition, restated.
    fmt = resolve_format(FORMAT_OF[slab_dtype])
    keep = slots >= 0
    for x, slab, scale in ((k, want[0], want[2]), (v, want[1], want[3])):
        q, s = fmt.quantize(x[keep])
        assert_same_bits(slab[slots[keep]], q, "ref vs KVFormat.quantize")
        if s is not None:
            assert_same_bits(scale[slots[keep]], s, "ref scales vs KVFormat.quantize")


def _all_e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value as fp32 (both zeros included)."""
    b = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return b[torch.isfinite(b)]


def test_kv_store_rounding_ties():
    """Rows whose amax makes the scale exactly 1, so the kernel's rounding alone decides:
    int8 rows hold every k + 1/2 (ties to even), fp8 rows every e4m3 value, every midpoint
    between neighbours (ties to even mantissa) and points just either side of each midpoint."""
    # int8: amax 127 -> scale 127/127 = 1.
    halves = torch.arange(-127, 127, dtype=torch.float32) + 0.5
    int8_x = torch.cat([torch.tensor([127.0]), halves, torch.tensor([0.49999997, -0.49999997, 2.5000002])])
    # fp8: amax 448 -> scale 448/448 = 1.
    vals = _all_e4m3_values().unique()  # sorted; one zero
    mids = (vals[1:] + vals[:-1]) / 2
    nudged = torch.cat([torch.nextafter(mids, torch.tensor(float("inf"))),
                        torch.nextafter(mids, torch.tensor(float("-inf")))])
    fp8_x = torch.cat([torch.tensor([448.0, -0.0, -1e-4, 1e-4]), vals, mids, nudged])
    for dtype, x in ((torch.int8, int8_x), (torch.float8_e4m3fn, fp8_x)):
        hd = 256
        rows = -(-len(x) // (hd - 1))
        pad = torch.zeros(rows * (hd - 1))
        pad[:len(x)] = x
        data = torch.cat([torch.full((rows, 1), float(x.abs().max())), pad.reshape(rows, hd - 1)], dim=1)
        data = data.reshape(rows, 1, hd).to(DEVICE)
        got, want = _slabs(1, hd, dtype), _slabs(1, hd, dtype)
        slots = torch.arange(rows, device=DEVICE)
        kv_store(data, data, got[0], got[1], slots, got[2], got[3])
        kv_store_ref(data, data, want[0], want[1], slots, want[2], want[3])
        assert bool((want[2][:rows] == 1.0).all())
        assert_same_bits(got[0][:rows], want[0][:rows], f"{_name(dtype)} values")
        assert_same_bits(got[2][:rows], want[2][:rows], f"{_name(dtype)} scales")


# --- decode --------------------------------------------------------------------------------------

def _check_decode(q, k, v, ks, vs, slots, k_pos, q_pos, scale, window, num_splits, indptr=None, block_n=16):
    got = decode_attention(q, k, v, slots, k_pos, q_pos, scale, window, ks, vs,
                           slot_indptr=indptr, num_splits=num_splits, block_n=block_n)
    want = decode_attention_ref(q, k, v, slots, k_pos, q_pos, scale, window, ks, vs, slot_indptr=indptr)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got.float(), want.float(), *TOL[q.dtype], "kernel vs ref")
    # The ref against the model's attention, one sequence at a time.
    qb = q.unsqueeze(0) if q.dim() == 2 else q
    bounds = [0, slots.numel()] if indptr is None else indptr.tolist()
    for b in range(qb.shape[0]):
        lo, hi = bounds[b], bounds[b + 1]
        direct = _direct(qb[b:b + 1], k, v, ks, vs, slots[lo:hi], k_pos[lo:hi], q_pos.reshape(-1)[b:b + 1],
                         scale, window)
        ref_b = want.unsqueeze(0)[b] if q.dim() == 2 else want[b:b + 1]
        assert_close(ref_b.float().reshape(direct.shape), direct, 1e-5 if q.dtype == torch.float32 else 1e-3,
                     1e-5 if q.dtype == torch.float32 else 1e-3, f"ref vs models.ops.attention (seq {b})")


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("kv_q", KV_Q, ids=lambda p: f"kv_{_name(p[0])}-q_{_name(p[1])}")
def test_decode_formats(kv_q, window, num_splits):
    """Every KV format, n_h 4 over n_kv 2, hd 40 (masked to 64), 37 keys in 3 tiles of 16."""
    kv_dtype, q_dtype = kv_q
    gen = torch.Generator().manual_seed(2)
    n_h, n_kv, hd, S = 4, 2, 40, 37
    k, v, ks, vs, slots = _filled_slabs(S, n_kv, hd, kv_dtype, gen)
    k_pos = torch.arange(S, device=DEVICE)
    q = (torch.randn(n_h, hd, generator=gen) * hd ** -0.5).to(q_dtype).to(DEVICE)
    q_pos = torch.tensor([S - 1], device=DEVICE)
    _check_decode(q, k, v, ks, vs, slots, k_pos, q_pos, 1.0, window, num_splits)


SHAPES = [  # n_h, n_kv, hd, S, window, kv dtype, q dtype, num_splits
    (4, 1, 64, 130, None, torch.float16, torch.float16, 1),
    (4, 1, 64, 130, 8, torch.int8, torch.float16, 4),
    (4, 2, 64, 130, None, torch.float8_e4m3fn, torch.float32, 4),
    (4, 2, 64, 130, 50, torch.float32, torch.float32, 5),
    (8, 1, 256, 37, 8, torch.int8, torch.float16, 2),
    (2, 1, 512, 20, None, torch.float8_e4m3fn, torch.float16, 2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}S{s[3]}w{s[4]}-{_name(s[5])}-sp{s[7]}")
def test_decode_shapes(shape):
    n_h, n_kv, hd, S, window, kv_dtype, q_dtype, num_splits = shape
    gen = torch.Generator().manual_seed(3)
    k, v, ks, vs, slots = _filled_slabs(S, n_kv, hd, kv_dtype, gen)
    k_pos = torch.arange(S, device=DEVICE)
    q = (torch.randn(n_h, hd, generator=gen) * hd ** -0.5).to(q_dtype).to(DEVICE)
    q_pos = torch.tensor([S - 1], device=DEVICE)
    _check_decode(q, k, v, ks, vs, slots, k_pos, q_pos, 1.0, window, num_splits)


@pytest.mark.parametrize("window", [None, 8])
def test_decode_batch_csr(window):
    """Three sequences in one launch through slot_indptr, with their own slots, lengths and query
    positions; keys listed out of position order; a non-unit scale; a window-pool sequence holding
    only positions 90..129 (as SequenceKV keeps); the default split count."""
    gen = torch.Generator().manual_seed(4)
    n_h, n_kv, hd = 4, 2, 40
    lengths = [37, 1, 40]
    k, v, ks, vs, all_slots = _filled_slabs(sum(lengths), n_kv, hd, torch.int8, gen)
    pos = [torch.randperm(37, generator=gen), torch.tensor([0]), torch.arange(90, 130)]
    k_pos = torch.cat(pos).to(DEVICE)
    indptr = torch.tensor([0, 37, 38, 78], device=DEVICE)
    q_pos = torch.tensor([36, 0, 129], device=DEVICE)
    q = (torch.randn(3, n_h, hd, generator=gen) * 0.3).to(DEVICE)
    for splits in (None, 4):
        _check_decode(q, k, v, ks, vs, all_slots, k_pos, q_pos, 0.7, window, splits, indptr=indptr)


def test_decode_sees_nothing_gives_zeros():
    """Rows with no visible key (an empty sequence, keys all outside the window) get zeros, not NaN,
    with one split and with several (the reduce then merges only empty splits)."""
    gen = torch.Generator().manual_seed(8)
    n_h, n_kv, hd = 4, 1, 40
    k, v, ks, vs, slots = _filled_slabs(25, n_kv, hd, torch.float16, gen)
    k_pos = torch.cat([torch.arange(5), torch.arange(20)]).to(DEVICE)
    indptr = torch.tensor([0, 5, 5, 25], device=DEVICE)  # sequence 1 is empty
    q_pos = torch.tensor([4, 0, 40], device=DEVICE)  # sequence 2: window 8 sees none of 0..19
    q = torch.randn(3, n_h, hd, generator=gen).half().to(DEVICE)
    want = decode_attention_ref(q, k, v, slots, k_pos, q_pos, 1.0, 8, slot_indptr=indptr)
    for splits in (1, 3):
        got = decode_attention(q, k, v, slots, k_pos, q_pos, 1.0, 8, slot_indptr=indptr, num_splits=splits,
                               block_n=16)
        assert_close(got.float(), want.float(), *TOL[torch.float16], f"{splits} splits")
        assert bool((got[1:] == 0).all())


def test_decode_shared_layer_reads_source_slab():
    """A KV-shared layer passes its source layer's slab: the kernel reads only what it is given."""
    gen = torch.Generator().manual_seed(5)
    n_h, n_kv, hd, S = 4, 1, 64, 37
    src = _filled_slabs(S, n_kv, hd, torch.float8_e4m3fn, gen)
    other = _filled_slabs(S, n_kv, hd, torch.float8_e4m3fn, gen)  # another layer, same slots
    k_pos = torch.arange(S, device=DEVICE)
    q = (torch.randn(n_h, hd, generator=gen) * 0.1).half().to(DEVICE)
    q_pos = torch.tensor([S - 1], device=DEVICE)
    a = decode_attention(q, src[0], src[1], src[4], k_pos, q_pos, 1.0, None, src[2], src[3], num_splits=2)
    b = decode_attention(q, other[0], other[1], src[4], k_pos, q_pos, 1.0, None, other[2], other[3], num_splits=2)
    want = decode_attention_ref(q, src[0], src[1], src[4], k_pos, q_pos, 1.0, None, src[2], src[3])
    assert_close(a.float(), want.float(), *TOL[torch.float16], "source slab")
    assert not torch.allclose(a.float(), b.float(), atol=1e-2)


def test_decode_split_counts_agree():
    """The split count is launch geometry only: 1 split, a few, and 24 over 9 tiles of 16 keys (15
    splits empty, merged by the reduce in 2 chunks of 16) give the same rows, for two sequences
    through slot_indptr with a window."""
    gen = torch.Generator().manual_seed(9)
    n_h, n_kv, hd = 4, 1, 40
    lengths = [130, 57]
    k, v, ks, vs, slots = _filled_slabs(sum(lengths), n_kv, hd, torch.int8, gen)
    k_pos = torch.cat([torch.randperm(130, generator=gen), torch.arange(57)]).to(DEVICE)
    indptr = torch.tensor([0, 130, 187], device=DEVICE)
    q_pos = torch.tensor([129, 56], device=DEVICE)
    q = (torch.randn(2, n_h, hd, generator=gen) * 0.3).to(DEVICE)
    want = decode_attention_ref(q, k, v, slots, k_pos, q_pos, 1.0, 50, ks, vs, slot_indptr=indptr)
    outs = {}
    for splits in (1, 3, 24):
        outs[splits] = decode_attention(q, k, v, slots, k_pos, q_pos, 1.0, 50, ks, vs, slot_indptr=indptr,
                                        num_splits=splits, block_n=16)
        assert_close(outs[splits], want, *TOL[torch.float32], f"{splits} splits vs ref")
    for splits in (3, 24):
        assert_close(outs[splits], outs[1], *TOL[torch.float32], f"{splits} splits vs 1")


TURING = [  # n_h, n_kv, hd, S, window, kv dtype: E2B's group of 8 at hd 256, E4B's 4 at hd 512
    (8, 1, 256, 37, 16, torch.bfloat16),
    (8, 2, 512, 21, None, torch.int8),
    (4, 1, 64, 45, None, torch.float8_e4m3fn),
]


@pytest.mark.parametrize("case", TURING, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}S{c[3]}w{c[4]}-{_name(c[5])}")
def test_turing_launch_bf16_queries_through_fp16_dots(case):
    """What an sm_75 launch computes (assume_gpu((7, 5))): bf16 q, K and V converted to fp16 for
    FMA dots, the head group unpadded, the head dim in chunks of 32, 16-key tiles. The dots are
    fp16 here, so the interpreter runs them right even for bf16 queries."""
    n_h, n_kv, hd, S, window, kv_dtype = case
    gen = torch.Generator().manual_seed(10)
    k, v, ks, vs, slots = _filled_slabs(S, n_kv, hd, kv_dtype, gen)
    k_pos = torch.arange(S, device=DEVICE)
    q = (torch.randn(3, n_h, hd, generator=gen) * hd ** -0.5).bfloat16().to(DEVICE)
    q_pos = torch.arange(S - 3, S, device=DEVICE)
    with assume_gpu((7, 5)):
        for splits in (1, 3):
            got = decode_attention(q[2], k, v, slots, k_pos, q_pos[2:], 1.0, window, ks, vs, num_splits=splits)
            want = decode_attention_ref(q[2], k, v, slots, k_pos, q_pos[2:], 1.0, window, ks, vs)
            assert_close(got.float(), want.float(), *TOL[torch.bfloat16], f"decode, {splits} splits")
        got = extend_attention(q, k, v, slots, k_pos, q_pos, 1.0, window, ks, vs)
    want = extend_attention_ref(q, k, v, slots, k_pos, q_pos, 1.0, window, ks, vs)
    assert_close(got.float(), want.float(), *TOL[torch.bfloat16], "extend")


# --- extend --------------------------------------------------------------------------------------

EXTEND = [  # n_h, n_kv, hd, S (prefix + chunk), T (chunk), window, kv dtype, q dtype
    (4, 1, 64, 37, 9, None, torch.float16, torch.float16),
    (4, 1, 64, 37, 9, 8, torch.int8, torch.float16),
    (4, 2, 40, 130, 20, 8, torch.float8_e4m3fn, torch.float16),
    (4, 2, 40, 130, 20, None, torch.float32, torch.float32),
    (4, 2, 40, 37, 37, 8, torch.bfloat16, torch.float32),  # a whole prompt
    (4, 2, 40, 37, 5, None, torch.int8, torch.float32),
    (8, 2, 256, 21, 6, 8, torch.float8_e4m3fn, torch.float16),
]
if not INTERPRET:
    EXTEND += [(4, 2, 40, 130, 20, 8, torch.int8, torch.bfloat16),
               (8, 1, 512, 70, 33, None, torch.bfloat16, torch.bfloat16)]


def _extend_id(c) -> str:
    return f"h{c[0]}kv{c[1]}d{c[2]}S{c[3]}T{c[4]}w{c[5]}-{_name(c[6])}-q_{_name(c[7])}"


@pytest.mark.parametrize("case", EXTEND, ids=_extend_id)
def test_extend(case):
    """A chunk of T queries at positions S-T..S-1 over the cached prefix and itself; the key list
    is shuffled (the kernel may not assume ascending positions) and the tiles are 16 x 16."""
    n_h, n_kv, hd, S, T, window, kv_dtype, q_dtype = case
    gen = torch.Generator().manual_seed(6)
    k, v, ks, vs, slots = _filled_slabs(S, n_kv, hd, kv_dtype, gen)
    order = torch.randperm(S, generator=gen).to(DEVICE)
    slots, k_pos = slots[order], torch.arange(S, device=DEVICE)[order]
    q = (torch.randn(T, n_h, hd, generator=gen) * hd ** -0.5).to(q_dtype).to(DEVICE)
    q_pos = torch.arange(S - T, S, device=DEVICE)
    got = extend_attention(q, k, v, slots, k_pos, q_pos, 1.0, window, ks, vs, block_m=16, block_n=16)
    want = extend_attention_ref(q, k, v, slots, k_pos, q_pos, 1.0, window, ks, vs)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got.float(), want.float(), *TOL[q_dtype], "kernel vs ref")
    direct = _direct(q, k, v, ks, vs, slots, k_pos, q_pos, 1.0, window)
    tol = 1e-5 if q_dtype == torch.float32 else 1e-3
    assert_close(want.float().cpu(), direct, tol, tol, "ref vs models.ops.attention")


def test_extend_matches_decode_rows():
    """Each row of an extend chunk equals a decode at that row's position (default tile sizes)."""
    gen = torch.Generator().manual_seed(7)
    n_h, n_kv, hd, S, T = 4, 2, 64, 40, 3
    k, v, ks, vs, slots = _filled_slabs(S, n_kv, hd, torch.int8, gen)
    k_pos = torch.arange(S, device=DEVICE)
    q = (torch.randn(T, n_h, hd, generator=gen) * 0.2).to(DEVICE)
    q_pos = torch.arange(S - T, S, device=DEVICE)
    ext = extend_attention(q, k, v, slots, k_pos, q_pos, 1.0, 16, ks, vs)
    for t in range(T):
        dec = decode_attention(q[t], k, v, slots, k_pos, q_pos[t:t + 1], 1.0, 16, ks, vs, num_splits=2)
        assert_close(ext[t], dec, *TOL[torch.float32], f"row {t}")


def test_split_merge_leaves_counters_at_zero():
    """The last split of each (sequence, KV head) merges the partials and resets its counter, so
    back-to-back split launches (every layer of a decode step, graph replays) stay correct."""
    from kernels.triton import attention as att

    g = torch.Generator().manual_seed(4)
    n_h, n_kv, hd, cap, B = 4, 2, 32, 96, 3
    k, v = (torch.randn(cap, n_kv, hd, generator=g) for _ in range(2))
    lens = [40, 7, 90]
    slots = torch.cat([torch.randperm(cap, generator=g)[:n] for n in lens])
    k_pos = torch.cat([torch.arange(n) for n in lens])
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q_pos = torch.tensor([n - 1 for n in lens])
    for step in range(3):
        q = torch.randn(B, n_h, hd, generator=g)
        want = att.decode_attention_ref(q, k, v, slots, k_pos, q_pos, 0.2, slot_indptr=indptr)
        got = att.decode_attention(q, k, v, slots, k_pos, q_pos, 0.2, slot_indptr=indptr, num_splits=5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert int(att._split_counters(q.device, B * n_kv).abs().sum()) == 0, step


@pytest.mark.parametrize("sms,keys,kv_dtype", [(132, 2048, torch.bfloat16), (170, 3000, torch.int8),
                                               (20, 1500, torch.float16)],
                         ids=["h200-bf16", "170sm-int8", "20sm-fp16"])
def test_decode_at_the_capped_split_count(sms, keys, kv_dtype):
    """Issue 21 item 2: on a many-SM GPU the eager launcher takes the merge-capped split count
    (`decode_splits`: E2B's head group of 8 at hd 256, 2048 keys on an H200 gets 8 splits, not the
    32 the SM count alone allows), and the merged rows equal the reference."""
    from triton.runtime.jit import KernelInterface

    from kernels.triton import attention as att

    g = torch.Generator().manual_seed(keys)
    n_h, n_kv, hd = 8, 1, 256
    cap = keys + 37
    k, v = (torch.zeros(cap, n_kv, hd, dtype=kv_dtype, device=DEVICE) for _ in range(2))
    ks, vs = ((torch.zeros(cap, n_kv, device=DEVICE) for _ in range(2)) if kv_dtype in SCALED else (None, None))
    slots = torch.randperm(cap, generator=g)[:keys].to(DEVICE)
    kv_store_ref(torch.randn(keys, n_kv, hd, generator=g).to(DEVICE),
                 torch.randn(keys, n_kv, hd, generator=g).to(DEVICE), k, v, slots, ks, vs)
    k_pos = torch.randperm(keys, generator=g).to(DEVICE)
    q = (torch.randn(n_h, hd, generator=g) * 0.3).to(DEVICE)
    q_pos = torch.tensor([keys - 1], device=DEVICE)
    want = decode_attention_ref(q, k, v, slots, k_pos, q_pos, 0.0625, None, ks, vs)
    with assume_gpu((9, 0), sms=sms):
        expect = att.decode_splits(keys, 1, n_kv, sms, group=n_h // n_kv, hd=hd, kv_dtype=kv_dtype)
        grids = []
        original = KernelInterface.__getitem__
        KernelInterface.__getitem__ = lambda self, grid: grids.append(grid) or original(self, grid)
        try:
            got = decode_attention(q, k, v, slots, k_pos, q_pos, 0.0625, None, ks, vs, block_n=128)
        finally:
            KernelInterface.__getitem__ = original
    assert grids == [(1, n_kv, expect)] and 1 < expect < -(-2 * sms // n_kv) and expect <= keys // 64
    assert att.merge_read_bytes(expect, n_h, hd) <= att.MERGE_SHARE * att.split_read_bytes(keys, expect, hd, kv_dtype)
    assert_close(got, want, *TOL[torch.float32], f"{expect} splits vs ref")
