"""ExpertBank: a 3-D MoE weight [E, out, in] (`ffn_gate_exps`, `ffn_up_exps`, fused
`ffn_gate_up_exps`, `ffn_down_exps`) kept as the GGUF file's bytes, on every runtime.

Why: the 26B-A4B's expert banks are ~96% of its weights. Expanded to float16 they were ~46 GB
against ~16.9 GB of Q4_K/Q5_K/Q6_K bytes in the file, and a token reads only 8 of 128 experts a
layer. So a bank is read once at load, by a file read into one uint8 tensor [E, out, row bytes]
(no float copy of E*out*in values is ever made), and:

- on the ggml runtime the MoE graph (models/gemma4_ggml.py) multiplies it with llama.cpp's
  `ggml_mul_mat_id` over these very bytes (`ggml_bank()`: a 3-D ggml tensor, zero copy; the GGUF
  placement, not ggml's CPU_REPACK copy, so the bytes are held once);
- elsewhere (the cpu_torch fallback, the float reference of `--exact` and the float64 tests, a
  GPU) `bank[e]` is one expert's [out, in] matrix over its byte slice (a view, no copy), which
  dequantizes that expert alone in each product (bit-exact models/quant.py dequantization, then
  x W^T in x's dtype: float64 stays float64).

F32/F16/BF16 banks are held the same way (their bytes are their values).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class _FileBytes:
    """What a weight over GGUF bytes (`raw`, uint8) says of itself: its tensors, bytes, device."""

    raw: torch.Tensor

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.raw,)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device


class ExpertMatrix(_FileBytes):
    """Expert e's [out, in] matrix: `raw` uint8 [out, row bytes], a view into the bank's bytes."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]):
        self.raw, self.ggml_type, self.shape = raw, int(ggml_type), (int(shape[0]), int(shape[1]))

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        """The expert's matrix dequantized (float32 values, exact in float64 too)."""
        from ..quant import dequantize

        return dequantize(self.raw, self.ggml_type, self.shape, dtype=dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x W^T [..., out] in x's dtype (float16/bfloat16 x: a float32 product):
        this expert dequantized for the call (out*in values, ~1.5 M for a 26B-A4B expert). On the
        kernel path (a hot-expert slot on the GPU) the dequantization is one Triton pass over the
        GGUF bytes (kernels/triton/qdequant.py) instead of ~40 torch ops."""
        dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        w = self._kernel_dense(x) if dt == torch.float32 else None
        return F.linear(x.to(dt), self.dense(dt) if w is None else w).to(x.dtype)

    def _kernel_dense(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """float32 W from the Triton dequantization where x and the bytes take the kernels (a GPU, or
        the interpreter's kernels_on_cpu) and the type has one."""
        from kernels.triton.launch import use_kernels
        from kernels.triton.qformats import Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0

        if self.ggml_type not in (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q4_0) or not use_kernels(x, self.raw):
            return None
        from kernels.triton.qdequant import qdequantize

        return qdequantize(self.raw, self.ggml_type, *self.shape, dtype=torch.float32)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        from ..quant import dequantize_rows

        return dequantize_rows(self.raw, self.ggml_type, ids.reshape(-1).long(), self.shape[1])


class ExpertBank(_FileBytes):
    """[E, out, in] experts in the file's bytes (`raw`: uint8 [E, out, row bytes]). `bank[e]` is
    expert e (ExpertMatrix, no copy); `ggml_bank()` the ggml tensor the MoE graph multiplies."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int, int]):
        from ..quant import row_bytes

        self.ggml_type, self.shape = int(ggml_type), tuple(int(s) for s in shape)
        E, n, k = self.shape
        self.raw = raw.reshape(E, n, row_bytes(self.ggml_type, k))
        self._ggml: Optional[object] = None

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int) -> ExpertMatrix:
        return ExpertMatrix(self.raw[int(e)], self.ggml_type, self.shape[1:])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("an expert bank multiplies one expert at a time: bank[e].linear(x)")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("an expert bank has no rows to look up: bank[e].rows(ids)")

    def grouped(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """y [P, out] float32, y[p] = x[p] W[experts[p]]^T for x float32 [P, in]: every pair in one
        Triton launch over the bytes (kernels/triton/qgrouped.py) where x and the bank take the
        kernels (a hot-expert cache on the GPU, or the interpreter's kernels_on_cpu), else each
        expert used multiplied as `bank[e].linear` does it."""
        from kernels.triton.launch import use_kernels
        from kernels.triton.qgrouped import SUPPORTED_TYPES, grouped_gemv

        if self.ggml_type in SUPPORTED_TYPES and use_kernels(x, self.raw, experts):
            return grouped_gemv(x.contiguous(), self.raw.contiguous(), self.ggml_type, experts, self.shape[2])
        y = torch.empty((x.shape[0], self.shape[1]), dtype=torch.float32, device=x.device)
        for e in experts.unique().tolist():
            at = (experts == e).nonzero(as_tuple=True)[0]
            y[at] = self[e].linear(x[at].float())
        return y

    def ggml_bank(self):
        """kernels.ggml.Bank over these bytes (made on first use, zero copy; the ggml runtime only)."""
        if self._ggml is None:
            from kernels import ggml

            if self.raw.data_ptr() % 32:  # ggml's TENSOR_ALIGNMENT; the loader's bytes are aligned already
                self.raw = self.raw.clone()  # torch's allocator aligns to 64 (the bytes stay held once)
            self._ggml = ggml.Bank(self.raw, self.ggml_type, self.shape)
        return self._ggml

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        """All experts dequantized (tests and tools; the runtime never calls it)."""
        return torch.stack([self[e].dense(dtype) for e in range(self.shape[0])])
