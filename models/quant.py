"""Torch dequantizers for GGML tensor types.

Turns the raw bytes of a GGUF tensor into a float tensor, bit-exactly matching
``gguf.quants.dequantize`` (the reference): every value is computed in float32
with the same float operations in the same order as gguf-py (which mirrors
ggml's ``dequantize_row_*``), then cast to the requested dtype.

Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS.

All work is vectorized torch on ``raw.device`` (no Python loop per block), so
the same code runs on CPU and CUDA tensors.  Quantized data is a sequence of
fixed-size blocks; each ``_dq_*`` function takes a uint8 tensor
``[n_blocks, bytes_per_block]`` and returns float32 ``[n_blocks, values_per_block]``.
All multi-byte fields are little-endian.

Shapes are PyTorch row-major (innermost dimension last), i.e. GGML's ``ne``
reversed; the innermost dimension must be a multiple of the block size.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGMLType

__all__ = [
    "GGMLType", "SUPPORTED_TYPES", "UnsupportedTensorType",
    "type_name", "block_size", "row_bytes", "dequantize", "dequantize_rows",
]

QK_K = 256
# Non-linear 4-bit codebook shared by IQ4_NL and IQ4_XS.
_IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# Blocks dequantized per step: bounds the temporaries of a big tensor (~16M values).
_CHUNK_VALUES = 1 << 24


class UnsupportedTensorType(ValueError):
    """Raised for a GGML tensor type this module cannot dequantize."""


def type_name(ggml_type: int) -> str:
    """Name of a GGML type, e.g. ``"Q4_K"`` (``"type 99"`` if unknown to gguf)."""
    try:
        return GGMLType(int(ggml_type)).name
    except ValueError:
        return f"type {int(ggml_type)}"


def _check_type(ggml_type: int) -> GGMLType:
    try:
        t = GGMLType(int(ggml_type))
    except ValueError:
        t = None
    if t is None or t not in _DEQUANT:
        raise UnsupportedTensorType(f"unsupported GGML tensor type {type_name(ggml_type)}")
    return t


def block_size(ggml_type: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a supported type."""
    return GGML_QUANT_SIZES[_check_type(ggml_type)]


def row_bytes(ggml_type: int, n_values: int) -> int:
    """Bytes taken by one row of ``n_values`` values."""
    bv, bb = block_size(ggml_type)
    if n_values % bv:
        raise ValueError(
            f"row of {n_values} values is not a multiple of the {type_name(ggml_type)} block size ({bv})")
    return n_values // bv * bb


# ---------------------------------------------------------------- helpers

