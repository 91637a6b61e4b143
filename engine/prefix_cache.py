"""Prefix caches over token ids: `radix` (reuse, LRU eviction) and `naive` (no reuse).

Radix nodes hold, per token, its full-pool slot and its window-pool slot (-1 once evicted or never
kept). A match of m tokens is served only up to the largest m' <= m whose last `window - 1`
positions still have window slots: a sliding layer's first new query needs them. Sequences hand
their slots over at the end of the prompt (so "regenerate" reuses the prompt) and at the end of the
answer (so the next turn reuses the conversation); locked nodes are never evicted.

Each token also records whether its KV was computed in a prefill forward of at least EXACT_ROWS
rows (engine/kv/canonical.py): a fresh prefill computes every row of a prompt but its last so, and
ggml's K-quant products round other row counts otherwise. A match serves only such tokens, and
never leaves fewer than EXACT_ROWS rows to compute before the prompt's last token (it steps back
instead), so a cached prompt computes its rows as a fresh one does. A decoded answer's KV (one row a
forward) is kept for nothing but that: the next turn recomputes it, as it does the last token of
the prompt before it (the cost: those rows' prefill in the second turn's time to first token).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from .kv.canonical import EXACT_ROWS
from .kv.pool import HybridKVPool

_clock = itertools.count()


@dataclass(eq=False)
class _Node:
    tokens: torch.Tensor  # [n] int64
    full: torch.Tensor  # [n] full-pool slots
    win: torch.Tensor  # [n] window-pool slots, -1 where absent
    exact: torch.Tensor  # [n] bool: computed in a prefill forward of >= EXACT_ROWS rows
    parent: Optional["_Node"] = None
    children: dict = field(default_factory=dict)  # first token -> node
    lock: int = 0
    last_used: int = 0
    holders: list = field(default_factory=list)  # the locked-node lists (PrefixMatch.nodes) holding it

    def split(self, k: int) -> "_Node":
        """Cut this node after k tokens; returns the new upper part (self keeps the tail). Whoever
        holds this node now holds the upper part too: it joins their lists, so their release
        unlocks both."""
        upper = _Node(self.tokens[:k], self.full[:k], self.win[:k], self.exact[:k], self.parent,
                      {int(self.tokens[k]): self},
                      self.lock, self.last_used, list(self.holders))
        for held in self.holders:
            held.append(upper)
        self.parent.children[int(self.tokens[0])] = upper
        self.tokens, self.full, self.win, self.parent = self.tokens[k:], self.full[k:], self.win[k:], upper
        self.exact = self.exact[k:]
        return upper


@dataclass
class PrefixMatch:
    length: int  # servable cached tokens
    full_slots: torch.Tensor
    win_pos: torch.Tensor
    win_slots: torch.Tensor
    nodes: list = field(default_factory=list)  # locked; give back with `release`


class RadixCache:
    kind = "radix"

    def __init__(self, pools: HybridKVPool, window: Optional[int]):
        self.pools, self.window = pools, window
        self.before_evict = None  # called once before KV would be let go (KV files save there)
        self.has_window = bool(pools.window.layers) and bool(window)
        e = torch.empty(0, dtype=torch.long)
        self.root = _Node(e, e.clone(), e.clone(), torch.empty(0, dtype=torch.bool))

    # --- lookup ------------------------------------------------------------------------------
    def _walk(self, tokens: list[int]) -> tuple[list[_Node], int]:
        """The nodes covering the longest cached prefix of `tokens` (a partly matched node is split
        so the path ends exactly there) and that prefix's length."""
        node, path, m = self.root, [], 0
        t = torch.tensor(tokens, dtype=torch.long)
        while m < len(t):
            child = node.children.get(int(t[m]))
            if child is None:
                break
            n = min(len(child.tokens), len(t) - m)
            same = int((child.tokens[:n] == t[m:m + n]).long().cumprod(0).sum())  # >= 1: keyed by t[m]
            if same < len(child.tokens):
                path.append(child.split(same))
                m += same
                break
            path.append(child)
            node, m = child, m + same
        return path, m

    def match(self, tokens: list[int], exact: bool = True) -> PrefixMatch:
        """Longest servable cached prefix of `tokens`, leaving at least the last token to compute.
        `exact` (a seeded request: its numbers must not hang on the cache): exact tokens only, and
        none or at least EXACT_ROWS rows before the last to compute; else every cached token (a
        decoded answer's KV too: the next turn prefills only its new tokens)."""
        nodes, m = self._walk(tokens[:-1])
        full = torch.cat([n.full for n in nodes]) if nodes else torch.empty(0, dtype=torch.long)
        win = torch.cat([n.win for n in nodes]) if nodes else torch.empty(0, dtype=torch.long)
        if exact:
            inexact = (~torch.cat([n.exact for n in nodes])[:m]).nonzero() if nodes else None
            if inexact is not None and inexact.numel():
                m = int(inexact[0])
            rows = len(tokens) - 1  # a fresh prefill computes these in forwards of >= EXACT_ROWS (or one)
            m = self._servable(win, m if rows >= EXACT_ROWS else 0)
            if 0 < rows - m < EXACT_ROWS:
                m = self._servable(win, max(0, rows - EXACT_ROWS))
        else:
            m = self._servable(win, m)
        need = self._window_positions(m)
        nodes = self._lock_upto(self._cut(nodes, m), m)
        return PrefixMatch(m, full[:m], need, win[need] if m else need, nodes)

    def lookup(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(full slots [m], window slots [m], -1 where absent) of the longest cached prefix of
        `tokens`, whether or not a query could be served from it; nothing is locked (KV files read
        the slots at once, on the engine thread; a restored file's KV counts as exact: a seed's
        guarantee does not cover a conversation restored from its file)."""
        nodes, m = self._walk(tokens)
        if not nodes:
            e = torch.empty(0, dtype=torch.long)
            return e, e.clone()
        return torch.cat([n.full for n in nodes])[:m], torch.cat([n.win for n in nodes])[:m]

    def _window_positions(self, m: int) -> torch.Tensor:
        if not self.has_window or m == 0:
            return torch.empty(0, dtype=torch.long)
        return torch.arange(max(0, m - self.window + 1), m)

    def _servable(self, win: torch.Tensor, m: int) -> int:
        if not self.has_window:
            return m
        while m > 0:
            need = self._window_positions(m)
            missing = (win[need] < 0).nonzero()
            if not missing.numel():
                return m
            m = int(need[int(missing[-1])])  # serve at most up to the last missing position
        return 0

    @staticmethod
    def _cut(nodes: list[_Node], m: int) -> list[_Node]:
        """`nodes` with the one holding position m split there, so that locking the first m tokens
        leaves the rest free (a later insert may swap in exact KV for them)."""
        total = 0
        for i, n in enumerate(nodes):
            if total < m < total + len(n.tokens):
                return nodes[:i] + [n.split(m - total)]
            total += len(n.tokens)
        return nodes

    def _lock_upto(self, nodes: list[_Node], m: int) -> list[_Node]:
        out, total, now = [], 0, next(_clock)
        for n in nodes:
            if total >= m:
                break
            n.lock += 1
            n.holders.append(out)
            n.last_used = now
            out.append(n)
            total += len(n.tokens)
        return out

    def release(self, nodes: list[_Node]) -> None:
        for n in list(nodes):
            n.lock -= 1
            assert n.lock >= 0
            n.holders = [h for h in n.holders if h is not nodes]

    # --- insertion ---------------------------------------------------------------------------
    def insert(self, tokens: list[int], full_slots: torch.Tensor, win_slots: torch.Tensor,
               exact: Optional[torch.Tensor] = None):
        """Offer the slots of `tokens` (win_slots -1 where the sequence has none; `exact` [n] bool,
        default all: which were computed in a prefill forward of >= EXACT_ROWS rows) to the tree.

        Returns (locked node path, full_taken [n], win_taken [n]): the tree owns the slots marked
        taken from now on. Where it already holds other slots for the same tokens that someone
        reads (a locked node: two requests prefilled the same prompt), the sequence keeps its own
        and frees them when it ends; a node nobody reads takes the sequence's slots and frees its
        own, so no two copies of the same KV sit in the pool (a request recomputed a prefix whose
        match was cut short by evicted window slots, e.g. after a preemption, or a decoded answer
        in the next turn's prefill), unless the node's copy has more exact tokens.
        """
        t = torch.tensor(tokens, dtype=torch.long)
        exact = torch.ones(len(tokens), dtype=torch.bool) if exact is None else exact
        nodes, m = self._walk(tokens)
        full_taken = torch.zeros(len(tokens), dtype=torch.bool)
        win_taken = torch.zeros(len(tokens), dtype=torch.bool)
        done = 0
        for node in nodes:  # the cached part
            n = len(node.tokens)
            inc_full, inc_win, inc_exact = full_slots[done:done + n], win_slots[done:done + n], exact[done:done + n]
            if node.lock == 0 and bool((inc_full >= 0).all()) and not torch.equal(node.full, inc_full) \
                    and int(inc_exact.sum()) >= int(node.exact.sum()):
                self.pools.full.free(node.full)  # unread: swap its copy for the sequence's
                node.full, node.exact = inc_full.clone(), inc_exact.clone()
                full_taken[done:done + n] = True
                swap = inc_win >= 0
                self.pools.window.free(node.win[swap & (node.win >= 0)])
                node.win = torch.where(swap, inc_win, node.win)
                win_taken[done:done + n] = swap
            else:  # adopt only window slots the tree lacks
                adopt = (node.win < 0) & (inc_win >= 0)
                node.win = torch.where(adopt, inc_win, node.win)
                win_taken[done:done + n] = adopt
            done += n
        if m < len(tokens):
            parent = nodes[-1] if nodes else self.root
            leaf = _Node(t[m:], full_slots[m:].clone(), win_slots[m:].clone(), exact[m:].clone(), parent)
            parent.children[int(t[m])] = leaf
            nodes = nodes + [leaf]
            full_taken[m:] = True
            win_taken[m:] = win_slots[m:] >= 0
        return self._lock_upto(nodes, len(tokens)), full_taken, win_taken

    # --- eviction ------------------------------------------------------------------------------
    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, full_tokens: int = 0, window_tokens: int = 0) -> None:
        """Free unlocked cached KV, least recently used first, until each pool has the free slots
        asked for (or nothing evictable is left)."""
        if self.before_evict is not None and (self.pools.full.n_free < full_tokens
                                              or self.pools.window.n_free < window_tokens):
            self.before_evict()
        for n in sorted((n for n in self._nodes() if n.lock == 0), key=lambda n: n.last_used):
            if self.pools.window.n_free >= window_tokens:
                break
            self.pools.window.free(n.win[n.win >= 0])
            n.win = torch.full_like(n.win, -1)
        while self.pools.full.n_free < full_tokens:
            leaves = [n for n in self._nodes() if not n.children and n.lock == 0]
            if not leaves:
                break
            leaf = min(leaves, key=lambda n: n.last_used)
            self.pools.full.free(leaf.full)
            self.pools.window.free(leaf.win[leaf.win >= 0])
            del leaf.parent.children[int(leaf.tokens[0])]

    def cached_tokens(self) -> int:
        return sum(len(n.tokens) for n in self._nodes())

    def clear(self) -> None:
        self.evict(self.pools.full.capacity + 1, self.pools.window.capacity + 1)


class NaiveCache(RadixCache):
    """No reuse: every request prefills its whole prompt and frees its slots when done."""

    kind = "naive"

    def match(self, tokens: list[int], exact: bool = True) -> PrefixMatch:
        e = torch.empty(0, dtype=torch.long)
        return PrefixMatch(0, e, e, e, [])

    def lookup(self, tokens):
        e = torch.empty(0, dtype=torch.long)
        return e, e.clone()

    def insert(self, tokens, full_slots, win_slots, exact=None):
        none = torch.zeros(len(tokens), dtype=torch.bool)
        return [], none, none


def make_prefix_cache(kind: str, pools: HybridKVPool, window: Optional[int]):
    if kind not in ("radix", "naive"):
        raise ValueError(f"unknown --cache-type '{kind}' (radix or naive)")
    return (RadixCache if kind == "radix" else NaiveCache)(pools, window)
