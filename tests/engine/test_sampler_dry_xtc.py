"""DRY and XTC (engine/dry.py, engine/sampler.py): the penalty each rule gives on written logits,
llama.cpp's own test cases (tests/test-sampling.cpp), and llama.cpp's DRY itself on the demo
model's vocabulary (sequence breakers turned into tokens, then the penalties) as the oracle."""
from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from engine.dry import (DEFAULT_BREAKERS, MAX_BREAKER_CHARS, MAX_TAIL_TOKENS, apply_dry, breaker_table,
                        dry_penalties)
from engine.sampler import Sampler, SamplingParams, exclude_top_choices


def _table(breakers) -> dict:
    """Token breakers [head, *tail] -> the table dry_penalties reads (llama.cpp's testing init)."""
    out: dict = {}
    for b in breakers:
        out.setdefault(b[0], []).append(tuple(b[1:]))
    return {k: tuple(v) for k, v in out.items()}


def _dry(history, mult=1.0, base=1.75, allowed=2, last_n=-1, breakers=()) -> dict:
    return dry_penalties(history, mult, base, allowed, last_n, _table(breakers))


# --- DRY on written histories -------------------------------------------------------------------

@pytest.mark.parametrize("probs, history, want, mult, base, allowed, last_n, breakers", [
    # llama.cpp tests/test-sampling.cpp, test_dry: probabilities after DRY then softmax
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, []),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [[3]]),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
])
def test_dry_matches_llama_cpp_test_cases(probs, history, want, mult, base, allowed, last_n, breakers):
    pen = _dry(history, mult, base, allowed, last_n, breakers)
    out = torch.softmax(apply_dry(torch.log(torch.tensor(probs)), pen), -1)
    assert torch.allclose(out, torch.tensor(want), atol=1e-6), out


def test_dry_penalty_grows_as_base_to_the_repeat_length_beyond_allowed():
    # 5 6 7 8 9 | 1 | 5 6 7 8: the suffix "5 6 7 8" (4 tokens) occurred before, followed by 9
    history = [5, 6, 7, 8, 9, 1, 5, 6, 7, 8]
    assert _dry(history, mult=0.8, base=1.75, allowed=2) == {9: pytest.approx(0.8 * 1.75 ** 2)}
    assert _dry(history, mult=0.8, base=1.75, allowed=4) == {9: pytest.approx(0.8)}
    assert _dry(history, allowed=5) == {}  # a repeat of 4 is allowed at 5


def test_dry_keeps_the_longest_repeat_per_token_and_penalizes_every_continuation():
    # "3 4" is the current suffix; it occurred twice before: followed by 5 (after "2 3 4", a
    # 3-token match since the history ends "2 3 4"), and by 6 (after "9 3 4", a 2-token match)
    history = [2, 3, 4, 5, 9, 3, 4, 6, 2, 3, 4]
    pen = _dry(history, mult=1.0, base=2.0, allowed=2)
    assert pen == {5: pytest.approx(2.0 ** 1), 6: pytest.approx(2.0 ** 0)}


def test_dry_window_limits_how_far_back_repeats_are_found():
    history = [5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7, 8]  # "5 6 7 8" then 9, and the history ends "5 6 7 8"
    assert _dry(history, last_n=-1) == {9: pytest.approx(1.75 ** 2)}  # -1: the whole history
    assert _dry(history, last_n=12) == {9: pytest.approx(1.75 ** 2)}
    assert _dry(history, last_n=11) == {9: pytest.approx(1.75)}  # the window starts at 6: "6 7 8"
    assert _dry(history, last_n=10) == {9: pytest.approx(1.0)}  # "7 8"
    assert _dry(history, last_n=9) == {}  # "8" alone is within the allowed length
    assert _dry(history, last_n=0) == {}  # 0: off
    assert _dry(history, mult=0.0) == {}


def test_dry_match_never_reaches_back_across_a_breaker():
    # the suffix "1 0 2 3" occurred before, followed by 4: 4 tokens, 2 ** (4 - 2)
    history = [1, 0, 2, 3, 4, 1, 0, 2, 3]
    assert _dry(history, base=2.0, allowed=2) == {4: pytest.approx(4.0)}
    # 0 a breaker: a match holds at most the 2 tokens after the last 0 ("2 3")
    assert _dry(history, base=2.0, allowed=2, breakers=[[0]]) == {4: pytest.approx(1.0)}
    assert _dry(history, base=2.0, allowed=3, breakers=[[0]]) == {}  # fewer than allowed after it


