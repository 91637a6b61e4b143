"""One decode (or draft-verify) forward for up to 4 running sequences over STATIC buffers, so that
on CUDA the whole forward is captured once as a `torch.cuda.CUDAGraph` and replayed every step.

A step for n sequences (n <= 4) of T rows each (T = 1 decode, T = 1 + K draft-verify):
  - pad to the bucket B in (1, 2, 4); dummy sequences and the unused rows of a short verify write
    their K/V to slot -1 ("padding row, write nothing": kernels/triton/kv_store.py) and are ignored;
  - host side, outside the graph (graphs cannot capture host work): `SequenceKV.begin` has already
    allocated the new slots (its bookkeeping stays authoritative); the model embeds the tokens
    into x [N, d] and the per-layer inputs [N, L, P] (`embed_into`: with `--embed-weights host`
    the rows are gathered on the host); positions [N], new slots [N] per pool, the per-sequence
    slot tables [B, C] of the full and the window pool with their positions, and the fp32 RoPE
    cos/sin at the positions (computed on the host: no trig or casts on the device) are packed
    into one buffer and reach the device in one `copy_`;
  - device side (the captured region): layers, final norm, head -> logits [N, V] and the post-norm
    rows y [N, d] (the assistant's h); under a graph these are the tensors the capture allocated,
    rewritten by every replay (no copy out). N = B * T.
Attention reads the tables: the torch reference gathers K/V by slot ([B, C] at once) and runs a
masked SDPA; the triton path calls `kernels.triton.attention.decode_attention` with one query row per
(sequence, t) and a `num_splits` fixed per captured shape (the grid of a graph never changes;
the kernel reads the split count from its grid, so one compiled kernel serves every count).
Table entries past a sequence's length hold slot 0 (a valid address) at position POS_PAD, which
no query can see (q_pos - POS_PAD < 0).

On the CPU (or with graphs off) the very same static-buffer code runs eagerly, so the CPU tests
exercise the bookkeeping the graph replays. Capacities C are powers of two >= the longest
sequence; when a sequence outgrows them the buffers of that (B, T) are reallocated (and the graph
re-captured), so a long chat re-captures about log2(context / 64) times per shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import failpoints
from .kv.pool import HybridKVPool
from .kv.sequence import SequenceKV

BUCKETS = (1, 2, 4)
POS_PAD = 1 << 30  # position of unused table entries: after every query, so never visible
MIN_CAPACITY = 64


def bucket_of(n: int) -> int:
    """The smallest batch bucket holding n sequences."""
    for b in BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"{n} sequences in one batched decode (at most {BUCKETS[-1]})")


def capacity_of(n: int) -> int:
    """Slot-table capacity for a sequence of n slots: a power of two, at least MIN_CAPACITY."""
    return max(MIN_CAPACITY, 1 << max(0, n - 1).bit_length())


def decode_splits(capacity: int, rows: int, n_kv: int, device, group: int, hd: int, kv_dtype) -> int:
    """Split-K programs per (query row, KV head) of a decode-attention launch over tables of
    `capacity` entries for `rows` = B * T query rows (`kernels.triton.attention.decode_splits`: two
    programs per SM of `device` where the capacity allows, capped so the last split's merge stays
    cheap). A function of the captured shape, the layer's KV geometry and the device only, so a
    graph's grid is a constant. Meta and CPU devices take the reference GPU's SM count
    (`kernels.arch.REFERENCE`, or `assume_gpu`)."""
    from kernels.arch import gpu_of
    from kernels.triton.attention import decode_splits as split_rule

    return split_rule(capacity, rows, n_kv, gpu_of(device).sms, group=group, hd=hd, kv_dtype=kv_dtype)


@dataclass
class StaticBatch:
    """Buffers of one (B, T) shape; replays read and write only these (and the KV slabs)."""

    B: int
    T: int
    full_cap: int
    win_cap: int
    x: torch.Tensor  # [N, d] model dtype: scaled token embeddings
    pl: Optional[torch.Tensor]  # [N, L, P] per-layer inputs (Gemma-4 PLE) or None
    pos: torch.Tensor  # [N] int64: position of every row
    new_full: torch.Tensor  # [N] int64: full-pool slot each row's K/V goes to, -1 = write nothing
    new_win: torch.Tensor  # [N] int64: the same for the window pool
    full_slots: torch.Tensor  # [B, full_cap] int64: slot of position p at [b, p], slot 0 beyond
    full_pos: torch.Tensor  # [B, full_cap] int64: p, POS_PAD beyond the sequence
    win_slots: torch.Tensor  # [B, win_cap] int64: the window slots a sequence holds
    win_pos: torch.Tensor  # [B, win_cap] int64: their positions, POS_PAD beyond
    rope: list  # per model.rope_sets() entry: (cos, sin) [N, 1, n_rot/2] fp32 at pos, made on the host
    staged: torch.Tensor  # uint8: every input above from pos on, back to back (views): one copy a step
    full_indptr: torch.Tensor  # triton path: [N+1] = arange * full_cap (one slot list per query row)
    win_indptr: torch.Tensor  # the same times win_cap
    # Outputs: the tensors the last run produced. Under a graph these are the ones the capture
    # allocated (in the graph's memory pool), which every replay rewrites in place: no copy out.
    logits: Optional[torch.Tensor] = None  # [N, V]
    hidden: Optional[torch.Tensor] = None  # [N, d] post-final-norm rows
    graph: object = None  # torch.cuda.CUDAGraph once captured

    @property
    def N(self) -> int:
        return self.B * self.T


class BatchDecoder:
    """Batched decode / verify forwards for one model and one set of pools.

    `backend`: None (the torch reference) or the engine's triton attention backend. Graphs are
    used when `graphs` and the model lives on CUDA and the backend is triton (the torch store's
    boolean masking needs a host sync) and the model has no MoE layers (their routing reads the
    chosen experts back to the host)."""

    def __init__(self, model, pools: HybridKVPool, backend=None, graphs: bool = True):
        self.model, self.pools, self.backend = model, pools, backend
        cfg = model.cfg
        self.triton = backend is not None and backend.name == "triton"
        self.use_graphs = (graphs and self.triton and model.device.type == "cuda"
                           and torch.cuda.is_available() and not getattr(cfg, "n_expert", 0))
        self.statics: dict[tuple[int, int], StaticBatch] = {}
        self._pool = None  # the CUDA graphs' shared memory pool
        self.replays = 0  # forwards served by a graph replay (for status and tests)

    # --- static buffers ----------------------------------------------------------------------
    def _static(self, B: int, T: int, full_need: int, win_need: int) -> StaticBatch:
        st = self.statics.get((B, T))
        if st is not None and st.full_cap >= full_need and st.win_cap >= win_need:
            return st
        m, cfg, dev = self.model, self.model.cfg, self.model.device
        full_cap = capacity_of(max(full_need, st.full_cap if st else 0)) if self.pools.full.layers else 0
        win_cap = capacity_of(max(win_need, st.win_cap if st else 0)) if self.pools.window.layers else 0
        N, P = B * T, getattr(cfg, "ple_width", 0)

        staged, views = _staged(self._host_inputs(B, T, full_cap, win_cap, torch.zeros(N, dtype=torch.long)), dev)
        ar = torch.arange(N + 1, device=dev)
        st = StaticBatch(
            B, T, full_cap, win_cap,
            x=torch.zeros((N, cfg.d_model), dtype=m.dtype, device=dev),
            pl=torch.zeros((N, cfg.n_layer, P), dtype=m.dtype, device=dev) if P else None,
            pos=views[0], new_full=views[1], new_win=views[2], full_slots=views[3], full_pos=views[4],
            win_slots=views[5], win_pos=views[6], rope=list(zip(views[7::2], views[8::2])), staged=staged,
            full_indptr=ar * full_cap, win_indptr=ar * win_cap)
        self.statics[(B, T)] = st  # the old buffers (and graph) of this shape are dropped
        return st

    # --- one step ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, kvs: list[SequenceKV], tokens: list[list[int]], T: int):
        """Run `tokens[i]` (1 <= len <= T, already `begin`-ed into kvs[i]) for every sequence.
        Returns (logits [n, T, V], y [n, T, d]), copies the caller may keep; rows past len(tokens[i])
        are padding."""
        n = len(kvs)
        assert n == len(tokens) and all(1 <= len(t) <= T for t in tokens)
        if failpoints.ACTIVE:
            failpoints.maybe_fail("forward.oom")
        B = bucket_of(n)
        st = self._static(B, T, max(len(kv) for kv in kvs),
                          max((len(kv.win_slots) for kv in kvs), default=0))
        self._fill(st, kvs, tokens)
        if not self.use_graphs:
            self._run_layers(st)
        else:
            if st.graph is None:
                self._capture(st)
            st.graph.replay()
            self.replays += 1
        logits = st.logits.view(B, T, -1)[:n].clone()
        return logits, st.hidden.view(B, T, -1)[:n].clone()

    def _host_inputs(self, B: int, T: int, full_cap: int, win_cap: int, pos: torch.Tensor) -> list:
        """The step's inputs as CPU tensors in StaticBatch order: pos, new_full, new_win, the slot
        tables and their positions (defaults: no writes, empty tables), then the fp32 RoPE tables
        (cos, sin per frequency set) at `pos` [B*T]: computed here, so the device runs no
        cos/sin/cast ops for them."""
        ints = [pos, torch.full((B * T,), -1, dtype=torch.long), torch.full((B * T,), -1, dtype=torch.long),
                torch.zeros((B, full_cap), dtype=torch.long), torch.full((B, full_cap), POS_PAD),
                torch.zeros((B, win_cap), dtype=torch.long), torch.full((B, win_cap), POS_PAD)]
        return ints + [t for cos_sin in self.model.rope_host(pos) for t in cos_sin]

    def _fill(self, st: StaticBatch, kvs: list[SequenceKV], tokens: list[list[int]]) -> None:
        """Host side: build every input on the CPU, then one `copy_` of all of them (plus the
        embedding rows, `embed_into`)."""
        B, T = st.B, st.T
        ids = torch.zeros(B * T, dtype=torch.long)  # padding rows embed token 0 (outputs ignored)
        pos = torch.zeros(B * T, dtype=torch.long)
        for b, (kv, toks) in enumerate(zip(kvs, tokens)):
            r, k = b * T, len(toks)
            start = len(kv) - k
            ids[r:r + k] = torch.tensor(toks)
            pos[r:r + T] = start  # padding rows of a short verify: a visible position, no write
            pos[r:r + k] = torch.arange(start, start + k)
        host = self._host_inputs(B, T, st.full_cap, st.win_cap, pos)
        _, new_full, new_win, full_slots, full_pos, win_slots, win_pos = host[:7]
        for b, (kv, toks) in enumerate(zip(kvs, tokens)):
            r, k = b * T, len(toks)
            step_full, step_win = kv.step_slots
            new_full[r:r + k] = step_full
            if len(step_win):
                new_win[r:r + k] = step_win
            if st.full_cap:
                full_slots[b, :len(kv)] = kv.full_slots
                full_pos[b, :len(kv)] = torch.arange(len(kv))
            if st.win_cap:
                w = len(kv.win_slots)
                win_slots[b, :w], win_pos[b, :w] = kv.win_slots, kv.win_pos
        # Dummy sequences: one visible key (slot 0 at position 0) so no softmax row is empty
        # (the torch path would give NaN); their rows write nothing and are never read back.
        full_pos[len(kvs):, :1] = 0
        win_pos[len(kvs):, :1] = 0
        self.model.embed_into(ids, st.x, st.pl)  # host-table gathers happen here, never inside the graph
        st.staged.copy_(_pack(host, pin=st.staged.is_cuda), non_blocking=True)  # pinned: the host does not wait

    def _run_layers(self, st: StaticBatch) -> None:
        """Device side, static buffers in and out: what the graph captures."""
        m = self.model
        kv = _TableKV(self, st)
        # A fresh view each run: `DecoderModel.rope` memoizes cos/sin on the identity of `pos`,
        # and the static buffer's contents change between runs.
        pos = st.pos.view(-1)
        m.seed_rope(pos, st.rope)  # the step's cos/sin came with the other inputs
        x = st.x
        for i in range(m.cfg.n_layer):
            x = m.layer(i, x, pos, None if st.pl is None else st.pl[:, i], kv)
        y = m.norm(x)
        st.hidden, st.logits = y, m.head(y)

    def _capture(self, st: StaticBatch) -> None:
        """Warm up on a side stream (Triton compiles, the allocator settles), then capture. The
        warm-up computes this step for real; the replay that follows recomputes it identically
        (the same K/V written to the same slots)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run_layers(st)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call from another thread (the app's model loader, a UI probe) during
        # the capture would otherwise invalidate it ("operation not permitted when stream is capturing").
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._run_layers(st)
        st.graph = graph


class _TableKV:
    """The models' KV-store protocol (`write`, `attend`) over a StaticBatch's tables: N = B * T
    query rows, sequence b owning rows b*T .. b*T + T - 1."""

    def __init__(self, dec: BatchDecoder, st: StaticBatch):
        self.dec, self.st, self.pools = dec, st, dec.pools
        self._gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slab -> K, V [B, C, n_kv, hd]
        self._rows: dict[str, tuple] = {}  # triton: pool name -> (slots, k_pos, indptr) per query row

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store = self.dec.backend.store if self.dec.triton else _masked_store
        self.pools.write(layer, self.st.new_full, self.st.new_win, k, v, store)

    def slab_target(self, layer: int):
        """Triton backend: where the models' fused attention prologue stores `layer`'s K/V itself
        (kernels/triton/qkv.py), one launch instead of norm kernels plus kv_store."""
        if not self.dec.triton:
            return None
        return self.pools.slab_target(layer, self.st.new_full, self.st.new_win)

    def _tables(self, pool):
        st = self.st
        return (st.win_slots, st.win_pos) if pool is self.pools.window else (st.full_slots, st.full_pos)

    def attend(self, layer: int, q: torch.Tensor, pos: torch.Tensor, window: Optional[int],
               scale: float) -> torch.Tensor:
        """q [N, n_h, hd] at pos [N] -> [N, n_h * hd] over the slab `layer` reads."""
        slab = self.pools.slab(layer)
        pool = self.pools.pool_of(slab)
        slots, k_pos = self._tables(pool)
        if self.dec.triton:
            return self._attend_triton(pool, slab, slots, k_pos, q, pos, window, scale)
        return self._attend_torch(pool, slab, slots, k_pos, q, pos, window, scale)

    def _attend_torch(self, pool, slab, slots, k_pos, q, pos, window, scale):
        B, C = slots.shape
        N, n_h, hd = q.shape
        T = N // B
        if slab not in self._gathered:  # KV-shared layers re-read their source's slab: once a step
            k, v = pool.read(slab, slots.reshape(-1), q.dtype)
            self._gathered[slab] = (k.view(B, C, *k.shape[1:]), v.view(B, C, *v.shape[1:]))
        k, v = self._gathered[slab]
        n_kv = k.shape[2]
        group = n_h // n_kv
        diff = pos.view(B, T, 1) - k_pos.view(B, 1, C)  # [B, T, C]
        mask = diff >= 0
        if window is not None:
            mask &= diff < window
        # As models.ops.attention, per sequence: fold each KV head's query group into the query
        # axis, q [B, n_kv, group*T, hd] (row g*T + t) against k, v [B, n_kv, C, hd].
        qg = q.view(B, T, n_kv, group, hd).permute(0, 2, 3, 1, 4).reshape(B, n_kv, group * T, hd)
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask.repeat(1, group, 1)[:, None], scale=scale)
        return o.reshape(B, n_kv, group, T, hd).permute(0, 3, 1, 2, 4).reshape(N, n_h * hd)

    def _attend_triton(self, pool, slab, slots, k_pos, q, pos, window, scale):
        from kernels.triton.attention import decode_attention

        B, C = slots.shape
        N, n_h, hd = q.shape
        T = N // B
        if pool.name not in self._rows:
            # One slot list per query row (sequence b's table repeated T times): the decode kernel
            # takes one query per list, and causality inside a verify comes from the positions.
            rows_slots = (slots if T == 1 else slots.repeat_interleave(T, dim=0)).reshape(-1)
            rows_pos = (k_pos if T == 1 else k_pos.repeat_interleave(T, dim=0)).reshape(-1)
            indptr = self.st.win_indptr if pool is self.pools.window else self.st.full_indptr
            self._rows[pool.name] = (rows_slots, rows_pos, indptr)
        rows_slots, rows_pos, indptr = self._rows[pool.name]
        scales = (pool.k_scale[slab], pool.v_scale[slab]) if pool.fmt.scaled else (None, None)
        o = decode_attention(q.contiguous(), pool.k[slab], pool.v[slab], rows_slots, rows_pos, pos, scale,
                             window, scales[0], scales[1], slot_indptr=indptr,
                             num_splits=decode_splits(C, N, pool.k[slab].shape[1], q.device, n_h // pool.k[slab].shape[1],
                                                        hd, pool.k[slab].dtype))
        return o.reshape(N, n_h * hd)


