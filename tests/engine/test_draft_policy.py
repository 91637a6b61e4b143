"""The draft turns itself off where it cannot pay (engine/draft_policy.py): the decision from
injected timings and acceptances (no timing is asserted), and the engine's output with the draft
switched off that way equals the target's alone."""
from __future__ import annotations

import numpy as np
import pytest

from engine.draft_policy import DraftPolicy, expected_tokens, speedup
from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig
from engine.speculative import SpecConfig
from tiny_models import TinySpec, load_tiny_pair


def test_expected_tokens_is_the_geometric_sum():
    for a in (0.0, 0.3, 0.8):
        for k in range(5):
            assert expected_tokens(a, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert expected_tokens(1.0, 4) == 5
    assert speedup(0.5, 0, 9.0, 9.0) == 1.0  # no draft: plain decoding


def _measured(policy: DraftPolicy, t1: float, verify: dict, draft_step: float, rounds=()) -> None:
    """Feed the policy what an engine would: plain forwards, verify forwards, draft steps, rounds."""
    for _ in range(policy.warmup):
        policy.record_forward(1, t1)
    for rows, t in verify.items():
        policy.record_forward(rows, t)
    policy.record_draft(4, 4 * draft_step)
    for drafted, accepted in rounds:
        policy.record_round(drafted, accepted)


def test_moe_like_verify_cost_turns_the_draft_off_at_once():
    """Verifying 5 rows costs 4.6 decodes (5 rows route to nearly 5x the experts) and a draft step
    0.15: even a perfect draft's k + 1 tokens cost more than k + 1 decodes, for every k <= 4."""
    p = DraftPolicy(4)
    assert p.tokens() == 0 and p.reason.startswith("draft measuring")  # timing plain steps first
    _measured(p, 0.010, {5: 0.046}, 0.0015)
    assert p.tokens() == 0
    assert p.reason.startswith("draft off: verifying 5 tokens costs 4.60x one on this model")
    assert "even a perfect draft cannot pay" in p.reason and "\n" not in p.reason
    for _ in range(2 * p.probe_every):  # it is never tried again
        p.record_forward(1, 0.010)
        assert p.tokens() == 0


def test_dense_like_cost_with_good_acceptance_keeps_the_draft_on():
    p = DraftPolicy(4)
    _measured(p, 0.010, {5: 0.012}, 0.0005, rounds=[(4, 3)] * 8)
    k = p.tokens()
    assert k >= 1 and p.reason.startswith("draft on:")
    a = p.acceptance
    assert speedup(a, k, p.verify_cost(k), p.draft_cost()) > 1.0
    # the chosen k is the best one under the model
    assert all(speedup(a, k, p.verify_cost(k), p.draft_cost())
               >= speedup(a, j, p.verify_cost(j), p.draft_cost()) for j in range(1, 5))


def test_low_acceptance_turns_it_off_then_it_is_tried_again():
    p = DraftPolicy(4)
    _measured(p, 0.010, {5: 0.016}, 0.001)
    assert p.tokens() == 4  # drafting while the verify and the acceptance are measured
    for _ in range(p.min_rounds):
        p.record_round(4, 0)
    assert p.tokens() == 0 and p.reason.startswith("draft off: verifying 5 tokens costs 1.60x one")
    assert "at acceptance" in p.reason
    for _ in range(p.probe_every):
        p.record_forward(1, 0.010)
    assert p.tokens() == 4 and p.reason.startswith("draft measuring")  # a probe
    for _ in range(p.min_rounds):
        p.record_round(4, 4)
    assert p.tokens() >= 1 and p.reason.startswith("draft on")


def test_the_measured_26b_costs_turn_the_draft_off_at_a_real_acceptance():
    """The full-size synthetic 26B-A4B on the 2-core VM (docs/speculative.md): one row 436 ms, 3
    rows 1,172, 5 rows 1,485; a draft step taken as a tenth of a decode. At an acceptance of 3 in 4
    no k pays; a draft accepted every time would (3 tokens for 2.69 + 0.2 decodes)."""
    p = DraftPolicy(4)
    _measured(p, 0.436, {3: 1.172, 5: 1.485}, 0.0436, rounds=[(4, 2), (4, 4), (4, 3), (4, 1)] * 2)
    assert p.tokens() == 0 and "at acceptance" in p.reason
    assert speedup(1.0, 2, p.verify_cost(2), p.draft_cost()) > 1.0


def test_pinned_costs_need_no_warmup():
    p = DraftPolicy(3)
    p.pin_costs({4: 3.9}, 0.05)
    assert p.tokens() == 0 and p.reason.startswith("draft off: verifying 4 tokens costs 3.90x one")


def test_verify_cost_interpolates_below_the_measured_width():
    p = DraftPolicy(4)
    p.pin_costs({5: 3.0}, 0.0)
    assert p.verify_cost(4) == 3.0 and p.verify_cost(2) == pytest.approx(2.0) and p.verify_cost(0) == 1.0


# --- the engine --------------------------------------------------------------------------------

SPEC = TinySpec()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("policy"), SPEC)


def _run(target, spec, **cfg):
    rng = np.random.default_rng(4)
    prompts = [[2] + rng.integers(11, 384, size=n - 1).tolist() for n in (17, 9)]
    eng = Engine(target.model, target.tokenizer, EngineConfig(full_tokens=1024, **cfg), spec=spec)
    reqs = [eng.add(p, SamplingParams(temperature=0.0, max_tokens=24)) for p in prompts]
    eng.run_to_completion()
    return [r.output_ids for r in reqs], eng.status()["speculative"]


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
def test_draft_off_by_cost_leaves_the_output_unchanged(pair, batched):
    target, draft = pair
    plain, _ = _run(target, None, batched_decode=batched)
    out, st = _run(target, SpecConfig(draft, tokens=3, verify_cost=3.9, draft_cost=0.05), batched_decode=batched)
    assert out == plain
    assert st["rounds"] == 0 and st["draft"].startswith("draft off: verifying 4 tokens costs 3.90x one")


def test_draft_off_by_acceptance_leaves_the_output_unchanged(pair):
    """A random draft (it accepts almost nothing) on costs that would pay at a good acceptance."""
    target, draft = pair
    plain, _ = _run(target, None)
    out, st = _run(target, SpecConfig(draft, tokens=3, verify_cost=1.6, draft_cost=0.1))
    assert out == plain
    # min_rounds rounds to measure the acceptance, then off (a probe would come after 64 plain forwards)
    assert st["draft"].startswith("draft off") and "at acceptance" in st["draft"]
    assert st["rounds"] == DraftPolicy(3).min_rounds
