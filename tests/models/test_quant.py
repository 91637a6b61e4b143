"""models.quant dequantizers against the gguf-py reference (bit-exact)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import quants as gguf_quants

from models.quant import (
    SUPPORTED_TYPES,
    GGMLType,
    UnsupportedTensorType,
    block_size,
    dequantize,
    dequantize_rows,
    row_bytes,
    type_name,
)

# Byte offsets of the float16 scale fields inside one block of each quantized type.
F16_FIELDS = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
ALL_TYPES = sorted(SUPPORTED_TYPES, key=int)
# (rows..., blocks per row); float types (1 value per block) get 32x more values per row.
SHAPES = [(3, 2), (7, 1), (2, 3, 1), (64, 2)]


def _finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random float16 bit patterns with |x| < 2: random sign and mantissa, exponent
    0..15 (so subnormals, tiny values and values near 1 all occur)."""
    sign = rng.integers(0, 2, n, dtype=np.uint16) << 15
    exp = rng.integers(0, 16, n, dtype=np.uint16) << 10
    mant = rng.integers(0, 1 << 10, n, dtype=np.uint16)
    return sign | exp | mant


def random_tensor_bytes(ggml_type: GGMLType, n_values: int, seed: int = 0) -> np.ndarray:
    """Random bytes for ``n_values`` values of ``ggml_type`` with finite float fields."""
    rng = np.random.default_rng(seed)
    bv, bb = GGML_QUANT_SIZES[ggml_type]
    n_blocks = n_values // bv
    if ggml_type == GGMLType.F32:
        return rng.standard_normal(n_values).astype(np.float32).view(np.uint8)
    if ggml_type == GGMLType.F16:
        return _finite_f16_bits(rng, n_values).view(np.uint8)
    if ggml_type == GGMLType.BF16:
        bits = rng.integers(0, 1 << 16, n_values, dtype=np.uint16)
        inf_nan = (bits & 0x7F80) == 0x7F80
        bits[inf_nan] &= 0xBFFF  # clear the top exponent bit: finite
        return bits.view(np.uint8)
    blocks = rng.integers(0, 256, (n_blocks, bb), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        blocks[:, off:off + 2] = _finite_f16_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def reference(raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...]) -> torch.Tensor:
    rb = row_bytes(ggml_type, shape[-1])
    out = gguf_quants.dequantize(raw.reshape(-1, rb), ggml_type)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


