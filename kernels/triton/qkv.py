"""The attention prologue of a KV-owning Gemma-4 layer in one launch: q and k RMSNorm + NeoX RoPE,
the weightless v RMSNorm, and K/V stored into their slabs (quantized for int8/fp8 slabs).

Unfused that is four launches per layer (q norm+rope, k norm+rope, v norm, kv_store) with the
normed k and v written to memory and read back; here one program per (token, head row) reads its
row of q, k or v once (plus the rotation partners, the same row: an L1 hit) and writes it once:
q to a [T, n_h, hd] tensor, k and v straight into the slabs at `slots` (or to dense [T, n_kv, hd]
outputs when no slabs are given: a dense cache writes them itself).
Grid: (T, n_h + 2 * n_kv); row r < n_h is query head r, then the K heads, then the V heads.

Numerics are those of the unfused kernels: fp32 norm and rotation (kernels/triton/fused.py
`rms_norm_rope`), the normed k/v rounded to the activation dtype (what `rms_norm_rope` returns),
then stored exactly as kernels/triton/kv_store.py stores that tensor (the same `store_row`).
`qkv_norm_rope_store_ref` is the torch definition: `rms_norm_rope_ref` + `rms_norm_ref` +
`kv_store_ref`.
"""
import torch

from .fused import rms_norm_ref, rms_norm_rope_ref
from .kv_store import check_store, kv_store_ref, quant_code, store_views

try:
    import triton
    import triton.language as tl

    from .kv_store import store_row
except ImportError:  # CPU-only installs: the ref still works
    triton = None

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

