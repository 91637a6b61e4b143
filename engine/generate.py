"""Single-sequence generation on a loaded model: prefill, then decode one token at a time.

The simple loop behind `edgegem run` (and the reference the batched engine is checked against):
a contiguous per-layer KV cache, logits only for the row that is sampled.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from models.kv_cache import DenseKVCache

from .sampler import Sampler, SamplingParams
from .scheduler import ContextOverflowError


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop" (end-of-generation token) | "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first generated token comes from the prefill pass; the rest are decode steps.
        return max(len(self.ids) - 1, 0) / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "ids": self.ids, "text": self.text,
                "finish_reason": self.finish_reason,
                "timings": {"prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                            "prefill_tok_s": round(self.prefill_tok_s, 2),
                            "decode_tok_s": round(self.decode_tok_s, 2)}}


@torch.inference_mode()
def generate(model, prompt_ids: list[int], params: SamplingParams, eog_ids: Iterable[int] = (),
             detokenizer=None, on_text: Optional[Callable[[str], None]] = None,
             context_length: Optional[int] = None) -> GenerationResult:
    """Greedy or sampled continuation of `prompt_ids`; streams text through `on_text`."""
    n_ctx = context_length or model.cfg.context_length
    if not prompt_ids:
        raise ValueError("empty prompt")
    if len(prompt_ids) >= n_ctx:
        raise ContextOverflowError(
            f"prompt of {len(prompt_ids)} tokens does not fit the {n_ctx}-token context")
    max_new = min(params.max_tokens, n_ctx - len(prompt_ids))
    eog = set(eog_ids)
    sampler = Sampler(params)
    cache = DenseKVCache()
    res = GenerationResult(list(prompt_ids))
    t0 = time.perf_counter()
    tokens = torch.tensor(prompt_ids, dtype=torch.long)
    last = torch.tensor([len(prompt_ids) - 1])
    logits = model.forward(tokens, torch.arange(len(prompt_ids)), cache, logits_rows=last)[0]
    res.prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    pos = len(prompt_ids)
    while len(res.ids) < max_new:
        tok = sampler.sample(logits)
        if tok in eog:
            res.finish_reason = "stop"
            break
        res.ids.append(tok)
        if detokenizer is not None:
            delta = detokenizer.push(tok)
            res.text += delta
            if on_text and delta:
                on_text(delta)
        if len(res.ids) >= max_new:
            break
        logits = model.forward(torch.tensor([tok]), torch.tensor([pos]), cache)[0]
        pos += 1
    if detokenizer is not None:
        tail = detokenizer.flush()
        res.text += tail
        if on_text and tail:
            on_text(tail)
    res.decode_s = time.perf_counter() - t1
    return res
