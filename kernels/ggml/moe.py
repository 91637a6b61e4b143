"""Expert banks for llama.cpp's MoE product, `ggml_mul_mat_id`: a 3-D GGUF tensor [E, n, k] whose
bytes stay the caller's (zero copy), and the product as a one-node graph (`mul_mat_id`) beside
its float64 reference (`mul_mat_id_ref`).

mul_mat_id(bank, x, ids): for every token t and slot j, y[t, j] = x[t, j mod n_x] W_{ids[t, j]}^T.
ggml groups the (token, slot) pairs by expert and multiplies each expert's rows in one pass over
its bytes (activations quantized to the type's vec_dot type, Q8_K or Q8_0, as mul_mat does): a
decode token reads n_used of E experts, a prefill chunk each expert once.

Placement: the GGUF bytes (ggml's plain CPU buffer). llama.cpp itself moves the types of
kernels/ggml/lib.REPACK into its CPU_REPACK layout (a copy of the same size) when the CPU has the
feature; that layout is not used for banks here, so that the file's bytes are held once (the
comparisons with llama.cpp set its `use_extra_bufts` off to run the same placement). Nor is it
faster for mul_mat_id here: a Q4_K bank of the 26B's shape ([128, 1408, 2816], 8 experts a token),
one thread on the 2-core AMD EPYC VM (shared, two runs, 2026-12-03): 1 token 6.1-7.6 ms GGUF
bytes against 7.8-9.3 ms repacked, 4 tokens 24-25 against 34-37, 32 tokens 192-196 against 232-251.
"""
from __future__ import annotations

import numpy as np
import torch

from .graph import Graph
from .lib import TYPES, GGMLError, library


class Bank:
    """[E, n, k] experts of `ggml_type` over `raw` (uint8, the GGUF bytes, 32-byte aligned, kept
    alive here); `node` is the 3-D ggml tensor (ne = k, n, E) a graph binds (`Graph.matrix`)."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int, int]):
        lib = library()
        self.ggml_type, self.shape = int(ggml_type), tuple(int(s) for s in shape)
        E, n, k = self.shape
        if self.ggml_type not in TYPES:
            raise GGMLError(f"ggml type {ggml_type} is not a matrix type this binding multiplies")
        raw = raw.view(torch.uint8).reshape(-1)
        if not raw.is_contiguous() or raw.data_ptr() % 32:
            raise ValueError("an expert bank's bytes must be contiguous and 32-byte aligned")
        if raw.numel() != lib.row_size(self.ggml_type, k) * n * E:
            raise ValueError(f"{TYPES[self.ggml_type]} [{E}, {n}, {k}]: {raw.numel()} bytes, expected "
                             f"{lib.row_size(self.ggml_type, k) * n * E}")
        self.raw, self._lib = raw, lib
        self._ctx = lib.context(1)
        self.node = lib.new_tensor_3d(self._ctx, self.ggml_type, k, n, E)
        self._buffer = lib.buffer_from_ptr(raw.data_ptr(), raw.numel())
        if lib.tensor_alloc(self._buffer, self.node, raw.data_ptr()) != 0:
            raise GGMLError("ggml_backend_tensor_alloc failed for an expert bank")
        self.nbytes = int(raw.numel())

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        try:
            lib.buffer_free(self._buffer)
            lib.free(self._ctx)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone already
            pass


def mul_mat_id(bank: Bank, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x float32 [T, n_x, k] (n_x 1: one row for every slot, or n_used), ids int32 [T, n_used]
    -> float32 [T, n_used, n]: y[t, j] = x[t, j mod n_x] W_{ids[t, j]}^T (one ggml_mul_mat_id)."""
    E, n, k = bank.shape
    T, n_used = ids.shape
    if x.dtype != torch.float32 or x.dim() != 3 or x.shape[0] != T or x.shape[2] != k or not x.is_contiguous():
        raise ValueError(f"mul_mat_id: x must be contiguous float32 [{T}, n_x, {k}], got {x.dtype} {tuple(x.shape)}")
    if ids.dtype != torch.int32 or not ids.is_contiguous() or (T and not 0 <= int(ids.min()) <= int(ids.max()) < E):
        raise ValueError(f"mul_mat_id: ids must be contiguous int32 in [0, {E})")
    g = Graph(8, True)
    y = g.mul_mat_id(g.matrix(bank), g.input(x), g.input(ids))
    g.output(y)
    g.finish()
    out = torch.empty(T, n_used, n)
    g.run([x, ids], [out])
    return out


def mul_mat_id_ref(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int, int], x: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """The reference: each chosen expert's blocks dequantized by gguf-py (ggml's own
    dequantization, bit for bit), times x in float64 -> [T, n_used, n] float64."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    E, n, k = shape
    blocks = raw.contiguous().view(torch.uint8).reshape(E, n, -1).numpy()
    T, n_used = ids.shape
    out = torch.empty(T, n_used, n, dtype=torch.float64)
    for t in range(T):
        for j in range(n_used):
            e = int(ids[t, j])
            w = np.ascontiguousarray(dequantize(blocks[e], GGMLQuantizationType(int(ggml_type))), dtype=np.float64)
            out[t, j] = x[t, j % x.shape[1]].double() @ torch.from_numpy(w).reshape(n, k).t()
    return out
