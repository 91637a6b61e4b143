"""Attention over token-granular KV slabs: decode (one query per sequence, split-K) and extend.

KV layout (engine/kv/pool.py): k_slab, v_slab [capacity, n_kv, hd] in bf16 / fp16 / fp32 / int8 /
float8_e4m3fn; the 8-bit formats add k_scale, v_scale [capacity, n_kv] fp32 (value = q · scale, one
scale per token per head). A sequence's keys are a list of slot indices into the slab plus their
absolute positions; the slab may belong to another layer (KV-shared layers pass their source's).

Semantics (models/common.py `attention`, spec §3.4-3.6): scores q·k·scale (Gemma-4: scale 1.0, no
softcap); key j visible to a query at position p iff 0 <= p - k_pos[j] (< window when given), so a
window W covers W keys including the query's own; query head h reads KV head h // (n_h / n_kv).
A query that sees no key gets zeros (SDPA would give NaN); the engine never asks for one.

Batched decode uses a CSR layout, the ragged form the engine already has per sequence:
    q [B, n_h, hd], q_pos [B]
    slot_indptr [B+1]: sequence b's keys are entries slot_indptr[b] : slot_indptr[b+1] of
    slots [total] (slot in the slab) and k_pos [total] (its absolute position).
Key order inside a sequence is free; blocks whose keys are all masked (beyond the causal edge or
out of the window) skip their K/V loads, which prunes most of them when positions ascend.

Numerics: dot inputs in q's dtype (8-bit K/V values are exact in fp16/bf16), fp32 accumulation,
exp2-domain online softmax. 8-bit scales are applied to the scores (k) and to the probabilities (v),
never to the K/V tiles: BLOCK_H·BLOCK_N multiplies instead of BLOCK_N·hd. Below sm_80 bf16 queries
go into the dots as fp16 (no bf16 MMA or bf16 conversions there; q, k and v are RMS-normed, so
fp16's range holds them; 8-bit values are exact in fp16 too).
Decode split-K (flash-decoding): grid (B, n_kv, splits); each split writes a normalized partial
output and its log2-sum-exp, bumps a per-(sequence, KV head) counter, and the split that finishes
last merges all partials and resets the counter: one launch per layer, split or not (a separate
reduce kernel would add a launch per layer to every decode step). Each program handles all n_h/n_kv query
heads of one KV head, so a K/V tile is read once per group: decode reads each visible key's
K and V bytes once per step. `decode_splits` sizes the split count from the GPU's SM count, capped
so the merge reads at most a quarter of what one split reads.

Tiles depend on the GPU (kernels.arch.gpu_of: the tensor's CUDA device, or the assumed GPU of a
dry run): `decode_tiles`, `extend_tiles`. Triton >= 3.2 has no tensor-core path below sm_80 and
runs every fp32 'ieee' dot on FMA units too; there tl.dot holds both operands' whole contraction
extent in each thread's registers, so the q·k dot runs over head-dim chunks (`_scores`).
"""
import math
from typing import NamedTuple

import torch

from ..arch import dot_fp16, gpu_of

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the *_ref functions still work
    triton = None

_SCALED = (torch.int8, torch.float8_e4m3fn)
_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + _SCALED
_LOG2E = 1.4426950408889634

