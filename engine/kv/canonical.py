"""Attention whose bits depend on positions only: not on the slots a sequence's KV sits in, nor on
how its prompt was cut into forwards. This is what lets a prompt served from the prefix cache give
the same logits as the same prompt prefilled afresh (and as it does beside other requests).

Decode on ggml (`decode_window`, `decode_mask`). ggml's flash attention (ops.cpp) makes one pass
over a window's keys per head, skipping -inf slots without reading them, where it has one query
row and fewer than 512 keys. From 512 keys on, one query row takes another path: the window is
cut into one equal chunk per thread and the chunks' partials merged, which rounds by where the
keys sit in the window (the slots' layout). With two query rows it never takes that path: the
threads share the heads, each head one pass over the keys, the bits of the one-row pass below 512
(measured equal there, and layout-independent above). So from SINGLE_PASS keys on the mask gets
a second, fully masked row (its output, zeros, is dropped): the bits hang on the positions only,
and both threads still work (measured faster than the split: 1,024 keys, 8 heads of 256, 2
threads, 219-266 us against 249-304 us).

Prefill on torch (`prefill_tiles`). A query row's attention through torch's SDPA rounds by the key
range it is given: where that range starts, and how long it is (measured on the CPU: a row's output
changed with the key count, 200 to 376 keys against 1,600). It does not change with the other
query rows computed beside it. So the rows go in tiles of TILE positions aligned to position 0.
A tile's keys are positions [k0, tile end): k0 is 0 (full layers) or the window's first position
rounded down to TILE. Keys past the chunk, or not held, are zero rows, masked anyway.
"""
from __future__ import annotations

from typing import Optional

import torch

SINGLE_PASS = 512  # ggml splits one query row's keys between threads from this many on
BUCKET = 64  # decode windows are rounded to this (one cached graph serves BUCKET steps)
SPREAD = 8  # a decode window over up to this many slots a key stays in place (`decode_window`)
TILE = 64  # prefill query rows per attention call; key ranges start at multiples of it


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def decode_window(slots: torch.Tensor, capacity: int, spread: bool = False) -> Optional[tuple[int, int]]:
    """(lo, size) of the slab window [lo, lo + size) for ggml's decode attention over the visible
    slots [n] (in position order, CPU int64), or None: slots not ascending, or (unless `spread`) a
    window of SINGLE_PASS slots or more spread over more than SPREAD times the keys (the kernel
    checks each slot's mask: sequences decoded side by side interleave their new slots, a few
    times the keys). size: the span rounded up to BUCKET."""
    n = slots.numel()
    if not n or (n > 1 and not bool((slots[1:] > slots[:-1]).all())):
        return None
    s0, s1 = int(slots[0]), int(slots[-1])
    size = min(_up(s1 - s0 + 1, BUCKET), capacity)
    if not spread and size >= SINGLE_PASS and size > SPREAD * n + BUCKET:
        return None
    return min(s0, capacity - size), size  # holds [s0, s1]: s1 < capacity


def decode_mask(slots: torch.Tensor, lo: int, size: int) -> torch.Tensor:
    """float16 [1, size]: 0 at the visible slots of the window [lo, lo + size), -inf elsewhere;
    [2, size] from SINGLE_PASS keys on, the second row fully masked (module doc)."""
    mask = torch.full((1 if size < SINGLE_PASS else 2, size), float("-inf"), dtype=torch.float16)
    mask[0, slots - lo] = 0.0
    return mask


def tile_key_start(tile_start: int, window: Optional[int]) -> int:
    """First key position a prefill tile starting at `tile_start` is given."""
    if not window:
        return 0
    return max(0, tile_start - window + 1) // TILE * TILE


def prefill_tiles(q: torch.Tensor, pos: torch.Tensor, window: Optional[int], keys, attention, scale: float
                  ) -> torch.Tensor:
    """Attention of the chunk's rows q [T, n_h, hd] at consecutive positions `pos` [T] in TILE-aligned
    tiles: `keys(a, b)` -> (k, v) [b - a, n_kv, hd] of positions [a, b) in position order (zero rows
    where absent); `attention` is models.ops.attention. -> [T, n_h * hd]."""
    p0, p1 = int(pos[0]), int(pos[-1]) + 1
    t0, t1 = p0 // TILE * TILE, _up(p1, TILE)
    base = tile_key_start(t0, window)
    k_all, v_all = keys(base, t1)
    k_pos = torch.arange(base, t1, device=k_all.device)
    outs = []
    for t in range(t0, t1, TILE):
        a, b = max(t, p0), min(t + TILE, p1)
        k0 = tile_key_start(t, window) - base
        e = t + TILE - base
        outs.append(attention(q[a - p0:b - p0], k_all[k0:e], v_all[k0:e], pos[a - p0:b - p0], k_pos[k0:e],
                              window, scale))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


# --- which forward computes a prompt row ----------------------------------------------------------
# ggml's K-quant products (Q4_K, Q6_K: the demo model's) round a row one way in a forward of fewer
# than EXACT_ROWS rows and another way from it on (another kernel), the same way for every row
# count on either side. A prompt's rows before its last token go in forwards of at least
# EXACT_ROWS rows (all of them in one forward when fewer), its last token in a forward of its own,
# and the prefix cache serves only rows computed so (engine/prefix_cache.py): then every row of a
# prompt rounds alike whether it was cached or not.
EXACT_ROWS = 8


def exact_chunk(left: int, budget: int) -> int:
    """Rows of the next prefill forward over `left` rows still to compute before the prompt's last
    token: up to `budget`, but never fewer than EXACT_ROWS (over the budget when other requests
    took most of it) and never leaving a remainder of fewer than EXACT_ROWS; all `left` when
    fewer than 2 * EXACT_ROWS would be cut."""
    if left <= 0:
        return 0
    n = min(max(budget, EXACT_ROWS), left)
    if 0 < left - n < EXACT_ROWS:
        n = left - EXACT_ROWS if left - EXACT_ROWS >= EXACT_ROWS else left
    return n
