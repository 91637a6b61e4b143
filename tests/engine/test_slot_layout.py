"""Where a request's KV slots lie does not change its numbers: slots ascend with positions
(`KVPool.alloc` takes the lowest free ones above the sequence's last), and a short window runs
ggml's one-pass decode attention however fragmented the pool is (engine/kv/sequence.py
`_masked`), so a request computed afresh repeats bit for bit whatever other requests hold."""
from __future__ import annotations

import pytest
import torch

from engine import sampler as smp
from engine.kv import KVPool
from engine.kv.format import resolve_format
from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig


def test_alloc_takes_the_lowest_free_slots_above_the_sequence():
    pool = KVPool("full", {}, 20, resolve_format("bf16"))
    first = pool.alloc(9)
    pool.free(first[[1, 2, 6, 7]])  # holes at 1, 2, 6, 7
    assert pool.alloc(3).tolist() == [1, 2, 6]  # a new sequence: the lowest, ascending
    assert pool.alloc(2, above=6).tolist() == [7, 9]  # above its last slot: the hole at 7, then fresh
    pool.free(torch.tensor([3, 4]))
    assert pool.alloc(1, above=9).tolist() == [10]  # nothing freed above 9: a fresh slot, not 3
    assert pool.alloc(2, above=2).tolist() == [3, 4]
    pool.free(torch.tensor([0, 5]))
    # fewer free above than wanted (11..19 are, 10 wanted): the lowest free ones
    assert pool.alloc(10, above=10).tolist() == [0, 5] + list(range(11, 19))
    assert pool.free_slots().tolist() == [19] and pool.n_free == 1


def test_a_fresh_request_repeats_bit_for_bit_on_a_fragmented_pool(gemma3_270m_path):
    """The demo model, greedy, once on an empty pool and once where other sequences hold every
    15 slots of every 16 in both pools: the same logits at every step, not only the same tokens."""
    from engine import api

    lm = api.open_model(gemma3_270m_path, exact=False)
    prompt = [2] + lm.tokenizer.encode("The lighthouse keeper looked out over the")
    seen: list[torch.Tensor] = []
    sample = smp.Sampler.sample

    def spy(self, logits, history=None):
        seen.append(logits.float().clone())
        return sample(self, logits, history)

    def run(fragment: bool) -> tuple[list[int], list[torch.Tensor]]:
        eng = Engine(lm.model, None, EngineConfig(full_tokens=1024))
        if fragment:
            for pool in (eng.pools.full, eng.pools.window):
                pool.free(pool.alloc(1024)[::16])  # held: 15 slots of every 16
        seen.clear()
        req = eng.add(prompt, SamplingParams(temperature=0.0, max_tokens=8))
        eng.run_to_completion()
        return req.output_ids, list(seen)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smp.Sampler, "sample", spy)
        clean, scattered = run(False), run(True)
    assert clean[0] == scattered[0] and len(clean[1]) == 8
    assert all(torch.equal(a, b) for a, b in zip(clean[1], scattered[1]))
