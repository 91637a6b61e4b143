"""The engine gives the reference's greedy tokens in every mode, and keeps its KV accounting honest.

Reference: `engine.generate.generate` (one sequence, contiguous KV, every layer on every row).
Tiny Gemma-4 prompts are longer than its sliding window (8), chunks shorter than it.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.client import GenerationParams, LocalClient
from engine.generate import generate
from engine.sampler import SamplingParams
from engine.scheduler import ContextOverflowError, Engine, EngineConfig
from models.loader import load_model
from tiny_models import TinySpec, write_tiny_gemma4

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_gemma4(tmp_path_factory.mktemp("eng") / "tiny.gguf", TinySpec(), seed=21)
    return load_model(path)


def _prompt(n: int, seed: int) -> list[int]:
    return [2] + np.random.default_rng(seed).integers(11, 384, size=n - 1).tolist()


def _run(model, prompts, **cfg) -> tuple[list[list[int]], Engine]:
    eng = Engine(model, None, EngineConfig(full_tokens=1024, **cfg))
    reqs = [eng.add(p, GREEDY) for p in prompts]
    eng.run_to_completion()
    return [r.output_ids for r in reqs], eng


MODES = {
    "default (radix, fast prefill, one chunk)": {},
    "debug: shared layers keep own KV": {"share_kv": False},
    "naive cache": {"cache_type": "naive"},
    "chunked prefill (5 < window 8)": {"prefill_chunk": 5},
    "chunked, fast prefill off": {"prefill_chunk": 5, "fast_prefill": False},
    "fast prefill off": {"fast_prefill": False},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_identical_to_reference(tiny, mode):
    prompt = _prompt(37, seed=1)
    ref = generate(tiny.model, prompt, GREEDY).ids
    out, _ = _run(tiny.model, [prompt], **MODES[mode])
    assert out[0] == ref


def test_four_concurrent_equal_four_one_by_one(tiny):
    prompts = [_prompt(n, seed=s) for n, s in ((30, 2), (19, 3), (41, 4), (12, 5))]
    together, eng = _run(tiny.model, prompts, max_running_requests=4, prefill_chunk=7)
    alone = [_run(tiny.model, [p], max_running_requests=1)[0][0] for p in prompts]
    assert together == alone
    assert together == [generate(tiny.model, p, GREEDY).ids for p in prompts]


@pytest.mark.parametrize("fmt", ["fp32", "int8_per_token_head", "fp8_per_token_head"])
def test_chat_turns_hit_the_prefix_cache(tiny, fmt):
    """Turn 2 and 3 prefill only their new tokens and decode exactly what a cold run decodes (no
    seed: the previous answer's decode-step KV is served too, engine/prefix_cache.py)."""
    cfg = {"kv_cache_dtype": fmt, "swa_kv_cache_dtype": fmt, "prefill_chunk": 6}
    eng = Engine(tiny.model, None, EngineConfig(full_tokens=1024, **cfg))
    history = _prompt(33, seed=6)
    for turn, new in enumerate(([], [105, 40, 41, 42, 106], [105, 43, 44, 106, 7])):
        history = history + new
        req = eng.add(history, GREEDY)
        eng.run_to_completion()
        cold, _ = _run(tiny.model, [history], cache_type="naive", **cfg)
        assert req.output_ids == cold[0], f"turn {turn + 1}"
        if turn:
            # the previous turn is reused up to its last sampled token, whose KV was never computed
            assert req.cached_len == len(history) - len(new) - 1
            assert req.stats()["prefilled_tokens"] == len(new) + 1
        history = history + req.output_ids


def test_regenerate_reuses_the_whole_prompt(tiny):
    eng = Engine(tiny.model, None, EngineConfig(full_tokens=1024))
    prompt = _prompt(29, seed=8)
    first = eng.add(prompt, GREEDY)
    eng.run_to_completion()
    again = eng.add(prompt, GREEDY)
    eng.run_to_completion()
    assert again.cached_len == len(prompt) - 1 and again.output_ids == first.output_ids


def test_abort_frees_slots(tiny):
    eng = Engine(tiny.model, None, EngineConfig(full_tokens=256, cache_type="naive"))
    before = (eng.pools.full.n_used, eng.pools.window.n_used)
    req = eng.add(_prompt(20, seed=9), SamplingParams(max_tokens=100))
    for _ in range(5):
        eng.step()
    assert eng.pools.full.n_used > before[0]
    eng.abort(req.id)
    assert (eng.pools.full.n_used, eng.pools.window.n_used) == before
    assert req.finish_reason == "abort" and not eng.has_work
    # radix: the aborted sequence is cached; clearing the cache returns every slot
    eng2 = Engine(tiny.model, None, EngineConfig(full_tokens=256))
    req2 = eng2.add(_prompt(20, seed=9), SamplingParams(max_tokens=100))
    for _ in range(5):
        eng2.step()
    eng2.abort(req2.id)
    assert eng2.pools.full.n_used == eng2.cache.cached_tokens()
    eng2.cache.clear()
    assert (eng2.pools.full.n_used, eng2.pools.window.n_used) == (0, 0)


def test_stops_on_max_tokens_and_stop_strings(tiny):
    eng = Engine(tiny.model, tiny.tokenizer, EngineConfig(full_tokens=512))
    req = eng.add(_prompt(15, seed=10), SamplingParams(max_tokens=5))
    eng.run_to_completion()
    assert len(req.output_ids) == 5 and req.finish_reason == "length"
    full = req.text
    assert len(full) > 2
    stop = full[1:3]
    req2 = eng.add(_prompt(15, seed=10), SamplingParams(max_tokens=5), stop_strings=(stop,))
    eng.run_to_completion()
    assert req2.finish_reason == "stop" and req2.text == full[:full.find(stop)] and stop not in req2.text
    events = [req2.events.get_nowait() for _ in range(req2.events.qsize())]
    assert "".join(e.text for e in events) == req2.text and events[-1].finished


def test_context_overflow_is_a_clear_error(tiny):
    eng = Engine(tiny.model, None, EngineConfig(full_tokens=64))
    with pytest.raises(ContextOverflowError, match="prompt of 80 tokens does not fit the 64-token context"):
        eng.add(_prompt(80, seed=11), GREEDY)


def test_client_streams_and_truncates_old_turns(tiny):
    client = LocalClient(tiny, EngineConfig(full_tokens=96), context_overflow="truncate")
    try:
        long = " ".join(["the"] * 30)
        msgs = [{"role": "system", "content": "be brief"}]
        for i in range(4):
            msgs += [{"role": "user", "content": long}, {"role": "assistant", "content": long}]
        msgs.append({"role": "user", "content": "the end"})
        rid = client.submit(msgs, GenerationParams(SamplingParams(max_tokens=6)))
        events = list(client.stream(rid, timeout=60))
        assert events[-1].finished and events[-1].finish_reason in ("length", "stop")
        assert sum(len(e.token_ids) for e in events) <= 6
        status = client.status()
        assert status["pools"]["full"]["capacity"] == 96
    finally:
        client.close()
    strict = LocalClient(tiny, EngineConfig(full_tokens=96))
    try:
        with pytest.raises(ContextOverflowError):
            strict.submit(msgs)
    finally:
        strict.close()


def test_status_and_runtime_rebuild(tiny):
    eng = Engine(tiny.model, None, EngineConfig(full_tokens=300))
    eng.add(_prompt(20, seed=12), GREEDY)
    eng.run_to_completion()
    st = eng.status()
    assert st["pools"]["full"]["slabs"] == 1 and st["pools"]["window"]["slabs"] == 3  # layers 0-3 own KV
    assert st["cached_prefix_tokens"] > 0 and st["pools"]["full"]["format"] == "fp32"
    eng.rebuild(full_tokens=500, kv_cache_dtype="int8_per_token_head")
    st = eng.status()
    assert st["pools"]["full"]["capacity"] == 500 and st["pools"]["full"]["format"] == "int8_per_token_head"
    assert st["cached_prefix_tokens"] == 0 and st["pools"]["full"]["used"] == 0


def test_gemma3_270m_engine_matches_reference(gemma3_270m_path):
    """Real weights, a prompt past the 512-token window: chunked fast prefill, radix reuse, naive."""
    from gemma3_text import TEXT

    lm = load_model(gemma3_270m_path)
    prompt = lm.tokenizer.encode(TEXT)[:560]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    ref = generate(lm.model, prompt, params).ids
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(full_tokens=2048, prefill_chunk=200))
    r1 = eng.add(prompt, params)
    eng.run_to_completion()
    assert r1.output_ids == ref
    turn2 = prompt + r1.output_ids + lm.tokenizer.encode("\nAnd then", add_bos=False)
    r2 = eng.add(turn2, params)
    eng.run_to_completion()
    assert r2.cached_len == len(prompt) + len(r1.output_ids) - 1
    assert r2.output_ids == generate(lm.model, turn2, params).ids
    # naive cache, one-shot prefill, fast prefill off, two requests at once
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(full_tokens=2048, prefill_chunk=1024, cache_type="naive",
                                                       fast_prefill=False))
    a, b = eng.add(prompt, params), eng.add(prompt[:300], params)
    eng.run_to_completion()
    assert a.output_ids == ref and b.output_ids == generate(lm.model, prompt[:300], params).ids


