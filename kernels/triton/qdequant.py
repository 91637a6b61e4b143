"""W = dequantize(GGUF quantized rows), on the device: embedding rows gathered from a quantized
table (the raw bytes travel, the floats are made where they are used) and any matrix kept in the
GGUF layout (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q4_0).

``w_raw`` is the GGUF tensor as stored: uint8 ``[n_out, row_bytes]``, each row the quant blocks of
one output feature (256 values per block for the K-quants, 32 for Q8_0/Q5_0/Q4_0).
``_qdequant_kernel``: program (i, j) dequantizes rows i*BLOCK_N.. at values j*256..j*256+255 in
registers with the same float ops as ``models/quant.py`` (bit-equal under the interpreter; a GPU may
fuse ``(d*sc)*q - m`` into one FMA) and writes them in the output's dtype.  The matrices the GEMMs
read are repacked at load (kernels/triton/qpack.py) and go through kernels/triton/qmatmul.py instead.

``qdequantize_ref`` is the plain-torch version, with the exact float32 op order of gguf-py /
``models/quant.py``.  Triton is optional: without it this module imports and the ref works.
"""
import torch

from .launch import check_device, interpreting
from .qformats import LAYOUT, Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0

try:  # CPU-only installs have no triton: the refs below still work.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["PARTS_SHAPE", "SUPPORTED_TYPES", "dequant_parts", "qdequantize", "qdequantize_ref"]

SUPPORTED_TYPES = frozenset(LAYOUT)

# Each K step covers 256 values as two parts of [G, L] = 128 values: one K-quant block, or 8
# blocks of 32.  (G, L) per type: L is the run of bytes whose nibbles form one scale group.
_VALUES_PER_STEP = 256
PARTS_SHAPE = {Q4_K: (4, 32), Q5_K: (4, 32), Q6_K: (8, 16), Q8_0: (8, 16), Q5_0: (8, 16), Q4_0: (8, 16)}
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------ kernels

