"""HalfWeight: a dense matrix kept in float16 (the CPU and older-GPU runtime format of what stays
dense: F16/BF16/F32 matrices, safetensors checkpoints, and on the CPU the 5- to 8-bit GGUF types).

Why: a float16 GEMV up to GEMV_ROWS rows (inputs rounded to float16, float32 accumulation, ~5e-4
relative error) reads half the bytes of float32; larger batches (prefill) upcast row blocks into a
reused float32 buffer for the float32 GEMM (float16 GEMMs are 5x slower than float32 on AVX2),
never the whole matrix per call. A float16 output out of range is inf: the model's per-step check
(models/decoder.py, FiniteWatch) reports it with the layer, rather than each matmul checking and
recomputing in float32 (that check once turned a model whose activations went non-finite into a
silent 10x slower path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BLOCK_VALUES

GEMV_ROWS = 16
_upcast: dict = {}  # numel -> the reused float32 buffer of HalfWeight's prefill blocks


class HalfWeight:
    """A [out, in] matrix kept in float16; `.linear(x)` and `.rows(ids)` return x's dtype."""

    def __init__(self, w: torch.Tensor):
        self.w = w.to(torch.float16).contiguous()
        self.shape = tuple(self.w.shape)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w,)

    @property
    def device(self) -> torch.device:
        return self.w.device

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= GEMV_ROWS or self.w.dim() != 2:
            return F.linear(x.to(torch.float16), self.w).to(x.dtype)
        n, k = self.shape
        step = max(1, min(n, BLOCK_VALUES // k))
        if step * k not in _upcast:
            _upcast.clear()
            with torch.inference_mode(False):  # writable under no_grad and inference_mode alike
                _upcast[step * k] = torch.empty(step * k, dtype=torch.float32)
        buf, x2 = _upcast[step * k], x.reshape(-1, k).float()
        out = torch.empty(x2.shape[0], n, dtype=torch.float32)
        for r0 in range(0, n, step):
            r1 = min(r0 + step, n)
            w = buf[:(r1 - r0) * k].view(r1 - r0, k).copy_(self.w[r0:r1])
            out[:, r0:r1] = torch.mm(x2, w.t())
        return out.to(x.dtype).reshape(*x.shape[:-1], n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.index_select(0, ids.to(self.w.device)).float()

    def __getitem__(self, idx) -> "HalfWeight":
        """Expert slices of 3-D MoE weights [E, out, in] stay in float16."""
        return HalfWeight(self.w[idx])

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        return self.w.to(dtype)
