"""Radix prefix cache: matching, locking, LRU eviction, and serving only what the window pool holds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.generate import generate
from engine.kv import resolve_format
from engine.kv import HybridKVPool
from engine.prefix_cache import RadixCache
from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig
from models.loader import load_model
from tiny_models import TinySpec, write_tiny_gemma4

W = 8  # the tiny model's sliding window


class _Cfg:
    """A 2-layer layout: layer 0 sliding, layer 1 full, both owning KV."""

    n_layer, n_kv_head, head_dim, is_sliding, kv_shared_layers = 2, 1, 4, (True, False), ()

    def has_kv(self, i):
        return True

    def kv_source(self, i):
        return i


def _pools(full=64, window=64):
    f = resolve_format("fp32")
    return HybridKVPool(_Cfg(), full, window, f, f)


def _offer(cache, pools, tokens, keep_window_from=0):
    """Insert `tokens` as a finished sequence holding window slots from `keep_window_from` on."""
    full = pools.full.alloc(len(tokens))
    win = torch.full((len(tokens),), -1, dtype=torch.long)
    win[keep_window_from:] = pools.window.alloc(len(tokens) - keep_window_from)
    nodes, _, _ = cache.insert(tokens, full, win)
    cache.release(nodes)
    return full


def test_match_returns_cached_slots_and_leaves_one_token():
    pools = _pools()
    cache = RadixCache(pools, W)
    toks = list(range(100, 120))
    full = _offer(cache, pools, toks)
    m = cache.match(toks)
    assert m.length == len(toks) - 1 and torch.equal(m.full_slots, full[:-1])
    assert m.win_pos.tolist() == list(range(len(toks) - W, len(toks) - 1))
    cache.release(m.nodes)
    branch = cache.match(toks[:12] + list(range(7, 16)))  # 8 new rows before the last: none stepped back
    assert branch.length == 12 and torch.equal(branch.full_slots, full[:12])
    cache.release(branch.nodes)


def test_match_serves_only_exact_rows_and_never_leaves_a_short_tail():
    """Tokens whose KV came from forwards of fewer than EXACT_ROWS rows (a prompt's last token, a
    decoded answer) are not served; a match that would leave 1..7 rows before the prompt's last
    token steps back to leave 8; a prompt of fewer than 9 tokens is computed whole."""
    from engine.kv.canonical import EXACT_ROWS

    pools = _pools()
    cache = RadixCache(pools, None)
    toks = list(range(400, 440))
    exact = torch.ones(len(toks), dtype=torch.bool)
    exact[30:] = False  # position 30 on: decoded
    nodes, _, _ = cache.insert(toks, pools.full.alloc(len(toks)), torch.full((len(toks),), -1), exact)
    cache.release(nodes)
    served = cache.match(toks + list(range(7, 20)))
    assert served.length == 30  # up to the first decoded token
    cache.release(served.nodes)
    short_tail = cache.match(toks[:28] + [1, 2, 3])  # 30 rows before the last, 28 cached
    assert short_tail.length == 30 - EXACT_ROWS
    cache.release(short_tail.nodes)
    assert cache.match(toks[:6] + [1, 2]).length == 0


def test_match_is_shortened_to_where_window_slots_exist():
    pools = _pools()
    cache = RadixCache(pools, W)
    toks = list(range(200, 230))
    _offer(cache, pools, toks, keep_window_from=20)  # window slots only for positions 20..29
    full = cache.match(toks + [1])  # wants 30: needs positions 23..29 -> present
    assert full.length == 30
    cache.release(full.nodes)
    # wants 25: needs 18..24, 18 and 19 missing; every shorter m needs some position < 20 too,
    # and the root always serves, so the match shrinks to nothing rather than serving stale windows
    early = cache.match(toks[:25] + [1, 2])
    assert early.length == 0
    cache.release(early.nodes)


def test_locked_prefixes_survive_eviction_and_lru_goes_first():
    pools = _pools(full=40, window=40)
    cache = RadixCache(pools, W)
    a, b = list(range(10, 25)), list(range(50, 65))
    _offer(cache, pools, a)
    _offer(cache, pools, b)
    held = cache.match(b + [1])  # b is locked and most recently used
    cache.evict(full_tokens=pools.full.capacity)  # ask for everything
    assert cache.match(a + [1]).length == 0  # a (unlocked, older) is gone
    assert pools.full.n_used == len(b)
    cache.release(held.nodes)
    cache.clear()
    assert pools.full.n_used == 0 and pools.window.n_used == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(write_tiny_gemma4(tmp_path_factory.mktemp("pc") / "t.gguf", TinySpec(), seed=4))


def test_engine_evicts_old_prefixes_under_pressure(tiny):
    """A full pool just big enough for one conversation: older cached prompts are evicted, answers
    stay exact and the accounting ends balanced."""
    params = SamplingParams(max_tokens=10)
    eng = Engine(tiny.model, None, EngineConfig(full_tokens=60, window_tokens=200, max_running_requests=1))
    rng = np.random.default_rng(0)
    for k in range(5):
        prompt = [2] + rng.integers(11, 384, size=40).tolist()
        req = eng.add(prompt, params)
        eng.run_to_completion()
        assert req.output_ids == generate(tiny.model, prompt, params).ids, k
        assert eng.pools.full.n_used == eng.cache.cached_tokens() <= 60
    eng.cache.clear()
    assert eng.pools.full.n_used == 0 and eng.pools.window.n_used == 0


def test_splitting_a_locked_node_is_released_with_it():
    """A match that ends inside a node another holder locked splits it: the upper part is locked
    for that holder too, and its release unlocks both (no lock left once everyone released)."""
    pools = _pools()
    cache = RadixCache(pools, None)
    toks = list(range(300, 320))
    _offer(cache, pools, toks)
    held = cache.match(toks + [1])  # locks the whole node
    other = cache.match(toks[:9] + list(range(5, 14)))  # splits it after 9 tokens
    assert other.length == 9
    cache.release(other.nodes)
    cache.release(held.nodes)
    assert all(n.lock == 0 and not n.holders for n in cache._nodes())
    cache.evict(full_tokens=pools.full.capacity)
    assert pools.full.n_free == pools.full.capacity