def test_dry_multi_token_breaker_counts_only_when_its_tail_follows():
    history = [1, 2, 3, 4, 8, 0, 1, 2, 3]  # "1 2 3" repeats (3 tokens) -> 4
    assert _dry(history, base=2.0) == {4: pytest.approx(2.0)}
    assert _dry(history, base=2.0, breakers=[[0, 1]]) == {4: pytest.approx(1.0)}  # "0 1" cuts it to "2 3"
    assert _dry(history, base=2.0, breakers=[[0, 5]]) == {4: pytest.approx(2.0)}  # 0 without its tail
    history = [9, 1, 2, 3, 4, 0, 9, 1, 2, 3]  # "9 1 2 3" repeats (4 tokens) -> 4
    assert _dry(history, base=2.0, breakers=[[0, 1]]) == {4: pytest.approx(4.0)}
    assert _dry(history, base=2.0, breakers=[[0, 9]]) == {4: pytest.approx(2.0)}  # cut to "1 2 3"


def test_dry_never_penalizes_a_one_token_breaker():
    history = [1, 2, 0, 5, 1, 2]  # 0 would extend "1 2", but 0 is a breaker
    assert _dry(history, allowed=2) == {0: pytest.approx(1.0)}
    assert _dry(history, allowed=2, breakers=[[0]]) == {}


def test_dry_exponent_is_clamped_so_the_penalty_stays_finite():
    history = [3] * 300  # a run of one token: each suffix repeats almost the whole window
    pen = _dry(history, mult=1.0, base=1.75, allowed=2)
    max_exp = int(88.7228391 / math.log(1.75))
    assert pen == {3: pytest.approx(1.75 ** max_exp)}
    assert math.isfinite(float(torch.tensor(pen[3], dtype=torch.float32)))


def test_dry_through_the_sampler_changes_the_greedy_pick_and_leaves_the_input():
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, 2.5])
    history = [1, 2, 3, 4, 0, 1, 2, 3]
    s = Sampler(SamplingParams(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2))
    assert s.sample(logits, history) == 5  # 4 would extend "1 2 3": 3.0 - 2.0 < 2.5
    assert Sampler(SamplingParams()).sample(logits, history) == 4  # DRY off by default
    assert torch.equal(logits, torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, 2.5]))


@pytest.mark.parametrize("bad", [{"dry_multiplier": -0.1}, {"dry_base": 0.9}, {"dry_allowed_length": -1},
                                 {"dry_penalty_last_n": -2}, {"xtc_probability": 1.5},
                                 {"xtc_probability": -0.1}, {"xtc_threshold": -0.1},
                                 {"dry_sequence_breakers": "\n"}, {"dry_sequence_breakers": ["a", 3]}])
def test_invalid_dry_and_xtc_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# --- DRY's sequence breakers against llama.cpp on a real vocabulary ---------------------------

@pytest.fixture(scope="module")
def demo_vocab(gemma3_270m_path):
    import llama_cpp

    from models.loader import open_gguf
    from models.tokenizer import Tokenizer

    llm = llama_cpp.Llama(model_path=str(gemma3_270m_path), vocab_only=True, verbose=False)
    tok = Tokenizer.from_gguf(open_gguf(gemma3_270m_path))
    return llm, tok


