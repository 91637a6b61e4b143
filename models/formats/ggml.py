"""GGMLWeight: the ggml runtime's form of a GGUF matrix (llama.cpp's kernels, kernels/ggml/lib.py): the
file's bytes, multiplied by ggml's own `mul_mat`.

Why: a decode step reads every weight once; ggml multiplies GGUF blocks by 8-bit-quantized
activations where torch's formats (int4.py, half.py) unpack to float. Measured on the 2-core
AMD EPYC (AVX-512 VNNI/BF16) VM, one thread, CPU time (the VM was shared), 2026-12-01:

| matrix (E2B) | rows | ggml repacked | ggml GGUF bytes | torch format |
| --- | --- | --- | --- | --- |
| Q4_K 12288x1536 (gate/up) | 1 | 0.48 ms | 0.55 | 1.02 (int4pack) |
| | 4 | 1.55 | 2.22 | 1.79 |
| | 16 | 4.21 | 3.46 | 7.19 |
| | 512 | 130 | 72.5 | 129 (bf16 GEMM of dequantized row blocks) |
| Q6_K 1536x6144 (down) | 1 | - | 0.27 | 0.79 (float16) |
| | 512 | - | 49.5 | 107 (float32 GEMM) |

So ggml takes every product, one row or a prefill chunk. For the types ggml repacks on this CPU
(Q4_K, Q4_0, IQ4_NL on AVX2; llama.cpp's own placement), a second copy in the repacked layout
runs products of up to PACKED_ROWS rows (decode, a speculative verify, batched decode) where it
pays, and the GGUF bytes everything else (prefill chunks: 1.8x faster at 512 rows above). That
copy costs memory a user would rather give to context (E2B 0.9 GB, E4B 1.9 GB, 26B-A4B 0.8 GB,
31B 14.2 GB at Q4_K_M), so it is held only where it pays (`keeps_repacked_copies`): on CPUs with
AVX-512, where it was measured faster (table above); on AVX2 alone the GGUF bytes are as fast or
faster at 1 to 4 rows (Q4_K, 2 threads, the 2-core AMD EPYC AVX2 VM, 2026-12-03, ms: [2112, 2816]
1 row 0.34 vs 0.35 repacked, 4 rows 1.11 vs 1.16; [1536, 6144] 1 row 0.49 vs 0.63): the
repacked layout only wins at 8 to 32 rows (8 rows 2.3 against 4.6 ms: ggml's K-quant products
take 8 to 16 rows at the cost of 16, with another kernel, so a split would not be llama.cpp's
bits), which a draft of the default 2 to 4 tokens (3 to 5 rows verified) never reaches.
Other types (Q6_K, Q5_K, Q8_0, Q5_0, ..., and the dense F32/F16/BF16 matrices) are only the GGUF
bytes, zero copy.
Memory: the file's bytes (Q6_K: 0.82 bytes a weight, against float16's 2).
"""
from __future__ import annotations

from typing import Optional

import torch

PACKED_ROWS = 8  # rows up to which the repacked layout runs (crossover measured between 4 and 16)
REPACK_SHARE = 0.25  # most of the memory free at load the repacked copies may take
HUGE_SHARE = 0.5  # most of the memory free at load the 2 MB-page copies may take


def keeps_repacked_copies(copy_bytes: int, free_bytes: Optional[int] = None) -> bool:
    """Whether the matrices ggml repacks also get the repacked copy (module doc): where the CPU
    has AVX-512 and the copies (`copy_bytes` in all) take at most REPACK_SHARE of the memory free
    now (`free_bytes`; a 31B's 14 GB of copies never). EDGEGEM_CPU_REPACK=on|off decides instead."""
    import os

    from kernels import ggml
    from kernels.env import env

    if env().cpu_repack != "auto":
        return env().cpu_repack == "on"
    if not ggml.cpu_features().get("avx512"):
        return False
    if free_bytes is None:
        free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return copy_bytes <= REPACK_SHARE * free_bytes


