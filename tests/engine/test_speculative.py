"""Speculative decoding with the assistant draft leaves the target's output unchanged.

Tiny random target + draft pairs written by the test (tests/tiny_models.py). A random draft
accepts little, which is the hard case for bookkeeping: nearly every round rolls KV back.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sampler import Sampler, SamplingParams
from engine.scheduler import Engine, EngineConfig
from engine.speculative import SpecConfig, accept
from models.gemma4_assistant import load_gemma4_assistant
from models.gguf import GGUFFile
from tiny_models import TinySpec, load_tiny_pair, write_tiny_assistant, write_tiny_gemma4

SPEC = TinySpec()  # 8 layers, 4 KV-shared, window 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("spec"), SPEC)


def _prompt(n, seed):
    return [2] + np.random.default_rng(seed).integers(11, 384, size=n - 1).tolist()


def _generate(target, prompts, params, draft=None, k=3, **cfg):
    spec = SpecConfig(draft, tokens=k, adaptive=False) if draft is not None else None
    eng = Engine(target.model, target.tokenizer, EngineConfig(full_tokens=2048, **cfg), spec=spec)
    eng.reqs = [eng.add(p, params) for p in prompts]
    eng.run_to_completion()
    return [r.output_ids for r in eng.reqs], eng


def _logprobs(eng) -> list[list[float]]:
    """The sampled tokens' log-probabilities of each of `_generate`'s requests, in order."""
    from tests.models.test_ggml_layer import picked_logprobs

    return [picked_logprobs(r) for r in eng.reqs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=200)


@pytest.mark.parametrize("cfg", [{}, {"cache_type": "naive"},
                                 {"kv_cache_dtype": "int8_per_token_head",
                                  "swa_kv_cache_dtype": "int8_per_token_head"}],
                         ids=["radix", "naive", "int8-kv"])
def test_greedy_with_draft_equals_greedy_without(pair, cfg):
    target, draft = pair
    prompts = [_prompt(23, 1), _prompt(14, 2)]  # two concurrent requests
    plain, _ = _generate(target, prompts, GREEDY, **cfg)
    spec, eng = _generate(target, prompts, GREEDY, draft=draft, **cfg)
    assert spec == plain and all(len(o) >= 200 or o for o in spec)
    st = eng.status()["speculative"]
    assert st["rounds"] > 0 and st["drafted"] > 0
    assert st["tokens_per_target_forward"] >= 1.0
    # every pool slot is accounted for after rollbacks: used == what the prefix cache holds
    assert eng.pools.full.n_used == eng.cache.cached_tokens()


def test_second_turn_with_draft_hits_prefix_cache(pair):
    target, draft = pair
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prompt = _prompt(30, 3)
    eng = Engine(target.model, target.tokenizer, EngineConfig(full_tokens=2048), spec=SpecConfig(draft, 2, adaptive=False))
    r1 = eng.add(prompt, params)
    eng.run_to_completion()
    turn2 = prompt + r1.output_ids + [105, 40, 41, 106]
    r2 = eng.add(turn2, params)
    eng.run_to_completion()
    assert r2.cached_len >= len(prompt) + len(r1.output_ids) - 1
    plain, _ = _generate(target, [turn2], params)
    assert r2.output_ids == plain[0]


def test_draft_for_another_target_is_refused(tmp_path, pair):
    target, _ = pair
    other = TinySpec(d_model=512)
    bad = load_gemma4_assistant(GGUFFile(write_tiny_assistant(tmp_path / "b.gguf", other, seed=1)))
    with pytest.raises(ValueError, match="embedding_length_out"):
        Engine(target.model, None, EngineConfig(full_tokens=64), spec=SpecConfig(bad))


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sample_then_match_keeps_the_target_distribution():
    """Rows with known target distributions: the first committed token follows row 0, and given
    the first draft was accepted, the second follows row 1 (what a sequential sampler would do)."""
    p0 = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    p1 = torch.tensor([0.1, 0.5, 0.2, 0.15, 0.05])
    p2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    logits = torch.log(torch.stack([p0, p1, p2]))
    drafts = [0, 1]  # the draft's guesses: row 0's and row 1's most likely tokens
    sampler = Sampler(SamplingParams(temperature=1.0, seed=123))
    first, second = np.zeros(5), np.zeros(5)
    for _ in range(8000):
        out = accept(sampler.sample, logits, drafts, [], frozenset())
        first[out[0]] += 1
        if out[0] == drafts[0]:
            assert len(out) >= 2
            second[out[1]] += 1
        else:
            assert len(out) == 1
    # chi-square, 4 degrees of freedom: 18.47 is the 0.001 critical value
    assert _chi2(first, p0.numpy()) < 18.47
    assert _chi2(second, p1.numpy()) < 18.47


def test_sampling_with_draft_matches_target_distribution(pair):
    """Temperature 1, top-k 4 on the tiny model: the second generated token (sampled at the first
    verify row) over many seeds follows the target's own next-token distribution."""
    target, draft = pair
    prompt = _prompt(12, 7)
    params = dict(temperature=1.0, top_k=4, max_tokens=2)
    eng = Engine(target.model, target.tokenizer, EngineConfig(full_tokens=4096), spec=SpecConfig(draft, 2, adaptive=False))
    pairs = []
    for seed in range(1500):
        r = eng.add(prompt, SamplingParams(seed=seed, **params))
        eng.run_to_completion()
        pairs.append(tuple(r.output_ids))
    firsts = [p[0] for p in pairs]
    t1 = max(set(firsts), key=firsts.count)
    seconds = np.array([p[1] for p in pairs if p[0] == t1 and len(p) > 1])
    from engine.sampler import logits_to_probs
    logits = target.model.forward(torch.tensor(prompt + [t1]))[-1]
    probs = logits_to_probs(logits, SamplingParams(**params)).numpy()
    support = np.nonzero(probs)[0]
    counts = np.array([(seconds == t).sum() for t in support], dtype=float)
    assert counts.sum() == len(seconds) > 200
    # top-k 4 -> 3 degrees of freedom: 16.27 is the 0.001 critical value
    assert _chi2(counts, probs[support]) < 16.27


