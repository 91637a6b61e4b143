"""y = x @ W^T with W in the repacked quantized layout of kernels/triton/qpack.py (Q4_K, Q5_K, Q6_K, Q8_0,
Q5_0, Q4_0): the decode GEMV (and the small-M verify path) reads each weight byte once, the prefill
path dequantizes tiles to a scratch buffer for a dense GEMM.

Decode, M <= DECODE_MAX_M rows of x (bs-1 decode, batched decode, draft verification):
``_gemv_kernel``. A program owns BLOCK_N output rows and walks K in steps of 256 values (one
K-quant super-block, or 8 blocks of 32). Thread layout per step: the tile [BLOCK_N rows, 8
sub-blocks, 4 words]; each thread holds one row's 32-value sub-block as four int32 words (one
16-byte load), and the M x-rows of those 32 values (eight 4-wide vector loads; the rows of x are
read once per program, and a program of BLOCK_N >= 16 rows makes x's share of the traffic small).
No int->float conversion per value: a nibble q is placed in the top mantissa bits of 1.0
(``(w >> shift) & 0x780000 | 0x3F800000`` is the float 1 + q/16, exactly), multiplied into
per-lane accumulators t' = sum (1 + q/16) x, and the 1 is taken out once per sub-block with the
sum of x: sum q x = 16 (t' - sum x). So a value costs a shift, a LOP3 and an FFMA; 5- and 6-bit
quants first merge their high bits into the nibble word with one LOP3 per 4 values (the byte-
select order of kernels/triton/qpack.py), then take a shift and a LOP3 a value as well (1 + q/32,
1 + q/64). Scales are loaded as words once per (row, sub-block) and applied once per sub-block:
acc += A t' - B sum x (A, B per format below). Accumulators stay per lane ([M, BLOCK_N, 8] after
the in-thread sum over the 4 words) and are reduced across the 8 sub-block lanes once, after the K loop.
Numerics: fp32 throughout; t' - sum x cancels the 1s exactly up to fp32 rounding of the two sums
(the error is a few ulp of sum |x| per sub-block, amplified at most 16-64x relative to the
reference's per-term rounding: ~1e-6 relative, far below bf16 activations).

Prefill, M > DECODE_MAX_M: ``_dequant_packed_kernel`` writes W in x's dtype to a scratch buffer (at
most PREFILL_SCRATCH_VALUES values, so a 262k-row vocab matrix goes in row chunks) and
``torch.matmul`` (cuBLAS on a GPU) does the product.

``qmatmul_ref`` is the plain-torch version (float32 W from ``qpack.dequantize_packed_ref``, float32
product). Triton is optional: without it this module imports and the ref works; launchers raise.
"""
import contextlib

import torch

from ..env import env
from .launch import check_device, interpreting
from .qformats import LAYOUT, Q4_K, Q5_K, Q6_K, Q8_0
from .qpack import PackedQuant, dequantize_packed_ref
from .qdequant import qdequantize, qdequantize_ref  # noqa: F401 - raw GGUF rows (embedding gathers)

try:  # CPU-only installs have no triton: the refs below still work.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["DECODE_MAX_M", "SUPPORTED_TYPES", "gemv_blocks", "gemv_launch_info", "gemv_config", "qdequantize",
           "qdequantize_packed", "qdequantize_ref", "qmatmul", "qmatmul_ref"]

SUPPORTED_TYPES = frozenset(LAYOUT)
DECODE_MAX_M = 16          # beyond it the prefill path (dequantize + dense GEMM) takes over
GEMV_MAX_M = 8             # x rows one GEMV launch takes (registers); 9..16 rows: two launches
PREFILL_SCRATCH_VALUES = 1 << 24   # 32 MiB of fp16 scratch per chunk
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ONE = 0x3F800000  # fp32 1.0's bits, a run-time argument of _gemv_kernel (see _one_plus)


# ------------------------------------------------------------------------------------ kernels

