"""y[p] = x[p] @ W[slot[p]]^T for P (row, matrix) pairs over a stack of GGUF-quantized matrices: the
hot-expert cache's products (models/expert_cache.py), every hit of a layer in one launch per bank.

``w_raw`` is uint8 ``[S, N, row_bytes]``: S matrices (a layer's expert slots) in the GGUF layout
(Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q4_0), ``slots`` [P] picks one for each row of ``x`` [P, K].
``_grouped_gemv_kernel``: program (i, p) owns rows i*BLOCK_N.. of pair p's matrix and walks K in
steps of 256 values, dequantizing in registers with qdequant's ``dequant_parts`` (the float ops
of models/quant.py) and multiplying by x's values; fp32 throughout, y fp32. It reads each pair's
rows once: P GEMVs in one launch, no dense copy of any matrix (the path it replaces dequantized
each hit's experts to memory and took ~15 torch ops a hit).

``grouped_gemv_ref`` is the plain-torch version (each slot dequantized by qdequantize_ref, float32
products). Triton is optional: without it this module imports and the ref works.
"""
import torch

from .launch import check_device, interpreting
from .qdequant import PARTS_SHAPE, SUPPORTED_TYPES, qdequantize_ref
from .qformats import LAYOUT

try:  # CPU-only installs have no triton: the ref below still works.
    import triton
    import triton.language as tl

    from .qdequant import dequant_parts
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["SUPPORTED_TYPES", "grouped_gemv", "grouped_gemv_ref"]

BLOCK_N = 16  # rows a program; [16, G, L] fp32 partial sums = 16 a thread at 4 warps

if triton is not None:

    @triton.jit
    def _grouped_gemv_kernel(x_ptr, w_ptr, slot_ptr, y_ptr, N, K, row_bytes, slot_bytes, stride_x, stride_y,
                             GGML: tl.constexpr, G: tl.constexpr, L: tl.constexpr, BLOCK_N: tl.constexpr):
        """y[p, rows] = x[p] . W[slot[p]][rows] for rows i*BLOCK_N.. (module doc)."""
        p = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        w = w_ptr + tl.load(slot_ptr + p).to(tl.int64) * slot_bytes
        xp = x_ptr + p.to(tl.int64) * stride_x
        acc = tl.zeros([BLOCK_N, G, L], dtype=tl.float32)
        for k0 in range(0, K, 2 * G * L):
            wa, ka, wb, kb = dequant_parts(w, rows, row_mask, k0, K, row_bytes, GGML, G, L)
            xa = tl.load(xp + ka, mask=ka < K, other=0.0).to(tl.float32)
            xb = tl.load(xp + kb, mask=kb < K, other=0.0).to(tl.float32)
            acc += wa * xa + wb * xb
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(y_ptr + p.to(tl.int64) * stride_y + rows, y, mask=row_mask)


def _fail(msg: str):
    raise ValueError(msg)


def _check(x: torch.Tensor, w_raw: torch.Tensor, ggml_type: int, slots: torch.Tensor, n_in: int) -> int:
    """The matrices' row bytes, after checking shapes, types and devices (one line each)."""
    if ggml_type not in SUPPORTED_TYPES:
        _fail(f"grouped_gemv: GGML type {ggml_type} has no kernel (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q4_0 do)")
    name, bv, bb = LAYOUT[ggml_type]
    if n_in <= 0 or n_in % bv:
        _fail(f"grouped_gemv: n_in={n_in} must be a positive multiple of the {name} block ({bv})")
    rb = n_in // bv * bb
    if w_raw.dtype != torch.uint8 or w_raw.dim() != 3 or w_raw.shape[2] != rb or not w_raw.is_contiguous():
        _fail(f"grouped_gemv: w_raw must be contiguous uint8 [S, N, {rb}] for {n_in} values a row, "
              f"got {w_raw.dtype} {tuple(w_raw.shape)}")
    if x.dim() != 2 or x.shape[1] != n_in or x.stride(-1) != 1 or not x.is_floating_point():
        _fail(f"grouped_gemv: x must be float [P, {n_in}] with a unit last stride, got {x.dtype} {tuple(x.shape)}")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0] or slots.dtype not in (torch.int32, torch.int64):
        _fail(f"grouped_gemv: slots must be int [P={x.shape[0]}], got {slots.dtype} {tuple(slots.shape)}")
    if not (x.device == w_raw.device == slots.device):
        _fail(f"grouped_gemv: x, w_raw and slots on one device, got {x.device}, {w_raw.device}, {slots.device}")
    return rb


def grouped_gemv(x: torch.Tensor, w_raw: torch.Tensor, ggml_type: int, slots: torch.Tensor,
                 n_in: int) -> torch.Tensor:
    """y [P, N] float32, y[p] = x[p] @ W[slots[p]]^T, W[s] the s-th [N, n_in] matrix of w_raw
    (uint8 [S, N, row bytes], GGUF blocks). Slots are not range-checked on the device: the caller's
    (the cache's own slot numbers). Raises ValueError on bad inputs."""
    rb = _check(x, w_raw, int(ggml_type), slots, n_in)
    check_device("grouped_gemv", x.device, triton)
    P, N = x.shape[0], w_raw.shape[1]
    y = torch.empty((P, N), dtype=torch.float32, device=x.device)
    if P == 0:
        return y
    G, L = PARTS_SHAPE[int(ggml_type)]
    block_n = 256 if interpreting() else BLOCK_N  # the interpreter pays per program, not per element
    _grouped_gemv_kernel[(triton.cdiv(N, block_n), P)](
        x, w_raw, slots, y, N, n_in, rb, N * rb, x.stride(0), y.stride(0),
        GGML=int(ggml_type), G=G, L=L, BLOCK_N=block_n, num_warps=4)
    return y


def grouped_gemv_ref(x: torch.Tensor, w_raw: torch.Tensor, ggml_type: int, slots: torch.Tensor,
                     n_in: int) -> torch.Tensor:
    """grouped_gemv in plain torch: each slot used dequantized once (float32), its rows multiplied."""
    _check(x, w_raw, int(ggml_type), slots, n_in)
    y = torch.empty((x.shape[0], w_raw.shape[1]), dtype=torch.float32, device=x.device)
    for s in slots.unique().tolist():
        at = (slots == s).nonzero(as_tuple=True)[0]
        W = qdequantize_ref(w_raw[s], int(ggml_type), w_raw.shape[1], n_in, dtype=torch.float32)
        y[at] = x[at].float() @ W.T
    return y


assert set(PARTS_SHAPE) == set(LAYOUT)  # every type the dequantizer reads has its parts' shape
