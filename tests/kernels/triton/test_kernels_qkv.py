"""kernels.triton.qkv: the fused attention prologue (q/k norm + RoPE, v norm, K/V store) vs its torch ref,
and vs the unfused kernels it replaces (rms_norm_rope, rms_norm, kv_store).

Odd shapes: T 1 and 5, head dims 40 and 64 (256 once), n_rot below the head dim and Gemma-4's
non-rotating pairs, GQA 3 heads over 1 and 4 over 2, views of one fused qkv output, negative
(padding) slots, every slab format. Runs under the Triton interpreter on the CPU.
"""
from triton_env import DEVICE, INTERPRET  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch

from kernels.triton.fused import rms_norm, rms_norm_rope
from kernels.triton.kv_store import kv_store
from kernels.triton.qkv import qkv_norm_rope_store, qkv_norm_rope_store_ref
from models.ops import rope_cos_sin, rope_inv_freq
from test_kernels_fused import TOL, _name, _rand, assert_close

CAPACITY = 23
X_DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
SLABS = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn]
SCALED = (torch.int8, torch.float8_e4m3fn)


def _cos_sin(T: int, n_rot: int, zero_pairs: int = 0):
    factors = [1.0] * (n_rot // 2 - zero_pairs) + [1e30] * zero_pairs
    pos = torch.tensor([0, 7, 130, 4099, 21, 3])[:T]
    return rope_cos_sin(pos, rope_inv_freq(n_rot, 1e4, factors), torch.float32)  # [T, 1, n_rot/2]


def _fused_qkv(T, n_h, n_kv, hd, dtype, extra=3, seed=0):
    """q, k, v as views of one [T, (n_h + 2 n_kv) hd + extra] projection output (row stride > width)."""
    y = _rand(T, (n_h + 2 * n_kv) * hd + extra, dtype=dtype, scale=2.0, seed=seed)
    q = y[:, :n_h * hd].view(T, n_h, hd)
    k = y[:, n_h * hd:(n_h + n_kv) * hd].view(T, n_kv, hd)
    v = y[:, (n_h + n_kv) * hd:(n_h + 2 * n_kv) * hd].view(T, n_kv, hd)
    return q, k, v


def _slabs(n_kv, hd, dtype):
    k = torch.zeros(CAPACITY, n_kv, hd, dtype=dtype, device=DEVICE)
    scales = (torch.zeros(CAPACITY, n_kv, device=DEVICE), torch.zeros(CAPACITY, n_kv, device=DEVICE)) \
        if dtype in SCALED else (None, None)
    return k, torch.zeros_like(k), *scales


def _values(slab, scale):
    """Slab rows as fp32 values (8-bit formats times their scales)."""
    v = slab.float()
    return v * scale[..., None] if scale is not None else v


def assert_slabs_close(got, want, x_dtype, what):
    """Plain slabs: the tolerance of the input dtype (plus the slab's rounding). 8-bit slabs: the
    kernel's and the ref's normed rows differ in the last bits, which can move a value across a
    rounding boundary: at most one quantization step (int8: one scale; e4m3: 1/8 relative)."""
    (gk, gs), (wk, ws) = got, want
    if wk.dtype not in SCALED:
        tol = max(TOL[x_dtype][0], {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(wk.dtype, 0.0))
        assert_close(gk.float(), wk.float(), tol, tol, what)
        return
    assert_close(gs, ws, 1e-5, 1e-5, what + " scales")
    g, w = _values(gk, gs), _values(wk, ws)
    if wk.dtype == torch.int8:
        step = ws[..., None]
    else:  # e4m3: 3 mantissa bits; subnormals step by 2**-9 (times the scale)
        step = 0.13 * w.abs() + ws[..., None] * 2.0 ** -9
    bad = (g - w).abs() > step + 1e-6
    assert not bad.any(), f"{what}: {int(bad.sum())} values off by more than one step, e.g. " \
                          f"{g[bad][:4].tolist()} vs {w[bad][:4].tolist()}"


@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=_name)
@pytest.mark.parametrize("slab_dtype", SLABS, ids=_name)
@pytest.mark.parametrize("T,n_h,n_kv,hd,n_rot,zero_pairs", [
    (5, 3, 1, 40, 24, 0),    # n_rot < hd: dims 24..39 only normed
    (5, 4, 2, 64, 64, 12),   # Gemma-4 full layers: partial rotation as cos 1 / sin 0 pairs
    (1, 4, 1, 256, 256, 0),  # decode, hd 256
], ids=str)
def test_qkv_norm_rope_store_matches_ref(T, n_h, n_kv, hd, n_rot, zero_pairs, slab_dtype, x_dtype):
    q, k, v = _fused_qkv(T, n_h, n_kv, hd, x_dtype)
    wq, wk = _rand(hd, dtype=torch.float32, seed=1), _rand(hd, dtype=torch.float32, seed=2)
    cos, sin = (t.to(DEVICE) for t in _cos_sin(T, n_rot, zero_pairs))
    slots = torch.tensor([4, -1, 22, 0, 9][:T], device=DEVICE)  # -1: a padding row, stored nowhere
    got, want = _slabs(n_kv, hd, slab_dtype), _slabs(n_kv, hd, slab_dtype)
    what = f"qkv T={T} n_h={n_h} n_kv={n_kv} hd={hd} n_rot={n_rot} {_name(x_dtype)} -> {_name(slab_dtype)}"
    q_got, k_none, v_none = qkv_norm_rope_store(q, k, v, wq, wk, 1e-6, cos, sin, got[0], got[1], slots,
                                                got[2], got[3])
    q_want, _, _ = qkv_norm_rope_store_ref(q, k, v, wq, wk, 1e-6, cos, sin, want[0], want[1], slots,
                                           want[2], want[3])
    assert k_none is None and v_none is None and q_got.is_contiguous()
    assert_close(q_got, q_want, *TOL[x_dtype], what + " q")
    for name, i in (("k", 0), ("v", 1)):
        assert_slabs_close((got[i], got[2 + i]), (want[i], want[2 + i]), x_dtype, f"{what} {name} slab")
    untouched = torch.ones(CAPACITY, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert not got[0][untouched.to(DEVICE)].float().any() and not got[1][untouched.to(DEVICE)].float().any()


@pytest.mark.parametrize("slab_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn], ids=_name)
def test_qkv_matches_the_unfused_kernels(slab_dtype):
    """What rms_norm_rope (q, k) + rms_norm (v) + kv_store give, the launches it replaces."""
    T, n_h, n_kv, hd = 5, 4, 2, 64
    q, k, v = _fused_qkv(T, n_h, n_kv, hd, torch.float32, seed=3)
    wq, wk = _rand(hd, dtype=torch.float32, seed=4), _rand(hd, dtype=torch.float32, seed=5)
    cos, sin = (t.to(DEVICE) for t in _cos_sin(T, 32))
    slots = torch.tensor([3, 1, 4, 15, 9], device=DEVICE)
    got, want = _slabs(n_kv, hd, slab_dtype), _slabs(n_kv, hd, slab_dtype)
    q_got = qkv_norm_rope_store(q, k, v, wq, wk, 1e-6, cos, sin, got[0], got[1], slots, got[2], got[3])[0]
    kv_store(rms_norm_rope(k, wk, 1e-6, cos, sin), rms_norm(v, None, 1e-6), want[0], want[1], slots, want[2], want[3])
    assert_close(q_got, rms_norm_rope(q, wq, 1e-6, cos, sin), *TOL[torch.float32], "q vs rms_norm_rope")
    for name, i in (("k", 0), ("v", 1)):
        assert_slabs_close((got[i], got[2 + i]), (want[i], want[2 + i]), torch.float32, f"{name} vs kv_store")


@pytest.mark.parametrize("dtype", X_DTYPES, ids=_name)
def test_qkv_dense_outputs_and_v_from_raw_k(dtype):
    """No slabs: q, k, v come back dense; v None normalizes the raw k (Gemma-4 without attn_v)."""
    T, n_h, n_kv, hd = 3, 3, 1, 40
    q, k, _ = _fused_qkv(T, n_h, n_kv, hd, dtype, seed=6)
    wq, wk = _rand(hd, dtype=torch.float32, seed=7), _rand(hd, dtype=torch.float32, seed=8)
    cos, sin = (t.to(DEVICE) for t in _cos_sin(T, 40))
    got = qkv_norm_rope_store(q, k, None, wq, wk, 1e-6, cos[:, 0], sin[:, 0])
    want = qkv_norm_rope_store_ref(q, k, None, wq, wk, 1e-6, cos, sin)
    for name, g, w in zip("qkv", got, want):
        assert g.is_contiguous()
        assert_close(g, w, *TOL[dtype], f"dense {name} {_name(dtype)}")
    assert_close(got[2], rms_norm(k, None, 1e-6), *TOL[dtype], "v = norm of the raw k")


def test_qkv_rejects_bad_shapes():
    q, k, v = _fused_qkv(2, 3, 1, 40, torch.float32)
    w = _rand(40, dtype=torch.float32)
    cos, sin = (t.to(DEVICE) for t in _cos_sin(2, 40))
    with pytest.raises(AssertionError, match="norm weight"):
        qkv_norm_rope_store(q, k, v, w[:39], w, 1e-6, cos, sin)
    with pytest.raises(AssertionError, match="cos/sin"):
        qkv_norm_rope_store(q, k, v, w, w, 1e-6, cos[:1], sin[:1])
    with pytest.raises(AssertionError, match="fp32"):
        qkv_norm_rope_store(q, k, v, w, w, 1e-6, cos.half(), sin.half())
