"""Hot experts in spare GPU memory: per MoE layer whose banks stay in host RAM, a few expert slots
on the device holding copies of the experts the router picks most (least recently used out).

A slot is one expert of one layer: its rows of every bank of that layer (gate/up or gate and up,
and down), the file's quantized bytes, 4.1 MiB on the 26B-A4B. The memory plan sizes the cache
(`expert_cache_bytes`, engine/memory_plan.py); `slots_per_layer` spreads it evenly over the host
layers. At each MoE block the chosen (token, expert) pairs split into hits, computed on the GPU over
the slots (`bank(layer, j)` is an ExpertBank over them, so the same product code runs), and misses,
computed by the CPU from the host banks; the two partial sums are added.

Filling happens *after* a block's products (`admit`), so a step's split never depends on copies it
is itself waiting for: on CUDA the copies go on a stream of their own and the next use of the layer
waits for them (an event per layer); elsewhere (the CPU, the interpreter's tests) they are plain
copies. An expert is admitted after `admit_after` misses (1: every miss; higher keeps one-off
picks from evicting steady ones); the least recently used slot makes room.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .formats import ExpertBank


@dataclass
class CacheStats:
    lookups: int = 0  # (token, expert) pairs routed through cached layers
    hits: int = 0
    copies: int = 0  # experts copied in
    per_layer: dict = field(default_factory=dict)  # layer -> [lookups, hits]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class _Layer:
    def __init__(self, banks: Sequence[ExpertBank], slots: int, device: torch.device):
        self.host = list(banks)
        self.slots = slots
        # device copies: per bank [slots, out, row bytes] uint8, the same layout as the bank's experts
        self.dev = [torch.empty((slots, *b.raw.shape[1:]), dtype=torch.uint8, device=device) for b in banks]
        self.banks = [ExpertBank(d, b.ggml_type, (slots, *b.shape[1:])) for d, b in zip(self.dev, banks)]
        self.where: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self.misses: dict[int, int] = {}
        self.ready = None  # CUDA event of the last fill


class ExpertCache:
    """`banks`: {layer: [its ExpertBanks in host memory]}; `slots_per_layer` experts cached per layer."""

    def __init__(self, banks: dict[int, Sequence[ExpertBank]], slots_per_layer: int, device="cpu",
                 admit_after: int = 1):
        if slots_per_layer < 0:
            raise ValueError(f"expert cache slots must be 0 or more, not {slots_per_layer}")
        self.device = torch.device(device)
        n_expert = {b.shape[0] for bs in banks.values() for b in bs}
        self.slots = min(slots_per_layer, min(n_expert) if n_expert else 0)
        self.layers = {i: _Layer(bs, self.slots, self.device) for i, bs in banks.items()} if self.slots else {}
        self.admit_after = max(1, admit_after)
        self.stats = CacheStats()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and self.layers else None

    @staticmethod
    def slots_for(cache_bytes: int, slot_bytes: int, n_layers: int) -> int:
        """The plan's bytes as slots per layer (even split, whole slots)."""
        return cache_bytes // max(slot_bytes, 1) // max(n_layers, 1)

    def covers(self, layer: int) -> bool:
        return layer in self.layers

    def split(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T, k] (the router's picks) -> (hit [T, k] bool, slot [T, k] long: the slot of a hit,
        0 elsewhere). Marks the hits most recently used and counts the lookups."""
        L = self.layers[layer]
        if L.ready is not None:  # this layer's last fill is on the device before its slots are read
            torch.cuda.current_stream(self.device).wait_event(L.ready)
            L.ready = None
        table = torch.full((L.host[0].shape[0],), -1, dtype=torch.long)
        for e, s in L.where.items():
            table[e] = s
        slot = table[ids.cpu().long()]  # the host's copy of the picks (no wait on a host tensor)
        hit = slot >= 0
        for e in ids.cpu()[hit].unique().tolist():
            L.where.move_to_end(int(e))
        n, h = ids.numel(), int(hit.sum())
        self.stats.lookups += n
        self.stats.hits += h
        row = self.stats.per_layer.setdefault(layer, [0, 0])
        row[0] += n
        row[1] += h
        return hit.to(ids.device), slot.clamp(min=0).to(ids.device)

    def bank(self, layer: int, j: int) -> ExpertBank:
        """Bank j of the layer over its device slots (expert s of it = slot s)."""
        return self.layers[layer].banks[j]

    def admit(self, layer: int, ids: torch.Tensor, hit: torch.Tensor) -> list[int]:
        """After the block: copy in the missed experts that earned a slot (admit_after misses),
        evicting the least recently used; returns the experts copied."""
        L = self.layers[layer]
        want = []
        for e in ids[~hit].unique().tolist():
            L.misses[e] = L.misses.get(e, 0) + 1
            if L.misses[e] >= self.admit_after:
                want.append(int(e))
        want = want[:L.slots]
        if not want:
            return []
        stream = self._stream
        ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
        with ctx:
            for e in want:
                if len(L.where) < L.slots:
                    s = len(L.where)
                else:
                    _, s = L.where.popitem(last=False)
                for d, b in zip(L.dev, L.host):
                    d[s].copy_(b.raw[e], non_blocking=stream is not None)
                L.where[e] = s
                L.misses.pop(e, None)
        if stream is not None:
            L.ready = torch.cuda.Event()
            L.ready.record(stream)
        self.stats.copies += len(want)
        return want

    def cached(self, layer: int) -> dict[int, int]:
        """{expert: slot} held for the layer now."""
        return dict(self.layers[layer].where) if layer in self.layers else {}


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> Optional[bool]:
        return None
