"""Speculative decoding with the Gemma-4 assistant (MTP draft), spec §4.6.

One round for a sequence whose last sampled token τ sits at position P (not yet in the KV):
  draft:  up to K greedy draft tokens d1..dK, every step at the same position P, the first fed
          (τ, h) with h the target's post-final-norm state at P-1, later ones (d_i, h'_i);
  verify: one target forward over [τ, d1..dK] at positions P..P+K, logits and h for every row;
  accept: sample-then-match. Row i's token t_i is sampled from the target's distribution p_i
          (p: target probabilities after the request's sampling settings); if t_i == d_{i+1} the
          next row is also valid, else t_i is the last token of the round. The emitted tokens are
          therefore exactly distributed as the target's own sampler, at any temperature: a draft
          only decides how many target rows one forward can commit. No draft probabilities q are
          needed (this is not Leviathan-style rejection sampling).
  rollback: the KV keeps τ and the accepted drafts; h for the next round is h at the last kept row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .draft_policy import DraftPolicy


@dataclass
class SpecConfig:
    draft: object  # models.gemma4_assistant.Gemma4Assistant
    tokens: int = 2  # K; vLLM recommends 2 for E2B, 4 for E4B
    p_min: float = 0.0  # stop drafting when the draft's top probability falls below this
    # engine/draft_policy.py: the draft goes off by itself where it cannot pay (adaptive=False:
    # always K). verify_cost: t(verify of 1 + K rows) / t(one decode row), draft_cost: t(one
    # draft step) / t(one decode row), when measured elsewhere (e.g. on the full-size model);
    # None: measured on the running engine.
    adaptive: bool = True
    verify_cost: Optional[float] = None
    draft_cost: Optional[float] = None


@dataclass
class SpecStats:
    rounds: int = 0  # target verify forwards
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens committed by those forwards

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": self.accepted / self.rounds if self.rounds else 0.0,
                "tokens_per_target_forward": self.emitted / self.rounds if self.rounds else 0.0}


@torch.no_grad()
def draft_tokens(spec: SpecConfig, target, kv, last_token: int, h: torch.Tensor, pos: int, k: int) -> list[int]:
    """Up to k greedy draft tokens at position `pos` (the draft owns no KV: it reads `kv`)."""
    out: list[int] = []
    tok = torch.tensor([last_token])
    h = h.reshape(1, -1)
    P = torch.tensor([pos])
    for _ in range(k):
        logits, h, _ = spec.draft.draft_step(tok, h, P, target, kv)
        probs = torch.softmax(logits[0].float(), dim=-1)
        d = int(torch.argmax(probs))
        if spec.p_min > 0 and float(probs[d]) < spec.p_min:
            break
        out.append(d)
        tok = torch.tensor([d])
    return out


def accept(sample, logits: torch.Tensor, drafts: list[int], history: list[int], eog) -> list[int]:
    """Sample-then-match over verify rows logits [K+1, V]: the committed tokens (accepted drafts
    and one token sampled by the target), stopping after an end-of-generation token."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        tok = sample(logits[i], history + out)
        out.append(tok)
        if tok in eog or i == len(drafts) or tok != drafts[i]:
            break
    return out


def draft_policy(spec: SpecConfig):
    """The engine's on/off and k decision for `spec` (engine/draft_policy.py), costs pinned from
    `spec.verify_cost` / `spec.draft_cost` where given; None when not adaptive."""
    if not spec.adaptive:
        return None
    policy = DraftPolicy(spec.tokens)
    policy.pin_costs({spec.tokens + 1: spec.verify_cost} if spec.verify_cost is not None else None, spec.draft_cost)
    return policy


def check_draft(draft, target_cfg) -> None:
    """A clear one-line error for a draft that cannot serve this target (see validate_against)."""
    draft.cfg.validate_against(target_cfg)


def max_draft(k: int, n_ids: int, n_out: int, max_tokens: int, limit: int) -> int:
    """Drafts that still leave room for the bonus token within max_tokens and the context."""
    return max(0, min(k, max_tokens - n_out - 1, limit - n_ids - 1))
