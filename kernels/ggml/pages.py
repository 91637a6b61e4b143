"""Weight bytes in 2 MB pages: the matrices ggml's CPU products stream through every decode token,
copied at load into anonymous memory that Linux backs with transparent huge pages.

Why: a decode token reads every matrix once, front to back (E2B: ~1.4 GB a token). Mapped from the
GGUF file, or copied by torch's allocator, those bytes sit in 4 KB pages: one TLB entry per 4 KB,
~350,000 page walks a token. In 2 MB pages the same reads take 512 times fewer, and the products
run faster: all of E2B's layer matrices multiplied by one row, best of 12 alternating rounds on
the 2-core AVX2 VM (docs/benchmarks.md): 54-57 ms from 2 MB pages against 57-60 ms from the map
or from 4 KB anonymous pages (~5%). llama.cpp maps its files (4 KB pages) by default.

How: an `Arena` hands out 64-byte-aligned pieces of chunks (at least CHUNK bytes, 2 MB-aligned)
that it maps anonymously and marks `madvise(MADV_HUGEPAGE)`; the kernel then backs each touched
2 MB stretch with one huge page where it has one free (else 4 KB pages: same bytes, no gain).
A piece is a uint8 torch tensor whose storage keeps its chunk mapped: a model's weights free
their chunks when the model goes. The cost: the bytes are copied once at load (~0.3 s a GB) and,
being anonymous, cannot be dropped and re-read from the file under memory pressure, so the
loader asks the policy first (models/formats/ggml.py `keeps_huge_pages`: only while the copies
take at most half of the available memory).

`thp_mode()` reads the kernel's setting: "always" and "madvise" give huge pages to these chunks,
"never" (or a system without the file) none: no chunks are made then.
"""
from __future__ import annotations

import mmap
import sys
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import torch

HUGE = 2 << 20     # the x86-64 (and arm64 4K-granule) transparent huge page
CHUNK = 64 << 20   # the least an arena maps at a time
ALIGN = 64         # a piece's start: ggml wants 32 (TENSOR_ALIGNMENT), torch's allocator gives 64
THP_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_FILE) -> str:
    """The kernel's transparent huge page mode: "always", "madvise" or "never" ("never" where the
    file is missing: not Linux, or a kernel without THP)."""
    try:
        text = path.read_text()
    except OSError:
        return "never"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "never"


def available() -> bool:
    """Whether chunks marked for huge pages can get them here (Linux, THP always or madvise)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def available_bytes() -> int:
    """Memory the kernel could hand out now (/proc/meminfo MemAvailable: free pages and the page
    cache it can drop); MemFree's sysconf figure where that file is missing."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Arena:
    """Pieces of 2 MB-page chunks (module doc). `copy(t)` -> a uint8 tensor in a chunk holding t's
    bytes; `bytes_held` counts the pieces handed out. Thread-safe (a loader may run in a thread)."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = -(-chunk // HUGE) * HUGE
        self._lock = threading.Lock()
        self._free: Optional[np.ndarray] = None  # the open chunk's unused tail (2 MB-aligned start)
        self.bytes_held = 0
        self.chunks = 0

    def _new_chunk(self, n_bytes: int) -> np.ndarray:
        size = max(self.chunk, -(-n_bytes // HUGE) * HUGE)
        if hasattr(mmap, "MAP_ANONYMOUS") and hasattr(mmap, "MADV_HUGEPAGE"):
            m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then take whole 2 MB pages
            whole = np.frombuffer(m, dtype=np.uint8)  # holds m open while any view of it lives
        else:  # no such mapping here (macOS, Windows: EDGEGEM_CPU_HUGEPAGES=on): same bytes, small pages
            whole = np.empty(size + HUGE, dtype=np.uint8)
        skip = (-whole.ctypes.data) % HUGE
        self.chunks += 1
        return whole[skip:skip + size]

    def empty(self, n_bytes: int) -> torch.Tensor:
        """An uninitialized uint8 tensor of n_bytes in a chunk (64-byte aligned)."""
        n = int(n_bytes)
        with self._lock:
            free = self._free
            if free is None or free.size < n:
                free = self._new_chunk(n)
            piece, rest = free[:n], free[-(-n // ALIGN) * ALIGN:]
            self._free = rest if rest.size >= ALIGN else None
            self.bytes_held += n
        return torch.from_numpy(piece)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """t's bytes (any dtype, contiguous or not) in a chunk, as a flat uint8 tensor."""
        src = t.contiguous().view(torch.uint8).reshape(-1)
        out = self.empty(src.numel())
        out.copy_(src)
        return out
