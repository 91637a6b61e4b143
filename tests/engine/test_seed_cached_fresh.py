"""A seed means the same answer: a prompt served from the prefix cache gives the logits a fresh
prefill of it gives, bit for bit, at every sampled step, in every KV format: a cached tail shorter
than ggml's 8-row product kernel, a second turn over the first turn's decoded answer, decode windows
of 512 keys and more, and a pool whose free slots are scattered (engine/kv/canonical.py)."""
from __future__ import annotations

import pytest
import torch

from engine import sampler as smp
from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig

FORMATS = ["fp32", "int8_per_token_head", "fp8_per_token_head"]
SEED = dict(temperature=0.9, seed=11)


@pytest.fixture(scope="module")
def demo(gemma3_270m_path):
    from engine import api

    lm = api.open_model(gemma3_270m_path, exact=False)
    words = lm.tokenizer.encode(
        "The lighthouse keeper climbed the stairs every evening to light the lamp, and every morning he "
        "wrote in his log the ships he had seen, the weather, the height of the tide and the birds that "
        "rested on the gallery rail. In the winter of the great storm the lamp failed twice, and both "
        "times he carried a lantern up the tower and stood there until the dawn came over the water.")
    return lm, [2] + words


@pytest.fixture
def logits_seen():
    """Every logits row the sampler is handed, in order (a spy on Sampler.sample)."""
    seen: list[torch.Tensor] = []
    sample = smp.Sampler.sample

    def spy(self, logits, history=None):
        seen.append(logits.float().clone())
        return sample(self, logits, history)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smp.Sampler, "sample", spy)
        yield seen


def _engine(lm, fmt: str, cache: str = "radix", **more) -> Engine:
    return Engine(lm.model, None, EngineConfig(kv_cache_dtype=fmt, swa_kv_cache_dtype=fmt, cache_type=cache,
                                               **{"full_tokens": 2048, **more}))


def _serve(eng: Engine, seen: list, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    seen.clear()
    req = eng.add(ids, SamplingParams(max_tokens=n, **SEED))
    eng.run_to_completion()
    assert req.finish_reason == "length", req.error
    return req.output_ids, list(seen)


def _same(cached, fresh) -> None:
    assert cached[0] == fresh[0]
    assert len(cached[1]) == len(fresh[1]) == len(fresh[0])
    for step, (a, b) in enumerate(zip(cached[1], fresh[1])):
        assert torch.equal(a, b), f"step {step}: logits differ by up to {float((a - b).abs().max()):.3g}"


@pytest.mark.parametrize("fmt,tail", [("fp32", 3), ("fp32", 12), ("int8_per_token_head", 3),
                                      ("fp8_per_token_head", 12)])
def test_a_cached_prefix_gives_the_fresh_prefills_logits(demo, logits_seen, fmt, tail):
    """Prompt A, then B = A + `tail` tokens on the same engine (B's prefix served from A's KV,
    including A's last token, computed alone) against B on an engine with no prefix cache; and B
    again (all but its last token cached)."""
    lm, words = demo
    a, b = words[:30], words[:30 + tail]
    eng = _engine(lm, fmt)
    _serve(eng, logits_seen, a, 1)
    cached = _serve(eng, logits_seen, b, 3)
    assert eng.cache.cached_tokens() > len(b)
    again = _serve(eng, logits_seen, b, 3)
    fresh = _serve(_engine(lm, fmt, "naive"), logits_seen, b, 3)
    _same(cached, fresh)
    _same(again, fresh)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_second_turn_over_the_answer_gives_the_fresh_prefills_logits(demo, logits_seen, fmt):
    """Turn 2's prompt holds turn 1's prompt and its decoded answer: served on the same engine
    (the answer's KV came from decode steps) against the whole conversation prefilled afresh."""
    lm, words = demo
    eng = _engine(lm, fmt)
    first = words[:24]
    answer, _ = _serve(eng, logits_seen, first, 10)
    second = first + answer + words[24:36]
    cached = _serve(eng, logits_seen, second, 3)
    fresh = _serve(_engine(lm, fmt, "naive"), logits_seen, second, 3)
    _same(cached, fresh)


def _long_prompt(words: list[int], n: int) -> list[int]:
    return (words * (n // len(words) + 1))[:n]


@pytest.mark.parametrize("fmt", ["fp32", "int8_per_token_head"])
def test_decode_windows_of_512_keys_and_more_repeat_when_cached(demo, logits_seen, fmt):
    """A 600-token prompt whose first 560 were another prompt's: every decode step attends over
    more than 512 keys on the full layers and 512 on the sliding ones (ggml splits such windows
    between threads), with the cached prefix's slots below another request's."""
    lm, words = demo
    long = _long_prompt(words, 600)
    eng = _engine(lm, fmt)
    _serve(eng, logits_seen, long[:560], 2)
    cached = _serve(eng, logits_seen, long, 4)
    fresh = _serve(_engine(lm, fmt, "naive"), logits_seen, long, 4)
    _same(cached, fresh)


def test_long_windows_repeat_on_a_scattered_pool(demo, logits_seen):
    """The same 600-token prompt on an empty pool and where every other slot of both pools is held:
    the keys are gathered into order (the window would not fit the slab), the same logits."""
    lm, words = demo
    long = _long_prompt(words, 600)
    clean = _serve(_engine(lm, "fp32", "naive"), logits_seen, long, 3)
    eng = _engine(lm, "fp32", "naive")
    for pool in (eng.pools.full, eng.pools.window):
        pool.free(pool.alloc(pool.capacity)[::2])  # held: every other slot
    _same(_serve(eng, logits_seen, long, 3), clean)
