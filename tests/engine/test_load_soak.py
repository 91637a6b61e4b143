"""Load and soak through the client: many requests against a small pool, and hundreds of turns over
many conversations with stops, regenerates, edits and injected failures. After every turn, once
idle: every KV slot is free or held by the prefix cache exactly once (Engine.check), nothing
escaped, nothing hangs. Figures are printed (`pytest -s`) and quoted in
docs/benchmarks.md#reliability-failpoints-load-soak-signals."""
from __future__ import annotations

import os
import random
import resource
import time

import pytest

from engine import failpoints
from engine.api import EngineOptions, GenerationParams, SamplingParams, open_model, start_client
from tiny_models import TinySpec, write_tiny_gemma4

# `make test` runs a short soak; EDGEGEM_SOAK_TURNS=300 (or more) is the long one docs/benchmarks.md quotes.
SOAK_TURNS = int(os.environ.get("EDGEGEM_SOAK_TURNS", "100"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return open_model(write_tiny_gemma4(tmp_path_factory.mktemp("soak") / "t.gguf", TinySpec(), seed=9), exact=False)


@pytest.fixture(autouse=True)
def disarm():
    yield
    failpoints.configure(None)


def _idle_check(client) -> dict:
    """Engine.check once idle, and the pools' accounting: free + cached = capacity."""
    def look(e):
        assert not e.running and not e.waiting
        e.check()
        return {"full_free": e.pools.full.n_free, "full_cap": e.pools.full.capacity,
                "cached": e.cache.cached_tokens()}
    return client.call(look)


def test_eight_concurrent_requests_past_the_pool_all_finish_by_preemption(tiny):
    """8 requests whose prompts and answers together need ~3x the full pool: the newest give their
    KV up and are recomputed later (engine/scheduler.py), so every one completes; none hangs;
    afterwards nothing is leaked."""
    rng = random.Random(0)
    client = start_client(tiny, EngineOptions(max_running_requests=8))
    client.rebuild(full_tokens=160, window_tokens=400)
    try:
        prompts = [" ".join(rng.choice(["cat", "dog", "mat", "sun", "hat", "sea"]) for _ in range(rng.randint(20, 35)))
                   for _ in range(8)]
        t0 = time.perf_counter()
        ids = [client.submit([{"role": "user", "content": p}], GenerationParams(SamplingParams(max_tokens=24)))
               for p in prompts]
        ends = [list(client.stream(i, timeout=120))[-1] for i in ids]
        took = time.perf_counter() - t0
        reasons = [e.finish_reason for e in ends]
        assert all(r in ("stop", "length") for r in reasons), [e.error for e in ends]
        preempted = sum(e.stats["preemptions"] for e in ends)
        assert preempted >= 1  # the pool was too small for them together
        st = _idle_check(client)
        assert st["full_free"] + st["cached"] == st["full_cap"]
        print(f"\nload: 8 requests, full pool 160 tokens: {8 - reasons.count('error')} completed, "
              f"{preempted} preemptions, {took:.1f} s, leaks 0")
    finally:
        client.close()


@pytest.mark.slow
def test_soak_hundreds_of_turns_over_many_conversations(tiny):
    rng = random.Random(1)
    words = "the cat sat on a mat while dogs ran far and the sun set over blue hills".split()
    client = start_client(tiny, EngineOptions(max_running_requests=2, context_overflow="truncate"))
    client.rebuild(full_tokens=600, window_tokens=600)  # small: conversations evict each other
    convs: list[list[dict]] = [[] for _ in range(12)]
    counts = {"turns": 0, "stopped": 0, "regenerated": 0, "edited": 0, "errors_seen": 0}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        for turn in range(SOAK_TURNS):
            conv = convs[rng.randrange(len(convs))]
            action = rng.random()
            if action < 0.1 and conv and conv[-1]["role"] == "assistant":  # regenerate the last answer
                conv.pop()
                counts["regenerated"] += 1
            elif action < 0.2 and len(conv) >= 2:  # edit the last message and resend
                del conv[-2:]
                conv.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))})
                counts["edited"] += 1
            else:
                conv.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 30)))})
            if len(conv) > 12:  # keep the history inside the context
                del conv[:2]
            if rng.random() < 0.07:  # a failure now and then, in this turn's forwards or step
                failpoints.configure(f"{rng.choice(['forward.oom', 'step.error'])}@{rng.randint(1, 4)}")
            stop_after = rng.randint(1, 5) if rng.random() < 0.15 else None
            rid = client.submit(conv, GenerationParams(SamplingParams(max_tokens=rng.randint(2, 10),
                                                                      temperature=rng.choice([0.0, 0.8]),
                                                                      seed=turn)))
            text, last = "", None
            for n, ev in enumerate(client.stream(rid, timeout=60)):
                text += ev.text
                last = ev
                if stop_after is not None and n + 1 == stop_after:
                    client.abort(rid)
            counts["stopped"] += last.finish_reason == "abort"
            if last.finish_reason == "error":
                counts["errors_seen"] += 1
                assert "\n" not in last.error
            conv.append({"role": "assistant", "content": text})
            if failpoints.ACTIVE and sum(failpoints.fired.values()):
                failpoints.configure(None)
            st = _idle_check(client)
            assert st["full_free"] + st["cached"] == st["full_cap"], (turn, st)
            counts["turns"] += 1
    finally:
        client.close()
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    print(f"\nsoak: {counts['turns']} turns over {len(convs)} conversations in {time.perf_counter() - t0:.0f} s; "
          f"{counts['stopped']} stopped, {counts['regenerated']} regenerated, {counts['edited']} edited, "
          f"{counts['errors_seen']} ended by injected failures; leaks 0; peak RSS grew {grew:.0f} MiB")
    assert counts["turns"] == SOAK_TURNS and counts["errors_seen"] > 0