if triton is not None:

    @triton.jit
    def _qkv_norm_rope_store_kernel(
            q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_dst_ptr, v_dst_ptr,
            k_scale_ptr, v_scale_ptr, slots_ptr, eps, NH, NKV,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
            stride_dt, stride_dh, stride_st, stride_sh,
            HD: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
            SLOTS: tl.constexpr):
        """Row r of token t: q head r (r < NH), k head r - NH, or v head r - NH - NKV.
        q/k: x * rstd * w, then dims j < HALF pair with j + HALF (cos/sin [T, HALF] fp32, row
        stride stride_ct); v: x * rstd. SLOTS: k/v go to slab row slots[t] (skipped when < 0),
        else to row t of dense outputs (the same strides stride_dt, stride_dh either way)."""
        t = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < HD
        if r < NH:
            src = q_ptr + t * stride_qt + r * stride_qh
            w_ptr = qw_ptr
        elif r < NH + NKV:
            src = k_ptr + t * stride_kt + (r - NH) * stride_kh
            w_ptr = kw_ptr
        else:
            src = v_ptr + t * stride_vt + (r - NH - NKV) * stride_vh
            w_ptr = qw_ptr  # not read: v has no weight
        x = tl.load(src + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
        y = x * rstd
        if r < NH + NKV:  # q or k: weight, then RoPE
            y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            if HALF > 0:
                first = cols < HALF
                rot = cols < 2 * HALF
                pcols = tl.where(first, cols + HALF, cols - HALF)
                yp = tl.load(src + pcols, mask=rot, other=0.0).to(tl.float32) * rstd
                yp = yp * tl.load(w_ptr + pcols, mask=rot, other=0.0).to(tl.float32)
                j = tl.where(first, cols, cols - HALF)
                c = tl.load(cos_ptr + t * stride_ct + j, mask=rot, other=1.0)
                s = tl.load(sin_ptr + t * stride_ct + j, mask=rot, other=0.0)
                y = tl.where(rot, tl.where(first, y * c - yp * s, y * c + yp * s), y)
        if r < NH:
            tl.store(q_out_ptr + (t * NH + r) * HD + cols, y.to(q_out_ptr.dtype.element_ty), mask=cmask)
        else:
            yr = y.to(q_out_ptr.dtype.element_ty)  # the normed k/v in the activation dtype, as unfused
            if SLOTS:
                slot = tl.load(slots_ptr + t).to(tl.int64)
            else:
                slot = t
            if slot >= 0:
                if r < NH + NKV:
                    h = r - NH
                    store_row(yr, k_dst_ptr + slot * stride_dt + h * stride_dh + cols,
                              k_scale_ptr + slot * stride_st + h * stride_sh, cmask, QUANT)
                else:
                    h = r - NH - NKV
                    store_row(yr, v_dst_ptr + slot * stride_dt + h * stride_dh + cols,
                              v_scale_ptr + slot * stride_st + h * stride_sh, cmask, QUANT)


def _rope_table(cos: torch.Tensor, T: int, hd: int, fn: str) -> torch.Tensor:
    """cos/sin as [T, n_rot/2] fp32 with a unit last stride (a [T, 1, n_rot/2] table is viewed)."""
    if cos.dim() == 3:
        assert cos.shape[1] == 1, f"{fn}: cos/sin {tuple(cos.shape)}"
        cos = cos[:, 0]
    assert cos.dim() == 2 and cos.shape[0] == T and 2 * cos.shape[1] <= hd, \
        f"{fn}: cos/sin {tuple(cos.shape)} for T={T}, head dim {hd}"
    assert cos.dtype == torch.float32 and cos.stride(-1) == 1, f"{fn}: cos/sin must be fp32, unit last stride"
    return cos


def qkv_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor, k_slab=None, v_slab=None,
                        slots=None, k_scale=None, v_scale=None):
    """q [T, n_h, hd], k, v [T, n_kv, hd] (fp16/bf16/fp32, unit last stride, any token/head strides:
    views of one fused qkv output; v None: V is the raw k, as Gemma-4 without attn_v).
    q_weight, k_weight [hd]; cos, sin fp32 [T, n_rot/2] (or [T, 1, n_rot/2]).

    With slabs (k_slab, v_slab [capacity, n_kv, hd], slots [T], scales for int8/fp8 slabs, as
    `kernels.triton.kv_store.kv_store`): returns (q_out, None, None) and K/V are stored. Without: returns
    (q_out, k_out, v_out), all contiguous in q's dtype."""
    if triton is None:
        raise RuntimeError("qkv_norm_rope_store: triton is not installed; use qkv_norm_rope_store_ref")
    v = k if v is None else v
    assert q.dim() == 3 and k.dim() == 3 and v.shape == k.shape, \
        f"qkv_norm_rope_store: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}"
    T, n_h, hd = q.shape
    n_kv = k.shape[1]
    assert k.shape == (T, n_kv, hd) and n_kv > 0, f"qkv_norm_rope_store: q {tuple(q.shape)} k {tuple(k.shape)}"
    assert q.dtype in _DTYPES and k.dtype == v.dtype == q.dtype, f"qkv_norm_rope_store: {q.dtype} {k.dtype} {v.dtype}"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "qkv_norm_rope_store: head dims must be contiguous"
    assert q.device == k.device == v.device
    for w in (q_weight, k_weight):
        assert w.shape == (hd,) and w.is_contiguous() and w.device == q.device, \
            f"qkv_norm_rope_store: norm weight {tuple(w.shape)} for head dim {hd}"
    assert q_weight.dtype == k_weight.dtype and q_weight.dtype in _DTYPES, "qkv_norm_rope_store: weight dtypes"
    cos, sin = _rope_table(cos, T, hd, "qkv_norm_rope_store"), _rope_table(sin, T, hd, "qkv_norm_rope_store")
    assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.device == q.device
    q_out = torch.empty((T, n_h, hd), dtype=q.dtype, device=q.device)
    k_out = v_out = None
    if k_slab is not None:
        assert v_slab is not None and slots is not None, "qkv_norm_rope_store: k_slab needs v_slab and slots"
        check_store(k, k_slab, k_scale, slots, "k")
        check_store(v, v_slab, v_scale, slots, "v")
        assert k_slab.dtype == v_slab.dtype and k_slab.stride() == v_slab.stride(), "k/v slabs differ"
        k_dst, v_dst = store_views(k_slab, v_slab)
        quant = quant_code(k_slab.dtype)
    else:
        k_dst = k_out = torch.empty((T, n_kv, hd), dtype=q.dtype, device=q.device)
        v_dst = v_out = torch.empty_like(k_out)
        quant = 0
    if T == 0:
        return q_out, k_out, v_out
    if quant:
        assert k_scale.stride() == v_scale.stride(), "k/v scales differ"
    k_sc, v_sc = (k_scale, v_scale) if quant else (k_dst, v_dst)  # not read unless quant
    block_d = triton.next_power_of_2(hd)
    _qkv_norm_rope_store_kernel[(T, n_h + 2 * n_kv)](
        q, k, v, q_weight, k_weight, cos, sin, q_out, k_dst, v_dst, k_sc, v_sc,
        slots if slots is not None else q_out, float(eps), n_h, n_kv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_dst.stride(0), k_dst.stride(1), k_sc.stride(0) if quant else 0, k_sc.stride(1) if quant else 0,
        HD=hd, HALF=cos.shape[1], BLOCK_D=block_d, QUANT=quant, SLOTS=slots is not None,
        num_warps=1 if block_d <= 256 else 2)
    return q_out, k_out, v_out


def qkv_norm_rope_store_ref(q, k, v, q_weight, k_weight, eps, cos, sin, k_slab=None, v_slab=None,
                            slots=None, k_scale=None, v_scale=None):
    """Torch version of `qkv_norm_rope_store` (same arguments and results)."""
    v = k if v is None else v
    q_out = rms_norm_rope_ref(q, q_weight, eps, cos, sin)
    k_out = rms_norm_rope_ref(k, k_weight, eps, cos, sin)
    v_out = rms_norm_ref(v, None, eps)
    if k_slab is None:
        return q_out, k_out, v_out
    kv_store_ref(k_out, v_out, k_slab, v_slab, slots, k_scale, v_scale)
    return q_out, None, None