if triton is not None:

    @triton.jit
    def _shift(w, S: tl.constexpr):
        """w << S for S >= 0, logical w >> -S otherwise (S is a compile-time constant)."""
        if S >= 0:
            return w << S
        else:
            return (w.to(tl.uint32, bitcast=True) >> (-S)).to(tl.int32, bitcast=True)

    @triton.jit
    def _one_plus(bits, one):
        """Mantissa bits (exponent field clear) -> the fp32 1.0 + bits * 2**-23. `one` is the
        int32 0x3F800000 passed at run time: as a register operand ptxas folds the mask and the
        OR into one LOP3 (with two immediates it needs two)."""
        return (bits | one).to(tl.float32, bitcast=True)

    @triton.jit
    def _load(ptr, mask, MASKED: tl.constexpr):
        """A load, masked (zeros outside) only when MASKED: the full steps carry no predicates."""
        if MASKED:
            return tl.load(ptr, mask=mask, other=0)
        else:
            return tl.load(ptr)

    @triton.jit
    def _high_words(h_ptr, row_off, kb, sb, u, mask, FMT: tl.constexpr, MASKED: tl.constexpr):
        """The two byte-select words (kernels/triton/qpack.py) of every lane u: E_p for parity p = 0, 1
        is (w >> 4p) & 0x0F0F0F0F merged with H_p, the lane's h word shifted so the high field of
        value (u, 2b + p) sits on bit 4 of byte b. Returns (H_0, H_1) masked to 0xF0F0F0F0.
        Q5 (FMT 13, 6): one word per sub-block, field bit (4 + 2u + p) % 8; Q6_K: word u // 2,
        field bits 4 * (1 - u % 2) + 2p."""
        if FMT == 14:
            hw = _load(h_ptr + row_off + kb * 16 + sb * 2 + u // 2, mask, MASKED)
            s0 = 4 * (u % 2)                       # shift left for p = 0; p = 1: two less
            s1 = s0 - 2
        else:
            hw = _load(h_ptr + row_off + kb * 8 + sb + u * 0, mask, MASKED)
            s0 = 4 - (4 + 2 * u) % 8
            s1 = s0 - 1
        hu = hw.to(tl.uint32, bitcast=True)
        h0 = ((hu << tl.maximum(s0, 0)) >> tl.maximum(-s0, 0)).to(tl.int32, bitcast=True)
        h1 = ((hu << tl.maximum(s1, 0)) >> tl.maximum(-s1, 0)).to(tl.int32, bitcast=True)
        return h0 & -252645136, h1 & -252645136    # 0xF0F0F0F0

    @triton.jit
    def _gelu_tanh(z):
        """fp32 GELU (tanh form), tanh from exp (the interpreter has no libdevice): for |u| < 0.2
        an odd Taylor series (relative error < 1e-9), else (1 - e) / (1 + e), e = exp(-2|u|)."""
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        a = tl.abs(u)
        us = tl.where(a < 0.2, u, 0.0)             # the series only where it is used (no overflow)
        u2 = us * us
        small = us * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 + u2 * (62.0 / 2835.0)))))
        ex = tl.exp(-2.0 * a)
        big = (1.0 - ex) / (1.0 + ex)
        t = tl.where(a < 0.2, small, tl.where(u < 0, -big, big))
        return 0.5 * z * (1.0 + t)

    @triton.jit
    def _f16_lo(w):
        """The fp16 in the low 16 bits of int32 w, as fp32."""
        return (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _step_q8(x_ptr, q_ptr, d_ptr, r3, r4, m4, M, kb, n_blk, stride_xm, q_stride, d_stride,
                 BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
        """`_step` for Q8_0: int8 quants in natural order, 32 per block, w = d * q (an I2F per
        value: 1.06 bytes a value leave room for it)."""
        sb3 = tl.arange(0, 8)[None, None, :]
        sb4 = sb3[:, :, :, None]
        i32 = tl.arange(0, 32)[None, None, None, :]
        kmask4 = (kb * 8 + sb4) < n_blk
        kmask3 = (kb * 8 + sb3) < n_blk
        if BLOCK_M == 1:
            xmask = kmask4
        else:
            xmask = (m4 < M) & kmask4
        q = _load(q_ptr + r4 * q_stride + kb * 256 + sb4 * 32 + i32, kmask4, MASKED)
        xv = _load(x_ptr + m4 * stride_xm + r4 * 0 + kb * 256 + sb4 * 32 + i32, xmask, MASKED or BLOCK_M > 1)
        t = tl.sum(q.to(tl.float32) * xv.to(tl.float32), axis=3)        # [BM, BN, 8]
        d = _load(d_ptr + r3 * d_stride + kb * 8 + sb3, kmask3, MASKED).to(tl.float32)
        return d * t

    @triton.jit
    def _step(x_ptr, q_ptr, h_ptr, s_ptr, d_ptr, r3, r4, m4, M, kb, n_blk, one, stride_xm,
              q_stride, h_stride, s_stride, d_stride,
              FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """The contribution [BLOCK_M, BLOCK_N, 8] of K step kb (values 256 kb .. 256 kb + 255) to y:
        one value per (x row, W row, sub-block lane). r3 [1, BN, 1] / r4 [1, BN, 1, 1]: W rows;
        m4 [BM, 1, 1, 1]: x rows. MASKED: the last, partial step of a 32-value-block type (blocks
        >= n_blk read as zeros)."""
        sb3 = tl.arange(0, 8)[None, None, :]
        sb4 = sb3[:, :, :, None]
        u4 = tl.arange(0, 4)[None, None, None, :]
        lane = kb * 32 + sb4 * 4 + u4                          # word / lane index in the step
        if MASKED:
            kmask4 = (kb * 8 + sb4) < n_blk                    # [1, 1, 8, 1]
            kmask3 = (kb * 8 + sb3) < n_blk
        else:
            kmask4 = None
            kmask3 = None
        if BLOCK_M == 1:
            xmask = kmask4
            X_MASKED: tl.constexpr = MASKED
        elif MASKED:
            xmask = (m4 < M) & kmask4
            X_MASKED: tl.constexpr = True
        else:
            xmask = m4 < M
            X_MASKED: tl.constexpr = True
        # x of value 4j + u (+ 4j below), addressed for every W row (stride 0): the load then
        # takes the weights' thread layout and needs no broadcast (a [BM, 1, 8, 4] tile gets a
        # layout of its own and a shared-memory conversion); repeated addresses are one transaction.
        x_row = x_ptr + m4 * stride_xm + r4 * 0 + kb * 256 + sb4 * 32 + u4
        w = _load(q_ptr + r4 * q_stride + lane, kmask4, MASKED)              # int32 [1, BN, 8, 4]
        if FMT == 13 or FMT == 6 or FMT == 14:
            h0, h1 = _high_words(h_ptr, r4 * h_stride, kb, sb4, u4, kmask4, FMT, MASKED)
            e0 = (w & 0x0F0F0F0F) | h0                 # byte b: the whole quant of j = 2b
            e1 = (_shift(w, -4) & 0x0F0F0F0F) | h1     # j = 2b + 1
        tp = tl.zeros([BLOCK_M, BLOCK_N, 8, 4], dtype=tl.float32)        # sum (1 + q/2^b) x
        xs = tl.zeros([BLOCK_M, BLOCK_N, 8, 4], dtype=tl.float32)        # sum x (in tp's layout)
        if FMT == 14:
            tp2 = tl.zeros([BLOCK_M, BLOCK_N, 8, 4], dtype=tl.float32)   # Q6_K: j >= 4 (values 16-31)
            xs2 = tl.zeros([BLOCK_M, BLOCK_N, 8, 4], dtype=tl.float32)
        for j in tl.static_range(8):
            xj = _load(x_row + 4 * j, xmask, X_MASKED).to(tl.float32)
            if FMT == 12 or FMT == 2:      # 4 bits at mantissa bits 19..22: 1 + q/16
                f = _one_plus(_shift(w, 19 - 4 * j) & 0x780000, one)
            else:
                if j % 2 == 0:
                    e = e0
                else:
                    e = e1
                if FMT == 14:              # 6 bits at mantissa bits 17..22: 1 + q/64
                    f = _one_plus(_shift(e, 17 - 8 * (j // 2)) & 0x7E0000, one)
                else:                      # 5 bits at 18..22: 1 + q/32
                    f = _one_plus(_shift(e, 18 - 8 * (j // 2)) & 0x7C0000, one)
            if FMT == 14 and j >= 4:
                tp2 += f * xj
                xs2 += xj
            else:
                tp += f * xj
                xs += xj
        t = tl.sum(tp, axis=3)                                  # [BM, BN, 8]
        xsum = tl.sum(xs, axis=3)                               # [BM, BN, 8]
        if FMT == 12 or FMT == 13:
            # 12 scale bytes as 3 words; byte s%4 of each: a (scales 0-3, high bits of 4-7),
            # b (mins 0-3, high bits of 4-7), c (low nibbles scale 4-7 | min 4-7 << 4).
            sp = s_ptr + r3 * s_stride + kb * 3
            sh = 8 * (sb3 % 4)
            a = (tl.load(sp) >> sh) & 255
            b = (tl.load(sp + 1) >> sh) & 255
            c = (tl.load(sp + 2) >> sh) & 255
            sc = tl.where(sb3 < 4, a & 63, (c & 15) | ((a >> 2) & 48)).to(tl.float32)
            mn = tl.where(sb3 < 4, b & 63, (c >> 4) | ((b >> 2) & 48)).to(tl.float32)
            dm = tl.load(d_ptr + r3 * d_stride + kb)            # (d, dmin) fp16 pair
            unit = 16.0 if FMT == 12 else 32.0                  # 2^bits
            A = (unit * _f16_lo(dm)) * sc                       # sum q x = unit (t' - xs)
            B = A + _f16_lo(dm >> 16) * mn                      # - dmin m sum x
            return A * t - B * xsum
        elif FMT == 14:
            # int8 scales of values 0-15 and 16-31 of each sub-block: one int16 per sub-block.
            s2 = tl.load(s_ptr + r3 * s_stride + kb * 8 + sb3).to(tl.int32)
            sc_a = ((s2 << 24) >> 24).to(tl.float32)
            sc_b = (s2 >> 8).to(tl.float32)
            d64 = 64.0 * tl.load(d_ptr + r3 * d_stride + kb).to(tl.float32)
            t2 = tl.sum(tp2, axis=3)
            xsum2 = tl.sum(xs2, axis=3)
            # sum (q - 32) x = 64 t' - 96 sum x
            return (d64 * sc_a) * (t - 1.5 * xsum) + (d64 * sc_b) * (t2 - 1.5 * xsum2)
        else:
            # Q4_0 / Q5_0: one fp16 d per 32-value block; q - 8 (4-bit) or q - 16 (5-bit).
            d = _load(d_ptr + r3 * d_stride + kb * 8 + sb3, kmask3, MASKED).to(tl.float32)
            if FMT == 2:
                return (16.0 * d) * (t - 1.5 * xsum)
            else:
                return (32.0 * d) * (t - 1.5 * xsum)

    @triton.jit
    def _epilogue(y, row0, ms, M, N, y_ptr, e_ptr, stride_ym, stride_em,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GELU_MUL: tl.constexpr, GLU: tl.constexpr):
        """Store y [BM, BN] (fp32, W rows row0..) in y's dtype, through the GLU or GELU_MUL epilogue."""
        rows = row0 + tl.arange(0, BLOCK_N)
        if GLU:
            # epilogue: W's rows interleave gate and up (2i, 2i + 1): out[i] = gelu_tanh(g_i) * u_i,
            # N / 2 outputs (Gemma's MLP activation without a round trip through memory).
            g, u = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
            half = row0 // 2 + tl.arange(0, BLOCK_N // 2)
            omask = (ms < M) & (half[None, :] < N // 2)
            tl.store(y_ptr + ms * stride_ym + half[None, :], (_gelu_tanh(g) * u).to(y_ptr.dtype.element_ty),
                     mask=omask)
        else:
            ymask = (ms < M) & (rows[None, :] < N)
            if GELU_MUL:
                # epilogue: gelu_tanh(y) * e (Gemma-4's per-layer-input gate), fp32 math.
                e = tl.load(e_ptr + ms * stride_em + rows[None, :], mask=ymask, other=0.0).to(tl.float32)
                y = _gelu_tanh(y) * e
            tl.store(y_ptr + ms * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty), mask=ymask)

    @triton.jit
    def _gemv_kernel(x_ptr, q_ptr, h_ptr, s_ptr, d_ptr, y_ptr, e_ptr, p_ptr, M, N, K, one, k_steps, stride_xm,
                     stride_ym, stride_em, q_stride, h_stride, s_stride, d_stride,
                     FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
                     GELU_MUL: tl.constexpr, GLU: tl.constexpr, SPLIT_K: tl.constexpr):
        """y[M, N] = x[M, K] @ W^T, M <= BLOCK_M; program i owns W rows i*BLOCK_N .. (module doc).
        Plane pointers are typed for their loads: q int32 (Q8_0: int8), h int32, s int32 (Q6_K:
        int16), d int32 (Q4_K/Q5_K: d|dmin) or fp16; strides in those elements. SPLIT_K > 1:
        program (i, s) takes K steps s*k_steps.. (the last split the partial step too) and stores
        its fp32 sum to p[s, M, N]; `_gemv_reduce_kernel` adds the splits in order."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_c = tl.minimum(rows, N - 1)       # tail rows re-read the last row: no load masks
        r3 = rows_c[None, :, None]
        r4 = r3[:, :, :, None]
        m4 = tl.arange(0, BLOCK_M)[:, None, None, None]
        n_blk = K // 32
        one = (one | N) & -8388608   # = one (N < 2**23): a register value, so ptxas fuses the LOP3s
        acc = tl.zeros([BLOCK_M, BLOCK_N, 8], dtype=tl.float32)
        if SPLIT_K == 1:
            kb0 = 0
            kb1 = K // 256
        else:
            kb0 = tl.program_id(1) * k_steps
            kb1 = tl.minimum(kb0 + k_steps, K // 256)
        for kb in range(kb0, kb1):
            acc += _k_step(x_ptr, q_ptr, h_ptr, s_ptr, d_ptr, r3, r4, m4, M, kb, n_blk, one, stride_xm,
                           q_stride, h_stride, s_stride, d_stride, FMT, BLOCK_M, BLOCK_N, False)
        if not EVEN_K:
            if _last_split(SPLIT_K):  # the partial step: the last split's
                acc += _k_step(x_ptr, q_ptr, h_ptr, s_ptr, d_ptr, r3, r4, m4, M, K // 256, n_blk, one, stride_xm,
                               q_stride, h_stride, s_stride, d_stride, FMT, BLOCK_M, BLOCK_N, True)
        y = tl.sum(acc, axis=2)                                 # [BM, BN]: the one cross-lane reduction
        ms = tl.arange(0, BLOCK_M)[:, None]
        if SPLIT_K == 1:
            _epilogue(y, tl.program_id(0) * BLOCK_N, ms, M, N, y_ptr, e_ptr, stride_ym, stride_em,
                      BLOCK_M, BLOCK_N, GELU_MUL, GLU)
        else:
            pmask = (ms < M) & (rows[None, :] < N)
            tl.store(p_ptr + tl.program_id(1) * M * N + ms * N + rows[None, :], y, mask=pmask)

    @triton.jit
    def _last_split(SPLIT_K: tl.constexpr):
        """Whether this program's split is the last (always, unsplit)."""
        if SPLIT_K == 1:
            return True
        else:
            return tl.program_id(1) == SPLIT_K - 1

    @triton.jit
    def _k_step(x_ptr, q_ptr, h_ptr, s_ptr, d_ptr, r3, r4, m4, M, kb, n_blk, one, stride_xm,
                q_stride, h_stride, s_stride, d_stride,
                FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """K step kb's contribution [BM, BN, 8] for any format (`_step_q8` or `_step`)."""
        if FMT == 8:
            return _step_q8(x_ptr, q_ptr, d_ptr, r3, r4, m4, M, kb, n_blk, stride_xm, q_stride, d_stride,
                            BLOCK_M, MASKED)
        else:
            return _step(x_ptr, q_ptr, h_ptr, s_ptr, d_ptr, r3, r4, m4, M, kb, n_blk, one, stride_xm,
                         q_stride, h_stride, s_stride, d_stride, FMT, BLOCK_M, BLOCK_N, MASKED)

    @triton.jit
    def _gemv_reduce_kernel(p_ptr, y_ptr, e_ptr, M, N, stride_ym, stride_em, SPLIT_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GELU_MUL: tl.constexpr,
                            GLU: tl.constexpr):
        """y = the epilogue of sum_s p[s] (s = 0, 1, .. in order: the same bits every run)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ms = tl.arange(0, BLOCK_M)[:, None]
        mask = (ms < M) & (rows[None, :] < N)
        y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            y += tl.load(p_ptr + split * M * N + ms * N + rows[None, :], mask=mask, other=0.0)
        _epilogue(y, tl.program_id(0) * BLOCK_N, ms, M, N, y_ptr, e_ptr, stride_ym, stride_em,
                  BLOCK_M, BLOCK_N, GELU_MUL, GLU)


    @triton.jit
    def _dequant_packed_kernel(q_ptr, h_ptr, s_ptr, d_ptr, out_ptr, N, K, stride_o,
                               q_stride, h_stride, s_stride, d_stride,
                               FMT: tl.constexpr, BLOCK_N: tl.constexpr):
        """out[N, K] (out's dtype) = W; program (i, kb) writes rows i*BLOCK_N.. at values 256 kb..
        with the float ops (and order) of qpack.dequantize_packed_ref. Planes typed as in
        `_gemv_kernel`."""
        kb = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        r3 = tl.minimum(rows, N - 1)[:, None, None]            # [BN, 1, 1]
        sb = tl.arange(0, 8)[None, :, None]                    # [1, 8, 1]
        kmask = ((kb * 8 + sb) < K // 32) & (rows[:, None, None] < N)   # [BN, 8, 1]
        dst = out_ptr + rows.to(tl.int64)[:, None, None] * stride_o + kb * 256 + sb * 32
        if FMT == 8:
            i = tl.arange(0, 32)[None, None, :]
            q = tl.load(q_ptr + r3 * q_stride + kb * 256 + sb * 32 + i, mask=kmask, other=0)
            d = tl.load(d_ptr + r3 * d_stride + kb * 8 + sb, mask=kmask, other=0.0).to(tl.float32)
            tl.store(dst + i, (q.to(tl.float32) * d).to(out_ptr.dtype.element_ty), mask=kmask)
        else:
            u = tl.arange(0, 4)[None, None, :]
            lane = kb * 32 + sb * 4 + u                        # [BN, 8, 4] words
            w = tl.load(q_ptr + r3 * q_stride + lane, mask=kmask, other=0)
            if FMT == 13 or FMT == 6 or FMT == 14:
                h0, h1 = _high_words(h_ptr, r3 * h_stride, kb, sb, u, kmask, FMT, True)
                e0 = (w & 0x0F0F0F0F) | h0
                e1 = (_shift(w, -4) & 0x0F0F0F0F) | h1
            if FMT == 12 or FMT == 13:
                sp = s_ptr + r3 * s_stride + kb * 3
                sh = 8 * (sb % 4)
                a = (tl.load(sp, mask=rows[:, None, None] < N, other=0) >> sh) & 255
                b = (tl.load(sp + 1, mask=rows[:, None, None] < N, other=0) >> sh) & 255
                c = (tl.load(sp + 2, mask=rows[:, None, None] < N, other=0) >> sh) & 255
                sc = tl.where(sb < 4, a & 63, (c & 15) | ((a >> 2) & 48)).to(tl.float32)
                mn = tl.where(sb < 4, b & 63, (c >> 4) | ((b >> 2) & 48)).to(tl.float32)
                dm = tl.load(d_ptr + r3 * d_stride + kb)
                dl = _f16_lo(dm) * sc                              # [BN, 8, 1]
                ml = _f16_lo(dm >> 16) * mn
            elif FMT == 14:
                s2 = tl.load(s_ptr + r3 * s_stride + kb * 8 + sb).to(tl.int32)
                d6 = tl.load(d_ptr + r3 * d_stride + kb).to(tl.float32)
                dl_a = d6 * ((s2 << 24) >> 24).to(tl.float32)
                dl_b = d6 * (s2 >> 8).to(tl.float32)
            else:
                d = tl.load(d_ptr + r3 * d_stride + kb * 8 + sb, mask=kmask, other=0.0).to(tl.float32)
            for j in tl.static_range(8):
                if FMT == 13 or FMT == 6 or FMT == 14:
                    if j % 2 == 0:
                        e = e0
                    else:
                        e = e1
                    if FMT == 14:
                        q = _shift(e, -8 * (j // 2)) & 63
                    else:
                        q = _shift(e, -8 * (j // 2)) & 31
                else:
                    q = _shift(w, -4 * j) & 15
                if FMT == 12 or FMT == 13:
                    v = dl * q.to(tl.float32) - ml
                elif FMT == 14:
                    if j < 4:
                        v = dl_a * (q - 32).to(tl.float32)
                    else:
                        v = dl_b * (q - 32).to(tl.float32)
                elif FMT == 2:
                    v = d * (q - 8).to(tl.float32)
                else:
                    v = d * (q - 16).to(tl.float32)
                tl.store(dst + 4 * j + u, v.to(out_ptr.dtype.element_ty), mask=kmask)


# ---------------------------------------------------------------------------------- launchers

def _fail(msg: str):
    raise ValueError(msg)


def _check_packed(fn: str, w: PackedQuant) -> None:
    if not isinstance(w, PackedQuant):
        _fail(f"{fn}: w must be a kernels.triton.qpack.PackedQuant, got {type(w).__name__}")
    if w.ggml_type not in LAYOUT:
        _fail(f"{fn}: unsupported GGML type {w.ggml_type}")
    if any(not p.is_contiguous() or p.dtype != torch.uint8 for p in w.planes):
        _fail(f"{fn}: planes must be contiguous uint8")
    if not 0 < w.shape[0] < 1 << 23:
        _fail(f"{fn}: {w.shape[0]} output rows (the GEMV takes 1 .. 2**23 - 1)")


def _check_x(fn: str, x: torch.Tensor, w: PackedQuant, out_dtype) -> torch.dtype:
    n_in = w.shape[1]
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES:
        _fail(f"{fn}: x must be float16, bfloat16 or float32, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.shape[-1] != n_in:
        _fail(f"{fn}: x must be [..., n_in={n_in}], got {tuple(x.shape)}")
    if x.device != w.device:
        _fail(f"{fn}: x on {x.device} but the weight on {w.device}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in (x.dtype, torch.float32):
        _fail(f"{fn}: out_dtype must be x's dtype ({x.dtype}) or float32, got {out_dtype}")
    return out_dtype


def _typed_planes(w: PackedQuant):
    """(q, h, s, d) viewed as the element types `_gemv_kernel` loads, with their row strides."""
    t = w.ggml_type
    q = w.q.view(torch.int8) if t == Q8_0 else w.q.view(torch.int32)
    h = w.h if w.h is None else w.h.view(torch.int32)
    s = w.s if w.s is None else (w.s.view(torch.int16) if t == Q6_K else w.s.view(torch.int32))
    d = w.d.view(torch.int32) if t in (Q4_K, Q5_K) else w.d.view(torch.float16)
    stride = (lambda p: p.stride(0) if p is not None else 0)
    return (q, h if h is not None else q, s if s is not None else q, d), (stride(q), stride(h), stride(s), stride(d))


def gemv_config(m: int, n_out: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the decode GEMV for m <= GEMV_MAX_M rows of x and n_out
    rows of W. A warp holds [4 rows, 8 sub-blocks, 4 words] per layer of its tile, so BLOCK_N =
    4 x warps x R with R rows a thread. R = 2 for one or two rows of x (x's conversion and sum
    are shared by the thread's rows: 0.33 SASS instructions a Q4_K byte against 0.41 with R = 1),
    R = 4 for the vocabulary-sized head (0.28), R = 1 beyond two rows of x (registers). Warps
    shrink with n_out so narrow matrices still get >= 32 programs (N = 1536: 96 programs of 2
    warps; N = 256: 32 of 1). Under the interpreter (which pays per program and per op, not per
    element) the blocks are wide."""
    block_m = 1 if m == 1 else min(GEMV_MAX_M, triton.next_power_of_2(m))
    if m == 1 and _BLOCKS:
        return 1, *_BLOCKS[-1]
    if device.type == "cpu" and interpreting():
        return block_m, 512, 4
    if block_m > 2:
        return block_m, 16, 4
    warps = 4 if n_out >= 2048 else 2 if n_out >= 1024 else 1
    rows = 4 if m == 1 and n_out >= 65536 else 2
    return block_m, 4 * warps * rows, warps


_BLOCKS: list[tuple[int, int]] = []  # gemv_blocks' overrides, innermost last
_SPLITS: list[int] = []  # gemv_split's
REDUCE_N = 256  # rows a program of the split-K reduction (even: GLU pairs stay in one program)


@contextlib.contextmanager
def gemv_split(splits: int):
    """One-row GEMVs launched inside split K over `splits` programs a row block (each a run of whole
    256-value steps, fp32 partial sums, then one reduction launch adding them in split order, so
    a result has the same bits every run): `splits` times the loads in flight, for a GPU whose
    row blocks alone are too few to keep its memory busy. The GEMV table's variants; the engine
    never sets it."""
    if not 1 <= splits <= 64:
        raise ValueError(f"gemv_split: splits must be 1..64, got {splits}")
    with _pushed(_SPLITS, int(splits)):
        yield


def _splits(m: int, n_in: int) -> tuple[int, int]:
    """(splits, K steps a split) of a GEMV: 1 unless `gemv_split` (else EDGEGEM_GEMV_SPLIT) asks
    more for one x row; never an empty split (K steps: whole 256-value steps; the partial one goes
    to the last split)."""
    steps = n_in // 256
    want = (_SPLITS[-1] if _SPLITS else env().gemv_split) if m == 1 else 1
    if want <= 1 or steps < 2:
        return 1, steps
    per = -(-steps // min(want, steps))
    return -(-steps // per), per


@contextlib.contextmanager
def gemv_blocks(block_n: int, warps: int):
    """One-row GEMVs launched inside take BLOCK_N = block_n rows a program and `warps` warps (the
    GEMV table's occupancy variants, engine/bench/gemv.py): block_n = 4 x warps x R, R rows a
    thread in {1, 2, 4}. The engine never sets it."""
    if warps not in (1, 2, 4, 8) or block_n % (4 * warps) or block_n // (4 * warps) not in (1, 2, 4):
        raise ValueError(f"gemv_blocks: block_n must be 4 x warps x (1, 2 or 4) rows a thread, warps 1-8; "
                         f"got block_n={block_n}, warps={warps}")
    with _pushed(_BLOCKS, (block_n, warps)):
        yield


@contextlib.contextmanager
def _pushed(stack: list, value):
    """`value` on top of an override stack for the block's duration (nested overrides restore)."""
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def _check_gelu_mul(fn: str, e, x: torch.Tensor, n_out: int) -> None:
    if e is None:
        return
    if not isinstance(e, torch.Tensor) or e.shape[:-1] != x.shape[:-1] or e.shape[-1] != n_out:
        _fail(f"{fn}: gelu_mul must be [..., n_out={n_out}] with x's leading shape {tuple(x.shape[:-1])}, "
              f"got {tuple(getattr(e, 'shape', ()))}")
    if e.dtype not in _X_DTYPES or e.device != x.device or e.stride(-1) != 1:
        _fail(f"{fn}: gelu_mul must be float16/bfloat16/float32 with a unit last stride on {x.device}")


def _gelu_mul_torch(y: torch.Tensor, e: torch.Tensor, out_dtype) -> torch.Tensor:
    return (torch.nn.functional.gelu(y.float(), approximate="tanh") * e.float()).to(out_dtype)


def _glu_torch(y: torch.Tensor, out_dtype) -> torch.Tensor:
    """Interleaved rows (gate 2i, up 2i + 1) -> gelu_tanh(gate) * up, fp32 math."""
    return _gelu_mul_torch(y[..., 0::2], y[..., 1::2], out_dtype)


def _check_glu(fn: str, glu: bool, gelu_mul, w: PackedQuant) -> None:
    if glu and (gelu_mul is not None or w.shape[0] % 2):
        _fail(f"{fn}: glu needs an even number of interleaved gate/up rows and no gelu_mul")


def qmatmul(x: torch.Tensor, w: PackedQuant, out_dtype: torch.dtype | None = None,
            gelu_mul: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """y [..., n_out] = x [..., n_in] @ W^T for a repacked W (kernels.triton.qpack.PackedQuant). x:
    float16/bfloat16/float32 (any leading shape; rows made contiguous). Output in `out_dtype`: x's
    dtype (default) or float32. `gelu_mul` [..., n_out] (row strides free): y = gelu_tanh(x W^T) *
    gelu_mul instead, in the GEMV's epilogue (fp32 math; Gemma-4's per-layer-input gate). `glu`: W's
    rows interleave gate and up (`interleave_rows`), and y [..., n_out / 2] = gelu_tanh(gate) * up
    (Gemma's MLP activation in the epilogue). Raises ValueError on bad inputs."""
    _check_packed("qmatmul", w)
    out_dtype = _check_x("qmatmul", x, w, out_dtype)
    _check_gelu_mul("qmatmul", gelu_mul, x, w.shape[0])
    _check_glu("qmatmul", glu, gelu_mul, w)
    check_device("qmatmul", x.device, triton)
    n_out, n_in = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n_in)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n_y = n_out // 2 if glu else n_out
    if m == 0:
        return torch.empty((*lead, n_y), dtype=out_dtype, device=x.device)
    if m <= DECODE_MAX_M:
        y = torch.empty((m, n_y), dtype=out_dtype, device=x.device)
        (q, h, s, d), strides = _typed_planes(w)
        e2 = None if gelu_mul is None else gelu_mul.reshape(-1, n_out)   # a view when rows collapse
        # float32 rows of x over Q6_K take two a launch: four spilled 16/16 B on sm_80 (the
        # exact model's 3-row verify; x's registers are twice bf16's)
        step = 2 if x2.dtype == torch.float32 and w.ggml_type == Q6_K else GEMV_MAX_M
        for m0 in range(0, m, step):
            mc = min(step, m - m0)
            block_m, block_n, warps = gemv_config(mc, n_out, x.device)
            splits, k_steps = _splits(mc, n_in)
            part = torch.empty((splits, mc, n_out), dtype=torch.float32, device=x.device) if splits > 1 else y
            e_m = y if e2 is None else e2[m0:]
            _gemv_kernel[(triton.cdiv(n_out, block_n), splits)](
                x2[m0:], q, h, s, d, y[m0:], e_m, part, mc, n_out, n_in, _ONE, k_steps,
                x2.stride(0), y.stride(0), 0 if e2 is None else e2.stride(0), *strides,
                FMT=w.ggml_type, BLOCK_M=block_m, BLOCK_N=block_n, EVEN_K=n_in % 256 == 0,
                GELU_MUL=e2 is not None, GLU=glu, SPLIT_K=splits, num_warps=warps)
            if splits > 1:
                _gemv_reduce_kernel[(triton.cdiv(n_out, REDUCE_N),)](
                    part, y[m0:], e_m, mc, n_out, y.stride(0), 0 if e2 is None else e2.stride(0),
                    SPLIT_K=splits, BLOCK_M=block_m, BLOCK_N=REDUCE_N, GELU_MUL=e2 is not None, GLU=glu,
                    num_warps=4)
        return y.reshape(*lead, n_y)
    # Prefill: dequantize row chunks to scratch in x's dtype, the dense GEMM does the product. A
    # float32 output (the LM head's logits) gets a float32 product, as the GEMV gives it: a bf16
    # GEMM would round the logits to bf16 (0.125 apart between 16 and 32) before the cast.
    wide = out_dtype == torch.float32 and gelu_mul is None and not glu
    gemm_dtype = torch.float32 if wide else x.dtype
    xg = x2.to(gemm_dtype)
    y = torch.empty((m, n_out), dtype=x.dtype if glu else out_dtype, device=x.device)
    chunk = max(16, PREFILL_SCRATCH_VALUES // n_in)
    scratch = torch.empty((min(chunk, n_out), n_in), dtype=gemm_dtype, device=x.device)
    for r0 in range(0, n_out, chunk):
        r1 = min(n_out, r0 + chunk)
        wd = qdequantize_packed(w.row_slice(r0, r1), out=scratch[:r1 - r0])
        y[:, r0:r1] = xg @ wd.T        # gemm_dtype, cast on copy when out_dtype is float32
    if gelu_mul is not None:           # prefill: torch ops after the GEMM (one chunk, not per token)
        y = _gelu_mul_torch(y, gelu_mul.reshape(-1, n_out), out_dtype)
    elif glu:
        y = _glu_torch(y, out_dtype)
    return y.reshape(*lead, n_y)


def qdequantize_packed(w: PackedQuant, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """W [n_out, n_in] in `dtype` (or into `out`, a [n_out, n_in] tensor with unit last stride):
    the prefill path's scratch."""
    _check_packed("qdequantize_packed", w)
    check_device("qdequantize_packed", w.device, triton)
    n_out, n_in = w.shape
    if out is None:
        if dtype not in _X_DTYPES:
            _fail(f"qdequantize_packed: dtype must be float16, bfloat16 or float32, got {dtype}")
        out = torch.empty((n_out, n_in), dtype=dtype, device=w.device)
    elif tuple(out.shape) != (n_out, n_in) or out.stride(-1) != 1 or out.dtype not in _X_DTYPES:
        _fail(f"qdequantize_packed: out must be [{n_out}, {n_in}] fp16/bf16/fp32 with unit last stride")
    if n_out == 0:
        return out
    (q, h, s, d), strides = _typed_planes(w)
    block_n = 512 if w.device.type == "cpu" and interpreting() else 16
    _dequant_packed_kernel[(triton.cdiv(n_out, block_n), triton.cdiv(n_in, 256))](
        q, h, s, d, out, n_out, n_in, out.stride(0), *strides, FMT=w.ggml_type, BLOCK_N=block_n,
        num_warps=4)
    return out


def gemv_launch_info(launch) -> dict | None:
    """For a recorded launch (kernels.triton.launch.Launch) of the decode GEMV with one row of x: the
    weight format, the weight bytes one program reads per iteration of its K loop (BLOCK_N rows x
    256 values) and its warps, which the static report turns into SASS instructions per weight
    byte. None for any other launch."""
    if launch.name != "_gemv_kernel" or launch.kwargs.get("BLOCK_M") != 1:
        return None
    name, bv, bb = LAYOUT[launch.kwargs["FMT"]]
    return {"format": name, "loop_bytes": launch.kwargs["BLOCK_N"] * 256 // bv * bb,
            "num_warps": launch.kwargs.get("num_warps", 4)}


# -------------------------------------------------------------------------------- torch refs

def qmatmul_ref(x: torch.Tensor, w: PackedQuant, out_dtype: torch.dtype | None = None,
                gelu_mul: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """``qmatmul`` in plain torch: float32 W and float32 product (and epilogue), cast to
    ``out_dtype``. Dequantizes at most PREFILL_SCRATCH_VALUES weights at a time (the vocab matrix
    is ~400M)."""
    _check_packed("qmatmul_ref", w)
    out_dtype = _check_x("qmatmul_ref", x, w, out_dtype)
    _check_gelu_mul("qmatmul_ref", gelu_mul, x, w.shape[0])
    _check_glu("qmatmul_ref", glu, gelu_mul, w)
    n_out, n_in = w.shape
    x2 = x.reshape(-1, n_in).to(torch.float32)
    y = torch.empty((x2.shape[0], n_out), dtype=torch.float32 if gelu_mul is not None or glu else out_dtype,
                    device=x.device)
    chunk = max(1, PREFILL_SCRATCH_VALUES // n_in)
    for r0 in range(0, n_out, chunk):
        r1 = min(n_out, r0 + chunk)
        y[:, r0:r1] = x2 @ dequantize_packed_ref(w.row_slice(r0, r1)).T
    if gelu_mul is not None:
        y = _gelu_mul_torch(y, gelu_mul.reshape(-1, n_out), out_dtype)
    elif glu:
        return _glu_torch(y, out_dtype).reshape(*x.shape[:-1], n_out // 2)
    return y.reshape(*x.shape[:-1], n_out)
