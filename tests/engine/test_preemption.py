"""Preemption: when the KV pool runs out during decode, the newest running request gives its KV up,
waits and is recomputed; every request finishes with the tokens it gets alone, and only a request
that cannot fit the pool by itself ends with an error. Tiny Gemma-4 (window 8) on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig
from models.loader import load_model
from tiny_models import TinySpec, write_tiny_gemma4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_gemma4(tmp_path_factory.mktemp("preempt") / "tiny.gguf", TinySpec(), seed=33)
    return load_model(path)


def _prompt(n: int, seed: int) -> list[int]:
    return [2] + np.random.default_rng(seed).integers(11, 384, size=n - 1).tolist()


def _engine(model, full_tokens: int, **cfg) -> Engine:
    return Engine(model, None, EngineConfig(full_tokens=full_tokens, **cfg))


_SOLO: dict = {}


def _solo(model, prompt, params) -> list[int]:
    key = (tuple(prompt), params.max_tokens)
    if key not in _SOLO:
        eng = _engine(model, 1024, max_running_requests=1)
        req = eng.add(prompt, params)
        eng.run_to_completion()
        _SOLO[key] = req.output_ids
    return _SOLO[key]


MODES = {"one forward each": {"batched_decode": False},
         "batched decode, chunked prefill (5 < window 8)": {"batched_decode": True, "prefill_chunk": 5}}


@pytest.mark.parametrize("mode", list(MODES))
def test_requests_past_the_pool_are_preempted_and_finish_with_their_solo_tokens(tiny, mode):
    # 4 requests of 17..29 prompt tokens + 30 answer tokens: ~210 slots together, each < 60 alone,
    # in a 100-slot pool: some must give their KV up mid-answer.
    params = SamplingParams(max_tokens=30)
    prompts = [_prompt(n, seed=s) for n, s in ((23, 1), (17, 2), (29, 3), (20, 4))]
    eng = _engine(tiny.model, 100, max_running_requests=4, **MODES[mode])
    reqs = [eng.add(p, params) for p in prompts]
    streamed = {r.id: [] for r in reqs}
    while eng.has_work:
        eng.step()
        for r in reqs:
            while not r.events.empty():
                ev = r.events.get()
                streamed[r.id] += ev.token_ids
        eng.check()  # every slot free, cached or held exactly once, after every step
    assert [r.finish_reason for r in reqs] == ["length"] * 4
    assert sum(r.preemptions for r in reqs) >= 1
    for r, p in zip(reqs, prompts):
        alone = _solo(tiny.model, p, params)
        assert r.output_ids == alone
        assert streamed[r.id] == alone  # the stream paused, nothing repeated or lost
    assert eng.pools.full.n_free + eng.cache.cached_tokens() == eng.pools.full.capacity


def test_the_newest_request_is_the_one_preempted(tiny):
    eng = _engine(tiny.model, 90, max_running_requests=3, batched_decode=False)
    reqs = [eng.add(_prompt(20, seed=s), SamplingParams(max_tokens=30)) for s in (5, 6, 7)]
    eng.run_to_completion()
    assert reqs[0].preemptions == 0  # the oldest always keeps its KV
    assert reqs[-1].preemptions >= 1
    assert all(r.finish_reason == "length" for r in reqs)


def test_a_request_alone_runs_to_the_context_the_pool_sets_and_the_next_runs(tiny):
    # The context limit is capped by the full pool, so a request alone always fits: it ends with
    # "length" at 48 tokens (prompt + answer), never with a KV error, and the engine goes on.
    eng = _engine(tiny.model, 48)
    big = eng.add(_prompt(20, seed=8), SamplingParams(max_tokens=40))
    eng.run_to_completion()
    assert big.finish_reason == "length" and len(big.all_ids) == 48 and big.preemptions == 0
    small = eng.add(_prompt(12, seed=9), SamplingParams(max_tokens=10))
    eng.run_to_completion()
    assert small.finish_reason == "length" and len(small.output_ids) == 10
    eng.check()


def test_preempted_request_reports_the_cache_hit_of_its_first_admission(tiny):
    eng = _engine(tiny.model, 100, max_running_requests=3, batched_decode=False)
    reqs = [eng.add(_prompt(25, seed=s), SamplingParams(max_tokens=30)) for s in (10, 11, 12)]
    eng.run_to_completion()
    last = reqs[-1]
    assert last.preemptions >= 1
    stats = last.stats()
    assert stats["cached_tokens"] == 0 and stats["prefilled_tokens"] == 25 and stats["preemptions"] == last.preemptions
