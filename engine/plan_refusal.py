"""The memory plan's refusal: one line naming the shortfall, and the flags that would fit, each
checked by planning with it (engine/memory_plan.py plans; this module only explains a failure)."""
from __future__ import annotations

import math
from dataclasses import replace

from .kv.format import resolve_format
from .placement import PlacementFlags
from .sizes import GiB, BudgetTooSmall, fmt_size, parse_size


def too_small(cfg, opt, smallest, needed, budget, suggest, placed, label: str, replan) -> BudgetTooSmall:
    """`opt`: the options as asked; `smallest`: the last settings the fit tried, which `needed` is for;
    `label` the model's name; `replan(options)` plans again (raising BudgetTooSmall where it does not fit)."""
    what = (f"the {label} weights, workspace and a "
            f"{min(opt.ctx_size or opt.min_context, cfg.context_length)}-token KV cache")
    at = f"prefill chunk {smallest.chunk}, {smallest.running} running request{'s' if smallest.running > 1 else ''}"
    if placed is not None and placed.offloads:
        at += f", {placed.describe(cfg.n_layer).split(';')[0]}"
    msg = (f"budget {fmt_size(budget)} is {fmt_size(needed - budget)} short of the {fmt_size(needed)} {what} "
           f"need at {at}")
    tips: list = []
    if suggest:
        if placed is not None and placed.source == "auto" and placed.offloads:
            # the suggestions re-plan at the placement auto ended with (one plan each, not every step)
            opt = replace(opt, placement=PlacementFlags(cpu_moe=bool(placed.expert_layers),
                                                        n_gpu_layers=placed.gpu_layers(cfg.n_layer)))
        tips = _suggestions(replan, cfg, opt, needed)
        msg += "; try " + (", ".join(t for t, _ in tips[:-1]) + ", or " if len(tips) > 1 else "") + tips[-1][0]
        if placed is not None and placed.offloads:
            msg += " (or --device cpu: every weight in host RAM)"
    return BudgetTooSmall(msg, needed, budget, tips)


def _fits(replan, opt) -> bool:
    try:
        replan(opt)
        return True
    except BudgetTooSmall:
        return False


def _suggestions(replan, cfg, opt, needed: int) -> list[tuple[str, dict]]:
    """Per knob, the mildest change that fits on its own (checked by planning with it, so the fit
    still lowers what the user left unset); if none does, knobs combined in order; last, the
    budget that fits as asked. Chunk and running requests are knobs only where the user set them:
    otherwise the fit has already tried every smaller value."""
    knobs: list[list[tuple[str, dict]]] = []
    if opt.embed_weights == "device":
        knobs.append([("--embed-weights host", {"embed_weights": "host"})])
    if opt.draft is not None:
        knobs.append([("without --spec-draft-model", {"draft": None})])
    if opt.prefill_chunk is not None:
        knobs.append([(f"--prefill-chunk {c}", {"prefill_chunk": c}) for c in (1024, 512, 256) if c < opt.chunk])
    if opt.max_running is not None:
        knobs.append([(f"--max-running-requests {r}", {"max_running": r}) for r in range(opt.running - 1, 0, -1)])
    for flag, key in (("--kv-cache-dtype", "kv_format"), ("--swa-kv-cache-dtype", "swa_format")):
        if not resolve_format(getattr(opt, key), opt.device).scaled:
            knobs.append([(f"{flag} int8_per_token_head", {key: "int8_per_token_head"})])
    knobs += _placement_knobs(cfg, opt)
    knobs = [k for k in knobs if k]
    tips = [next(((t, o) for t, o in k if _fits(replan, replace(opt, **o))), None) for k in knobs]
    tips = [t for t in tips if t]
    combo: dict = {}
    flags: list[str] = []
    for k in knobs if not tips else []:  # nothing fits alone: add knobs in order until it does
        hit = next(((t, o) for t, o in k if _fits(replan, replace(opt, **combo, **o))), None)
        combo.update((hit or k[-1])[1])
        flags.append((hit or k[-1])[0])
        if hit:
            tips.append((" ".join(flags), dict(combo)))
            break
    tenths = math.ceil(needed / GiB * 10)
    while not _fits(replan, replace(opt, budget=parse_size(f"{tenths / 10}GiB"))):
        tenths += 1
    tips.append((f"--gpu-memory-budget {tenths / 10}GiB", {"budget": parse_size(f"{tenths / 10}GiB")}))
    return tips


def _placement_knobs(cfg, opt) -> list[list[tuple[str, dict]]]:
    """More in host RAM than the placement flags given said: more expert banks, fewer GPU layers."""
    f, L, out = opt.placement, cfg.n_layer, []
    if opt.device == "cuda" and f.n_cpu_moe is not None and not f.cpu_moe and getattr(cfg, "n_expert", 0):
        out.append([(f"--n-cpu-moe {n}", {"placement": replace(f, n_cpu_moe=n)}) for n in range(f.n_cpu_moe + 1, L + 1)])
    if opt.device == "cuda" and f.n_gpu_layers is not None:
        out.append([(f"--n-gpu-layers {n}", {"placement": replace(f, n_gpu_layers=n)})
                    for n in range(min(f.n_gpu_layers, L) - 1, 0, -1)])
    return out
