"""Sampling: greedy, seeded temperature sampling, top-k / top-p / min-p filters, penalties, checks."""
from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, SamplingParams, apply_penalties, logits_to_probs


def _logits(probs) -> torch.Tensor:
    """Logits whose softmax (temperature 1) is `probs`."""
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def _kept(probs: torch.Tensor) -> list[int]:
    return [i for i, p in enumerate(probs.tolist()) if p > 0]


# --- greedy / temperature ------------------------------------------------------------------

def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    s = Sampler(SamplingParams(temperature=0.0, seed=1))
    for _ in range(20):
        logits = torch.randn(1000, generator=g)
        assert s.sample(logits) == int(torch.argmax(logits))


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0])
    assert Sampler(SamplingParams()).sample(logits) == 1


def _draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    s = Sampler(params)
    return [s.sample(logits) for _ in range(n)]


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    a = _draws(SamplingParams(temperature=1.0, seed=7), logits, 64)
    b = _draws(SamplingParams(temperature=1.0, seed=7), logits, 64)
    c = _draws(SamplingParams(temperature=1.0, seed=8), logits, 64)
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # it really samples (not greedy)


def test_temperature_sharpens_and_flattens():
    logits = _logits([0.5, 0.3, 0.2])
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    ref = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(cold, ref, atol=1e-6)
    assert torch.allclose(hot, torch.softmax(logits / 2.0, -1), atol=1e-6)
    assert cold[0] > 0.5 > hot[0]


def test_top_k_1_equals_greedy():
    g = torch.Generator().manual_seed(1)
    for seed in range(10):
        logits = torch.randn(300, generator=g) * 3
        s = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=seed))
        assert all(s.sample(logits) == int(torch.argmax(logits)) for _ in range(5))


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.7, 3.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert _kept(probs) == [1, 3, 5]
    assert torch.allclose(probs[[1, 3, 5]], torch.softmax(logits[[1, 3, 5]], -1), atol=1e-6)
    assert abs(float(probs.sum()) - 1) < 1e-6


# --- top-p / min-p ------------------------------------------------------------------------

@pytest.mark.parametrize("top_p, kept", [
    (0.35, [0]),  # 0.4 alone reaches 0.35
    (0.5, [0, 1]),  # 0.4 < 0.5, 0.4 + 0.3 reaches it
    (0.7 - 1e-4, [0, 1]),
    (0.75, [0, 1, 2]),
    (0.95, [0, 1, 2, 3]),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    # ids shuffled so the kept set is not just a prefix of the vocabulary
    order = [2, 0, 3, 1]  # id 2 has 0.4, id 0 has 0.3, id 3 has 0.2, id 1 has 0.1
    probs_by_id = [0.3, 0.1, 0.4, 0.2]
    probs = logits_to_probs(_logits(probs_by_id), SamplingParams(temperature=1.0, top_p=top_p))
    want = sorted(order[r] for r in kept)
    assert _kept(probs) == want
    mass = sum(probs_by_id[i] for i in want)
    for i in want:
        assert abs(float(probs[i]) - probs_by_id[i] / mass) < 1e-5  # renormalized


@pytest.mark.parametrize("probs, kept", [
    ([0.5, 0.25, 0.25], [0]),  # the top token alone has exactly top_p
    ([0.25, 0.25, 0.25, 0.25], [0, 1]),
])
def test_top_p_exact_boundary_keeps_no_extra_token(probs, kept):
    # These sums are exact in float32; llama.cpp stops as soon as the cumulative mass >= p.
    out = logits_to_probs(_logits(probs), SamplingParams(temperature=1.0, top_p=0.5))
    assert _kept(out) == kept


def test_min_p_drops_tokens_below_min_p_times_max():
    probs_by_id = [0.05, 0.4, 0.2, 0.15, 0.11, 0.09]
    out = logits_to_probs(_logits(probs_by_id), SamplingParams(temperature=1.0, min_p=0.25))
    # threshold 0.25 * 0.4 = 0.1: 0.05 and 0.09 go, 0.11 stays
    assert _kept(out) == [1, 2, 3, 4]
    mass = 0.4 + 0.2 + 0.15 + 0.11
    assert torch.allclose(out[[1, 2, 3, 4]], torch.tensor([0.4, 0.2, 0.15, 0.11]) / mass, atol=1e-5)


def test_filters_combine():
    probs_by_id = [0.05, 0.4, 0.2, 0.15, 0.11, 0.09]
    out = logits_to_probs(_logits(probs_by_id), SamplingParams(temperature=1.0, top_k=4, min_p=0.3))
    assert _kept(out) == [1, 2, 3]  # top-4 = {1,2,3,4}; min-p 0.12 drops 4
    out = logits_to_probs(_logits(probs_by_id), SamplingParams(temperature=1.0, top_k=4, top_p=0.6))
    assert _kept(out) == [1, 2]


def test_sampled_tokens_stay_inside_the_filtered_set():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(temperature=1.3, top_k=20, top_p=0.8, min_p=0.05, seed=11)
    allowed = set(_kept(logits_to_probs(logits, params)))
    assert 1 < len(allowed) <= 20
    assert set(_draws(params, logits, 300)) <= allowed


# --- penalties ----------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_multiplies_negative_within_window():
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0, 0.5, 4.0])
    # penalty_last_n=3: only the last three history tokens (1, 2, 1) count; 0 and 5 are too old
    history = [0, 5, 1, 2, 1]
    p = SamplingParams(repetition_penalty=2.0, penalty_last_n=3)
    out = apply_penalties(logits, history, p)
    want = logits.clone()
    want[1] = -2.0  # negative: multiplied (once, although seen twice)
    want[2] = 1.5  # positive: divided
    assert torch.equal(out, want)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 3.0, -2.0, 0.5, 4.0]))  # input untouched


