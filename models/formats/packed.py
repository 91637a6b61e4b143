"""QuantWeight: a GGUF matrix kept quantized on its device for the Triton kernels (the triton
runtime), or an embedding table kept in its GGUF rows (`lookup`: host tables, the CPU runtimes'
lookup-only tables).

Why: a decode step reads every weight once; the packed planes (kernels/triton/qpack.py: GGUF bytes
regrouped for wide GEMV loads, the same byte count) are read once per call by kernels.triton.qmatmul, and
a table only gathered from never needs more than the rows it is asked for.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import runtime


class QuantWeight:
    """A matrix kept quantized on its device.

    Matrices that are multiplied hold the repacked planes (`packed`, kernels/triton/qpack.py: GGUF bytes
    regrouped for wide GEMV loads, the same byte count); `.linear(x)` runs `kernels.triton.qmatmul`, which
    reads each weight byte once per call. Embedding tables that are only looked up (`lookup=True`:
    the host tables of `--embed-weights host`) keep the GGUF bytes (`raw`), so a gather moves
    whole GGUF rows. `.rows(ids)` dequantizes only the requested rows from either form."""

    TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"})  # what qmatmul handles

    def __init__(self, raw: Optional[torch.Tensor], ggml_type: int, shape: tuple[int, int], lookup: bool = False,
                 packed=None):
        from kernels.triton.qpack import pack

        self.ggml_type, self.shape = int(ggml_type), tuple(shape)
        self.interleaved = False  # rows (gate_0, up_0, gate_1, ...): multiplied through `glu`
        self.reader = None  # a models.row_reader.RowReader: lookup rows read from the file, not the map
        if packed is not None:
            self.raw, self.packed = None, packed
        elif lookup:
            self.raw, self.packed = raw.contiguous(), None
        else:
            self.raw, self.packed = None, pack(raw.contiguous(), self.ggml_type, self.shape)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the bytes (the planes, or the GGUF rows of a lookup table)."""
        return (self.raw,) if self.packed is None else self.packed.planes

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def linear(self, x: torch.Tensor, gelu_mul: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x W^T; with `gelu_mul` (same leading shape, n_out wide) gelu_tanh(x W^T) * gelu_mul, the
        epilogue fused into the GEMV."""
        from kernels.triton.qmatmul import qmatmul

        if self.packed is None:
            raise ValueError(f"QuantWeight {self.shape}: a lookup table cannot be multiplied")
        return qmatmul(x, self.packed, gelu_mul=gelu_mul)

    def glu(self, x: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(x G^T) * (x U^T) [..., n_out / 2] for an interleaved gate/up matrix (`interleave`):
        the GEMV's GLU epilogue, one launch for Gemma's gate, up and activation."""
        from kernels.triton.qmatmul import qmatmul

        if not self.interleaved:
            raise ValueError(f"QuantWeight {self.shape}: glu needs interleaved gate/up rows")
        return qmatmul(x, self.packed, glu=True)

    def interleave(self) -> "QuantWeight":
        """A stacked [gate; up] matrix with its rows interleaved for `glu`."""
        w = QuantWeight(None, self.ggml_type, self.shape, packed=self.packed.interleave_rows())
        w.interleaved = True
        return w

    @classmethod
    def cat(cls, ws: list["QuantWeight"]) -> "QuantWeight":
        """The rows of several matrices of one type and input width stacked into one (q/k/v or
        gate/up fused at load: one GEMV launch instead of several)."""
        from kernels.triton.qpack import PackedQuant

        t, n_in = ws[0].ggml_type, ws[0].shape[1]
        if any(w.ggml_type != t or w.shape[1] != n_in or w.packed is None for w in ws):
            raise ValueError("QuantWeight.cat: matrices of different types or input widths, or lookup tables")
        p = PackedQuant.cat([w.packed for w in ws])
        return cls(None, t, p.shape, packed=p)

    def raw_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The GGUF bytes of rows `ids` [n, row_bytes] of a lookup table (read from the file when it
        has a reader: no mapped page joins the resident set)."""
        if self.reader is not None:
            return self.reader.rows(ids)
        return self.raw.index_select(0, ids.to(self.raw.device))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` [n, n_in] (on the table's device)."""
        if self.packed is None:
            from ..quant import dequantize

            sel = self.raw_rows(ids.reshape(-1))
            if sel.device.type == "cpu" and runtime.ggml_available():  # ggml's dequantization: bit-exact, one pass
                from kernels.ggml.ops import dequantize_rows

                return dequantize_rows(sel, self.ggml_type, self.shape[1])
            return dequantize(sel, self.ggml_type, (sel.shape[0], self.shape[1]))
        from kernels.triton.launch import use_kernels
        from kernels.triton.qpack import dequantize_packed_ref

        picked = self.packed.rows(ids)
        if use_kernels(picked.q):
            from kernels.triton.qmatmul import qdequantize_packed

            return qdequantize_packed(picked, torch.float32)
        return dequantize_packed_ref(picked)
