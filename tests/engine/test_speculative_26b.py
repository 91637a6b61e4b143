"""Speculative decoding over a 26B-A4B-like MoE target (tests/models/test_gemma4_assistant_26b.py's
pair) on the exact float64 path: greedy output with the draft equals the target's alone for
several draft lengths, with the real (random, rarely right) assistant and with drafts that are
the target's own tokens up to a wrong one at a varying depth (every acceptance length 0..k)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine import scheduler
from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig
from engine.speculative import SpecConfig
from models.gemma4_assistant import load_gemma4_assistant
from models.gguf import GGUFFile
from models.loader import load_model
from tiny_models import TinySpec, write_tiny_assistant, write_tiny_gemma4

TARGET = TinySpec(n_layer=6, pattern=[True] * 5 + [False], n_kv_shared=0, ple_width=0, n_head=4,
                  n_kv_head=[2] * 5 + [1], n_expert=4, n_expert_used=2, expert_ffn=128, double_wide=False,
                  v_on_full_layers=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec26b")
    target = load_model(write_tiny_gemma4(d / "t.gguf", TARGET, seed=41), dtype=torch.float64)
    draft = load_gemma4_assistant(GGUFFile(write_tiny_assistant(d / "a.gguf", TARGET, seed=42, d_model=96)),
                                  dtype=torch.float64)
    return target, draft


def _prompts():
    rng = np.random.default_rng(5)
    return [[2] + rng.integers(11, TARGET.n_vocab, size=n - 1).tolist() for n in (19, 11)]


def _generate(target, prompts, spec=None):
    eng = Engine(target.model, target.tokenizer, EngineConfig(full_tokens=1024), spec=spec)
    reqs = [eng.add(p, GREEDY) for p in prompts]
    eng.run_to_completion()
    return [r.output_ids for r in reqs], eng


@pytest.fixture(scope="module")
def plain(pair):
    return _generate(pair[0], _prompts())[0]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_the_assistant_equals_the_target_alone(pair, plain, k):
    target, draft = pair
    out, eng = _generate(target, _prompts(), SpecConfig(draft, tokens=k, adaptive=False))
    assert out == plain
    st = eng.status()["speculative"]
    assert st["rounds"] > 0 and st["drafted"] > 0


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_with_drafts_wrong_at_every_depth_equals_the_target_alone(pair, plain, k, monkeypatch):
    """Drafts are the target's own next tokens with the i-th one wrong, i cycling over 0..k (k: all
    right), so rounds accept every length from 0 to k and roll the rest of the KV back."""
    target, draft = pair
    prompts = _prompts()
    eng = Engine(target.model, target.tokenizer, EngineConfig(full_tokens=1024), spec=SpecConfig(draft, tokens=k, adaptive=False))
    reqs = [eng.add(p, GREEDY) for p in prompts]
    wrong_at = itertools.cycle(range(k + 1))

    def oracle(spec, model, kv, last_token, h, pos, n):
        i = next(j for j, r in enumerate(reqs) if r.kv is kv)
        drafts = (prompts[i] + plain[i])[pos + 1:pos + 1 + n]
        wrong = next(wrong_at)
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % TARGET.n_vocab
        return drafts

    monkeypatch.setattr(scheduler, "draft_tokens", oracle)
    eng.run_to_completion()
    assert [r.output_ids for r in reqs] == plain
    st = eng.status()["speculative"]
    assert 0 < st["accepted"] < st["drafted"]
