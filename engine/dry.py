"""DRY ("Don't Repeat Yourself"), the repetition penalty of koboldcpp and llama.cpp (pi6am's
koboldcpp PR 982, ported to llama.cpp's `llama_sampler_dry_apply`; this is our own port of it).

A token that would extend a sequence already seen in the last `dry_penalty_last_n` tokens gets
    logit -= dry_multiplier * dry_base ** (L - dry_allowed_length)
where L >= dry_allowed_length is the length of the longest suffix of the history that also occurs
earlier followed by that token. Sequence breakers (llama.cpp's defaults "\\n", ":", "\\"", "*")
cut repetitions: a match never reaches back across the last breaker, and a single-token breaker is
never penalized itself. Breakers are strings; `breaker_table` turns them into token sequences the
way llama.cpp's `get_overlapping_token_sequences` does (a token whose text contains the string is a
breaker on its own; a token whose text ends with the string's beginning is the head of a breaker
whose tail is the rest of the string, tokenized).

The work per sampled token is O(n) over the window (the reverse Z-algorithm); n = 64 by default,
~0.1 ms in Python. The penalties land on the logits row where it lives (GPU or CPU) in one indexed
subtraction.
"""
from __future__ import annotations

import bisect
import itertools
import math
import weakref
from typing import Mapping, Sequence

import torch

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp common.h dry_sequence_breakers
MAX_BREAKER_CHARS = 40  # llama.cpp truncates a breaker to this many bytes
MAX_TAIL_TOKENS = 20  # and its tokenized tail to this many tokens (keeps step 1 O(n))
FLOAT_MAX_LOG = 88.7228391  # log(float32 max): dry_base ** exponent is clamped below overflow

# head token -> the tails that complete a breaker after it (() for a one-token breaker)
BreakerTable = Mapping[int, tuple[tuple[int, ...], ...]]

_tables: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def breaker_table(tokenizer, breakers: Sequence[str]) -> BreakerTable:
    """Sequence-breaker strings -> {head token: tails}, over the tokenizer's whole vocabulary
    (cached per tokenizer and breaker tuple). The vocabulary is searched as one byte string, the
    tokens' texts end to end: ~50 ms for Gemma's 262,144 tokens, where a loop over the tokens
    took ~1.5 s (the first DRY request's wait)."""
    key = tuple(breakers)
    per_tok = _tables.setdefault(tokenizer, {})
    if key in per_tok:
        return per_tok[key]
    pieces = tokenizer.pieces()  # llama.cpp's detokenize(special)
    blob = b"".join(pieces)
    ends = list(itertools.accumulate(map(len, pieces)))  # token t's text is blob[ends[t] - len: ends[t]]
    table: dict[int, list[tuple[int, ...]]] = {}
    for text in key:
        s = text.encode()[:MAX_BREAKER_CHARS]
        if not s:
            continue  # llama.cpp skips empty breakers
        inside = {t for t, q in _occurrences(blob, ends, s) if q + len(s) <= ends[t]}
        # a word ending with a proper prefix s[:k] heads a breaker whose tail tokenizes s[k:]
        heads: dict[int, list[int]] = {}
        for k in range(1, len(s)):
            for t, q in _occurrences(blob, ends, s[:k]):
                if q + k == ends[t] and t not in inside:
                    heads.setdefault(t, []).append(k)
        for tok in sorted(inside | heads.keys()):
            if tok in inside:
                _add(table, tok, ())
                continue
            for k in sorted(heads[tok], reverse=True):  # the longest prefix first, as llama.cpp's scan
                rest = s[k:].decode("utf-8", errors="replace")
                _add(table, tok, tuple(tokenizer.encode(rest, add_bos=False, parse_special=False)[:MAX_TAIL_TOKENS]))
    out = {tok: tuple(tails) for tok, tails in table.items()}
    per_tok[key] = out
    return out


def _occurrences(blob: bytes, ends: list[int], s: bytes):
    """(token, position) of every occurrence of `s` in `blob` (overlapping ones too) that starts
    inside a token's text."""
    q = blob.find(s)
    while q != -1:
        yield bisect.bisect_right(ends, q), q
        q = blob.find(s, q + 1)


def _add(table: dict, tok: int, tail: tuple[int, ...]) -> None:
    tails = table.setdefault(tok, [])
    if tail not in tails:
        tails.append(tail)


def dry_penalties(history: Sequence[int], multiplier: float, base: float, allowed_length: int,
                  last_n: int, breakers: BreakerTable) -> dict[int, float]:
    """{token: penalty to subtract from its logit} for the next token after `history`.
    `last_n` < 0 scans the whole history; 0 (or multiplier 0) turns DRY off."""
    if multiplier == 0.0 or base < 1.0 or last_n == 0:
        return {}
    n = len(history) if last_n < 0 else min(len(history), last_n)
    if n <= allowed_length:
        return {}
    win = list(history[len(history) - n:])

    def rat(i: int) -> int:  # the i-th token from the end (llama.cpp's ring_buffer::rat)
        return win[n - 1 - i]

    # 1. The nearest breaker (head + its tail, read forward) limits how far back a match may reach.
    rep_limit = n
    for i in range(n):
        tails = breakers.get(rat(i))
        if not tails:
            continue
        longest = -1
        for tail in tails:
            m = len(tail)
            if longest < m <= i and all(tail[o] == rat(i - o - 1) for o in range(m)):
                longest = m
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return {}

    # 2. Reverse Z-algorithm: count[n-1-k] = length (capped at rep_limit) of the longest suffix of
    # the window that also ends k tokens before its end.
    count = [0] * n
    last, lt, rt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            count[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p, right = k - lt, rt - k + 1
            if count[last - p] < right:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1

    # 3. The token after each repeat would extend it: keep the longest repeat per such token.
    longest_for: dict[int, int] = {}
    for i in range(n - 1):
        length = count[i]
        if length >= allowed_length:
            tok = win[i + 1]
            if longest_for.get(tok, -1) < length:
                longest_for[tok] = length

    # 4. multiplier * base ** (length - allowed), the exponent clamped so the power stays finite.
    max_exp = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    out = {}
    for tok, length in longest_for.items():
        if () in breakers.get(tok, ()):
            continue  # a one-token breaker is never penalized
        e = length - allowed_length
        if max_exp > 0:
            e = min(e, max_exp)
        out[tok] = multiplier * base ** e
    return out


def apply_dry(logits: torch.Tensor, penalties: Mapping[int, float]) -> torch.Tensor:
    """[V] logits (any device) less the penalties; the input is left untouched."""
    if not penalties:
        return logits
    ids = torch.tensor(list(penalties), dtype=torch.long, device=logits.device)
    pen = torch.tensor(list(penalties.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_put((ids,), -pen, accumulate=True)