def keeps_huge_pages(copy_bytes: int, free_bytes: Optional[int] = None) -> bool:
    """Whether the model's ggml matrices (`copy_bytes` in all) are copied into 2 MB pages at load
    (kernels/ggml/pages.py: ~5% faster decode products on the AVX2 VM): where the kernel gives
    huge pages (THP always or madvise) and the copies take at most HUGE_SHARE of the memory free
    now (MemAvailable). Anonymous copies cannot be dropped and re-read from the file under
    pressure as the map's pages can, so a model near the machine's memory stays mapped (a 31B on
    24 GB). EDGEGEM_CPU_HUGEPAGES=on|off decides instead (on: copied even where THP is off)."""
    from kernels.env import env
    from kernels.ggml import pages

    if env().cpu_hugepages != "auto":
        return env().cpu_hugepages == "on"
    if not pages.available():
        return False
    if free_bytes is None:  # MemAvailable: the page cache the copies may take back counts as free
        free_bytes = pages.available_bytes()
    return copy_bytes <= HUGE_SHARE * free_bytes


def describe_huge_pages(setting: str) -> str:
    """One line for `doctor`, `info` and the benches: where the ggml matrices' bytes live under
    EDGEGEM_CPU_HUGEPAGES=`setting` (`keeps_huge_pages`)."""
    from kernels.ggml import pages

    mode = pages.thp_mode()
    if setting == "off":
        return "weights mapped (4 KB pages: EDGEGEM_CPU_HUGEPAGES=off)"
    if setting == "on":
        return f"weights in 2 MB pages (forced; THP {mode})"
    if not pages.available():
        return f"weights mapped (4 KB pages: THP {mode})"
    return f"weights in 2 MB pages where they take at most {HUGE_SHARE:.0%} of the available memory (THP {mode})"


def takes(ggml_type: int, shape) -> bool:
    """A 2-D matrix this form holds (on the ggml runtime): every GGUF matrix type ggml multiplies,
    the dense F32/F16/BF16 ones too, so that each product is llama.cpp's (a float16 copy of an F32
    `per_layer_model_proj` alone moved tiny models' activations 1e-3 off llama.cpp's)."""
    from kernels import ggml

    return shape is not None and len(shape) == 2 and ggml.supported(ggml_type)


def is_ggml(*weights) -> bool:
    """Every one of `weights` is a GGMLWeight: a product of it runs on llama.cpp's kernels
    (`matrix_for`). The one question the ggml chains (models/ops.py, models/gemma3_ggml.py) ask of a
    weight on the ggml runtime: its lookup tables stay QuantWeight rows, and a matrix of a type ggml
    lacks stays in a torch format, so the runtime alone does not say it (a layout, not a runtime)."""
    return bool(weights) and all(isinstance(w, GGMLWeight) for w in weights)


class GGMLWeight:
    """A [out, in] GGUF matrix (`raw`: uint8 [out, row bytes]) multiplied by ggml (module doc).
    `.linear(x)` -> x W^T in x's dtype for any leading shape; `.rows(ids)` dequantizes rows."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int],
                 repacked_copy: Optional[bool] = None):
        from kernels import ggml

        self.ggml_type, self.shape = int(ggml_type), (int(shape[0]), int(shape[1]))
        self.plain = ggml.Matrix(raw, self.ggml_type, self.shape, repack=False)  # holds the bytes
        self.repacked: Optional[object] = None
        if repacked_copy is None:  # one matrix on its own (the loader decides for a whole model)
            repacked_copy = keeps_repacked_copies(self.plain.nbytes)
        if repacked_copy and ggml.repacks(self.ggml_type, self.shape[0]):
            self.repacked = ggml.Matrix(self.plain.raw, self.ggml_type, self.shape, repack=True)

    @property
    def raw(self) -> torch.Tensor:
        return self.plain.raw.view(self.shape[0], -1)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.plain.raw,)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return self.plain.nbytes + (self.repacked.nbytes if self.repacked is not None else 0)

    def matrix_for(self, rows: int):
        """The kernels.ggml.Matrix a product of `rows` rows runs on (module doc: PACKED_ROWS)."""
        return self.repacked if self.repacked is not None and rows <= PACKED_ROWS else self.plain

    def linear(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., in] -> [..., out]. float32 contiguous x (the CPU path's activations) goes in as
        it is; `out` (float32 [rows, out]) receives the product when given."""
        n, k = self.shape
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        y = self.matrix_for(x2.shape[0]).mul(x2, out)
        return (y if x.dtype == torch.float32 else y.to(x.dtype)).reshape(*x.shape[:-1], n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` [len, in] from the GGUF bytes."""
        from ..quant import dequantize_rows

        return dequantize_rows(self.raw, self.ggml_type, ids.reshape(-1).long(), self.shape[1])

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        """The whole matrix (tests and tools; the runtime never calls it)."""
        from ..quant import dequantize

        return dequantize(self.raw, self.ggml_type, self.shape).to(dtype)