if triton is not None:

    @triton.jit
    def _e4m3_bits_to_fp16(raw):
        """float8_e4m3fn bytes (uint8) -> fp16 holding value · 2**-8, exactly: the e4m3 exponent and
        mantissa bits shifted left by 7 are an fp16 with a bias 8 higher (subnormals included).
        Done by hand because Triton has no fp8e4nv type before sm_89; callers fold the 2**8 into
        the per-token scale. Four integer ops an element (the hardware cvt is one)."""
        bits = raw.to(tl.uint16)
        return (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)

    @triton.jit
    def _to_dot(x, q_rows, DOT_F16: tl.constexpr):
        """x as a dot operand: in q's type, or fp16 below sm_80 (no bf16 MMA or bf16 conversions)."""
        if DOT_F16:
            y = x.to(tl.float16)
        else:
            y = x.to(q_rows.dtype.element_ty)
        return y

    @triton.jit
    def _scores(q, q_rows, mask_rows, k_ptr, slot, mask_n, kv_head, stride_kt, stride_kh,
                HD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr,
                BLOCK_N: tl.constexpr, FP8: tl.constexpr, DOT_F16: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """q · k^T of R rows against a tile of keys gathered by slot: [BLOCK_R, BLOCK_N] fp32.
        BLOCK_DK == BLOCK_D: one dot with q held in registers (tensor cores). BLOCK_DK < BLOCK_D:
        the head dim in chunks, q re-read from L1 per chunk: Triton's FMA dot (sm_75: no MMA)
        holds both operands' whole contraction extent per thread, and q [R, 512] with a [512, N]
        tile spills; chunks of 32 keep it to about (rows + cols per thread) x 32 registers."""
        if BLOCK_DK == BLOCK_D:
            offs_d = tl.arange(0, BLOCK_D)
            kt = tl.load(k_ptr + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                         mask=mask_n[None, :] & (offs_d[:, None] < HD), other=0)  # k^T [BLOCK_D, BLOCK_N]
            if FP8:
                kt = _e4m3_bits_to_fp16(kt)
            qk = tl.dot(q, _to_dot(kt, q_rows, DOT_F16), input_precision=DOT_PRECISION)
        else:
            qk = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
            for c in tl.static_range(BLOCK_D // BLOCK_DK):
                offs_c = c * BLOCK_DK + tl.arange(0, BLOCK_DK)
                q_c = tl.load(q_rows[:, None] + offs_c[None, :], mask=mask_rows[:, None] & (offs_c[None, :] < HD),
                              other=0.0)
                kt = tl.load(k_ptr + slot[None, :] * stride_kt + kv_head * stride_kh + offs_c[:, None],
                             mask=mask_n[None, :] & (offs_c[:, None] < HD), other=0)
                if FP8:
                    kt = _e4m3_bits_to_fp16(kt)
                qk += tl.dot(_to_dot(q_c.to(tl.float32), q_rows, DOT_F16), _to_dot(kt, q_rows, DOT_F16),
                             input_precision=DOT_PRECISION)
        return qk

    @triton.jit
    def _attend_block(q, q_rows, mask_rows, acc, m_i, l_i, start, end, q_pos_rows, q_pos_min, q_pos_max, kv_head,
                      k_ptr, v_ptr, ks_ptr, vs_ptr, slots_ptr, kpos_ptr, qk_scale, window,
                      stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_kst, stride_ksh, stride_vst, stride_vsh,
                      HD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr,
                      BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SCALED: tl.constexpr, FP8: tl.constexpr,
                      DOT_F16: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One BLOCK_N tile of keys (list entries start..start+BLOCK_N, < end) into the online
        softmax state of R query rows: q [R, BLOCK_D] in the dot type (unused when BLOCK_DK <
        BLOCK_D: q_rows [R] pointers to each row's q, mask_rows [R], are read instead), acc [R, D]
        fp32, m_i, l_i [R] fp32 (log2)."""
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k_pos = tl.load(kpos_ptr + offs_n, mask=mask_n, other=0)
        # Skip tiles no row can see (all after the last query, or all left of every row's window).
        kp_min = tl.min(tl.where(mask_n, k_pos, 2147483647), axis=0)
        kp_max = tl.max(tl.where(mask_n, k_pos, -2147483647), axis=0)
        live = kp_min <= q_pos_max
        if HAS_WINDOW:
            live = live & (q_pos_min - kp_max < window)
        if live:
            slot = tl.load(slots_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
            qk = _scores(q, q_rows, mask_rows, k_ptr, slot, mask_n, kv_head, stride_kt, stride_kh,
                         HD, BLOCK_R, BLOCK_D, BLOCK_DK, BLOCK_N, FP8, DOT_F16, DOT_PRECISION)
            if SCALED:
                k_sc = tl.load(ks_ptr + slot * stride_kst + kv_head * stride_ksh, mask=mask_n, other=0.0)
                if FP8:
                    k_sc = k_sc * 256.0
                qk = qk * (k_sc * qk_scale)[None, :]
            else:
                qk = qk * qk_scale
            diff = q_pos_rows[:, None] - k_pos[None, :]
            visible = mask_n[None, :] & (diff >= 0)
            if HAS_WINDOW:
                visible = visible & (diff < window)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(qk - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            offs_d = tl.arange(0, BLOCK_D)
            v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_n[:, None] & (offs_d[None, :] < HD), other=0)
            if FP8:
                v = _e4m3_bits_to_fp16(v)
            if SCALED:
                v_sc = tl.load(vs_ptr + slot * stride_vst + kv_head * stride_vsh, mask=mask_n, other=0.0)
                if FP8:
                    v_sc = v_sc * 256.0
                p = p * v_sc[None, :]
            acc = acc * alpha[:, None] + tl.dot(_to_dot(p, q_rows, DOT_F16), _to_dot(v, q_rows, DOT_F16),
                                                input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _decode_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slots_ptr, kpos_ptr, qpos_ptr, indptr_ptr,
                             out_ptr, mid_o_ptr, mid_lse_ptr, count_ptr, single_len, qk_scale, window, n_h, n_kv,
                             stride_qb, stride_qh, stride_ob, stride_oh,
                             stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_kst, stride_ksh, stride_vst, stride_vsh,
                             GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_N: tl.constexpr,
                             HAS_INDPTR: tl.constexpr, HAS_WINDOW: tl.constexpr, SCALED: tl.constexpr,
                             FP8: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F16: tl.constexpr):
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if HAS_INDPTR:
            seq_start = tl.load(indptr_ptr + b).to(tl.int64)
            seq_len = (tl.load(indptr_ptr + b + 1) - seq_start).to(tl.int32)
        else:
            seq_start = 0
            seq_len = single_len
        # Splits get whole BLOCK_N tiles; trailing splits of a short sequence may get nothing.
        n_splits = tl.num_programs(2)  # a run-time value: one compiled kernel serves every split count
        chunk = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, seq_len)

        offs_g = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_g
        mask_h = offs_g < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HD
        q_rows = q_ptr + b * stride_qb + heads * stride_qh
        if BLOCK_DK == BLOCK_D:  # else _scores reads q by chunks
            q = tl.load(q_rows[:, None] + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
            if DOT_F16:
                q = q.to(tl.float32).to(tl.float16)  # [BLOCK_H, BLOCK_D]
        else:
            q = 0.0
        q_pos = tl.load(qpos_ptr + b)
        q_pos_rows = tl.zeros([BLOCK_H], dtype=q_pos.dtype) + q_pos

        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                q, q_rows, mask_h, acc, m_i, l_i, start, hi, q_pos_rows, q_pos, q_pos, kv_head,
                k_ptr, v_ptr, ks_ptr, vs_ptr, slots_ptr + seq_start, kpos_ptr + seq_start, qk_scale, window,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst, stride_vsh,
                HD, BLOCK_H, BLOCK_D, BLOCK_DK, BLOCK_N, HAS_WINDOW, SCALED, FP8, DOT_F16, DOT_PRECISION)

        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        mask_o = mask_h[:, None] & mask_d[None, :]
        if n_splits == 1:
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=mask_o)
        else:
            # mid_o [B, n_h, n_splits, HD] fp32, mid_lse [B, n_h, n_splits] fp32 (log2 domain).
            row = (b * n_h + heads) * n_splits + split
            tl.store(mid_o_ptr + row[:, None] * HD + offs_d[None, :], o, mask=mask_o)
            lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            tl.store(mid_lse_ptr + row, lse, mask=mask_h)
            # The last split of (b, kv head) to finish merges all of them (no reduce launch): every
            # thread's partial stores come before the barrier, the counter's acq_rel atomic orders
            # them before the last program's reads (through L2: .cg), which reset the counter.
            tl.debug_barrier()
            counter = count_ptr + b * n_kv + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel")
            if done == n_splits - 1:
                base = (b * n_h + heads) * n_splits                      # [BLOCK_H]
                m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
                for s in range(n_splits):
                    m = tl.maximum(m, tl.load(mid_lse_ptr + base + s, cache_modifier=".cg", mask=mask_h,
                                              other=float("-inf")))
                m = tl.where(m == float("-inf"), 0.0, m)                 # every split empty: weights 0
                o = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
                den = tl.zeros([BLOCK_H], dtype=tl.float32)
                for s in range(n_splits):
                    w = tl.math.exp2(tl.load(mid_lse_ptr + base + s, cache_modifier=".cg", mask=mask_h,
                                             other=float("-inf")) - m)
                    part = tl.load(mid_o_ptr + (base + s)[:, None] * HD + offs_d[None, :], cache_modifier=".cg",
                                   mask=mask_o, other=0.0)
                    o += w[:, None] * part
                    den += w
                o = o / tl.where(den == 0.0, 1.0, den)[:, None]
                tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=mask_o)
                tl.atomic_xchg(counter, 0, sem="relaxed")                 # ready for the next launch

    @triton.jit
    def _extend_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slots_ptr, kpos_ptr, qpos_ptr, out_ptr,
                       n_rows, n_keys, qk_scale, window,
                       stride_qt, stride_qh, stride_ot, stride_oh,
                       stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_kst, stride_ksh, stride_vst, stride_vsh,
                       GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SCALED: tl.constexpr,
                       FP8: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F16: tl.constexpr):
        # Rows fold (query t, head of the KV group g) = r // GROUP, r % GROUP, so each K/V tile is
        # loaded once for all GROUP heads that share it.
        kv_head = tl.program_id(1)
        offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_r = offs_r < n_rows
        t = offs_r // GROUP
        heads = kv_head * GROUP + offs_r % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HD
        q_rows = q_ptr + t * stride_qt + heads * stride_qh
        if BLOCK_DK == BLOCK_D:
            q = tl.load(q_rows[:, None] + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :], other=0.0)
            if DOT_F16:
                q = q.to(tl.float32).to(tl.float16)
        else:
            q = 0.0
        q_pos_rows = tl.load(qpos_ptr + t, mask=mask_r, other=0)
        q_pos_min = tl.min(tl.where(mask_r, q_pos_rows, 2147483647), axis=0)
        q_pos_max = tl.max(tl.where(mask_r, q_pos_rows, -2147483647), axis=0)

        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                q, q_rows, mask_r, acc, m_i, l_i, start, n_keys, q_pos_rows, q_pos_min, q_pos_max, kv_head,
                k_ptr, v_ptr, ks_ptr, vs_ptr, slots_ptr, kpos_ptr, qk_scale, window,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst, stride_vsh,
                HD, BLOCK_M, BLOCK_D, BLOCK_DK, BLOCK_N, HAS_WINDOW, SCALED, FP8, DOT_F16, DOT_PRECISION)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])


# --- launchers ------------------------------------------------------------------------------------

def _check_kv(q, k_slab, v_slab, k_scale, v_scale, slots, k_pos):
    n_h, hd = q.shape[-2:]
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"q dtype {q.dtype}"
    assert q.stride(-1) == 1, "q head dim must be contiguous"
    assert k_slab.dim() == 3 and v_slab.shape == k_slab.shape, f"slabs {tuple(k_slab.shape)} {tuple(v_slab.shape)}"
    cap, n_kv, hd_kv = k_slab.shape
    assert hd_kv == hd and n_h % n_kv == 0, f"q [.., {n_h}, {hd}] against slab [{cap}, {n_kv}, {hd_kv}]"
    assert k_slab.dtype == v_slab.dtype and k_slab.dtype in _KV_DTYPES, f"slab dtype {k_slab.dtype}"
    assert k_slab.stride(-1) == 1 and v_slab.stride(-1) == 1, "slab head dim must be contiguous"
    scaled = k_slab.dtype in _SCALED
    if scaled:
        for s in (k_scale, v_scale):
            assert s is not None and s.shape == (cap, n_kv) and s.dtype == torch.float32, \
                "8-bit slabs need fp32 k_scale, v_scale [capacity, n_kv]"
    else:
        assert k_scale is None and v_scale is None, f"scales given for an unscaled {k_slab.dtype} slab"
    assert slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64), f"slots {slots.shape} {slots.dtype}"
    assert k_pos.shape == slots.shape and k_pos.dtype in (torch.int32, torch.int64), f"k_pos {k_pos.shape}"
    assert slots.is_contiguous() and k_pos.is_contiguous()
    assert q.device == k_slab.device == slots.device == k_pos.device
    return n_h, hd, n_kv, scaled


def _common_args(q, k_slab, v_slab, k_scale, v_scale, scaled):
    if k_slab.dtype == torch.float8_e4m3fn:  # decoded from bytes by _e4m3_bits_to_fp16
        k_slab, v_slab = k_slab.view(torch.uint8), v_slab.view(torch.uint8)
    ks = k_scale if scaled else k_slab  # placeholder pointer, never read when not SCALED
    vs = v_scale if scaled else v_slab
    strides = (k_slab.stride(0), k_slab.stride(1), v_slab.stride(0), v_slab.stride(1),
               ks.stride(0) if scaled else 0, ks.stride(1) if scaled else 0,
               vs.stride(0) if scaled else 0, vs.stride(1) if scaled else 0)
    # fp32 q (the reference-numerics mode) must not be silently run as tf32 on the GPU.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    return k_slab, v_slab, ks, vs, strides, precision


class Tiles(NamedTuple):
    """Launch shape of one attention kernel: rows per program (the padded head group for decode,
    query-head rows for extend), the q·k contraction chunk (== block_d: one tensor-core dot),
    keys per tile, warps."""
    rows: int
    block_dk: int
    block_n: int
    num_warps: int


def _fma_dots(q_dtype: torch.dtype, arch: tuple[int, int]) -> bool:
    """Triton lowers tl.dot to FMA loops where no MMA fits: every dot below sm_80 (Triton >= 3.2
    dropped Turing's mma.m16n8k8), and fp32 'ieee' dots everywhere."""
    return q_dtype == torch.float32 or tuple(arch) < (8, 0)


def decode_tiles(hd: int, group: int, q_dtype: torch.dtype, arch: tuple[int, int],
                 kv_dtype: torch.dtype = torch.bfloat16) -> Tiles:
    """Tiles of `_decode_split_kernel` (ptxas -v, spill-free on sm_75..sm_120 for E2B/E4B: hd 256/512,
    group 8/4, every KV format). Tensor cores: the head group padded to 16 rows (the MMA's M), one
    dot over the whole head dim. FMA dots: rows = the group itself (no padded FMAs), the head dim
    in chunks of 32 (see _scores). Two exceptions from the sm_90/sm_120 and fp32-model compiles
    (issue 21), each checked on the archs it touches: fp32 queries over fp32 KV at hd 256 spilled
    16/12 B with 4 warps on sm_86/sm_89 (none with 8 on sm_80-89; 8 spill on sm_90/sm_120, 4 do
    not), and int8 KV at hd 256 spilled 4/4 B on sm_90 over 32-key tiles (none over 16). At hd
    512 on sm_90/sm_120 the fp32 model's 4-row group (E4B) spilled with 8 warps and the 8-row one
    (E2B) with 4: each gets the other, but for the 4-row group over int8 KV on sm_90, which
    spilled with 4 warps and not with 8."""
    block_d = max(16, triton.next_power_of_2(hd))
    arch = tuple(arch)
    if _fma_dots(q_dtype, arch):
        rows = max(1, triton.next_power_of_2(group))
        wide = (hd > 256 and (arch < (9, 0) or rows >= 8 or (kv_dtype == torch.int8 and arch < (10, 0)))) or \
            (q_dtype == kv_dtype == torch.float32 and (8, 0) <= arch < (9, 0))
        return Tiles(rows, min(32, block_d), 16, 8 if wide else 4)
    narrow = hd > 256 or (kv_dtype == torch.int8 and (9, 0) <= arch < (10, 0))
    return Tiles(max(16, triton.next_power_of_2(group)), block_d, 16 if narrow else 32, 4 if hd <= 256 else 8)


def extend_tiles(hd: int, q_dtype: torch.dtype, arch: tuple[int, int]) -> Tiles:
    """Tiles of `_extend_kernel` (ptxas -v: spill-free on sm_75..sm_89 for hd 256/512, every KV
    format, a 2048-row prefill chunk and a 3-row verify; untimed, chosen from compile reports).
    Tensor cores: 16 query rows over 32 keys (hd 256) or 16 (hd 512), 8 warps: ptxas holds an
    8-warp program to 128 registers a thread, and 32 x 256 or 16 x 512 x 32-key tiles spilled
    4-44 bytes there (with 4 warps too, for fp8). FMA dots: 8 rows, the head dim in chunks of 32
    (see _scores), 16 keys; 16 rows of hd 512 need all 255 registers on sm_75."""
    block_d = max(16, triton.next_power_of_2(hd))
    if _fma_dots(q_dtype, arch):
        return Tiles(8, min(32, block_d), 16, 8)
    return Tiles(16, block_d, 32 if hd <= 256 else 16, 8)


SPLIT_MIN_KEYS = 64  # keys per split at least (its partial output is a quarter of what it reads at most)
MERGE_SHARE = 0.25  # the merging split reads at most this share of what one split reads
INDEX_BYTES = 16  # a key's int64 slot and int64 position, read with its K/V


def _key_bytes(hd: int, kv_dtype: torch.dtype) -> int:
    """What a split reads per key of one KV head: K and V, 8-bit formats' two fp32 scales, the
    int64 slot and position."""
    return 2 * hd * kv_dtype.itemsize + (8 if kv_dtype in _SCALED else 0) + INDEX_BYTES


def split_read_bytes(keys: int, splits: int, hd: int, kv_dtype: torch.dtype) -> int:
    """Bytes one split of a (query row, KV head) reads: its ceil(keys / splits) keys (`_key_bytes`)."""
    return -(-keys // splits) * _key_bytes(hd, kv_dtype)


def merge_read_bytes(splits: int, group: int, hd: int) -> int:
    """Bytes the last split reads to merge: every split's fp32 partial output and log2-sum-exp for
    the `group` query heads of its KV head ([group, hd + 1] fp32 each). 0 for one split."""
    return 0 if splits <= 1 else splits * group * (hd + 1) * 4


def decode_splits(keys: int, rows: int, n_kv: int, sms: int, *, group: int, hd: int,
                  kv_dtype: torch.dtype) -> int:
    """Splits per (query row, KV head) of one decode launch: enough (row, KV head, split) programs
    for two per SM, as long as each split keeps SPLIT_MIN_KEYS keys and the merge stays cheap.

    The last split merges all partials alone, so its extra read grows with the split count while a
    split's own read shrinks: merge / split = splits^2 x group x (hd + 1) x 4 / (keys x key bytes).
    Splits from the SM count alone made that 4-33x on a 132-SM H200 (E2B, 264 splits from 17K
    keys): the merging program, not the KV read, set the layer's attention time. So the count is
    capped at splits^2 <= MERGE_SHARE x keys x key bytes / partial bytes, which keeps
    merge_read_bytes <= MERGE_SHARE x split_read_bytes for every GPU and context (E2B's bf16 full
    layer: 5 splits at 1,024 keys, 11 at 4,096, 64 at 131,072; below the cap the SM fill decides).
    `keys`: entries of each row's slot list (the batched decoder passes its table capacity, so the
    count, which sets the grid, is fixed for a captured (B, T, capacity)); `group`: query heads per
    KV head; `hd`: head dim; `kv_dtype`: the slab's."""
    want = -(-2 * sms // max(1, rows * n_kv))
    partial = group * (hd + 1) * 4
    cap = math.isqrt(int(MERGE_SHARE * keys * _key_bytes(hd, kv_dtype)) // partial)
    return max(1, min(want, keys // SPLIT_MIN_KEYS, cap))


_COUNTERS: dict = {}


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros [>= n], one per (sequence, KV head), shared by every decode_attention launch on
    `device` (each launch's last split leaves them at zero again). Made once per device and size:
    a CUDA graph's warm-up run allocates it before the capture."""
    key = (str(device), n)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    return buf


def decode_attention(q: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor, slots: torch.Tensor,
                     k_pos: torch.Tensor, q_pos: torch.Tensor, scale: float, window=None,
                     k_scale=None, v_scale=None, slot_indptr=None, num_splits=None, block_n=None):
    """One query row per sequence over its slots.

    q: [n_h, hd] (one sequence: every entry of slots belongs to it; slot_indptr None) or
    [B, n_h, hd] with slot_indptr [B+1] (int32/int64; may be None when B == 1).
    slots, k_pos: [total] int32/int64; q_pos: [B] (or one element) int32/int64, all on q's device.
    Returns the output in q's shape and dtype.
    """
    assert triton is not None, "decode_attention needs triton; use decode_attention_ref"
    single = q.dim() == 2
    q3 = q.unsqueeze(0) if single else q
    assert q3.dim() == 3, f"q {tuple(q.shape)}"
    B = q3.shape[0]
    n_h, hd, n_kv, scaled = _check_kv(q3, k_slab, v_slab, k_scale, v_scale, slots, k_pos)
    q_pos = q_pos.reshape(-1)
    assert q_pos.numel() == B and q_pos.dtype in (torch.int32, torch.int64) and q_pos.device == q.device
    if slot_indptr is None:
        assert B == 1, "a batch of sequences needs slot_indptr"
    else:
        assert slot_indptr.shape == (B + 1,) and slot_indptr.dtype in (torch.int32, torch.int64)
        assert slot_indptr.device == q.device
    assert window is None or window >= 1
    out = torch.empty_like(q3)
    group = n_h // n_kv
    gpu = gpu_of(q.device)
    block_d = max(16, triton.next_power_of_2(hd))
    tiles = decode_tiles(hd, group, q.dtype, gpu.arch, k_slab.dtype)
    block_n = block_n or tiles.block_n
    if num_splits is None:  # eager callers; the batched decoder passes a per-capacity constant
        num_splits = decode_splits(-(-slots.numel() // B), B, n_kv, gpu.sms, group=group, hd=hd,
                                   kv_dtype=k_slab.dtype)
    k_slab, v_slab, ks, vs, strides, precision = _common_args(q3, k_slab, v_slab, k_scale, v_scale, scaled)
    dot16 = q.dtype == torch.bfloat16 and dot_fp16(gpu.arch)
    if num_splits > 1:
        mid_o = torch.empty((B, n_h, num_splits, hd), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, n_h, num_splits), dtype=torch.float32, device=q.device)
        counts = _split_counters(q.device, B * n_kv)
    else:
        mid_o = mid_lse = out  # unused
        counts = slots
    _decode_split_kernel[(B, n_kv, num_splits)](
        q3, k_slab, v_slab, ks, vs, slots, k_pos, q_pos, slot_indptr if slot_indptr is not None else slots,
        out, mid_o, mid_lse, counts, slots.numel(), float(scale) * _LOG2E, int(window or 0), n_h, n_kv,
        q3.stride(0), q3.stride(1), out.stride(0), out.stride(1), *strides,
        GROUP=group, HD=hd, BLOCK_H=tiles.rows, BLOCK_D=block_d, BLOCK_DK=tiles.block_dk, BLOCK_N=block_n,
        HAS_INDPTR=slot_indptr is not None, HAS_WINDOW=window is not None, SCALED=scaled,
        FP8=k_slab.dtype == torch.uint8, DOT_PRECISION=precision, DOT_F16=dot16, num_warps=tiles.num_warps)
    return out[0] if single else out


def extend_attention(q: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor, slots: torch.Tensor,
                     k_pos: torch.Tensor, q_pos: torch.Tensor, scale: float, window=None,
                     k_scale=None, v_scale=None, block_m=None, block_n=None):
    """T queries of one sequence (a prefill chunk, or draft tokens to verify) over its keys: the
    cached prefix and the chunk itself, already stored in the slab (kv_store first). The causal mask
    comes from the positions alone, so the key list may hold the whole chunk for every query.

    q: [T, n_h, hd]; q_pos: [T]; slots, k_pos: [S]. Returns [T, n_h, hd] in q's dtype.
    """
    assert triton is not None, "extend_attention needs triton; use extend_attention_ref"
    assert q.dim() == 3, f"q {tuple(q.shape)}"
    T = q.shape[0]
    n_h, hd, n_kv, scaled = _check_kv(q, k_slab, v_slab, k_scale, v_scale, slots, k_pos)
    assert q_pos.shape == (T,) and q_pos.dtype in (torch.int32, torch.int64) and q_pos.device == q.device
    assert window is None or window >= 1
    out = torch.empty_like(q)
    if T == 0:
        return out
    group = n_h // n_kv
    arch = gpu_of(q.device).arch
    block_d = max(16, triton.next_power_of_2(hd))
    tiles = extend_tiles(hd, q.dtype, arch)
    block_m = block_m or tiles.rows
    block_n = block_n or tiles.block_n
    k_slab, v_slab, ks, vs, strides, precision = _common_args(q, k_slab, v_slab, k_scale, v_scale, scaled)
    dot16 = q.dtype == torch.bfloat16 and dot_fp16(arch)
    n_rows = T * group
    _extend_kernel[(triton.cdiv(n_rows, block_m), n_kv)](
        q, k_slab, v_slab, ks, vs, slots, k_pos, q_pos, out,
        n_rows, slots.numel(), float(scale) * _LOG2E, int(window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides,
        GROUP=group, HD=hd, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_DK=tiles.block_dk, BLOCK_N=block_n,
        HAS_WINDOW=window is not None, SCALED=scaled, FP8=k_slab.dtype == torch.uint8,
        DOT_PRECISION=precision, DOT_F16=dot16, num_warps=tiles.num_warps)
    return out


# --- torch references ------------------------------------------------------------------------------

def _gather_ref(slab, scale, slots):
    """slab[slots] dequantized to fp32: [S, n_kv, hd]."""
    x = slab[slots.long()].float()
    return x * scale[slots.long()][..., None] if scale is not None else x


def _attend_ref(q, k, v, q_pos, k_pos, scale, window):
    """q [T, n_h, hd]; k, v [S, n_kv, hd] fp32 -> [T, n_h, hd] fp32, zeros for rows that see nothing."""
    T, n_h, hd = q.shape
    n_kv = k.shape[1]
    diff = q_pos.long()[:, None] - k_pos.long()[None, :]  # [T, S]
    visible = diff >= 0
    if window is not None:
        visible &= diff < window
    # Head h = kv * group + g reads KV head kv: split q's heads as [n_kv, group], K/V are not copied.
    qg = q.float().reshape(T, n_kv, n_h // n_kv, hd)
    s = torch.einsum("tkgd,skd->kgts", qg, k) * scale
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all-masked rows: 0/0
    return torch.einsum("kgts,skd->tkgd", p, v).reshape(T, n_h, hd)


def decode_attention_ref(q, k_slab, v_slab, slots, k_pos, q_pos, scale, window=None,
                         k_scale=None, v_scale=None, slot_indptr=None, num_splits=None, block_n=None):
    """Torch version of `decode_attention` (same arguments; num_splits, block_n are ignored)."""
    single = q.dim() == 2
    q3 = q.unsqueeze(0) if single else q
    _check_kv(q3, k_slab, v_slab, k_scale, v_scale, slots, k_pos)
    B = q3.shape[0]
    bounds = [0, slots.numel()] if slot_indptr is None else slot_indptr.tolist()
    assert len(bounds) == B + 1
    q_pos = q_pos.reshape(-1)
    out = torch.empty_like(q3)
    for b in range(B):
        sl = slots[bounds[b]:bounds[b + 1]]
        k = _gather_ref(k_slab, k_scale, sl)
        v = _gather_ref(v_slab, v_scale, sl)
        out[b] = _attend_ref(q3[b:b + 1], k, v, q_pos[b:b + 1], k_pos[bounds[b]:bounds[b + 1]],
                             scale, window)[0].to(q.dtype)
    return out[0] if single else out


def extend_attention_ref(q, k_slab, v_slab, slots, k_pos, q_pos, scale, window=None,
                         k_scale=None, v_scale=None, block_m=None, block_n=None):
    """Torch version of `extend_attention` (same arguments; block sizes are ignored)."""
    _check_kv(q, k_slab, v_slab, k_scale, v_scale, slots, k_pos)
    k = _gather_ref(k_slab, k_scale, slots)
    v = _gather_ref(v_slab, v_scale, slots)
    return _attend_ref(q, k, v, q_pos, k_pos, scale, window).to(q.dtype)