def test_decode_attention_over_slot_runs_equals_one_gather():
    """One query over K/V split in runs (views of a pool's consecutive slots) equals attention over
    the gathered K/V: causal and windowed, GQA 6 heads on 2 KV heads, odd run lengths."""
    import torch

    from models.ops import attention, decode_attention_parts

    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(41, 2, 24, generator=g), torch.randn(41, 2, 24, generator=g)
    k_pos = torch.arange(41)
    q = torch.randn(1, 6, 24, generator=g)
    cuts = [0, 7, 8, 30, 41]
    for window in (None, 16):
        for q_pos in (40, 35):  # the last key, and keys after the query (hidden)
            want = attention(q.double(), k.double(), v.double(), torch.tensor([q_pos]), k_pos, window, 0.2)
            got = decode_attention_parts(q, [k[a:b] for a, b in zip(cuts, cuts[1:])],
                                         [v[a:b] for a, b in zip(cuts, cuts[1:])], torch.tensor([q_pos]),
                                         [k_pos[a:b] for a, b in zip(cuts, cuts[1:])], window, 0.2)
            assert torch.allclose(got.double(), want, atol=1e-5)


def test_decode_reads_the_visible_keys_in_place_after_chunked_prefill(tiny, monkeypatch):
    """After a chunked prefill a sequence's slots ascend with its positions, so a decode step's
    visible keys are one slot run read in place (a view of the slab, no gather); the tokens equal
    the reference."""
    import engine.kv.sequence as skv

    seen = []
    visible = skv.SequenceKV._visible_kv

    def spy(self, layer, window):
        k, v = visible(self, layer, window)
        slab = self.pools.pool_of(self.pools.slab(layer)).k[self.pools.slab(layer)]
        seen.append(k.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr())
        return k, v
    monkeypatch.setattr(skv.SequenceKV, "_visible_kv", spy)
    prompt = _prompt(45, seed=3)
    out, eng = _run(tiny.model, [prompt], prefill_chunk=5)
    assert out[0] == generate(tiny.model, prompt, GREEDY).ids
    assert seen and all(seen)
    pool = eng.pools.window  # slots freed together are handed out again in the same order
    got = pool.alloc(6)
    pool.free(got)
    assert pool.alloc(6).tolist() == got.tolist() == sorted(got.tolist())


def test_a_script_that_never_closes_its_client_exits_cleanly(gemma3_270m_path):
    """An open client is closed at interpreter exit: its engine thread still running while Python
    finalized aborted the process (libstdc++'s terminate, exit status 134) in 4 of 6 runs here."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys\nfrom pathlib import Path\nfrom engine import api\n"
              f"lm = api.open_model(Path({str(gemma3_270m_path)!r}), exact=False)\n"
              "c = api.start_client(lm, api.EngineOptions())\n"
              "r = api.run_prompt(c, lm, 'hi', api.GenerationParams(api.SamplingParams(max_tokens=3)))\n"
              "print(len(r['ids']))\n")
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "3" and "terminate called" not in run.stderr
