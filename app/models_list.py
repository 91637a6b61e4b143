"""`edgegem models`: the GGUFs in the models directory (and the demo model), each with its size,
architecture, quant and the longest context that fits with int8 KV under the memory plan."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

PLAN_KV = "int8_per_token_head"  # the format small cards use for long chats (half of bf16's bytes)
RUNNABLE = ("gemma4", "gemma3")


def model_rows(root: Path, budget: Optional[str] = None, device: str = "auto") -> dict:
    from engine import api
    from engine.memory_plan import default_budget, parse_size
    from engine.models_dir import gguf_summary, local_models

    device = api.default_device() if device == "auto" else device
    budget_bytes, source = (parse_size(budget), "--gpu-memory-budget") if budget else default_budget(device)
    entries = [(m.name, m.rel, m.path, m.size) for m in local_models(root)]
    demo = api.demo_model_path()
    if demo is not None:
        entries.append(("demo", None, demo, demo.stat().st_size))
    rows = []
    for name, rel, path, size in entries:
        row = {"name": name, "path": str(path), "rel": rel, "size": size}
        try:
            row.update(gguf_summary(path))
        except ValueError as e:  # not a GGUF, truncated, unknown tensor type: listed, with the reason
            row["error"] = str(e)
            rows.append(row)
            continue
        row["plan"] = _plan(path, row["architecture"], budget_bytes, device)
        rows.append(row)
    return {"models_dir": str(root), "device": device, "budget": budget_bytes, "budget_source": source,
            "kv_format": PLAN_KV, "models": rows}


def _plan(path: Path, arch: str, budget: int, device: str) -> dict:
    """{"max_context", "context_length"}, or {"note"} for a draft or a model that does not fit."""
    from engine import api
    from engine.memory_plan import PlanOptions

    if arch == "gemma4-assistant":
        return {"note": "assistant draft (--spec-draft-model)"}
    if arch == "clip":
        return {"note": "image encoder (mmproj) of the model beside it"}
    if arch not in RUNNABLE:
        return {"note": f"architecture {arch} is not supported"}
    opt = PlanOptions(budget=budget, device=device, kv_format=PLAN_KV)
    try:
        p = api.memory_plan(api.open_layout(str(path)), opt)
    except ValueError as e:  # BudgetTooSmall: first sentence only, the table stays one line per model
        return {"note": "does not fit: " + str(e).split(";")[0]}
    return {"max_context": p["max_context"], "context_length": p["context_length"]}


def _fmt_plan(plan: dict) -> str:
    if "note" in plan:
        return plan["note"]
    full = " (full)" if plan["max_context"] >= plan["context_length"] else ""
    return f"{plan['max_context']}{full}"


def print_models(d: dict, as_json: bool = False) -> None:
    from engine.memory_plan import fmt_size

    if as_json:
        print(json.dumps(d, indent=1))
        return
    print(f"models in {d['models_dir']}; context with {d['kv_format']} KV on {d['device']}, "
          f"budget {fmt_size(d['budget'])} ({d['budget_source']})")
    if not d["models"]:
        print("  none yet: edgegem pull unsloth/gemma-4-E2B-it-GGUF:Q4_K_M")
        return
    width = max(len(r["name"]) for r in d["models"])
    print(f"  {'name':{width}s}  {'size':>9s}  {'architecture':16s}  {'quant':10s}  context")
    for r in d["models"]:
        if "error" in r:
            print(f"  {r['name']:{width}s}  {fmt_size(r['size']):>9s}  unreadable: {r['error']}")
            continue
        print(f"  {r['name']:{width}s}  {fmt_size(r['size']):>9s}  {r['architecture']:16s}  {r['quant'] or '?':10s}  "
              f"{_fmt_plan(r['plan'])}")
    print("  use one with --model NAME (a unique piece of the name is enough; 'demo' is the bundled model)")
