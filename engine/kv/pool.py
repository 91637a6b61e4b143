"""Hybrid KV pools: a full-attention pool and a sliding-window pool of token-granular slots.

Each pool holds one slab (K and V, plus per-token-head scales for 8-bit formats) per KV-owning
layer of its attention type. KV-shared layers own nothing: they read their source layer's slab,
found through `config.kv_shared_layers` (via `kv_source`), the same list attention reads. A slot
is one token of one sequence in every slab of its pool ("pages of size 1").

Beside a GPU, the slabs of the layers the CPU computes (`host_layers`: whole layers in host RAM,
models/host_layers.py) are host memory in the same format; a slot still names one token in every
slab of its pool, whichever side holds the slab.

`share_kv=False` is a debug mode: every layer gets its own slab and a source layer's K/V are also
copied into the slabs of the layers that share it, so tests can check the mapping changes nothing.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .format import KVFormat, owning_layers


class KVPoolFull(RuntimeError):
    """No free slots left in a pool (the scheduler evicts cached prefixes or waits)."""


def _dims(cfg, layer: int) -> tuple[int, int]:
    n_kv, hd = cfg.n_kv_head, cfg.head_dim
    return (n_kv[layer] if isinstance(n_kv, (tuple, list)) else n_kv,
            hd[layer] if isinstance(hd, (tuple, list)) else hd)


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed slab. On the CPU through numpy's calloc: the OS hands out zero pages as slots are
    first written, so a 65,536-token pool costs RAM only for the tokens used (torch.zeros writes
    every byte: ~1 GB of E2B's default CPU pools resident at once)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    same_size = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[torch.empty(0, dtype=dtype).element_size()]
    return torch.from_numpy(np.zeros(shape, dtype=same_size)).view(dtype)


class KVPool:
    """Slabs of one attention type. k[layer]: [capacity, n_kv, hd] in the format's value dtype, on
    `device`, or in host memory for the `host_layers` (the CPU's layers beside a GPU)."""

    def __init__(self, name: str, layer_dims: dict[int, tuple[int, int]], capacity: int, fmt: KVFormat,
                 device="cpu", host_layers=frozenset()):
        self.name, self.fmt, self.capacity, self.device = name, fmt, int(capacity), torch.device(device)
        self.layers = sorted(layer_dims)
        self.host_layers = frozenset(i for i in host_layers if i in layer_dims)
        where = {i: torch.device("cpu") if i in self.host_layers else self.device for i in self.layers}
        cap = self.capacity if self.layers else 0
        self.k = {i: _zeros((cap, *layer_dims[i]), fmt.value_dtype, where[i]) for i in self.layers}
        self.v = {i: _zeros(tuple(self.k[i].shape), fmt.value_dtype, where[i]) for i in self.layers}
        self.k_scale = self.v_scale = None
        if fmt.scaled:
            self.k_scale = {i: torch.zeros((cap, layer_dims[i][0]), device=where[i]) for i in self.layers}
            self.v_scale = {i: torch.zeros_like(self.k_scale[i]) for i in self.layers}
        self.unit_bytes = sum(fmt.unit_bytes(*layer_dims[i]) for i in self.layers)
        # Free slots, in a structure whose cost does not grow with the capacity: the never-used
        # slots are the range [_fresh, capacity); freed slots (all below _fresh) sit ascending in
        # _freed[_lo:_top] (int64 [capacity], pages touched only as slots are freed). A sequence
        # takes the lowest free slots above its own (`alloc`), so its slots ascend with its
        # positions until the pool nears full: attention reads a slab in slot order, and ggml's online
        # softmax (and a sum over slot runs) rounds by that order, so a request computed afresh
        # repeats bit for bit whatever ran before (llama.cpp's `cache_prompt: false`), and a
        # cached prefix extends in order. (A Python list of every slot cost ~36 bytes a slot:
        # 0.8 GB of host RAM and about a second for a 21.4M-slot pool, again at every rebuild.)
        self._fresh = 0
        self._freed = torch.empty(self.capacity, dtype=torch.long)
        self._lo = self._top = 0

    # --- accounting -----------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        return self.capacity - self._fresh + self._top - self._lo

    @property
    def n_used(self) -> int:
        return self.capacity - self.n_free

    def alloc(self, n: int, above: int = -1) -> torch.Tensor:
        """n free slots (int64 [n], CPU, ascending): the lowest free ones above `above` (a
        sequence's latest slot, one handed out before, so its slots keep ascending with its
        positions: the comment in __init__), or, where fewer are free above it (a pool near
        full), the lowest free ones."""
        if n > self.n_free:
            raise KVPoolFull(f"{self.name} KV pool: {n} slots wanted, {self.n_free} free of {self.capacity}")
        freed = self._freed[self._lo:self._top]
        i = int(torch.searchsorted(freed, above, right=True)) if above >= 0 and freed.numel() else 0
        if freed.numel() - i + self.capacity - self._fresh < n:
            i = 0
        reused = min(n, freed.numel() - i)
        out = freed[i:i + reused].clone()
        if i == 0:
            self._lo += reused
        elif reused:  # taken from the middle: the ones above move down (few: those freed above)
            freed[i:freed.numel() - reused] = freed[i + reused:].clone()
            self._top -= reused
        if self._lo == self._top:
            self._lo = self._top = 0
        if n > reused:
            fresh = torch.arange(self._fresh, self._fresh + n - reused)
            self._fresh += n - reused
            out = torch.cat([out, fresh]) if reused else fresh
        return out

    def free(self, slots) -> None:
        """Give slots back (negative entries, "no slot", are skipped)."""
        s = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
        s = s[s >= 0]
        if s.numel() > self.n_used:  # a double free would hand one slot to two sequences
            raise RuntimeError(f"{self.name} KV pool: {s.numel()} slots freed, only {self.n_used} in use")
        if not s.numel():
            return
        # merged into the ascending freed slots, kept at the front: numpy's insert at the searched
        # places copies each held slot once (10M held: ~24 ms, where a sort of both took ~1 s)
        held = self._freed[self._lo:self._top].numpy()
        new = s.sort().values.numpy()
        merged = torch.from_numpy(np.insert(held, np.searchsorted(held, new), new))
        self._freed[:merged.numel()] = merged
        self._lo, self._top = 0, merged.numel()

    def free_slots(self) -> torch.Tensor:
        """Every free slot (int64, CPU, ascending): consistency checks and tests."""
        return torch.cat([self._freed[self._lo:self._top], torch.arange(self._fresh, self.capacity)])

    # --- data ------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, n_kv, hd] at slots [T] of `layer`'s slab (quantizing 8-bit formats)."""
        s = slots.to(self.k[layer].device)
        kq, ks = self.fmt.quantize(k)
        vq, vs = self.fmt.quantize(v)
        self.k[layer][s] = kq
        self.v[layer][s] = vq
        if self.fmt.scaled:
            self.k_scale[layer][s] = ks
            self.v_scale[layer][s] = vs

    def read(self, layer: int, slots: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [S, n_kv, hd] in `dtype` gathered from slots [S] (on the slab's device)."""
        s = slots.to(self.k[layer].device)
        ks = self.k_scale[layer][s] if self.fmt.scaled else None
        vs = self.v_scale[layer][s] if self.fmt.scaled else None
        return (self.fmt.dequantize(self.k[layer][s], ks, dtype),
                self.fmt.dequantize(self.v[layer][s], vs, dtype))

    def status(self) -> dict:
        return {"format": self.fmt.name, "capacity": self.capacity, "used": self.n_used, "free": self.n_free,
                "unit_bytes": self.unit_bytes, "slabs": len(self.layers), "host_slabs": len(self.host_layers)}


class HybridKVPool:
    """The full pool and the window pool of one model, and the layer -> slab mapping."""

    def __init__(self, cfg, full_tokens: int, window_tokens: int, fmt: KVFormat,
                 swa_fmt: Optional[KVFormat] = None, device="cpu", share_kv: bool = True, host_layers=()):
        self.cfg, self.share_kv = cfg, share_kv
        # the slabs (slab layers, `slab`) the CPU reads beside a GPU: those of its whole layers
        self.host_layers = frozenset(host_layers)
        full_layers = owning_layers(cfg, sliding=False, share_kv=share_kv)
        win_layers = owning_layers(cfg, sliding=True, share_kv=share_kv)
        self.full = KVPool("full", {i: _dims(cfg, i) for i in full_layers}, full_tokens, fmt, device,
                           self.host_layers)
        self.window = KVPool("window", {i: _dims(cfg, i) for i in win_layers}, window_tokens,
                             swa_fmt or fmt, device, self.host_layers)
        # Debug mode: source layer -> the shared layers that keep a copy of its K/V.
        self.copies: dict[int, list[int]] = {}
        if not share_kv:
            for layer, src in cfg.kv_shared_layers:
                self.copies.setdefault(src, []).append(layer)

    @property
    def n_slabs(self) -> int:
        return len(self.full.layers) + len(self.window.layers)

    def slab(self, layer: int) -> int:
        """The slab `layer` attends over: its KV source when sharing, else its own."""
        return self.cfg.kv_source(layer) if self.share_kv else layer

    def pool_of(self, layer: int) -> KVPool:
        return self.window if self.cfg.is_sliding[layer] else self.full

    def targets(self, layer: int, full_slots: torch.Tensor, win_slots: torch.Tensor) -> list:
        """(pool, slab layer, slots) of every slab `layer`'s K/V go to: its own, plus in the debug
        mode the layers keeping copies of it."""
        out = []
        for target in [layer] + self.copies.get(layer, []):
            pool = self.pool_of(target)
            out.append((pool, target, win_slots if pool is self.window else full_slots))
        return out

    def write(self, layer: int, full_slots: torch.Tensor, win_slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, store=None) -> None:
        """K/V of `layer` (and, in the debug mode, of the layers keeping copies of it); `store(pool,
        layer, slots, k, v)` is the attention backend's writer (default: the pool's own)."""
        for pool, target, slots in self.targets(layer, full_slots, win_slots):
            if store is None:
                pool.write(target, slots, k, v)
            else:
                store(pool, target, slots, k, v)

    def slab_target(self, layer: int, full_slots: torch.Tensor, win_slots: torch.Tensor):
        """models.kv_cache.SlabTarget of `layer`'s one slab (slots moved to its device), or None in
        the debug mode where its K/V go to several slabs (the caller then uses `write`)."""
        from models.kv_cache import SlabTarget

        targets = self.targets(layer, full_slots, win_slots)
        if len(targets) != 1:
            return None
        pool, target, slots = targets[0]
        scaled = pool.fmt.scaled
        return SlabTarget(pool.k[target], pool.v[target], pool.k_scale[target] if scaled else None,
                          pool.v_scale[target] if scaled else None, slots.to(pool.device))

    def status(self) -> dict:
        return {"full": self.full.status(), "window": self.window.status(), "share_kv": self.share_kv}
