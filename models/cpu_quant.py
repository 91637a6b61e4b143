"""The torch CPU formats (the cpu_torch runtime) made at load from GGUF matrices: which types
repack (`repackable`), and each matrix's form (`cpu_weight`): models/formats/int4.Int4Weight for
the 4-bit types, float16 for the wider ones. The formats themselves, and why, are in
models/formats/int4.py, half.py and int8_head.py.
"""
from __future__ import annotations

import torch

from .formats.base import BLOCK_VALUES
from .formats.int4 import Int4Weight

TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"})


def repackable(ggml_type: int, shape) -> bool:
    """A 2-D matrix of a type Int4Weight holds."""
    from .quant import type_name

    return shape is not None and len(shape) == 2 and type_name(int(ggml_type)) in TYPES


def dequantize_half(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> torch.Tensor:
    """float16 [out, in] of a GGUF matrix, dequantized BLOCK_VALUES at a time (no float32 copy of
    the whole matrix at load)."""
    from .quant import dequantize, row_bytes

    n, k = shape
    blocks = raw.contiguous().view(n, row_bytes(int(ggml_type), k))
    out = torch.empty(n, k, dtype=torch.float16)
    step = max(1, BLOCK_VALUES // k)
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        out[r0:r1] = dequantize(blocks[r0:r1], int(ggml_type), (r1 - r0, k))
    return out


def cpu_weight(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]):
    """The CPU runtime form of a GGUF matrix: an Int4Weight for the 4-bit types; for the wider ones
    (Q6_K, Q5_K, Q5_0, Q8_0) a float16 matrix (the caller wraps it in models.formats.half.HalfWeight).
    Why: their two int4 planes double the int4pack work (12288x1536 on one AVX2 core: ~6.5 ms),
    torch's float16 GEMV reads 2 bytes a weight in 4.6 ms. (fbgemm's float16 linear is faster still,
    2.9 ms, but its prepack costs ~50 ns a value: half a minute at load for E2B's Q6_K tensors.)
    Bytes: E2B's Q6_K matrices are 260M values, 0.5 GB as float16; its tied Q6_K head (403M
    values) does not come here but goes to models/formats/int8_head.Int8Head (int8 ranking, exact top rows)
    when fbgemm is there, which keeps its peak RSS near the file's size."""
    if Int4Weight.bits_of(ggml_type) > 4:
        return dequantize_half(raw, ggml_type, shape)
    return Int4Weight(raw, ggml_type, shape)
