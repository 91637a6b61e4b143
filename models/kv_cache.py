"""The KV store protocol a model's attention writes and reads through, and the dense per-sequence
cache (`score`, `run`, tests); the engine supplies pooled stores with the same methods."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Protocol

import torch


class SlabTarget(NamedTuple):
    """Where one layer's K/V rows of this forward go in a pooled cache, for kernels that store them
    themselves (kernels/triton/qkv.py): slabs [capacity, n_kv, hd], per-token-head fp32 scales [capacity,
    n_kv] for 8-bit slabs (else None), and the slot of each row [T] on the slabs' device (< 0:
    write nothing)."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: Optional[torch.Tensor]
    v_scale: Optional[torch.Tensor]
    slots: torch.Tensor


class KVStore(Protocol):
    """What a model's attention needs from a KV cache (the engine supplies pooled ones).

    A pooled cache may also offer `slab_target(layer) -> SlabTarget | None`: the models' kernel
    path then stores K/V straight into the slabs in the launch that norms them, instead of calling
    `write`."""

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k [S, n_kv, hd], v [S, n_kv, hd], positions [S]) of one layer."""
        ...


class DenseKVCache:
    """Contiguous per-layer KV for one sequence, grown by doubling; for `score`, `run` and tests.

    Only layers that are written get storage, so KV-shared layers cost nothing here either.
    """

    def __init__(self) -> None:
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._pos: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = self._len.get(layer, 0)
        T = k.shape[0]
        if layer not in self._k or n + T > self._k[layer].shape[0]:
            cap = max(64, 2 ** math.ceil(math.log2(n + T)))
            newk = k.new_empty((cap,) + tuple(k.shape[1:]))
            newv = v.new_empty((cap,) + tuple(v.shape[1:]))
            newp = torch.empty(cap, dtype=torch.long, device=k.device)
            if n:
                newk[:n], newv[:n], newp[:n] = self._k[layer][:n], self._v[layer][:n], self._pos[layer][:n]
            self._k[layer], self._v[layer], self._pos[layer] = newk, newv, newp
        self._k[layer][n:n + T] = k
        self._v[layer][n:n + T] = v
        self._pos[layer][n:n + T] = pos
        self._len[layer] = n + T

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self._len[layer]
        return self._k[layer][:n], self._v[layer][:n], self._pos[layer][:n]

    def truncate(self, n_tokens: int) -> None:
        """Drop every position >= n_tokens (positions are written in order)."""
        for layer in self._len:
            self._len[layer] = min(self._len[layer], n_tokens)

    def __len__(self) -> int:
        return max(self._len.values(), default=0)
