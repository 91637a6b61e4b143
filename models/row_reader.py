"""Rows of a GGUF lookup table read from the file on demand.

Why not the memory map: a page fault on a mapped file maps its neighbours too (fault-around, 64 KB)
and starts read-ahead, so gathering 1024 random rows of E2B's per-layer table (7,350 bytes each)
put 1.26 GB of that 1.9 GB table into the process's resident set (measured, 2026-12-01). `os.pread`
copies exactly the rows asked for; the file's pages stay in the page cache, which the kernel
reclaims at will, and out of RSS.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import torch


class RowReader:
    """`rows(ids)` -> uint8 [len(ids), row_bytes]: rows `ids` of a [n_rows, row_bytes] byte matrix
    that starts at `offset` in `path`."""

    def __init__(self, path, offset: int, n_rows: int, row_bytes: int):
        self.path, self.offset, self.n_rows, self.row_bytes = str(path), int(offset), int(n_rows), int(row_bytes)
        self._lock = threading.Lock()  # the seek+read fallback (no os.pread on Windows) shares one handle
        self._file = open(self.path, "rb", buffering=0)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids).reshape(-1).long().cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n_rows):
            raise IndexError(f"row ids outside 0..{self.n_rows - 1}")
        uniq, inverse = torch.unique(ids, return_inverse=True)  # a prompt repeats tokens: read each row once
        out = np.empty((uniq.numel(), self.row_bytes), dtype=np.uint8)
        fd, rb = self._file.fileno(), self.row_bytes
        for j, r in enumerate(uniq.tolist()):
            if self._read(fd, memoryview(out[j]), self.offset + r * rb) != rb:
                raise OSError(f"{self.path}: short read at row {r} (the file changed or is truncated)")
        return torch.from_numpy(out)[inverse]

    def _read(self, fd: int, buf: memoryview, at: int) -> int:
        if hasattr(os, "preadv"):
            return os.preadv(fd, [buf], at)
        with self._lock:
            self._file.seek(at)
            return self._file.readinto(buf)

    def close(self) -> None:
        self._file.close()

    def __getstate__(self):  # picklable (spawned bench children rebuild the handle)
        return {k: v for k, v in self.__dict__.items() if k not in ("_file", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._file = open(self.path, "rb", buffering=0)
