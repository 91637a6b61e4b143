"""`edgegem bench --spec-draft-model D`: decode through the engine with and without the assistant
draft on one greedy prompt, the draft's acceptance, and what a verify step costs against a plain one.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .cpu import bench_prompt
from .throughput import _sync


def spec_bench(target_path: Path, draft_path: Path, n_prompt: int = 64, n_decode: int = 64,
               spec_tokens: int = 2, device: str = "cpu") -> dict:
    """Decode tokens/s through the engine with and without the assistant draft on the same greedy
    prompt, the draft's acceptance, and the cost of a verify step against a plain decode step.
    Greedy outputs must be equal (the draft only changes speed); the table says whether they were."""
    from models.gguf import GGUFFile
    from models.loader import load_model

    from ..api import load_draft
    from ..sampler import SamplingParams
    from ..scheduler import Engine, EngineConfig

    exact = device != "cpu"
    lm = load_model(target_path, device=device, weight_dtype=None if exact else torch.float16,
                    quantized=device == "cuda")
    spec = load_draft(str(draft_path), lm, spec_tokens)
    spec.adaptive = False  # measure the draft at K every step, wherever the engine would turn it off
    vocab = len(GGUFFile(target_path).metadata.get("tokenizer.ggml.tokens", ())) or lm.config.vocab_size
    prompt = bench_prompt(vocab, n_prompt)
    params = SamplingParams(temperature=0.0, max_tokens=n_decode)
    runs = {}
    for name, s in (("plain", None), ("draft", spec)):
        eng = Engine(lm.model, lm.tokenizer, EngineConfig(full_tokens=n_prompt + n_decode + 64, cache_type="naive"),
                     spec=s)
        req = eng.add(prompt, params)
        eng.step()  # the prompt
        _sync(device)
        t0 = time.perf_counter()
        eng.run_to_completion()
        _sync(device)
        dt = time.perf_counter() - t0
        n = max(len(req.output_ids) - 1, 1)
        stats = eng.spec_stats.as_dict() if s is not None else None
        steps = stats["rounds"] if stats else n
        runs[name] = {"decode_tok_s": n / dt, "ids": req.output_ids, "ms_per_target_step": 1000 * dt / max(steps, 1),
                      "speculative": stats}
    out = {"target": str(target_path), "draft": str(draft_path), "device": device, "runtime": lm.runtime.value,
           "spec_tokens": spec_tokens,
           "plain_decode_tok_s": runs["plain"]["decode_tok_s"], "draft_decode_tok_s": runs["draft"]["decode_tok_s"],
           "speedup": runs["draft"]["decode_tok_s"] / runs["plain"]["decode_tok_s"],
           "verify_step_cost": runs["draft"]["ms_per_target_step"] / runs["plain"]["ms_per_target_step"],
           "greedy_equal": runs["plain"]["ids"] == runs["draft"]["ids"], **runs["draft"]["speculative"]}
    out["table"] = "\n".join([
        f"{Path(target_path).name} + draft {Path(draft_path).name} on {device}, runtime {lm.runtime.value}: "
        f"{n_prompt}-token prompt, "
        f"{n_decode} greedy tokens, K = {spec_tokens}",
        f"decode tok/s without draft {out['plain_decode_tok_s']:.1f}, with draft {out['draft_decode_tok_s']:.1f} "
        f"({out['speedup']:.2f}x)",
        f"acceptance {out['acceptance_rate']:.1%} ({out['accepted']} of {out['drafted']} drafted), "
        f"{out['tokens_per_target_forward']:.2f} tokens per target forward; a draft+verify round costs "
        f"{out['verify_step_cost']:.2f}x a plain decode step",
        f"greedy outputs equal: {out['greedy_equal']}"])
    return out
