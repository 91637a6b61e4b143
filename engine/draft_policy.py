"""Whether the assistant draft pays on this model, and how many tokens to draft: from measured
forward costs and the running acceptance (spec §4.6; the loop itself is engine/speculative.py).

Symbols, costs in units of t1 = the time of one plain decode forward (one row a sequence):
  K       the most draft tokens a round (--spec-tokens); k <= K the number used
  a       the probability that a draft token is accepted when the ones before it were
  c_v(k)  t(verify forward of 1 + k rows a sequence) / t1
  c_d     t(one draft step) / t1
A round commits the accepted drafts plus one token the target samples itself. Draft i (1-based)
survives iff drafts 1..i all match, with probability a^i, so

  E[tokens a round] = 1 + sum_{i=1..k} a^i = sum_{i=0..k} a^i = (1 - a^(k+1)) / (1 - a)

for c_v(k) + k c_d units of time, while plain decoding commits 1 token a unit. The draft pays iff

  speedup(k) = sum_{i=0..k} a^i / (c_v(k) + k c_d) > 1

and the best k maximises it (k = 0 is plain decoding, speedup 1). Even a perfect draft (a = 1)
gives at most k + 1 tokens, so where c_v(k) + k c_d >= k + 1 for every k the draft can never pay:
on a MoE target, k + 1 rows route to up to (k + 1) x top-k experts, so a verify reads nearly
k + 1 times the expert weights a decode reads and costs close to k + 1 decodes (llama.cpp saw no
MoE gain for this reason); on a dense model the rows share one read of every matrix and a verify
costs little more than a decode.

a is estimated as a geometric rate: a round that drafted n and accepted m < n saw m successes and
one failure, one with m = n saw n successes. With a uniform prior and older rounds decaying,
a = (successes + 1) / (successes + failures + 2).

Timings are measured on the running engine (the forward of a plain step, of a verify step, and the
draft steps; the median of the recent ones), or pinned from outside (`pin_costs`, SpecConfig's
`verify_cost` / `draft_cost`: e.g. a measurement on the full-size model). The engine decodes the
first `warmup` steps without the draft to time t1, then drafts with K for `min_rounds` rounds to
time the verify and estimate a, then decides every step. When the draft is off only because of a
low acceptance it is tried again (`min_rounds` rounds) after `probe_every` plain steps; when even
a perfect draft cannot pay, it stays off.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Optional


def expected_tokens(a: float, k: int) -> float:
    """sum_{i=0..k} a^i: tokens a round commits with k drafts at acceptance rate a."""
    return sum(a ** i for i in range(k + 1))


def speedup(a: float, k: int, verify_cost: float, draft_cost: float) -> float:
    """Tokens a unit of time with k drafts against plain decoding's 1 (verify_cost = c_v(k))."""
    return expected_tokens(a, k) / (verify_cost + k * draft_cost) if k else 1.0