def _view(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 ``[n, k]`` as ``dtype`` ``[n, k // itemsize]`` (copying only
    when the bytes are not contiguous or not at an aligned storage offset)."""
    b = b.contiguous()
    if b.storage_offset() % dtype.itemsize:
        b = b.clone()
    return b.view(dtype)


def f16_at(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """The float16 field at byte ``off`` of each block, as float32 ``[n, 1]``."""
    return _view(blocks[:, off:off + 2], torch.float16).to(torch.float32)


def _shifts(values, device, dtype=torch.uint8) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split bytes ``[n, k]`` into 4-bit values ``[n, k // group, 2, group]``:
    in each run of ``group`` bytes, all low nibbles come first, then all high ones."""
    n = qs.shape[0]
    sh = _shifts([0, 4], qs.device).view(1, 1, 2, 1)
    return (qs.reshape(n, -1, 1, group) >> sh) & 0x0F


def bitplanes(qh: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Split bytes ``[n, k]`` into ``bits``-wide fields ``[n, k // group, 8 // bits, group]``:
    plane j holds bits ``j*bits .. j*bits+bits-1`` of each byte in the run."""
    n = qh.shape[0]
    sh = _shifts(list(range(0, 8, bits)), qh.device).view(1, 1, -1, 1)
    return (qh.reshape(n, -1, 1, group) >> sh) & ((1 << bits) - 1)


def _kvalues(device) -> torch.Tensor:
    return torch.tensor(_IQ4_KVALUES, dtype=torch.float32, device=device)


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12 bytes of 6-bit (scale, min) pairs of Q4_K / Q5_K into two
    int ``[n, 8]`` tensors.  Bytes 0-3: scales 0-3 (low 6 bits), bytes 4-7: mins 0-3
    (low 6 bits); bytes 8-11: low nibble = scale 4-7 low bits, high nibble = min 4-7
    low bits; the top 2 bits of bytes 0-3 / 4-7 are the high bits of scales / mins 4-7."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


# ---------------------------------------------------------------- float types

# F32: 1 value in 4 bytes (IEEE float32).
def _dq_f32(blocks):
    return _view(blocks, torch.float32)


# F16: 1 value in 2 bytes (IEEE float16), widened exactly to float32.
def _dq_f16(blocks):
    return _view(blocks, torch.float16).to(torch.float32)


# BF16: 1 value in 2 bytes (top half of a float32), widened exactly.
def _dq_bf16(blocks):
    return _view(blocks, torch.bfloat16).to(torch.float32)


# ---------------------------------------------------------------- 32-value blocks

# Q4_0: 32 values in 18 bytes: d f16, 16 bytes of 4-bit quants
# (low nibbles = values 0-15, high nibbles = 16-31).  x = d * (q - 8)
def _dq_q4_0(blocks):
    n = blocks.shape[0]
    q = nibbles(blocks[:, 2:], 16).reshape(n, 32).to(torch.int16) - 8
    return f16_at(blocks, 0) * q.to(torch.float32)


# Q4_1: 32 values in 20 bytes: d f16, m f16, 16 bytes of 4-bit quants.  x = d * q + m
def _dq_q4_1(blocks):
    n = blocks.shape[0]
    q = nibbles(blocks[:, 4:], 16).reshape(n, 32).to(torch.float32)
    return (f16_at(blocks, 0) * q) + f16_at(blocks, 2)


def q5_quants(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit quants ``[n, 32]`` from 4 bytes of high bits (bit i of the little-endian
    uint32 is the 5th bit of value i) and 16 bytes of low nibbles."""
    n = qs.shape[0]
    hi = (qh.reshape(n, 4, 1) >> _shifts(list(range(8)), qh.device).view(1, 1, 8)) & 1
    lo = nibbles(qs, 16).reshape(n, 32)
    return (lo | (hi.reshape(n, 32) << 4)).to(torch.int16)


# Q5_0: 32 values in 22 bytes: d f16, 4 bytes of 5th bits, 16 bytes of 4-bit quants.
# x = d * (q - 16)
def _dq_q5_0(blocks):
    q = q5_quants(blocks[:, 2:6], blocks[:, 6:]) - 16
    return f16_at(blocks, 0) * q.to(torch.float32)


# Q5_1: 32 values in 24 bytes: d f16, m f16, 4 bytes of 5th bits, 16 bytes of 4-bit quants.
# x = d * q + m
def _dq_q5_1(blocks):
    q = q5_quants(blocks[:, 4:8], blocks[:, 8:]).to(torch.float32)
    return (f16_at(blocks, 0) * q) + f16_at(blocks, 2)


# Q8_0: 32 values in 34 bytes: d f16, 32 int8 quants.  x = q * d
def _dq_q8_0(blocks):
    q = blocks[:, 2:].view(torch.int8).to(torch.float32)
    return q * f16_at(blocks, 0)


# IQ4_NL: 32 values in 18 bytes: d f16, 16 bytes of 4-bit indices into the
# non-linear codebook _IQ4_KVALUES (nibble order as Q4_0).  x = d * kvalues[q]
def _dq_iq4_nl(blocks):
    n = blocks.shape[0]
    q = nibbles(blocks[:, 2:], 16).reshape(n, 32)
    return f16_at(blocks, 0) * _kvalues(blocks.device)[q.long()]


# ---------------------------------------------------------------- 256-value K blocks

# Q2_K: 256 values in 84 bytes: 16 bytes of 4-bit (scale | min << 4) per 16-value
# sub-block, 64 bytes of 2-bit quants, d f16, dmin f16.
# Quants: each 32-byte half holds 128 values as 4 bit planes (2 bits each) of 32.
# x = (d * scale) * q - (dmin * min)
def _dq_q2_k(blocks):
    n = blocks.shape[0]
    sc = blocks[:, :16]
    d, dmin = f16_at(blocks, 80), f16_at(blocks, 82)
    dl = (d * (sc & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = bitplanes(blocks[:, 16:80], 32, 2).reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


# Q3_K: 256 values in 110 bytes: 32 bytes hmask (3rd bits, bit plane j = values
# 32j..32j+31), 64 bytes of 2-bit low quants (as Q2_K), 12 bytes of 6-bit scales
# for 16 sub-blocks of 16, d f16.
# Scales: bytes 0-7 hold the low nibbles (low nibble = scales 0-7, high = 8-15),
# bytes 8-11 the 2-bit high parts (bit pair j of byte 8+i = scale 4j+i).
# q = low2 - (hmask bit ? 0 : 4); x = (d * (scale - 32)) * q
def _dq_q3_k(blocks):
    n = blocks.shape[0]
    dev = blocks.device
    d = f16_at(blocks, 108)
    scales = blocks[:, 96:108]
    lsc = (scales[:, :8].reshape(n, 1, 8) >> _shifts([0, 4], dev).view(1, 2, 1)).reshape(n, 16)
    hsc = (scales[:, 8:].reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], dev).view(1, 4, 1)).reshape(n, 16)
    sc = ((lsc & 0x0F) | ((hsc & 0x03) << 4)).to(torch.int16) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = bitplanes(blocks[:, 32:96], 32, 2).reshape(n, 16, 16).to(torch.int16)
    qh = bitplanes(blocks[:, :32], 32, 1).reshape(n, 16, 16).to(torch.int16)
    q = (ql - ((qh ^ 1) << 2)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


# Q4_K: 256 values in 144 bytes: d f16, dmin f16, 12 bytes of 6-bit scales/mins
# for 8 sub-blocks of 32, 128 bytes of 4-bit quants (each run of 32 bytes holds
# two sub-blocks: low nibbles, then high nibbles).
# x = (d * scale) * q - (dmin * min)
def _dq_q4_k(blocks):
    n = blocks.shape[0]
    sc, mn = scale_min_k4(blocks[:, 4:16])
    dl = (f16_at(blocks, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (f16_at(blocks, 2) * mn.to(torch.float32)).reshape(n, 8, 1)
    q = nibbles(blocks[:, 16:], 32).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


# Q5_K: 256 values in 176 bytes: d f16, dmin f16, 12 bytes of 6-bit scales/mins
# (as Q4_K), 32 bytes of 5th bits (bit plane j = sub-block j), 128 bytes of 4-bit
# quants (as Q4_K).  x = (d * scale) * q - (dmin * min)
def _dq_q5_k(blocks):
    n = blocks.shape[0]
    sc, mn = scale_min_k4(blocks[:, 4:16])
    dl = (f16_at(blocks, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (f16_at(blocks, 2) * mn.to(torch.float32)).reshape(n, 8, 1)
    ql = nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    qh = bitplanes(blocks[:, 16:48], 32, 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


# Q6_K: 256 values in 210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits,
# 16 int8 scales for sub-blocks of 16, d f16.
# Each 128-value half: 64 ql bytes (low nibbles = values 0-63, high = 64-127) and
# 32 qh bytes (bit pair j = values 32j..32j+31).  x = (d * scale) * (q - 32)
def _dq_q6_k(blocks):
    n = blocks.shape[0]
    sc = blocks[:, 192:208].view(torch.int8).to(torch.float32)
    dl = (f16_at(blocks, 208) * sc).reshape(n, 16, 1)
    ql = nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    qh = bitplanes(blocks[:, 128:192], 32, 2).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int16) - 32
    return (dl * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, QK_K)


# IQ4_XS: 256 values in 136 bytes: d f16, scales_h u16 (2 high bits per sub-block),
# 4 bytes scales_l (4 low bits per sub-block: low nibble first), 128 bytes of
# 4-bit codebook indices (16 bytes per sub-block of 32, nibble order as Q4_0).
# x = (d * (scale - 32)) * kvalues[q]
def _dq_iq4_xs(blocks):
    n = blocks.shape[0]
    dev = blocks.device
    sh = blocks[:, 2:4].to(torch.int32)
    sh = (sh[:, :1] | (sh[:, 1:] << 8)) >> _shifts(list(range(0, 16, 2)), dev, torch.int32).view(1, 8)
    sl = (blocks[:, 4:8].reshape(n, 4, 1) >> _shifts([0, 4], dev).view(1, 1, 2)).reshape(n, 8)
    sc = ((sl & 0x0F).to(torch.int32) | ((sh & 0x03) << 4)) - 32
    dl = (f16_at(blocks, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    q = nibbles(blocks[:, 8:], 16).reshape(n, 8, 32)
    return (dl * _kvalues(dev)[q.long()]).reshape(n, QK_K)


_DEQUANT: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _dq_f32,
    GGMLType.F16: _dq_f16,
    GGMLType.BF16: _dq_bf16,
    GGMLType.Q4_0: _dq_q4_0,
    GGMLType.Q4_1: _dq_q4_1,
    GGMLType.Q5_0: _dq_q5_0,
    GGMLType.Q5_1: _dq_q5_1,
    GGMLType.Q8_0: _dq_q8_0,
    GGMLType.Q2_K: _dq_q2_k,
    GGMLType.Q3_K: _dq_q3_k,
    GGMLType.Q4_K: _dq_q4_k,
    GGMLType.Q5_K: _dq_q5_k,
    GGMLType.Q6_K: _dq_q6_k,
    GGMLType.IQ4_NL: _dq_iq4_nl,
    GGMLType.IQ4_XS: _dq_iq4_xs,
}

SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(_DEQUANT)


# ---------------------------------------------------------------- public API

def _numpy_bytes(raw: np.ndarray) -> np.ndarray:
    arr = np.asarray(raw)  # drops the memmap subclass without copying
    if not arr.flags.writeable:
        # torch.from_numpy warns on read-only memory: copy just this tensor's bytes.
        arr = np.array(arr, copy=True)
    if arr.dtype != np.uint8:
        arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return arr.reshape(-1)


def _as_bytes(raw) -> torch.Tensor:
    """Flat uint8 torch view of ``raw`` (a torch tensor or numpy array)."""
    if isinstance(raw, np.ndarray):
        return torch.from_numpy(_numpy_bytes(raw))
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"raw must be a torch.Tensor or numpy array, not {type(raw).__name__}")
    if raw.dtype != torch.uint8:
        raw = raw.contiguous().reshape(-1).view(torch.uint8)
    return raw.reshape(-1)


def _check_dtype(dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise ValueError(f"output dtype must be a floating point dtype, not {dtype}")


def _dequant_into(out: torch.Tensor, blocks: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """Dequantize ``blocks`` [n, bytes] into ``out`` [n, values] chunk by chunk."""
    fn = _DEQUANT[t]
    bv = GGML_QUANT_SIZES[t][0]
    step = max(1, _CHUNK_VALUES // bv)
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = fn(blocks[i:i + step])  # float32 result, cast on copy
    return out


def dequantize(raw, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize a whole tensor.

    ``raw``: the tensor's bytes (uint8 torch tensor or numpy array/memmap, any
    shape); ``shape``: PyTorch shape (GGML ne reversed).  Returns a new contiguous
    tensor of ``shape`` and ``dtype`` on ``raw``'s device (CPU for numpy input).
    """
    t = _check_type(ggml_type)
    _check_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    n_values = 1
    for s in shape:
        n_values *= s
    inner = shape[-1] if shape else 1
    row_bytes(t, inner)  # checks the innermost dimension against the block size
    bv, bb = GGML_QUANT_SIZES[t]
    data = _as_bytes(raw)
    expected = n_values // bv * bb
    if data.numel() != expected:
        raise ValueError(
            f"{type_name(t)} tensor of shape {shape} needs {expected} bytes, got {data.numel()}")
    blocks = data.view(-1, bb)
    out = torch.empty((blocks.shape[0], bv), dtype=dtype, device=data.device)
    return _dequant_into(out, blocks, t).view(shape)


def dequantize_rows(raw, ggml_type: int, row_ids: torch.Tensor, row_len: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize only rows ``row_ids`` of a 2-D matrix ``[n_rows, row_len]``
    stored in ``raw`` (e.g. an embedding lookup).  Returns ``[len(row_ids), row_len]``
    on ``raw``'s device (CPU for numpy input); ids may repeat and be in any order."""
    t = _check_type(ggml_type)
    _check_dtype(dtype)
    rb = row_bytes(t, row_len)
    bv, bb = GGML_QUANT_SIZES[t]
    ids = torch.as_tensor(row_ids).reshape(-1).long()
    if isinstance(raw, np.ndarray):
        # Gather in numpy first so a (read-only) memmap only has the wanted rows read/copied.
        arr = np.asarray(raw)
        if arr.dtype != np.uint8:
            arr = arr.reshape(-1).view(np.uint8)
        arr = arr.reshape(-1)
        if arr.size % rb:
            raise ValueError(f"{arr.size} bytes is not a whole number of {type_name(t)} rows of {row_len} values")
        sel = torch.from_numpy(arr.reshape(-1, rb)[ids.cpu().numpy()])
    else:
        data = _as_bytes(raw)
        if data.numel() % rb:
            raise ValueError(f"{data.numel()} bytes is not a whole number of {type_name(t)} rows of {row_len} values")
        sel = data.view(-1, rb)[ids.to(data.device)]
    blocks = sel.reshape(-1, bb)
    out = torch.empty((blocks.shape[0], bv), dtype=dtype, device=blocks.device)
    return _dequant_into(out, blocks, t).view(ids.numel(), row_len)