def _offsets(parts: list[torch.Tensor]) -> list[int]:
    """Byte offset of each part packed back to back, each starting on an 8-byte boundary."""
    out, at = [], 0
    for t in parts:
        out.append(at)
        at += -(-t.numel() * t.element_size() // 8) * 8
    return out + [at]


def _pack(parts: list[torch.Tensor], pin: bool = False) -> torch.Tensor:
    """CPU tensors -> one uint8 tensor laid out as `_staged` reads it (in pinned memory with `pin`:
    a non-blocking copy from pageable memory would still make the host wait for the GPU)."""
    offs = _offsets(parts)
    buf = torch.zeros(offs[-1], dtype=torch.uint8, pin_memory=pin)
    for t, at in zip(parts, offs):
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        buf[at:at + raw.numel()] = raw
    return buf


def _staged(parts: list[torch.Tensor], device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A device uint8 buffer holding `parts` (as `_pack` lays them out) and a view of each, in its
    dtype and shape: the step's inputs then reach the device in one copy instead of one each."""
    offs = _offsets(parts)
    buf = _pack(parts).to(device)
    views = [buf[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for t, at in zip(parts, offs)]
    return buf, views


def _masked_store(pool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The torch store with kv_store's padding rule: rows at a negative slot write nothing."""
    keep = slots >= 0
    pool.write(layer, slots[keep], k[keep], v[keep])
