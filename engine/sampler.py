"""Token sampling on the logits of the sampled rows only: greedy, temperature, top-k, top-p, min-p,
repetition, presence and frequency penalties, DRY (engine/dry.py) and XTC; optionally the
log-probabilities of each pick.

Order, as llama.cpp's default chain: penalties, DRY, then (sampled requests only) temperature,
top-k, top-p, min-p, XTC. XTC ("exclude top choices", p-e-w's sampler in text-generation-webui and
llama.cpp): with probability `xtc_probability`, every token whose probability reaches
`xtc_threshold` is removed except the least likely of them, so the answer leaves its most
predictable path while staying among tokens the model finds plausible. Greedy requests skip it
(it is a sampling filter). Its threshold is tested on the distribution the filters left, after
temperature (llama.cpp tests it before temperature; at temperature 1 the two agree).

`SamplingParams.temperature == 0` is greedy (argmax, ties to the lowest id like llama.cpp).
A seeded `torch.Generator` per request makes sampled runs repeatable.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from typing import Mapping, Optional

import torch

from .dry import DEFAULT_BREAKERS, BreakerTable, apply_dry, dry_penalties


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 256
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the last `penalty_last_n`
    presence_penalty: float = 0.0  # subtracted once from each token seen there
    frequency_penalty: float = 0.0  # subtracted once per occurrence there (llama.cpp's penalty_freq)
    penalty_last_n: int = 64  # llama.cpp's default window (prompt and output tokens)
    logprobs: Optional[int] = None  # None: off; k >= 0: each pick's log-probability and the k best
    # DRY (engine/dry.py; llama.cpp's names and defaults): off at multiplier 0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75  # >= 1
    dry_allowed_length: int = 2  # repeats longer than this are penalized
    dry_penalty_last_n: int = 64  # window scanned for repeats; -1 = the whole history, 0 = off
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS
    # XTC: off at probability 0; a threshold above 0.5 can never find two tokens, so it is off too
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1

    def __post_init__(self):
        if (self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1 or self.top_k < 0
                or self.repetition_penalty <= 0 or self.max_tokens < 0 or self.penalty_last_n < 0
                or (self.logprobs is not None and self.logprobs < 0)
                or self.dry_multiplier < 0 or self.dry_base < 1 or self.dry_allowed_length < 0
                or self.dry_penalty_last_n < -1 or not 0 <= self.xtc_probability <= 1
                or not 0 <= self.xtc_threshold <= 1):
            raise ValueError(f"invalid sampling parameters: {self}")
        if isinstance(self.dry_sequence_breakers, str) or not all(
                isinstance(b, str) for b in self.dry_sequence_breakers):
            raise ValueError("dry_sequence_breakers must be a list of strings")
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))

    @classmethod
    def from_request(cls, values: Mapping) -> "SamplingParams":
        """The one way a front end builds these: `values` by field name (a flag, a setting or an API
        field, as parsed or as stored: "0.7" and 0.7 alike); None or absent keeps the default, keys
        that are no field (a settings dict's others) are ignored. A bad value: one-line ValueError."""
        out = {}
        for f in fields(cls):
            v = values.get(f.name)
            if v is None:
                continue
            if f.name == "dry_sequence_breakers":
                out[f.name] = tuple(v) if not isinstance(v, str) else v  # a bare string is refused below
            elif isinstance(f.default, float):
                out[f.name] = float(v)
            else:  # the int fields, and seed / logprobs (None by default)
                out[f.name] = int(v)
        return cls(**out)

    @property
    def dry_on(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0


def apply_penalties(logits: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    """llama.cpp's penalties over the last `penalty_last_n` tokens: a seen token's logit is divided
    by the repetition penalty when positive, multiplied when negative; then presence subtracts
    once and frequency once per occurrence (logit -= count * freq + (count > 0) * presence)."""
    if ((p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)
            or not history or not p.penalty_last_n):
        return logits
    seen, counts = torch.tensor(history[-p.penalty_last_n:], dtype=torch.long).unique(return_counts=True)
    seen, counts = seen.to(logits.device), counts.to(logits.device)
    out = logits.clone()
    vals = out[seen]
    vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    out[seen] = vals - p.presence_penalty - p.frequency_penalty * counts.to(vals.dtype)
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """One picked token's natural-log probability under the model's distribution (the logits before
    penalties, temperature and filters, as vLLM and OpenAI report them) and the `k` best tokens."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first, ties in id order


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """[V] logits -> the logprob of `token` and the k most likely tokens (one log_softmax: ~1 ms for
    262,144 entries on a small CPU, paid only by requests that ask)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple = ()
    if k:
        vals, idx = lp.topk(min(k, lp.shape[-1]))
        top = tuple(sorted(zip(idx.tolist(), vals.tolist()), key=lambda t: (-t[1], t[0])))  # ties: lower id first
    return TokenLogprob(int(token), float(lp[token]), top)


TOP_P_CANDIDATES = 256  # top-p first looks among this many best tokens (exact: see logits_to_probs)


def logits_to_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits -> [V] probabilities after temperature, top-k, top-p and min-p filtering.
    Top-p keeps the smallest prefix (by probability) whose mass reaches top_p; it is looked for
    among the TOP_P_CANDIDATES best tokens first, and the whole vocabulary is sorted only when those
    hold less than top_p of the mass (the answer is the same: the prefix lies inside them). Sorting
    262,144 probabilities costs ~15 ms a token on a small CPU, the top 256 well under 1 ms."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p = None
        if TOP_P_CANDIDATES < probs.shape[-1]:
            top = probs.topk(TOP_P_CANDIDATES).indices.sort().values  # ties in id order, as sort keeps them
            order = probs[top].sort(descending=True, stable=True)
            if float(order.values.sum()) >= p.top_p:
                sorted_p, idx = order.values, top[order.indices]
        if sorted_p is None:
            sorted_p, idx = probs.sort(descending=True, stable=True)
        cum = sorted_p.cumsum(-1)
        before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], -1)  # mass ranked above
        drop = before >= p.top_p  # keep the smallest prefix whose mass reaches top_p (llama.cpp)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return probs / probs.sum()


def exclude_top_choices(probs: torch.Tensor, threshold: float) -> torch.Tensor:
    """XTC on [V] probabilities: when two or more tokens reach `threshold`, all of them but the
    least likely are set to 0 (renormalized). Among equally likely ones the highest id is kept
    (llama.cpp's sort leaves that order unspecified). Tokens the filters removed never count."""
    above = ((probs >= threshold) & (probs > 0)).nonzero().flatten()
    if above.numel() < 2:
        return probs
    vals = probs[above]
    # the kept one: the smallest probability among them; among equal ones the last in id order
    keep = above[(vals == vals.min()).nonzero().flatten()[-1]]
    out = probs.clone()
    out[above] = 0.0
    out[keep] = probs[keep]
    return out / out.sum()


class Sampler:
    def __init__(self, params: SamplingParams, breakers: Optional[BreakerTable] = None):
        """`breakers`: DRY's sequence breakers as tokens (engine.dry.breaker_table of the model's
        tokenizer and params.dry_sequence_breakers); None: no breakers."""
        self.params = params
        self.breakers = breakers or {}
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()
        # With params.logprobs: one TokenLogprob per sample() call, in order; the scheduler takes
        # them as it commits the tokens (a speculative round samples several rows before that).
        self.picked: deque[TokenLogprob] = deque()

    def sample(self, logits: torch.Tensor, history: Optional[list[int]] = None) -> int:
        """One token id from a [V] logits row; `history`: tokens so far, for the penalties."""
        raw, p = logits, self.params
        logits = apply_penalties(logits, history or [], p)
        if p.dry_on and history:
            logits = apply_dry(logits, dry_penalties(history, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                                                     p.dry_penalty_last_n, self.breakers))
        if p.temperature == 0:
            tok = int(torch.argmax(logits))
        else:
            probs = logits_to_probs(logits, p)
            # one uniform draw per token while XTC is on (off, the generator's stream is unchanged)
            if p.xtc_probability > 0 and p.xtc_threshold <= 0.5 and \
                    float(torch.rand((), generator=self.gen)) < p.xtc_probability:
                probs = exclude_top_choices(probs, p.xtc_threshold)
            tok = int(torch.multinomial(probs.cpu(), 1, generator=self.gen))
        if self.params.logprobs is not None:
            self.picked.append(token_logprobs(raw, tok, self.params.logprobs))
        return tok
