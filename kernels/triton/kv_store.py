"""Store one forward's K/V rows into token-granular KV slabs, quantizing 8-bit formats on the fly.

Slab layout (engine/kv/pool.py): values k_slab, v_slab [capacity, n_kv, hd] in the format's dtype
(bf16 / fp16 / fp32 / int8 / float8_e4m3fn); 8-bit formats add k_scale, v_scale [capacity, n_kv] fp32,
one scale per token per head:
    int8: scale = max(amax, 1e-12) / 127, q = clamp(round_half_even(x / scale), -127, 127)
    fp8:  scale = max(amax, 1e-12) / 448, q = e4m3fn(clamp(x / scale, -448, 448))  (RTNE)
`kv_store_ref` is the torch definition (the same arithmetic as the engine's KVFormat.quantize);
the kernel reproduces it bit for bit: both divisions are IEEE round-to-nearest (`div_rn`, not
Triton's default fast `/`), and rounding uses the fp32 magic-number trick below.

A negative slot means "padding row, write nothing" (lets a CUDA graph run a fixed T).
K and V share one launch (grid axis 2). The row store `store_row` is also the last step of the
fused attention prologue (kernels/triton/qkv.py), which norms, rotates and stores in one pass.
Memory traffic: reads T·n_kv·hd input elements twice per tensor (amax, then quantize; the second
read hits L1/L2) and writes T·n_kv·(hd·bytes + 4).
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: kv_store_ref still works
    triton = None

_INT8_MAX = 127.0
_FP8_MAX = 448.0  # float8_e4m3fn
_SCALED = (torch.int8, torch.float8_e4m3fn)
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:

    @triton.jit
    def _round_to_e4m3_grid(y):
        """fp32 y, |y| <= 448 -> the nearest float8_e4m3fn value (ties to even), still as fp32.

        Rounding here rather than in a cast keeps the result exact on every path (the Triton
        interpreter's fp32 -> fp8 cast drops the carry when rounding up crosses a power of two,
        126.8 -> 64, and pre-sm_89 GPUs have no e4m3 conversion).
        ulp u = 2**(max(e, -6) - 3) for y in [2**e, 2**(e+1)) (e4m3: 3 mantissa bits, subnormal
        below 2**-6); adding c = 1.5 * 2**23 * u leaves fp32 a spacing of exactly u, so the add
        rounds y to a multiple of u, ties to even (c/u is even), and subtracting c is exact.
        """
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6)
        c = (((e + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2**(e + 20)
        r = (y + c) - c
        return tl.where(r == 0.0, y * 0.0, r)  # keep the sign of zero, as torch's cast does

    @triton.jit
    def _e4m3_grid_to_bits(r):
        """fp32 r on the e4m3 grid -> its float8_e4m3fn byte (uint8), without a Triton fp8 type:
        Triton has no fp8e4nv before sm_89, and its interpreter's fp32 -> fp8 cast is wrong.

        r · 2**-8 is exactly an fp16 (e4m3 normals 2**-6..448 land on fp16 normals 2**-14..1.75,
        e4m3 subnormals k·2**-9 on fp16 subnormals), whose bits are the e4m3 bits shifted left by 7.
        """
        bits = (r * 0.00390625).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        return (((bits >> 8) & 0x80) | ((bits >> 7) & 0x7F)).to(tl.uint8)

    @triton.jit
    def store_row(x, dst, scale_dst, mask, QUANT: tl.constexpr):
        """One (token, head) row x [BLOCK_D] (any float dtype, masked lanes 0) -> the slab row at
        `dst` (a block of pointers): QUANT 0 cast to the slab's dtype; 1 int8, 2 fp8 e4m3fn (as its
        bytes), each with its fp32 scale stored at `scale_dst`. Shared by kv_store and the fused
        q/k/v prologue (kernels/triton/qkv.py), so both quantize bit for bit alike."""
        if QUANT == 0:
            tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)
        else:
            xf = x.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-12)
            if QUANT == 1:
                scale = tl.math.div_rn(amax, 127.0)
                y = tl.math.div_rn(xf, scale)
                # Round half to even like torch.round: for |y| < 2**22, adding 1.5 * 2**23 leaves
                # a ulp of 1, so the fp32 add itself rounds to an integer (ties to even).
                # Triton emits no reassociation flags, so the add/sub pair survives (checked in
                # the sm_90 PTX: two add.f32).
                y = (y + 12582912.0) - 12582912.0
                y = tl.minimum(tl.maximum(y, -127.0), 127.0)
                tl.store(dst, y.to(tl.int8), mask=mask)
            else:
                scale = tl.math.div_rn(amax, 448.0)
                y = tl.math.div_rn(xf, scale)
                y = _round_to_e4m3_grid(tl.minimum(tl.maximum(y, -448.0), 448.0))
                tl.store(dst, _e4m3_grid_to_bits(y), mask=mask)
            tl.store(scale_dst, scale)

    @triton.jit
    def _kv_store_kernel(k_ptr, v_ptr, k_slab_ptr, v_slab_ptr, k_scale_ptr, v_scale_ptr, slots_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_st, stride_sh, stride_ct, stride_ch,
                         HD: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
        # One program per (token, kv head, K or V): one row of HD values. QUANT: 0 cast, 1 int8,
        # 2 fp8 e4m3fn. K and V share the launch (grid axis 2): one kernel per layer, not two.
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, BLOCK_D)
            mask = offs < HD
            row = slot * stride_st + h * stride_sh
            scale_at = slot * stride_ct + h * stride_ch
            if tl.program_id(2) == 0:
                x = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + offs, mask=mask, other=0.0)
                store_row(x, k_slab_ptr + row + offs, k_scale_ptr + scale_at, mask, QUANT)
            else:
                x = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + offs, mask=mask, other=0.0)
                store_row(x, v_slab_ptr + row + offs, v_scale_ptr + scale_at, mask, QUANT)


def check_store(x: torch.Tensor, slab: torch.Tensor, scale, slots: torch.Tensor, name: str) -> None:
    """The store launchers' asserts for one of K/V (`name`): x [T, n_kv, hd] rows into `slab`
    [capacity, n_kv, hd] at `slots` [T], with a float32 `scale` [capacity, n_kv] for an 8-bit slab
    (kv_store here, the fused prologue in qkv.py)."""
    T, n_kv, hd = x.shape
    assert x.dtype in _PLAIN, f"{name}: {x.dtype} input"
    assert slab.dim() == 3 and slab.shape[1:] == (n_kv, hd), f"{name} slab {tuple(slab.shape)} vs rows {tuple(x.shape)}"
    assert slab.dtype in _PLAIN + _SCALED, f"{name} slab dtype {slab.dtype}"
    assert x.stride(-1) == 1 and slab.stride(-1) == 1, f"{name}: head dim must be contiguous"
    assert slots.shape == (T,) and slots.dtype in (torch.int32, torch.int64), f"slots {slots.shape} {slots.dtype}"
    assert x.device == slab.device == slots.device
    if slab.dtype in _SCALED:
        assert scale is not None and scale.shape == (slab.shape[0], n_kv) and scale.dtype == torch.float32, \
            f"{name}_scale must be fp32 [capacity, n_kv] for a {slab.dtype} slab"
    else:
        assert scale is None, f"{name}_scale given for an unscaled {slab.dtype} slab"


def kv_store(k: torch.Tensor, v: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor,
             slots: torch.Tensor, k_scale=None, v_scale=None) -> None:
    """k, v [T, n_kv, hd] fp16/bf16/fp32 -> k_slab[slots], v_slab[slots] (+ scales for int8/fp8 slabs).

    slots: [T] int32/int64 slot per row, on the slabs' device; negative slots are skipped.
    """
    assert triton is not None, "kv_store needs triton; use kv_store_ref"
    assert k.dim() == 3 and v.shape == k.shape, f"k {tuple(k.shape)} v {tuple(v.shape)}"
    check_store(k, k_slab, k_scale, slots, "k")
    check_store(v, v_slab, v_scale, slots, "v")
    T, n_kv, hd = k.shape
    if T == 0:
        return
    assert k_slab.dtype == v_slab.dtype and k_slab.stride() == v_slab.stride(), "k/v slabs differ"
    quant = quant_code(k_slab.dtype)
    if quant:
        assert k_scale.stride() == v_scale.stride(), "k/v scales differ"
    ks, vs = store_views(k_slab, v_slab)
    _kv_store_kernel[(T, n_kv, 2)](
        k, v, ks, vs, k_scale if quant else ks, v_scale if quant else vs, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), ks.stride(0), ks.stride(1),
        k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0,
        HD=hd, BLOCK_D=triton.next_power_of_2(hd), QUANT=quant, num_warps=1 if hd <= 256 else 2)


def quant_code(slab_dtype: torch.dtype) -> int:
    """The kernels' QUANT constant for a slab dtype: 0 plain cast, 1 int8, 2 fp8 e4m3fn."""
    return {torch.int8: 1, torch.float8_e4m3fn: 2}.get(slab_dtype, 0)


