"""Token sampling on the logits of the sampled rows only: greedy, temperature, top-k, top-p, min-p.

`SamplingParams.temperature == 0` is greedy (argmax, ties to the lowest id like llama.cpp).
A seeded `torch.Generator` per request makes sampled runs repeatable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 256

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1 or self.top_k < 0:
            raise ValueError(f"invalid sampling parameters: {self}")


def logits_to_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits -> [V] probabilities after temperature, top-k, top-p and min-p filtering."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return probs / probs.sum()


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def sample(self, logits: torch.Tensor) -> int:
        """One token id from a [V] logits row."""
        if self.params.temperature == 0:
            return int(torch.argmax(logits))
        probs = logits_to_probs(logits, self.params).cpu()
        return int(torch.multinomial(probs, 1, generator=self.gen))
