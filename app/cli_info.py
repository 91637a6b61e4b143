"""`edgegem info`: a model's (or a synthetic layout's) layers, tensor types and memory plan."""
from __future__ import annotations

import json
from pathlib import Path

from .cli_options import _draft_path


def cmd_info(a) -> int:
    from engine import api
    from engine.memory_plan import PlanOptions, parse_size

    from .cli_options import placement_options
    if a.model and a.synthetic:
        raise ValueError("give a MODEL file or --synthetic, not both")
    opt = PlanOptions(budget=parse_size(a.gpu_memory_budget) if a.gpu_memory_budget else None, device=a.device,
                      kv_format=a.kv_cache_dtype, swa_format=a.swa_kv_cache_dtype, embed_weights=a.embed_weights,
                      prefill_chunk=a.prefill_chunk, max_running=a.max_running_requests,
                      draft=_draft_path(a.spec_draft_model), **placement_options(a))
    model = str(api.resolve_model(a.model)) if a.model else None  # a path or a models-folder name
    if model and not a.synthetic:
        from dataclasses import replace

        mmproj = a.mmproj or api.find_mmproj(model)
        opt = replace(opt, mmproj=Path(mmproj) if mmproj else None)
    from dataclasses import replace

    runtime = api.runtime_info(a.device, a.exact, Path(model) if model else None)
    opt = replace(opt, dequantizes=runtime["name"] != "ggml")  # llama.cpp's kernels expand no matrix
    d = api.describe(api.open_layout(model, a.synthetic), plan=opt)
    d["runtime"] = runtime
    if a.json:
        print(json.dumps(d, indent=1))
        return 0
    print(f"{d['file']}\n  architecture {d['architecture']}  name {d['name']}")
    print(f"  {d['n_layer']} layers, d_model {d['d_model']}, vocab {d['vocab_size']}, "
          f"context {d['context_length']}, sliding window {d['sliding_window']}")
    print(f"  runtime on {a.device}{' --exact' if a.exact else ''}: {d['runtime']['name']} ({d['runtime']['detail']})")
    if d["runtime"].get("weight_pages"):
        print(f"  {d['runtime']['weight_pages']}")
    for k in ("ple_width", "kv_shared_layers", "fast_prefill", "final_softcap", "n_expert", "n_expert_used",
              "expert_ffn"):
        if k in d:
            print(f"  {k}: {d[k]}")
    print("  layer  type     head_dim  heads/kv  ffn     kv_source")
    for L in d["layers"]:
        src = "own" if L["kv_source"] == L["layer"] else f"layer {L['kv_source']}"
        print(f"  {L['layer']:5d}  {L['type']:7s}  {L['head_dim']:8d}  {L['n_head']:2d}/{L['n_kv_head']:<5d}  "
              f"{L['ffn']:6d}  {src}")
    print("  tensor types:")
    for k, v in d["tensor_types"].items():
        print(f"    {k:6s} {v['tensors']:4d} tensors  {v['bytes'] / 2**20:9.1f} MiB")
    print(f"  total {d['total_bytes'] / 2**20:.1f} MiB ({d['total_bytes']:,} B, {d['total_bytes'] / 1e9:.2f} GB)")
    _print_plan(d["plan"])
    return 0

def _print_plan(p: dict) -> None:
    from engine.memory_plan import fmt_size
    if "error" in p:
        print(f"  memory plan ({p['budget_source']}, {fmt_size(p['budget'])}): {p['error']}")
        return
    o = p["options"]
    print(f"  memory plan for {p['model']} on {p['device']}: budget {fmt_size(p['budget'])} ({p['budget_source']}), "
          f"embed weights on {o['embed_weights']}, prefill chunk {o['prefill_chunk']}, "
          f"{o['max_running']} running requests")
    if p.get("fitted"):
        print(f"    {p['fitted']}")
    if p.get("placement"):
        pl = p["placement"]
        cache = f"; hot-expert cache {fmt_size(pl['expert_cache_bytes'])}" if pl["host_expert_bytes"] else ""
        print(f"    placement: {pl['summary']}{cache}")
    if p.get("capped"):
        print(f"    {p['capped']}")
    print(f"    {'component':28s} {'device':>10s} {'host':>10s}  detail")
    for c in p["components"]:
        print(f"    {c['name']:28s} {fmt_size(c['device_bytes']):>10s} {fmt_size(c['host_bytes']):>10s}  {c['detail']}")
    print(f"    {'total':28s} {fmt_size(p['device_total']):>10s} {fmt_size(p['host_total']):>10s}  "
          f"({fmt_size(p['unused_bytes'])} of the budget unused)")
    for k in ("full", "window"):
        kv = p["kv"][k]
        print(f"    {k} pool: {kv['format']}, {kv['unit_bytes']} B/token over {len(kv['layers'])} layers, "
              f"{kv['tokens']} tokens")
    print(f"    max context {p['max_context']} tokens (model limit {p['context_length']})")
    print(f"  max context by KV format (window pool {p['kv']['window']['format']}):")
    print(f"    {'format':22s} {'B/token':>8s} {'full pool tokens':>17s} {'max context':>12s}")
    for f, r in p["max_context_by_format"].items():
        if r is None:
            print(f"    {f:22s} {'':>8s} {'does not fit':>17s}")
        else:
            print(f"    {f:22s} {r['unit_bytes']:8d} {r['full_pool_tokens']:17d} {r['max_context']:12d}")