def assert_exact(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """torch.equal, and on failure report the worst mismatching elements."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if torch.equal(got, want):
        return
    g, w = got.reshape(-1).double(), want.reshape(-1).double()
    bad = (g != w).nonzero().reshape(-1)
    err = (g[bad] - w[bad]).abs()
    order = err.argsort(descending=True)[:8]
    lines = []
    for i in order.tolist():
        flat = int(bad[i])
        idx = tuple(int(x) for x in np.unravel_index(flat, tuple(got.shape)))
        lines.append(f"  {idx}: got {g[flat].item()!r} want {w[flat].item()!r} |diff| {err[i].item():.3g}")
    pytest.fail(f"{what}: {bad.numel()}/{g.numel()} elements differ; worst:\n" + "\n".join(lines))


def _shape(ggml_type: GGMLType, spec: tuple[int, ...]) -> tuple[int, ...]:
    bv = GGML_QUANT_SIZES[ggml_type][0]
    return (*spec[:-1], spec[-1] * max(bv, 32))


@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_matches_gguf_reference(ggml_type, spec):
    shape = _shape(ggml_type, spec)
    n = int(np.prod(shape))
    raw = random_tensor_bytes(ggml_type, n, seed=int(ggml_type) * 100 + len(spec) + spec[-1])
    want = reference(raw, ggml_type, shape)
    assert_exact(dequantize(raw, ggml_type, shape), want, f"{ggml_type.name} numpy input")
    got = dequantize(torch.from_numpy(raw.copy()).reshape(-1, 2), ggml_type, shape)  # any-shaped bytes
    assert got.is_contiguous()
    assert_exact(got, want, f"{ggml_type.name} torch input")


def test_supported_types():
    assert len(SUPPORTED_TYPES) == 15
    assert {type_name(t) for t in SUPPORTED_TYPES} == {
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
    assert block_size(GGMLType.Q4_K) == (256, 144)
    assert block_size(int(GGMLType.Q8_0)) == (32, 34)
    assert row_bytes(GGMLType.Q6_K, 512) == 420
    assert row_bytes(GGMLType.F16, 7) == 14


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0,
                                       GGMLType.IQ4_XS, GGMLType.BF16], ids=lambda t: t.name)
def test_dequantize_rows(ggml_type):
    n_rows, row_len = 11, 2 * max(GGML_QUANT_SIZES[ggml_type][0], 32)
    raw = random_tensor_bytes(ggml_type, n_rows * row_len, seed=7)
    full = dequantize(raw, ggml_type, (n_rows, row_len))
    ids = torch.tensor([5, 0, 10, 5, 3, 3, 9])
    assert_exact(dequantize_rows(raw, ggml_type, ids, row_len), full[ids], "numpy rows")
    assert_exact(dequantize_rows(torch.from_numpy(raw), ggml_type, ids, row_len), full[ids], "torch rows")
    assert_exact(dequantize_rows(raw, ggml_type, ids, row_len, dtype=torch.float16),
                 full[ids].half(), "float16 rows")
    assert dequantize_rows(raw, ggml_type, torch.tensor([], dtype=torch.long), row_len).shape == (0, row_len)


def test_read_only_memmap_without_warnings(tmp_path):
    t, row_len, n_rows = GGMLType.Q4_K, 512, 9
    rb = row_bytes(t, row_len)
    raw = random_tensor_bytes(t, n_rows * row_len, seed=3)
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\xff" * 5 + raw.tobytes() + b"\xee" * 3)  # unaligned, surrounded by junk
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm[5:5 + raw.size]
    want = reference(raw, t, (n_rows, row_len))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_exact(dequantize(view, t, (n_rows, row_len)), want, "memmap")
        ids = torch.tensor([8, 1, 1])
        assert_exact(dequantize_rows(view, t, ids, row_len), want[ids], "memmap rows")
    assert raw.size == n_rows * rb


def test_unaligned_torch_bytes():
    # A tensor's bytes at an odd offset inside a larger uint8 buffer.
    for t in (GGMLType.F32, GGMLType.F16, GGMLType.Q4_1):
        shape = _shape(t, (3, 1))
        raw = random_tensor_bytes(t, int(np.prod(shape)), seed=11)
        buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
        buf[1:] = torch.from_numpy(raw)
        assert_exact(dequantize(buf[1:], t, shape), reference(raw, t, shape), f"{t.name} unaligned")


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.F16], ids=lambda t: t.name)
def test_other_dtypes_are_cast_float32(ggml_type):
    shape = _shape(ggml_type, (5, 1))
    raw = random_tensor_bytes(ggml_type, int(np.prod(shape)), seed=5)
    f32 = dequantize(raw, ggml_type, shape)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        assert_exact(dequantize(raw, ggml_type, shape, dtype=dtype), f32.to(dtype), str(dtype))


def test_unsupported_type_and_bad_sizes():
    raw = np.zeros(64, dtype=np.uint8)
    with pytest.raises(UnsupportedTensorType, match="IQ2_XXS"):
        dequantize(raw, GGMLType.IQ2_XXS, (256,))
    with pytest.raises(UnsupportedTensorType, match="Q8_K"):
        dequantize_rows(raw, GGMLType.Q8_K, torch.tensor([0]), 256)
    with pytest.raises(UnsupportedTensorType, match="TQ1_0"):
        block_size(GGMLType.TQ1_0)
    with pytest.raises(UnsupportedTensorType, match="999"):
        row_bytes(999, 32)
    assert issubclass(UnsupportedTensorType, ValueError)
    with pytest.raises(ValueError, match="multiple"):
        row_bytes(GGMLType.Q4_K, 300)
    with pytest.raises(ValueError):
        dequantize(raw, GGMLType.Q4_0, (2, 48))  # row not a multiple of 32
    with pytest.raises(ValueError, match="bytes"):
        dequantize(raw, GGMLType.Q4_0, (2, 32))  # 36 bytes needed, 64 given