if triton is not None:

    @triton.jit
    def _load_u8(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _load_f16(ptr, mask):
        """The little-endian float16 at byte ``ptr`` (any alignment), widened to float32."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
        return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _scale_min_k4(bp, s, mask):
        """6-bit (scale, min) of sub-block ``s`` (0..7) of Q4_K/Q5_K, from the 12 bytes at bp+4:
        bytes 0-3 scales 0-3, 4-7 mins 0-3, 8-11 low nibble scale 4-7 / high nibble min 4-7; the
        top 2 bits of bytes 0-3 / 4-7 are the high bits of scales / mins 4-7."""
        j = s % 4
        a = _load_u8(bp + 4 + j, mask)
        b = _load_u8(bp + 8 + j, mask)
        c = _load_u8(bp + 12 + j, mask)
        sc = tl.where(s < 4, a & 63, (c & 15) | ((a >> 2) & 48))
        mn = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 2) & 48))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def dequant_parts(w_ptr, rows, row_mask, k0, K, row_bytes,
                       GGML: tl.constexpr, G: tl.constexpr, L: tl.constexpr):
        """Values k0 .. k0+255 of rows ``rows`` [BN] as two parts in storage order:
        ``wa``, ``wb``: fp32 [BN, G, L]; ``ka``, ``kb``: int32 [1, G, L], their columns in W
        (>= K where a 32-block type runs past the row end; those weights are 0)."""
        g = tl.arange(0, G)[None, :, None]
        i = tl.arange(0, L)[None, None, :]
        row_ptr = w_ptr + rows.to(tl.int64)[:, None, None] * row_bytes   # [BN, 1, 1]
        mask = row_mask[:, None, None]
        if GGML == 12:
            # Q4_K: 144 B = d f16, dmin f16, 12 B scales/mins, 128 B quants: run g of 32 bytes
            # holds sub-block 2g (low nibbles) and 2g+1 (high).  x = (d*sc)*q - dmin*mn
            bp = row_ptr + (k0 // 256) * 144
            d = _load_f16(bp, mask)
            dmin = _load_f16(bp + 2, mask)
            q = _load_u8(bp + 16 + 32 * g + i, mask)
            sc_a, mn_a = _scale_min_k4(bp, 2 * g, mask)
            sc_b, mn_b = _scale_min_k4(bp, 2 * g + 1, mask)
            wa = (d * sc_a) * (q & 15).to(tl.float32) - dmin * mn_a
            wb = (d * sc_b) * (q >> 4).to(tl.float32) - dmin * mn_b
            ka = k0 + 64 * g + i
            kb = ka + 32
        elif GGML == 13:
            # Q5_K: 176 B = d, dmin, 12 B scales/mins (as Q4_K), 32 B of 5th bits (bit s of
            # byte i = value 32s+i), 128 B low nibbles (as Q4_K).
            bp = row_ptr + (k0 // 256) * 176
            d = _load_f16(bp, mask)
            dmin = _load_f16(bp + 2, mask)
            qh = _load_u8(bp + 16 + i, mask)                  # [BN, 1, 32]: loaded once
            q = _load_u8(bp + 48 + 32 * g + i, mask)
            sc_a, mn_a = _scale_min_k4(bp, 2 * g, mask)
            sc_b, mn_b = _scale_min_k4(bp, 2 * g + 1, mask)
            qa = (q & 15) | (((qh >> (2 * g)) & 1) << 4)
            qb = (q >> 4) | (((qh >> (2 * g + 1)) & 1) << 4)
            wa = (d * sc_a) * qa.to(tl.float32) - dmin * mn_a
            wb = (d * sc_b) * qb.to(tl.float32) - dmin * mn_b
            ka = k0 + 64 * g + i
            kb = ka + 32
        elif GGML == 14:
            # Q6_K: 210 B = 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales (one per 16
            # values), d f16.  Half h (128 values): ql bytes 64h+t (t < 64) hold values 128h+t
            # (low nibble) and 128h+64+t (high); qh byte 32h+(t%32), bit pair 2*(t//32) (+4 for
            # the high-nibble value).  Here g = 4h + t//16, i = t%16.  x = (d*sc)*(q-32)
            bp = row_ptr + (k0 // 256) * 210
            h = g // 4
            u = g % 4
            ql = _load_u8(bp + 16 * g + i, mask)
            qh = _load_u8(bp + 128 + 32 * h + 16 * (u % 2) + i, mask)   # each byte by 2 lanes
            shift = 2 * (u // 2)
            qa = ((ql & 15) | (((qh >> shift) & 3) << 4)) - 32
            qb = ((ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)) - 32
            d = _load_f16(bp + 208, mask)
            sc_a = tl.load(bp + 192 + 8 * h + u, mask=mask, other=0).to(tl.int8, bitcast=True)
            sc_b = tl.load(bp + 196 + 8 * h + u, mask=mask, other=0).to(tl.int8, bitcast=True)
            wa = (d * sc_a.to(tl.float32)) * qa.to(tl.float32)
            wb = (d * sc_b.to(tl.float32)) * qb.to(tl.float32)
            ka = k0 + 128 * h + 16 * u + i
            kb = ka + 64
        else:
            # 32-value blocks, G of them per step: block (k0/32 + g).  Part a = values 0-15,
            # part b = 16-31 (the low / high nibbles of the 16 quant bytes).
            blk = k0 // 32 + g                                  # [1, G, 1]
            mask = mask & (blk < K // 32)
            ka = 32 * blk + i
            kb = ka + 16
            if GGML == 8:
                # Q8_0: 34 B = d f16, 32 int8 quants.  x = q * d
                bp = row_ptr + blk * 34
                d = _load_f16(bp, mask)
                qa = tl.load(bp + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True)
                qb = tl.load(bp + 18 + i, mask=mask, other=0).to(tl.int8, bitcast=True)
                wa = qa.to(tl.float32) * d
                wb = qb.to(tl.float32) * d
            elif GGML == 6:
                # Q5_0: 22 B = d f16, 4 B of 5th bits (bit j of the LE uint32 = value j),
                # 16 B of nibbles.  x = d * (q - 16)
                bp = row_ptr + blk * 22
                d = _load_f16(bp, mask)
                qh = (_load_u8(bp + 2, mask) | (_load_u8(bp + 3, mask) << 8)
                      | (_load_u8(bp + 4, mask) << 16) | (_load_u8(bp + 5, mask) << 24))
                q = _load_u8(bp + 6 + i, mask)
                qa = ((q & 15) | (((qh >> i) & 1) << 4)) - 16
                qb = ((q >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16
                wa = d * qa.to(tl.float32)
                wb = d * qb.to(tl.float32)
            else:
                # Q4_0: 18 B = d f16, 16 B of nibbles.  x = d * (q - 8)
                bp = row_ptr + blk * 18
                d = _load_f16(bp, mask)
                q = _load_u8(bp + 2 + i, mask)
                wa = d * ((q & 15) - 8).to(tl.float32)
                wb = d * ((q >> 4) - 8).to(tl.float32)
        return wa, ka, wb, kb

    @triton.jit
    def _qdequant_kernel(w_ptr, out_ptr, N, K, row_bytes,
                         GGML: tl.constexpr, G: tl.constexpr, L: tl.constexpr, BLOCK_N: tl.constexpr):
        """out[N, K] (out's dtype) = W; program (i, j) writes rows i*BLOCK_N.. x values j*256.."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        k0 = tl.program_id(1) * (2 * G * L)
        wa, ka, wb, kb = dequant_parts(w_ptr, rows, row_mask, k0, K, row_bytes, GGML, G, L)
        out_rows = out_ptr + rows.to(tl.int64)[:, None, None] * K
        mask = row_mask[:, None, None]
        tl.store(out_rows + ka, wa.to(out_ptr.dtype.element_ty), mask=mask & (ka < K))
        tl.store(out_rows + kb, wb.to(out_ptr.dtype.element_ty), mask=mask & (kb < K))


# ---------------------------------------------------------------------------------- launchers

def _fail(msg: str):
    raise ValueError(msg)


def _check_weight(fn: str, w_raw: torch.Tensor, ggml_type, n_out: int, n_in: int) -> int:
    """Validate the quantized weight; returns the GGML type id."""
    t = int(ggml_type)
    if t not in LAYOUT:
        _fail(f"{fn}: unsupported GGML type {ggml_type!r}; supported: "
              + ", ".join(name for name, _, _ in LAYOUT.values()))
    name, bv, bb = LAYOUT[t]
    if n_out <= 0 or n_in <= 0 or n_in % bv:
        _fail(f"{fn}: n_out={n_out}, n_in={n_in}: need n_out > 0 and n_in a positive multiple "
              f"of the {name} block ({bv})")
    if not isinstance(w_raw, torch.Tensor) or w_raw.dtype != torch.uint8:
        _fail(f"{fn}: w_raw must be a uint8 tensor, got {getattr(w_raw, 'dtype', type(w_raw).__name__)}")
    row_bytes = n_in // bv * bb
    if tuple(w_raw.shape) != (n_out, row_bytes):
        _fail(f"{fn}: {name} [{n_out}, {n_in}] needs w_raw of shape ({n_out}, {row_bytes}), got {tuple(w_raw.shape)}")
    if not w_raw.is_contiguous():
        _fail(f"{fn}: w_raw must be contiguous (rows as in the GGUF file), got strides {w_raw.stride()}")
    return t


def _check_triton(fn: str, device: torch.device) -> None:
    check_device(fn, device, triton)


def _dequant_into(out: torch.Tensor, w_raw: torch.Tensor, t: int, n_in: int) -> torch.Tensor:
    n_rows = out.shape[0]
    g, l = PARTS_SHAPE[t]
    block_n = 64 if interpreting() else 16  # the interpreter pays per program: wide row blocks make the tests fast
    grid = (triton.cdiv(n_rows, block_n), triton.cdiv(n_in, _VALUES_PER_STEP))
    _qdequant_kernel[grid](w_raw, out, n_rows, n_in, w_raw.shape[1],
                           GGML=t, G=g, L=l, BLOCK_N=block_n)
    return out


def qdequantize(w_raw: torch.Tensor, ggml_type, n_out: int, n_in: int,
                dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """W [n_out, n_in] in ``dtype`` from its quantized rows (the prefill path's scratch)."""
    t = _check_weight("qdequantize", w_raw, ggml_type, n_out, n_in)
    if dtype not in _X_DTYPES:
        _fail(f"qdequantize: dtype must be float16, bfloat16 or float32, got {dtype}")
    _check_triton("qdequantize", w_raw.device)
    return _dequant_into(torch.empty((n_out, n_in), dtype=dtype, device=w_raw.device), w_raw, t, n_in)


# -------------------------------------------------------------------------------- torch refs

def _f16_field(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """float16 field at byte ``off`` of each block [n, bytes] -> float32 [n, 1]."""
    return blocks[:, off:off + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles_lo_hi(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., k] -> [..., 2k]: all low nibbles, then all high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def scale_min_k4_ref(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes [n, 12] of Q4_K/Q5_K 6-bit scales/mins -> float32 [n, 8] each."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _dequant_blocks_ref(b: torch.Tensor, t: int) -> torch.Tensor:
    """Blocks uint8 [n, bytes per block] -> float32 [n, values per block] (layouts as in the kernel)."""
    n = b.shape[0]
    if t == Q4_0:
        q = _nibbles_lo_hi(b[:, 2:18]).to(torch.int16) - 8
        return _f16_field(b, 0) * q.to(torch.float32)
    if t == Q5_0:
        bits = torch.arange(8, dtype=torch.uint8, device=b.device)
        hi = ((b[:, 2:6, None] >> bits) & 1).reshape(n, 32)
        q = (_nibbles_lo_hi(b[:, 6:22]) | (hi << 4)).to(torch.int16) - 16
        return _f16_field(b, 0) * q.to(torch.float32)
    if t == Q8_0:
        return b[:, 2:34].view(torch.int8).to(torch.float32) * _f16_field(b, 0)
    if t in (Q4_K, Q5_K):
        sc, mn = scale_min_k4_ref(b[:, 4:16])
        dl = (_f16_field(b, 0) * sc)[:, :, None]
        ml = (_f16_field(b, 2) * mn)[:, :, None]
        qs_off = 16 if t == Q4_K else 48
        q = _nibbles_lo_hi(b[:, qs_off:qs_off + 128].reshape(n, 4, 32)).reshape(n, 8, 32)
        if t == Q5_K:
            planes = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
            q = q | (((b[:, None, 16:48] >> planes) & 1) << 4)
        return (dl * q.to(torch.float32) - ml).reshape(n, 256)
    if t == Q6_K:
        ql = _nibbles_lo_hi(b[:, :128].reshape(n, 2, 64))                        # [n, 2, 128]
        pairs = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[None, None, :, None]
        qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> pairs) & 3).reshape(n, 2, 128)
        q = (ql | (qh << 4)).to(torch.int16) - 32
        dl = (_f16_field(b, 208) * b[:, 192:208].view(torch.int8).to(torch.float32))[:, :, None]
        return (dl * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, 256)
    raise AssertionError(t)


def qdequantize_ref(w_raw: torch.Tensor, ggml_type, n_out: int, n_in: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [n_out, n_in] in ``dtype``, plain torch (float32 math, then cast)."""
    t = _check_weight("qdequantize_ref", w_raw, ggml_type, n_out, n_in)
    bb = LAYOUT[t][2]
    w = _dequant_blocks_ref(w_raw.reshape(-1, bb), t).reshape(n_out, n_in)
    return w if dtype == torch.float32 else w.to(dtype)