def test_cli_run_with_draft(tmp_path):
    import json
    import subprocess
    import sys

    t = write_tiny_gemma4(tmp_path / "t.gguf", SPEC, seed=31)
    a = write_tiny_assistant(tmp_path / "a.gguf", SPEC, seed=32)

    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "app.cli", "run", "--model", str(t), "--prompt", "the cat",
                            "--max-tokens", "12", "--json", *extra], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.splitlines()[-1])

    plain, spec = run(), run("--spec-draft-model", str(a), "--spec-tokens", "3")
    assert spec["ids"] == plain["ids"] and plain["speculative"] is None
    assert spec["speculative"]["rounds"] > 0 and spec["speculative"]["drafted"] > 0
    bad = subprocess.run([sys.executable, "-m", "app.cli", "run", "--model", str(t), "--prompt", "x",
                          "--spec-draft-model", str(t)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unsupported architecture 'gemma4'" in bad.stderr


def test_spec_bench_reports_both_speeds_and_acceptance(tmp_path):
    from engine.bench import spec_bench

    t = write_tiny_gemma4(tmp_path / "t.gguf", SPEC, seed=31)
    a = write_tiny_assistant(tmp_path / "a.gguf", SPEC, seed=32)
    out = spec_bench(t, a, n_prompt=16, n_decode=12, spec_tokens=2)
    assert out["greedy_equal"] and out["plain_decode_tok_s"] > 0 and out["draft_decode_tok_s"] > 0
    assert out["drafted"] > 0 and 0.0 <= out["acceptance_rate"] <= 1.0 and out["verify_step_cost"] > 0
    assert "acceptance" in out["table"]


def test_greedy_with_draft_on_llama_cpp_kernels_equals_greedy_without(tmp_path):
    """Target and draft on the CPU runtime (a Q4_K_M target on llama.cpp's kernels, the draft's
    matrices too): the verify's 1 + k rows go through the token graph (models/token_graph.py),
    each row attending as the decode step at its position would, so greedy output and its
    log-probabilities are the plain decode's bit for bit."""
    from engine.api import load_draft, open_model
    from models.formats import GGMLWeight
    from models.runtime import Runtime, ggml_available
    from tiny_models import quantize_gguf

    if not ggml_available():
        pytest.skip("llama.cpp's kernels are not available here")
    t = quantize_gguf(write_tiny_gemma4(tmp_path / "t.gguf", SPEC, seed=31), tmp_path / "t-q4km.gguf")
    target = open_model(t, exact=False)
    spec = load_draft(str(write_tiny_assistant(tmp_path / "a.gguf", SPEC, seed=32)), target, spec_tokens=3)
    assert spec.draft.runtime is Runtime.GGML and isinstance(spec.draft.w["blk.0.attn_q.weight"], GGMLWeight)
    prompts = [_prompt(23, 1), _prompt(14, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=60, logprobs=1)
    plain, eng = _generate(target, prompts, params)
    plain_lp = _logprobs(eng)
    verify_rows = []
    step = type(target.model).decode_step

    def spy(self, x, pos, caches, pl=None):
        out = step(self, x, pos, caches, pl)
        if out is not None and len(set(map(id, caches))) == 1:
            verify_rows.append(x.shape[0])
        return out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(target.model), "decode_step", spy)
        drafted, eng = _generate(target, prompts, params, draft=spec.draft)
    assert drafted == plain and eng.status()["speculative"]["drafted"] > 0
    assert _logprobs(eng) == plain_lp
    assert max(verify_rows) == 4  # 1 + k rows of one sequence in one graph