def store_views(*slabs: torch.Tensor):
    """The slabs as the kernels write them: fp8 as its bytes (written by _e4m3_grid_to_bits)."""
    return tuple(s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s for s in slabs)


def quantize_ref(x: torch.Tensor, dtype: torch.dtype):
    """x [..., hd] -> (values in `dtype`, fp32 scales [...] or None): the KV formats' definition."""
    if dtype not in _SCALED:
        return x.to(dtype), None
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(1e-12)
    if dtype == torch.int8:
        scale = amax / _INT8_MAX
        q = torch.round(xf / scale[..., None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    else:
        scale = amax / _FP8_MAX
        q = (xf / scale[..., None]).clamp_(-_FP8_MAX, _FP8_MAX).to(dtype)
    return q, scale


def kv_store_ref(k: torch.Tensor, v: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor,
                 slots: torch.Tensor, k_scale=None, v_scale=None) -> None:
    """Torch version of `kv_store` (same arguments, same result bit for bit)."""
    assert k.dim() == 3 and v.shape == k.shape
    check_store(k, k_slab, k_scale, slots, "k")
    check_store(v, v_slab, v_scale, slots, "v")
    keep = slots >= 0
    s = slots[keep]
    for x, slab, scale in ((k, k_slab, k_scale), (v, v_slab, v_scale)):
        q, sc = quantize_ref(x[keep], slab.dtype)
        slab[s] = q
        if scale is not None:
            scale[s] = sc