def _llama_dry(llm, history, mult, base, allowed, last_n, breakers) -> dict:
    """llama.cpp's DRY sampler on zero logits after `history`: {token: penalty}."""
    import llama_cpp

    arr = (ctypes.c_char_p * len(breakers))(*[b.encode() for b in breakers])
    smpl = llama_cpp.llama_sampler_init_dry(llm._model.vocab, mult, base, allowed, last_n, arr, len(breakers))
    try:
        for t in history:
            llama_cpp.llama_sampler_accept(smpl, t)
        n = llama_cpp.llama_vocab_n_tokens(llm._model.vocab)
        data = np.zeros(n, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data[n]
        data["id"] = np.arange(n)
        cur = llama_cpp.llama_token_data_array(ctypes.cast(data.ctypes.data, llama_cpp.llama_token_data_p),
                                               n, -1, False)
        llama_cpp.llama_sampler_apply(smpl, ctypes.byref(cur))
        assert cur.size == n and cur.data[0].id == 0  # DRY changes logits in place, never the array
        hit = np.nonzero(data["logit"])[0]
        return {int(data["id"][i]): -float(data["logit"][i]) for i in hit}
    finally:
        llama_cpp.llama_sampler_free(smpl)


@pytest.mark.parametrize("text, breakers", [
    ("The cat sat on the mat. The cat sat on the mat. The cat sat on the", DEFAULT_BREAKERS),
    # a quote and a newline inside the repeat cut it (the defaults), a colon too
    ('He said "the cat sat on the mat" and "the cat sat on the', DEFAULT_BREAKERS),
    ("Name: the cat sat on\nName: the cat sat on\nName: the cat sat", DEFAULT_BREAKERS),
    # a multi-token breaker (head + tail tokens) and one inside longer tokens
    ("the big red fox ran far away, the big red fox ran far away, the big red fox ran far", ("red fox", ",")),
    ("one two three four one two three four one two three", ("wo th",)),
])
def test_dry_penalties_equal_llama_cpp_on_the_demo_vocabulary(demo_vocab, text, breakers):
    llm, tok = demo_vocab
    history = tok.encode(text, add_bos=False)
    table = breaker_table(tok, breakers)
    for mult, base, allowed, last_n in ((0.8, 1.75, 2, 64), (1.0, 1.5, 3, 16), (2.0, 1.1, 1, 0)):
        ours = dry_penalties(history, mult, base, allowed, last_n, table)
        theirs = _llama_dry(llm, history, mult, base, allowed, last_n, list(breakers))
        assert ours.keys() == theirs.keys(), (mult, base, allowed, last_n)
        for k, v in ours.items():
            assert v == pytest.approx(theirs[k], rel=1e-5)
    assert dry_penalties(history, 0.8, 1.75, 2, 64, table)  # the case is not trivially empty


def _breaker_table_token_by_token(tok, breakers) -> dict:
    """The table as llama.cpp's get_overlapping_token_sequences builds it: a scan of each token's
    text in id order (what `breaker_table` computes from one byte string)."""
    table: dict = {}
    for text in breakers:
        s = text.encode()[:MAX_BREAKER_CHARS]
        for t, word in enumerate(tok.pieces() if s else ()):
            tails = table.setdefault(t, [])
            if s in word:
                tails.append(()) if () not in tails else None
                continue
            pos = word.find(s[:1])
            while pos != -1:
                i = len(word) - pos
                if word[pos:] == s[:i]:
                    tail = tuple(tok.encode(s[i:].decode("utf-8", errors="replace"), add_bos=False,
                                            parse_special=False)[:MAX_TAIL_TOKENS])
                    tails.append(tail) if tail not in tails else None
                pos = word.find(s[:1], pos + 1)
    return {t: tuple(tails) for t, tails in table.items() if tails}


@pytest.mark.parametrize("breakers", [
    DEFAULT_BREAKERS,
    ("red fox", ",", "wo th"),  # multi-token breakers: heads end with a prefix of the string
    ("e", "—", "…!", "<start_of_turn>"),  # a common letter; UTF-8 multi-byte; a control token's text
    ("", "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ"),  # empty (skipped); longer than llama.cpp's 40
])
def test_breaker_table_from_one_byte_string_equals_the_token_by_token_scan(demo_vocab, breakers):
    _, tok = demo_vocab
    table = breaker_table(tok, breakers)
    assert table == _breaker_table_token_by_token(tok, breakers)
    assert table  # every case has heads


# --- XTC -------------------------------------------------------------------------------------

@pytest.mark.parametrize("threshold, kept", [
    (0.09, [3]),  # llama.cpp test_xtc: all four reach it, the least likely stays
    (0.19, [2, 3]),
    (0.29, [1, 2, 3]),
    (0.39, [0, 1, 2, 3]),  # only one token reaches 0.39: nothing to exclude
])
def test_xtc_removes_all_top_choices_but_the_least_likely(threshold, kept):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    out = exclude_top_choices(probs, threshold)
    assert [i for i, p in enumerate(out.tolist()) if p > 0] == kept
    assert torch.allclose(out[kept], probs[kept] / probs[kept].sum())


def test_xtc_ignores_tokens_the_filters_removed():
    probs = torch.tensor([0.0, 0.7, 0.0, 0.3])
    assert torch.equal(exclude_top_choices(probs, 0.0), torch.tensor([0.0, 0.0, 0.0, 1.0]))


def test_xtc_fires_with_its_probability_and_off_leaves_the_random_stream():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 2000

    def draws(**kw):
        s = Sampler(SamplingParams(temperature=1.0, seed=3, **kw))
        return [s.sample(logits) for _ in range(n)]

    always = draws(xtc_probability=1.0, xtc_threshold=0.1)
    assert set(always) == {2, 3}  # 0.5, 0.3 and 0.15 reach 0.1: only 0.15 of them stays (and 0.05)
    half = draws(xtc_probability=0.5, xtc_threshold=0.1)
    top = half.count(0) / n  # fires half the time: token 0 keeps about half its 0.5
    assert 0.2 < top < 0.3
    assert draws(xtc_probability=0.0) == draws()  # off: same seeded stream as without XTC
    assert draws(xtc_probability=1.0, xtc_threshold=0.6) == draws()  # > 0.5: never two tokens
    g = Sampler(SamplingParams(temperature=0.0, xtc_probability=1.0, xtc_threshold=0.1))
    assert g.sample(logits) == 0  # greedy stays greedy
