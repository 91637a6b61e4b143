"""Looking at a model without serving it: a GGUF's architecture, layer plan and tensor types, its
memory plan and the max context per KV format (`edgegem info`, the models list), what a GPU runs
(`edgegem doctor`). Nothing here loads weights."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Optional

from kernels.arch import support
from models.loader import open_gguf


def gpu_support(capability: tuple[int, int], triton_installed: bool = True):
    """What runs on a GPU of this compute capability (kernels.arch.ArchSupport: Triton kernels or
    the torch path and why, fp8 KV, the attention dots' operand type), for `edgegem doctor`."""
    return support(tuple(capability), triton_installed)


def open_layout(model: Optional[str] = None, synthetic: Optional[str] = None):
    """A GGUF file (metadata and tensor table, memory-mapped), or a synthetic layout (E2B, E4B,
    26B-A4B, 31B: models/synthetic.py)."""
    if synthetic:
        from models.synthetic import synthetic_layout
        return synthetic_layout(synthetic)
    if not model:
        raise ValueError("give a MODEL file or --synthetic e2b|e4b|26b-a4b|31b")
    return open_gguf(Path(model).expanduser())


def memory_plan(layout, opt, cfg=None) -> dict[str, Any]:
    """The memory plan (engine/memory_plan.py) plus the max context for every KV format. Without
    an explicit budget a model that does not fit the default one gives {"error": ...} instead of
    raising, so `info` still shows the architecture."""
    from dataclasses import replace

    from .memory_plan import BudgetTooSmall, default_budget, max_context_by_format, plan_memory
    explicit = opt.budget is not None
    if not explicit:
        budget, source = default_budget(opt.device)
        opt = replace(opt, budget=budget)
    try:
        p = plan_memory(layout, opt, cfg)
    except BudgetTooSmall as e:
        if explicit:
            raise
        return {"error": str(e), "budget": opt.budget, "budget_source": source, "needed": e.needed}
    if not explicit:
        p.budget_source = source
    return {**p.to_dict(), "max_context_by_format": max_context_by_format(layout, opt, cfg)}


def fast_prefill_note(cfg) -> str:
    """Whether fast prefill (engine/runner.py: a prompt's KV-shared layers run on its last row only)
    has anything to skip on this model."""
    if not cfg.n_kv_shared:
        return "does not apply: no KV-shared layers (every layer writes its own KV)"
    return (f"applies: layers {cfg.first_shared}-{cfg.n_layer - 1} are KV-shared and run on a prompt's "
            f"last row only")


def describe(path, plan=None) -> dict[str, Any]:
    """Architecture, layer plan and tensor types/sizes of a GGUF (a path or an opened layout),
    without loading weights; with `plan` (memory_plan.PlanOptions) also the memory plan."""
    f = path if hasattr(path, "tensors") else open_gguf(path)
    arch = f.architecture
    if arch == "gemma4":
        from models.gemma4 import Gemma4Config
        cfg = Gemma4Config.from_gguf(f)
        layers = [{"layer": i, "type": "sliding" if cfg.is_sliding[i] else "full",
                   "head_dim": cfg.head_dim[i], "n_head": cfg.n_head[i], "n_kv_head": cfg.n_kv_head[i],
                   "ffn": cfg.ffn_width[i], "kv_source": cfg.kv_source(i)} for i in range(cfg.n_layer)]
        extra = {"ple_width": cfg.ple_width, "kv_shared_layers": len(cfg.kv_shared_layers),
                 "final_softcap": cfg.final_softcap, "n_expert": cfg.n_expert, "fast_prefill": fast_prefill_note(cfg)}
        if cfg.n_expert:
            extra.update(n_expert_used=cfg.n_expert_used, expert_ffn=cfg.expert_ffn_width)
    else:
        from models.gemma3 import Gemma3Config
        cfg = Gemma3Config.from_gguf(f)
        layers = [{"layer": i, "type": "sliding" if cfg.is_sliding[i] else "full", "head_dim": cfg.head_dim,
                   "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head, "ffn": cfg.ffn_width, "kv_source": i}
                  for i in range(cfg.n_layer)]
        extra = {"final_softcap": cfg.final_softcap}
    by_type: Counter = Counter()
    bytes_by_type: Counter = Counter()
    for t in f:
        by_type[t.type_name] += 1
        bytes_by_type[t.type_name] += t.n_bytes
    out = {
        "file": str(f.path), "architecture": arch, "name": f.get("general.name"),
        "n_layer": cfg.n_layer, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
        "context_length": cfg.context_length, "sliding_window": cfg.sliding_window, **extra,
        "layers": layers,
        "tensor_types": {k: {"tensors": by_type[k], "bytes": bytes_by_type[k]} for k in sorted(by_type)},
        "total_bytes": sum(bytes_by_type.values()),
    }
    if plan is not None:
        out["plan"] = memory_plan(f, plan, cfg)
    return out
