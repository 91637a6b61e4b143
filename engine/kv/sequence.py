"""One sequence's KV in the hybrid pools: the models' `KVStore` protocol over slot lists.

Full pool: one slot per position 0..n-1. Window pool: slots only for the positions a future query
can still see (the last `window - 1` before the next position), so a sequence holds at most
window + chunk window slots however long it gets. Slots that came from the prefix cache are not
this sequence's to free; `full_owned` / `win_owned` say which are.

Beside a GPU, the slabs of the layers the CPU computes (`HybridKVPool.host_layers`) are read and
written as on the CPU runtime whatever the device's backend: host slots, float32 reads, ggml's
decode attention where the host runtime attends on it (`host_ggml_attention`).
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.ggml import attention as ggml_attention_kernel
from models.ops import attention, decode_attention

from .canonical import BUCKET, EXACT_ROWS, decode_mask, decode_window, prefill_tiles
from .pool import HybridKVPool

_EMPTY = torch.empty(0, dtype=torch.long)
MAX_RUNS = 8  # a decode step attends over up to this many slot runs in place; more: one gather


def to_device_once(parts: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """CPU integer tensors -> int64 views of one buffer on `device`, in one copy. On CUDA the host
    side is pinned and the copy non-blocking: a copy from pageable memory (`t.to(dev)`) makes the
    host wait until the GPU has drained its queue, and the attention layers used to do two such
    copies each per forward (slots and positions: 70 for an E2B prefill chunk). On the CPU the
    tensors are returned as they are."""
    if device.type == "cpu":
        return dict(parts)
    flat = [t.reshape(-1).long() for t in parts.values()]
    sizes = [t.numel() for t in flat]
    host = torch.empty(sum(sizes), dtype=torch.long, pin_memory=device.type == "cuda")
    torch.cat(flat, out=host)
    on_dev = host.to(device, non_blocking=True)
    return dict(zip(parts, on_dev.split(sizes)))


def _last(slots: torch.Tensor) -> int:
    return int(slots[-1]) if slots.numel() else -1


def ggml_attention_for(model, backend=None) -> bool:
    """Whether `model`'s sequences attend on ggml's kernel in a decode step (`SequenceKV`'s
    `ggml_attention`): no kernel backend and the model's runtime says so
    (models.runtime.Runtime.attends_on_ggml). Asked once by whoever builds the sequences."""
    runtime = getattr(model, "runtime", None)  # a model built without the loader has none: torch
    return backend is None and runtime is not None and runtime.attends_on_ggml()


class SequenceKV:
    def __init__(self, pools: HybridKVPool, window: Optional[int], dtype=torch.float32, margin: int = 64,
                 backend=None, ggml_attention: bool = False, host_ggml_attention: bool = False):
        # margin: window positions kept beyond what attention needs, so a cached prefix can be
        # served from up to `margin` tokens before the point where it was stored.
        self.pools, self.window, self.dtype, self.margin = pools, window, dtype, margin
        self.backend = backend  # None: the torch reference (gather, then models.ops.attention)
        # decode attention on ggml's kernel: what the model's runtime says, decided once by whoever
        # builds this (the engine: `ggml_attention_for`); False: the torch products
        self.ggml_attention = ggml_attention
        self.host_ggml_attention = host_ggml_attention  # the same for the host slabs' layers
        self.has_window = bool(pools.window.layers)
        self.full_slots = _EMPTY.clone()  # [n] slot of position p at index p
        self.full_owned = torch.empty(0, dtype=torch.bool)  # False: the prefix cache owns it
        self.exact = torch.empty(0, dtype=torch.bool)  # [n] computed in a forward of >= EXACT_ROWS rows
        self.win_pos = _EMPTY.clone()  # [w] positions held in the window pool, ascending
        self.win_slots = _EMPTY.clone()
        self.win_owned = torch.empty(0, dtype=torch.bool)
        self._step: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._pos = _EMPTY  # this forward's positions (CPU int64)
        self._reads: dict = {}  # this forward's gathered K/V by slab, and its slot tables on the device

    def __len__(self) -> int:
        return int(self.full_slots.numel())

    # --- prefix reuse ----------------------------------------------------------------------
    def attach_prefix(self, full_slots: torch.Tensor, win_pos: torch.Tensor, win_slots: torch.Tensor) -> None:
        """Start from cached KV (slots owned by the prefix cache, locked by the caller)."""
        assert len(self) == 0
        self.full_slots = full_slots.clone()
        self.full_owned = torch.zeros(len(full_slots), dtype=torch.bool)
        self.exact = torch.ones(len(full_slots), dtype=torch.bool)  # the cache serves only such KV
        self.win_pos, self.win_slots = win_pos.clone(), win_slots.clone()
        self.win_owned = torch.zeros(len(win_pos), dtype=torch.bool)

    # --- one forward -----------------------------------------------------------------------
    def begin(self, pos: torch.Tensor) -> None:
        """Allocate slots for positions `pos` (the next len(pos) positions) in both pools."""
        n = len(self)
        assert pos.numel() and int(pos[0]) == n and int(pos[-1]) == n + pos.numel() - 1, "positions must extend"
        # above the sequence's latest slot: its slots ascend with its positions (KVPool.__init__)
        new_full = self.pools.full.alloc(pos.numel(), _last(self.full_slots)) if self.pools.full.layers else \
            torch.full((pos.numel(),), -1, dtype=torch.long)
        try:
            new_win = self.pools.window.alloc(pos.numel(), _last(self.win_slots)) if self.has_window else _EMPTY
        except Exception:
            self.pools.full.free(new_full)
            raise
        self.full_slots = torch.cat([self.full_slots, new_full])
        self.full_owned = torch.cat([self.full_owned, torch.ones(pos.numel(), dtype=torch.bool)])
        self.exact = torch.cat([self.exact, torch.full((pos.numel(),), pos.numel() >= EXACT_ROWS)])
        if self.has_window:
            self.win_pos = torch.cat([self.win_pos, pos.cpu()])
            self.win_slots = torch.cat([self.win_slots, new_win])
            self.win_owned = torch.cat([self.win_owned, torch.ones(pos.numel(), dtype=torch.bool)])
        self._step = (new_full, new_win)
        self._pos = pos.cpu()
        self._reads = {}

    @property
    def step_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(full [T], window [T] or empty) slots `begin` allocated for this forward: what the
        batched decoder copies into its static tables."""
        assert self._step is not None, "no forward in progress (call begin first)"
        return self._step

    def tables(self) -> dict[str, torch.Tensor]:
        """This forward's positions (`pos`), new slots (`new_full`, `new_win`) and the sequence's
        slot lists with their positions (`full_slots`, `full_pos`, `win_slots`, `win_pos`) on the
        pools' device, built at the first use of a forward in one copy (`to_device_once`); every
        layer's store and attention reads these."""
        if "tables" not in self._reads:  # outside a forward (a draft reading the target's KV): no new slots
            new_full, new_win = self._step if self._step is not None else (_EMPTY, _EMPTY)
            self._reads["tables"] = to_device_once({
                "pos": self._pos, "new_full": new_full, "new_win": new_win, "full_slots": self.full_slots,
                "full_pos": torch.arange(len(self)), "win_slots": self.win_slots, "win_pos": self.win_pos},
                self.pools.full.device)
        return self._reads["tables"]

    def positions(self, device) -> torch.Tensor:
        """This forward's positions on `device` (the pools' device: from the one table copy)."""
        t = self.tables()["pos"]
        return t if t.device.type == torch.device(device).type else self._pos.to(device)

    def _on_host(self, slab: int) -> bool:
        """Whether `slab` (a slab layer, `pools.slab`) is one of the CPU's beside a GPU."""
        return slab in self.pools.host_layers

    def _dtype(self, slab: int):
        return torch.float32 if self._on_host(slab) else self.dtype  # the CPU runtime computes in float32

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._on_host(self.pools.slab(layer)):  # the host slab: CPU slots, the pool's own store
            self.pools.write(layer, *self.step_slots, k, v)
            return
        t = self.tables()
        self.pools.write(layer, t["new_full"], t["new_win"], k, v, None if self.backend is None else self.backend.store)

    def slab_target(self, layer: int):
        """A kernel backend (triton): the slabs and slots the models' fused attention prologue
        stores this forward's K/V into itself (models.kv_cache.SlabTarget); None otherwise."""
        if getattr(self.backend, "name", None) != "triton" or self._on_host(self.pools.slab(layer)):
            return None
        t = self.tables()
        return self.pools.slab_target(layer, t["new_full"], t["new_win"])

    def _slots(self, pool) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, positions) of this sequence in `pool`, in position order (CPU bookkeeping)."""
        if pool is self.pools.window:
            return self.win_slots, self.win_pos
        return self.full_slots, torch.arange(len(self))

    def _device_slots(self, pool, host: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`_slots` on the pools' device, from this forward's one table copy (`host`: the CPU's)."""
        if host:
            return self._slots(pool)
        t = self.tables()
        return (t["win_slots"], t["win_pos"]) if pool is self.pools.window else (t["full_slots"], t["full_pos"])

    def _spans(self, pool) -> Optional[list[tuple[int, int, int]]]:
        """The maximal runs of consecutive ascending slots of this sequence in `pool`, as (first
        slot, start, end) over its slot list, or None when the pool is scaled (8-bit: dequantized by
        the gather), empty, or broken into more than MAX_RUNS runs. Once a step per pool."""
        key = ("spans", pool.name)
        if key not in self._reads:
            slots, spans = self._slots(pool)[0], None
            n = slots.numel()
            if n and not pool.fmt.scaled:
                edges = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
                if len(edges) < MAX_RUNS:
                    edges = [0] + edges + [n]
                    spans = list(zip(slots[edges[:-1]].tolist(), edges[:-1], edges[1:]))
            self._reads[key] = spans
        return self._reads[key]

    def _views(self, pool, slab: int, spans) -> tuple[list, list]:
        """K and V of each span as (dequantized) views of the slab: no gather."""
        def run(t, f, a, b):
            return pool.fmt.dequantize(t[slab][f:f + b - a], None, self._dtype(slab))
        return [run(pool.k, *sp) for sp in spans], [run(pool.v, *sp) for sp in spans]

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slab = self.pools.slab(layer)
        if slab not in self._reads:  # KV-shared layers re-read their source's slab: gather once a step
            pool = self.pools.pool_of(slab)
            slots, positions = self._device_slots(pool, self._on_host(slab))
            spans = self._spans(pool)
            if spans is not None and len(spans) == 1:  # consecutive slots (a sequence alone in a fresh pool)
                (k,), (v,) = self._views(pool, slab, spans)
            else:
                k, v = pool.read(slab, slots, self._dtype(slab))
            self._reads[slab] = (k, v, positions)
        return self._reads[slab]

    def _masked(self, layer: int, window: Optional[int], row: int = -1):
        """(k, v, mask) for ggml's decode attention (kernels/ggml/attention.py) of this forward's
        row `row` (default the last: a decode step's one row): k, v [S, n_kv, hd] views of
        `layer`'s slab over the slots [lo, lo + S) that hold every position that row's query
        sees, mask float16 [1, S] (0 at those slots, -inf elsewhere; [2, S] from SINGLE_PASS
        keys on, a second, fully masked query row: engine/kv/canonical.py), so the bits do not
        hang on where the slots lie; S a multiple of BUCKET (one graph serves a growing sequence
        for BUCKET steps). The window is what a decode step at that row's position would get, so
        a verify row attends as the decode step would. None for 8-bit pools, or slots spread over
        more than twice their count (then `attend` gathers the keys).
        The window and mask once a step per pool, window and row (slabs of a pool share slots)."""
        slab = self.pools.slab(layer)
        pool = self.pools.pool_of(slab)
        if pool.fmt.scaled:
            return None
        q_pos = int(self._pos[row]) if self._step is not None else len(self) - 1
        key = ("masked", pool.name, window, q_pos)
        if key not in self._reads:
            slots = self._visible_slots(pool, window, q_pos)
            placed = decode_window(slots, pool.capacity)
            self._reads[key] = None if placed is None else (*placed, decode_mask(slots, *placed))
        hit = self._reads[key]
        if hit is None:
            return None
        lo, size, mask = hit
        return pool.k[slab][lo:lo + size], pool.v[slab][lo:lo + size], mask

    def _visible_slots(self, pool, window: Optional[int], q_pos: Optional[int] = None) -> torch.Tensor:
        """Slots of the positions a query at `q_pos` (default: the last position) sees (the last
        `window` up to it, or all up to it), in position order."""
        slots, positions = self._slots(pool)
        q_pos = len(self) - 1 if q_pos is None else q_pos
        seen = positions <= q_pos
        if window:
            seen &= positions > q_pos - window
        return slots if bool(seen.all()) else slots[seen]

    def _visible_kv(self, layer: int, window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n, n_kv, hd] of the positions this step's query sees in position order: a view of
        the slab where their slots are consecutive, else gathered (8-bit pools: dequantized), so
        the products see one tensor of the same shape whatever the slots. Once a step per slab and
        window."""
        slab = self.pools.slab(layer)
        key = ("visible_kv", slab, window)
        if key not in self._reads:
            pool = self.pools.pool_of(slab)
            slots = self._visible_slots(pool, window)
            s0, n = int(slots[0]), slots.numel()
            if not pool.fmt.scaled and int(slots[-1]) - s0 == n - 1:
                dtype = self._dtype(slab)
                self._reads[key] = (pool.fmt.dequantize(pool.k[slab][s0:s0 + n], None, dtype),
                                    pool.fmt.dequantize(pool.v[slab][s0:s0 + n], None, dtype))
            else:
                self._reads[key] = pool.read(slab, slots, self._dtype(slab))
        return self._reads[key]

    def _gathered_window(self, layer: int, window: Optional[int]):
        """`_masked`'s (k, v, mask) over the visible keys gathered into consecutive rows: the same
        bits as a slab whose slots are consecutive (the window is placed the same way)."""
        k, v = self._visible_kv(layer, window)
        n = k.shape[0]
        rows = torch.arange(n)
        lo, size = decode_window(rows, n + BUCKET, spread=True)
        kw = k.new_empty((lo + size, *k.shape[1:]))
        vw = v.new_empty((lo + size, *v.shape[1:]))
        kw[:n], vw[:n] = k, v  # the other rows are masked: never read
        return kw[lo:], vw[lo:], decode_mask(rows, lo, size)

    def _position_kv(self, layer: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [b - a, n_kv, hd] of `layer`'s slab at positions [a, b) in position order, zero rows
        where this sequence holds none (past its end, or window positions let go): prefill tiles."""
        slab = self.pools.slab(layer)
        key = ("positions", slab, a, b)
        if key not in self._reads:
            pool = self.pools.pool_of(slab)
            slots, positions = self._slots(pool)
            at = torch.full((b - a,), -1, dtype=torch.long)
            keep = (positions >= a) & (positions < b)
            at[positions[keep] - a] = slots[keep]
            k, v = pool.read(slab, at.clamp_min(0), self._dtype(slab))
            absent = (at < 0).to(k.device)
            self._reads[key] = (k.masked_fill_(absent[:, None, None], 0.0),
                                v.masked_fill_(absent[:, None, None], 0.0))
        return self._reads[key]

    def decode_window(self, layer: int, window: Optional[int], row: int = 0):
        """(k window, v window, mask) of `layer`'s slab (its source's for a KV-shared layer) for
        row `row` of this forward computed in one ggml graph (models/token_graph.py: a decode
        token, or a row of a draft's verify), or None (attention not on ggml's kernel, a kernel
        backend, the debug copies, not float32, or a window `_masked` does not give)."""
        slab = self.pools.slab(layer)
        host = self._on_host(slab)
        ggml = self.host_ggml_attention if host else self.ggml_attention and self.backend is None
        if not ggml or self.pools.copies or self._step is None:
            return None
        pool = self.pools.pool_of(slab)
        if pool.k[slab].dtype != torch.float32 or pool.fmt.scaled:
            return None
        return self._masked(layer, window, row)

    def decode_target(self, layer: int, window: Optional[int], row: int = 0):
        """`decode_window` of a layer that owns its slab, with the slabs and the row's new slot:
        (k slab, v slab, slot [1], k window, v window, mask), or None (`decode_window`'s cases and
        a KV-shared layer)."""
        slab = self.pools.slab(layer)
        if slab != layer:
            return None
        masked = self.decode_window(layer, window, row)
        if masked is None:
            return None
        pool = self.pools.pool_of(slab)
        key = ("slot", pool.name, row)
        if key not in self._reads:  # one tensor a pool and row: the graph's inputs are keyed by it
            new_full, new_win = self._step
            self._reads[key] = (new_win if pool is self.pools.window else new_full)[row:row + 1]
        return (pool.k[slab], pool.v[slab], self._reads[key], *masked)

    def attend(self, layer: int, q: torch.Tensor, pos: torch.Tensor, window: Optional[int],
               scale: float, last_key: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of `layer` over its slab (the source's when sharing, its own copy in the debug
        mode), rounded by positions, not slots (engine/kv/canonical.py): on the ggml runtime
        (`ggml_attention`) a decode step runs llama.cpp's kernel over a window of the slab (or of
        the visible keys gathered); the torch reference's decode step takes the visible keys as one
        tensor (in place where their slots are consecutive) and its prefill rows go in position
        tiles; a kernel backend reads the slots in place. `last_key` [T] (an image on a sliding
        layer of 26B/31B, models/image_attention.py): the chunk's image rows also see the rest of
        their image (one gather, untiled); one row (a decode step) never carries one."""
        host = self._on_host(self.pools.slab(layer))
        if self.backend is None or host:  # the host slabs beside a GPU: as on the CPU runtime
            decode = q.shape[0] == 1 and q.device.type == "cpu"
            # ggml's kernel reads float32 rows with a unit last stride: a dtype and layout condition,
            # not a runtime one. The exactness tests run float64 models through this same code, and
            # a float64 (or strided) query keeps the torch products below.
            ggml = self.host_ggml_attention if host else self.ggml_attention
            on_ggml = ggml and decode and q.dtype == torch.float32 and q.stride(-1) == 1
            if on_ggml and not self.pools.pool_of(self.pools.slab(layer)).fmt.scaled:
                # llama.cpp's kernel over a window of the slab, or of the keys gathered in order
                masked = self._masked(layer, window) or self._gathered_window(layer, window)
                return ggml_attention_kernel.decode_attention(q, *masked, scale)
            if decode:  # the visible keys as one tensor (in place or gathered), no mask
                k, v = self._visible_kv(layer, window)
                return decode_attention(q, [k], [v], scale)
            if last_key is None and q.shape[0] > 1:  # prefill rows in position tiles (canonical.py)
                return prefill_tiles(q, pos, window, lambda a, b: self._position_kv(layer, a, b), attention,
                                     scale)
            k, v, k_pos = self.read(layer)
            return attention(q, k, v, pos, k_pos, window, scale, last_key)
        slab = self.pools.slab(layer)
        pool = self.pools.pool_of(slab)
        slots, k_pos = self._device_slots(pool)
        if last_key is not None:
            return self.backend.attend(pool, slab, slots, k_pos, q, pos, window, scale, last_key=last_key)
        return self.backend.attend(pool, slab, slots, k_pos, q, pos, window, scale)

    def end(self) -> None:
        """After a forward: drop window slots no future query can see (pos <= n - window), beyond
        the margin kept for prefix reuse."""
        self._step, self._reads = None, {}
        if self.has_window and self.window:
            self._drop_window(self.win_pos <= len(self) - self.window - self.margin)

    # --- shrinking ---------------------------------------------------------------------------
    def _drop_window(self, drop: torch.Tensor) -> None:
        self._reads = {}  # tables and reads of the old slot lists
        if drop.any():
            self.pools.window.free(self.win_slots[drop & self.win_owned])
            keep = ~drop
            self.win_pos, self.win_slots, self.win_owned = self.win_pos[keep], self.win_slots[keep], self.win_owned[keep]

    def truncate(self, n: int) -> None:
        """Forget positions >= n (speculative rollback); only this sequence's own slots are freed."""
        assert 0 <= n <= len(self) and bool(self.full_owned[n:].all())
        self._reads = {}
        self.pools.full.free(self.full_slots[n:])
        self.full_slots, self.full_owned, self.exact = self.full_slots[:n], self.full_owned[:n], self.exact[:n]
        if self.has_window:
            self._drop_window(self.win_pos >= n)

    def release(self) -> None:
        """Free every slot this sequence owns (the prefix cache keeps its own)."""
        self._reads = {}
        self.pools.full.free(self.full_slots[self.full_owned])
        if self.has_window:
            self.pools.window.free(self.win_slots[self.win_owned])
        self.full_slots, self.full_owned = _EMPTY.clone(), torch.empty(0, dtype=torch.bool)
        self.exact = torch.empty(0, dtype=torch.bool)
        self.win_pos, self.win_slots, self.win_owned = _EMPTY.clone(), _EMPTY.clone(), torch.empty(0, dtype=torch.bool)

    def window_slots_by_position(self) -> torch.Tensor:
        """[n] window slot of every position, -1 where this sequence holds none."""
        out = torch.full((len(self),), -1, dtype=torch.long)
        if self.has_window and len(self.win_pos):
            out[self.win_pos] = self.win_slots
        return out

    def hand_over(self, full_taken: torch.Tensor, win_taken: torch.Tensor) -> None:
        """The prefix cache took these positions' slots (masks over positions 0..n-1)."""
        n = len(full_taken)
        self.full_owned[:n] &= ~full_taken
        if self.has_window and len(self.win_pos):
            taken = torch.zeros(len(self), dtype=torch.bool)
            taken[:n] = win_taken
            self.win_owned &= ~taken[self.win_pos]
