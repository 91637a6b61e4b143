"""The `Weight` protocol: what the model files and the loaders ask of a matrix kept in a runtime
format (models/formats/*.py) instead of a plain tensor.

A model's weight dict holds dense tensors (the float32/float64 reference, norms, scales) and
objects of these formats; `models.ops.linear` and `models.ops.embedding_rows` take either. The
callers use `shape`, `linear(x)` (x W^T in x's dtype for any leading shape) and `rows(ids)`
(embedding lookups, float32); the loaders and benches count bytes through `tensors` / `nbytes`.
The CPU formats also give `dense()` (the whole matrix, for tests and tools; no runtime caller).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

BLOCK_VALUES = 1 << 22  # values per dequantized row block of a prefill GEMM (16 MB of float32)


@runtime_checkable
class Weight(Protocol):
    """An [out, in] matrix (or [E, out, in] experts) in a runtime format."""

    shape: tuple[int, ...]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the bytes (empty where they are not tensors: fbgemm's packed chunks)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes held, all forms together (a matrix kept twice counts twice)."""
        ...

    @property
    def device(self) -> torch.device:
        ...

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x W^T [..., out]."""
        ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` [len, in]."""
        ...