def test_presence_penalty_subtracts_once_per_seen_token():
    logits = torch.tensor([2.0, -1.0, 3.0, 0.0])
    out = apply_penalties(logits, [2, 2, 2, 1, 3], SamplingParams(presence_penalty=0.5, penalty_last_n=4))
    assert torch.equal(out, torch.tensor([2.0, -1.5, 2.5, -0.5]))
    both = apply_penalties(logits, [0, 1], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5))
    assert torch.equal(both, torch.tensor([0.5, -2.5, 3.0, 0.0]))


def test_frequency_penalty_subtracts_once_per_occurrence_with_presence_once():
    logits = torch.tensor([2.0, -1.0, 3.0, 0.0, 1.0])
    # window of 5: token 2 three times, 1 and 3 once; token 4 is outside (too old)
    out = apply_penalties(logits, [4, 2, 2, 2, 1, 3], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25,
                                                                     penalty_last_n=5))
    assert torch.allclose(out, torch.tensor([2.0, -1.75, 1.25, -0.75, 1.0]))


def test_logprobs_of_each_pick_and_the_k_best_are_the_models_log_softmax():
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0, 1.0])
    s = Sampler(SamplingParams(logprobs=3, repetition_penalty=3.0))
    tok = s.sample(logits, history=[1])  # the penalty moves the pick to 3, not the reported logprobs
    assert tok == 3
    (picked,) = s.picked
    want = torch.log_softmax(logits, -1)
    assert picked.token_id == 3 and math.isclose(picked.logprob, float(want[3]), rel_tol=1e-6)
    assert [t for t, _ in picked.top] == [1, 3, 4]  # best first, the tie in id order
    assert all(math.isclose(lp, float(want[t]), rel_tol=1e-6) for t, lp in picked.top)
    assert not Sampler(SamplingParams()).picked  # off by default: nothing computed
    with pytest.raises(ValueError):
        SamplingParams(logprobs=-1)


def test_penalties_off_or_empty_history_change_nothing():
    logits = torch.tensor([1.0, -1.0, 2.0])
    assert torch.equal(apply_penalties(logits, [0, 1], SamplingParams()), logits)
    assert torch.equal(apply_penalties(logits, [], SamplingParams(repetition_penalty=1.5)), logits)
    assert torch.equal(apply_penalties(logits, [0, 1], SamplingParams(repetition_penalty=1.5, penalty_last_n=0)),
                       logits)


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([1.0, 2.0, 1.5])
    s = Sampler(SamplingParams(repetition_penalty=2.0))
    assert s.sample(logits) == 1
    assert s.sample(logits, history=[1]) == 2  # 2.0 / 2 = 1.0 < 1.5


# --- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.1}, {"min_p": -0.1},
    {"min_p": 1.0}, {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0}, {"max_tokens": -1},
    {"penalty_last_n": -1},
])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_valid_edge_params_accepted():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=0, penalty_last_n=0)


# --- distribution sanity ------------------------------------------------------------------

def test_temperature_1_sampling_matches_softmax_chi_square():
    logits = torch.tensor([1.2, 0.3, -0.5, 0.8, -1.7])
    probs = torch.softmax(logits.double(), -1)
    n = 4000
    draws = torch.tensor(_draws(SamplingParams(temperature=1.0, seed=1234), logits, n))
    counts = torch.bincount(draws, minlength=5).double()
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001. Seeded, so deterministic, not flaky.
    assert chi2 < 18.47, (chi2, counts.tolist(), expected.tolist())
    # every token's frequency within 4 standard errors
    se = torch.sqrt(probs * (1 - probs) / n)
    assert bool(((counts / n - probs).abs() < 4 * se).all())
    assert math.isclose(float(counts.sum()), n)