@dataclass
class DraftPolicy:
    max_tokens: int  # K
    warmup: int = 3  # plain steps timed before the first round
    min_rounds: int = 8  # rounds before deciding (and a re-probe's length)
    probe_every: int = 64  # plain steps before a draft off for low acceptance is tried again
    decay: float = 0.98  # weight kept by older rounds in the acceptance estimate
    window: int = 16  # recent timings whose median is used
    verify_pinned: dict = field(default_factory=dict)  # rows a sequence -> c_v, measured elsewhere
    draft_pinned: Optional[float] = None
    _times: dict = field(default_factory=dict)  # rows a sequence -> deque of forward seconds
    _draft_times: deque = field(default_factory=deque)  # seconds per draft step
    _succ: float = 0.0
    _fail: float = 0.0
    _rounds: int = 0  # rounds since the last decision point (warm-up, probe)
    _plain: int = 0  # plain steps since the draft went off
    _k: int = -1  # the current decision; -1: not decided yet
    now: int = 0  # what tokens() said last
    reason: str = ""

    # --- what was measured ---------------------------------------------------------------------
    def pin_costs(self, verify: Optional[dict] = None, draft: Optional[float] = None) -> None:
        """Costs measured elsewhere: verify {rows a sequence: c_v}, draft c_d (units of t1)."""
        self.verify_pinned.update(verify or {})
        if draft is not None:
            self.draft_pinned = draft

    def record_forward(self, rows: int, seconds: float) -> None:
        """A decode-phase target forward of `rows` rows a sequence (1: plain, 1 + k: verify)."""
        self._times.setdefault(rows, deque(maxlen=self.window)).append(seconds)
        if rows == 1 and self._k == 0:
            self._plain += 1

    def record_draft(self, steps: int, seconds: float) -> None:
        if steps:
            self._draft_times.append(seconds / steps)
            while len(self._draft_times) > self.window:
                self._draft_times.popleft()

    def record_round(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self._succ = self._succ * self.decay + accepted
        self._fail = self._fail * self.decay + (accepted < drafted)
        self._rounds += 1

    # --- estimates -------------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        return (self._succ + 1.0) / (self._succ + self._fail + 2.0)

    def _t1(self) -> Optional[float]:
        t = self._times.get(1)
        return median(t) if t else None

    def verify_cost(self, k: int) -> Optional[float]:
        """c_v(k): pinned, else measured, else interpolated linearly between 1 row (cost 1) and
        the nearest measured width above; None when nothing wider than k is known."""
        rows = k + 1
        if rows == 1:
            return 1.0
        t1 = self._t1()
        if self.verify_pinned:  # measured elsewhere: the engine's own timings are not mixed in
            known = {r: float(c) for r, c in self.verify_pinned.items()}
        elif t1:  # more rows never cost less than one (a tiny model's noise can say otherwise)
            known = {r: max(1.0, median(t) / t1) for r, t in self._times.items() if r > 1 and t}
        else:
            known = {}
        if rows in known:
            return known[rows]
        wider = [r for r in known if r > rows]
        if not wider:
            return None
        r = min(wider)
        return 1.0 + (known[r] - 1.0) * (rows - 1) / (r - 1)

    def draft_cost(self) -> Optional[float]:
        if self.draft_pinned is not None:
            return self.draft_pinned
        t1 = self._t1()
        return median(self._draft_times) / t1 if t1 and self._draft_times else None

    # --- the decision ----------------------------------------------------------------------------
    def tokens(self) -> int:
        """Draft tokens for this step (0: decode without the draft)."""
        self.now = self._tokens()
        return self.now

    def _tokens(self) -> int:
        K = self.max_tokens
        if self._k < 0:  # not decided: time plain steps first, then draft rounds
            pinned = bool(self.verify_pinned) and self.draft_pinned is not None
            if not pinned and len(self._times.get(1, ())) < self.warmup:
                self.reason = "draft measuring: timing plain decode steps"
                return 0
            known = self.verify_cost(K) is not None and self.draft_cost() is not None
            if known and self._never_pays():
                self._decide()  # no acceptance rate can make it pay: no rounds to wait for
                return self._k
            if self._rounds < self.min_rounds or not known:
                self.reason = "draft measuring: timing verify rounds"
                return K
            self._decide()
        elif self._k == 0 and not self._never_pays() and self._plain >= self.probe_every:
            self._k, self._rounds, self._plain = -1, 0, 0  # try it again (content changes)
            self.reason = "draft measuring: trying the draft again"
            return K
        elif self._rounds >= self.min_rounds or self._k == 0:
            self._decide()
        return self._k

    def _never_pays(self) -> bool:
        c_d = self.draft_cost() or 0.0
        return all((self.verify_cost(k) or 1.0) + k * c_d >= k + 1 for k in range(1, self.max_tokens + 1))

    def _decide(self) -> None:
        a, c_d, K = self.acceptance, self.draft_cost(), self.max_tokens
        if c_d is None or self.verify_cost(K) is None:
            return
        gains = {k: speedup(a, k, self.verify_cost(k), c_d) for k in range(1, K + 1)}
        best = max(gains, key=gains.get)
        c_v = self.verify_cost(K)
        was = self._k
        self._rounds = 0
        if gains[best] > 1.0:
            self._k = best
            self.reason = (f"draft on: {best} tokens a round, acceptance {a:.0%}, expected "
                           f"{gains[best]:.2f}x the tokens a unit of time (verifying {K + 1} tokens costs "
                           f"{c_v:.2f}x one)")
        else:
            self._k = 0
            if was != 0:
                self._plain = 0
            why = ("even a perfect draft cannot pay" if self._never_pays()
                   else f"at acceptance {a:.0%} a round of {best} gives {expected_tokens(a, best):.2f} tokens for "
                        f"{self.verify_cost(best) + best * c_d:.2f}x the time")
            self.reason = f"draft off: verifying {K + 1} tokens costs {c_v:.2f}x one on this model; {why}"

    def as_dict(self) -> dict:
        K = self.max_tokens
        return {"draft": self.reason or "draft measuring", "draft_tokens_now": self.now,
                "verify_cost": self.verify_cost(K), "draft_cost": self.draft_cost(),
                "acceptance_estimate": self.acceptance}
