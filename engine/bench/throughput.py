"""The engine bench: prefill tokens/s per prompt length and decode tokens/s per context through the
Engine, the bytes a decode step reads, their share of the device's peak bandwidth and the peak memory
(`edgegem bench --device cuda`, or `--synthetic e2b|e4b` on any device).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from .gpu_profile import decode_profile, profile_lines
from .table import Column, header, row

PROFILE_STEPS = 8  # decode steps under the profiler per context (`profile`), after the timed ones

# Peak memory bandwidth in GB/s (10^9 B/s) by device name, most specific first (vendor spec sheets).
PEAK_BANDWIDTH_GBPS = (
    ("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("A100-SXM4-80GB", 2039), ("A100 80GB", 2039),
    ("A100-PCIE-80GB", 1935), ("A100", 1555), ("RTX 4090", 1008), ("RTX 3090", 936),
    ("RTX 4060 Ti", 288), ("RTX 4060", 272), ("RTX 3060 Ti", 448), ("RTX 3060", 360),
)


def peak_bandwidth_gbps(device_name: str):
    """Known peak bandwidth of a device (GB/s), or None."""
    for key, gbps in PEAK_BANDWIDTH_GBPS:
        if key.lower() in device_name.lower():
            return float(gbps)
    return None


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads on the model's device: every matrix and vector
    there (QuantWeight bytes, dense/float16 tensors), except the embedding lookup tables, of which a
    step reads only the current token's row (token_embd counts when it doubles as the tied head).
    Of an expert bank (`*_exps.weight`, 26B-A4B) a token reads its top k of E experts: k/E of it."""
    from models.weights import weight_tensors

    seen, total = set(), 0
    head = getattr(model, "head_w", None)
    cfg = getattr(model, "cfg", None)
    used = getattr(cfg, "n_expert_used", 0) / getattr(cfg, "n_expert", 0) if getattr(cfg, "n_expert", 0) else 1.0
    for name, w in model.w.items():
        if name in ("per_layer_token_embd.weight", "token_embd.host") or \
                (name == "token_embd.weight" and w is not head):
            continue
        share = used if name.endswith("_exps.weight") else 1.0
        for t in weight_tensors(w):
            if t.device.type != model.device.type or id(t) in seen:
                continue
            seen.add(id(t))
            total += int(t.numel() * t.element_size() * share)
    return total


def kv_bytes_read(cfg, pools, context: int) -> int:
    """KV bytes one decode step reads with `context` tokens before it: every attending layer reads
    the keys/values it sees (its own or, when KV-shared, its source layer's: the shared layers
    re-read the same slabs) -- (context + 1) tokens on full layers, min(context + 1, window) on
    sliding ones -- at the unit bytes of its pool's format (values plus per-token scales)."""
    total = 0
    for i in range(cfg.n_layer):
        src = cfg.kv_source(i)
        pool = pools.pool_of(src)
        seen = context + 1 if cfg.window(i) is None else min(context + 1, cfg.window(i))
        total += seen * pool.fmt.unit_bytes(cfg.n_kv_head[src], cfg.head_dim[src])
    return total


def _peak_memory(device) -> tuple[int, str]:
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "host peak RSS (ru_maxrss)"


def _random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=max(1, n)).tolist()


@torch.inference_mode()
def gpu_bench(model=None, device="cuda", budget=None, kv_cache_dtype: str = "auto", embed_weights: str = "host",
              fast_prefill: bool = True, prompts=(512, 4096, 16384), contexts=(0, 4096, 32768),
              decode_steps: int = 32, synthetic=None, swa_kv_cache_dtype: str = "auto",
              peak_bandwidth=None, quantized=None, attention_backend: str = "auto", seed: int = 0,
              batched_decode=None, on_row=None, options=None, profile: bool = False) -> dict:
    """Prefill tok/s per prompt length and decode tok/s per context through the Engine.

    `model`: a GGUF path, a loaded `Gemma4Model`/`LoadedModel`, or None with `synthetic`
    ("e2b"/"e4b"/"tiny": random weights built in memory). Pools follow the memory planner for
    `budget` (bytes or "8GiB"; default 90% of free memory) with one running request; on the CPU the
    full pool is capped to what the runs need. Each prefill is timed from `add` to its first token
    (CUDA synchronized around it); each decode figure is prefill to `context` tokens and one decode
    step (untimed), then `decode_steps` timed steps (`time_decode`). One warm-up (the shortest
    prompt plus 2 decode steps, then the longest prompt) runs first. The untimed step keeps the CUDA graph's re-capture out
    of the figure: the warm-up's slot tables hold 1,024 tokens, a step at context 4,096 needs 8,192
    (batch_decode.capacity_of), so the first step at a longer context reallocates them and captures
    again (a warm-up run and a capture of the whole step, many times a replay's cost).
    Bytes per decode token = device weight bytes (`device_weight_bytes`) + KV bytes read at that
    context (`kv_bytes_read`); achieved bandwidth = bytes/token x decode tok/s, and its share of the
    device's peak (`peak_bandwidth` in GB/s, else the PEAK_BANDWIDTH_GBPS table; n/a if unknown).
    `quantized` (synthetic): QuantWeight matrices for the Triton kernels (default on CUDA or under
    TRITON_INTERPRET=1), else dense weights on the plain torch path. `batched_decode`: the engine's
    setting (None: its default, on for CUDA). `on_row(kind, row)`: called once with "warmup" (load
    and warm-up seconds, the device), then with "prefill" or "decode" and each row as soon as it
    is measured (`edgegem bench --rows` prints them), so a run stopped part-way keeps its rows.
    `options`: the `EngineOptions` whose budget and placement flags decide which expert banks (and,
    of a GGUF path, layers) stay in host RAM, as `run` and `chat` load a file; a synthetic MoE then
    keeps its placed banks in host RAM (`synthetic_model(host_tensors=)`), beside the device. `profile`: after
    each decode row, `PROFILE_STEPS` more steps under torch's profiler (`gpu_profile.decode_profile`:
    the kernels' device time per step beside the wall time, the top kernels) in the row's "profile"."""
    from kernels.triton.launch import interpreting

    from ..kv.format import resolve_format
    from ..memory_plan import PlanOptions, parse_size, plan_memory
    from ..sampler import SamplingParams
    from ..scheduler import Engine, EngineConfig

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    lm = None
    if synthetic:
        from models.synthetic import synthetic_layout, synthetic_model
        if quantized is None:
            quantized = dev.type == "cuda" or interpreting()
        layout = synthetic_layout(synthetic)
        placed = _synthetic_placement(synthetic, layout, options)
        lm_model = synthetic_model(synthetic, dev, seed=seed, host_embeddings=embed_weights == "host",
                                   quantized=quantized, host_tensors=frozenset(placed.get("host_tensors", ())))
        label = f"synthetic {synthetic.upper()} (random weights, Q4_K_M mix)"
        if options is not None:
            from models.loader import LoadedModel

            from ..api import attach_host_experts
            attach_host_experts(lm_model, placed, dev.type)
            lm = LoadedModel(model=lm_model, arch="gemma4", path=Path(f"synthetic-{synthetic}.gguf"), source=layout)
    elif isinstance(model, (str, Path)):
        from ..api import open_model
        lm = open_model(Path(model), exact=False, device=dev.type, embed_weights=embed_weights, options=options)
        layout, lm_model, label = lm.source, lm.model, Path(model).name
    else:
        lm_model = getattr(model, "model", model)
        layout, label = getattr(model, "source", None), type(lm_model).__name__
    load_s = time.perf_counter() - t0
    cfg = lm_model.cfg

    kv = resolve_format(kv_cache_dtype, dev.type).name
    swa = resolve_format(swa_kv_cache_dtype, dev.type).name
    chunk = 2048 if dev.type == "cuda" else 512
    need = max(max(prompts, default=1), max(contexts, default=0) + 1) + decode_steps + 8
    full, window = need, None
    plan = None
    if options is not None and lm is not None and dev.type == "cuda":
        # the plan of the placement the load made (host expert banks / layers off the budget)
        from dataclasses import replace

        from ..api import engine_plan
        plan, kv, swa, chunk = engine_plan(lm, replace(options, max_running_requests=1, prefill_chunk=chunk,
                                                       kv_cache_dtype=kv, swa_kv_cache_dtype=swa))
        full, window = plan.kv["full"]["tokens"] or 1, plan.kv["window"]["tokens"] or None
    elif isinstance(getattr(layout, "tensors", None), dict):
        plan = plan_memory(layout, PlanOptions(budget=parse_size(budget) if budget is not None else None,
                                               device=dev.type, kv_format=kv, swa_format=swa,
                                               embed_weights=embed_weights, prefill_chunk=chunk, max_running=1),
                           cfg)
        full, window = plan.kv["full"]["tokens"] or 1, plan.kv["window"]["tokens"] or None
        if dev.type != "cuda":
            full = min(full, need)
    engine = Engine(lm_model, None, EngineConfig(max_running_requests=1, prefill_chunk=chunk,
                                                 fast_prefill=fast_prefill, cache_type="naive",
                                                 kv_cache_dtype=kv, swa_kv_cache_dtype=swa, full_tokens=full,
                                                 window_tokens=window, attention_backend=attention_backend,
                                                 batched_decode=batched_decode))
    limit, vocab = engine.context_limit, cfg.vocab_size
    rng_seed = iter(range(seed + 1, seed + 10_000))

    def prefill(n: int, max_tokens: int):
        req = engine.add(_random_prompt(vocab, n, next(rng_seed)), SamplingParams(max_tokens=max_tokens))
        _sync(dev)
        t = time.perf_counter()
        while req.state.name in ("WAITING", "PREFILL") and req.finish_reason is None:
            engine.step()
        _sync(dev)
        if req.finish_reason == "error":
            raise RuntimeError(f"bench prefill of {n} tokens failed (KV pools too small for it?)")
        return req, time.perf_counter() - t

    def finish(req):
        engine.abort(req.id)
        engine.run_to_completion()

    t_warm = time.perf_counter()
    warm, _ = prefill(min(prompts, default=8), 3)
    for _ in range(2):
        engine.step()
    _sync(dev)
    finish(warm)
    if len(set(prompts)) > 1 and max(prompts) < engine.context_limit:
        # the longest prompt too: a path only long chunks take (host expert banks streamed to the
        # GPU from 32 rows) compiles here, not inside the first row that takes it
        finish(prefill(max(prompts), 1)[0])
    warmup_s = time.perf_counter() - t_warm

    out = {"model": label, "device": str(dev), "device_name": _device_name(dev), "load_s": load_s,
           "runtime": lm_model.runtime.value,
           "dtype": str(lm_model.dtype).replace("torch.", ""), "kv_cache_dtype": kv, "swa_kv_cache_dtype": swa,
           "embed_weights": embed_weights, "fast_prefill": fast_prefill, "prefill_chunk": chunk,
           "full_pool_tokens": engine.pools.full.capacity if engine.pools.full.layers else 0,
           "window_pool_tokens": engine.pools.window.capacity if engine.pools.window.layers else 0,
           "context_limit": limit, "weight_bytes_per_token": device_weight_bytes(lm_model),
           "prefill": [], "decode": []}
    if plan is not None:
        out["budget"] = plan.budget
    peak = peak_bandwidth if peak_bandwidth else peak_bandwidth_gbps(out["device_name"]) if dev.type == "cuda" else None
    out["peak_bandwidth_gbps"] = peak

    def add_row(kind: str, row: dict) -> None:
        out[kind].append(row)
        if on_row is not None:
            on_row(kind, row)

    if on_row is not None:  # where the time went before the first figure (the first run JIT-compiles)
        on_row("warmup", {"load_s": load_s, "warmup_s": warmup_s, "device_name": out["device_name"],
                          "peak_bandwidth_gbps": peak, "context_limit": limit})

    for n in prompts:
        if n >= limit:
            add_row("prefill", {"prompt_tokens": n, "skipped": f"over the {limit}-token context"})
            continue
        req, s = prefill(n, 1)
        finish(req)
        add_row("prefill", {"prompt_tokens": n, "seconds": s, "tok_s": n / s})
    for c in contexts:
        if max(c, 1) + decode_steps + 2 >= limit:
            add_row("decode", {"context": c, "skipped": f"over the {limit}-token context"})
            continue
        # context 0: a 1-token prompt; its first token, one untimed step, then decode_steps timed ones
        req, _ = prefill(max(c, 1), decode_steps + 2 + (PROFILE_STEPS if profile else 0))
        engine.step()  # untimed: the slot tables grow to this context here (a graph re-capture on CUDA)
        before, he0, cl0 = len(req.output_ids), engine.status().get("host_experts"), engine.status().get("cpu_layers")
        s = time_decode(engine, dev, decode_steps)
        n_done = len(req.output_ids) - before
        prof = decode_profile(engine, dev, PROFILE_STEPS) if profile else None
        finish(req)
        tok_s = n_done / s if s > 0 else 0.0
        kv_b = kv_bytes_read(cfg, engine.pools, c)
        b = out["weight_bytes_per_token"] + kv_b
        row = {"context": c, "steps": n_done, "seconds": s, "tok_s": tok_s, "kv_bytes_per_token": kv_b,
               "bytes_per_token": b, "achieved_gbps": b * tok_s / 1e9}
        row["bandwidth_share"] = row["achieved_gbps"] / peak if peak else None
        if he0:
            row.update(host_expert_row(he0, engine.status()["host_experts"], n_done))
        if cl0:
            row.update(cpu_layer_row(cl0, engine.status()["cpu_layers"], n_done))
        if prof is not None:
            row["profile"] = prof
        add_row("decode", row)
    out["peak_memory_bytes"], out["peak_memory_source"] = _peak_memory(dev)
    out["table"] = _bench_table(out)
    return out


def has_experts(variant: str) -> bool:
    """Whether a synthetic layout is an MoE (its banks are what a placement keeps in host RAM)."""
    from models.synthetic import VARIANTS

    return bool(VARIANTS[variant.lower()].get("n_expert"))


def _synthetic_placement(variant: str, layout, options) -> dict:
    """The memory plan's placement of a synthetic layout built in memory (`options`: the budget and
    placement flags; None: every weight on the device): expert banks only, whole layers need the
    file (`bench --keep-gguf`, opened as `run` opens it)."""
    if options is None:
        return {}
    from ..api import plan_placement

    placed = plan_placement(layout, options)
    if placed.get("cpu_layers"):
        raise ValueError(f"the plan keeps whole layers of the synthetic {variant} on the CPU "
                         f"({placed['summary'].split(';')[0]}); built in memory it places expert banks only: "
                         "--keep-gguf PATH writes the file and opens it as run does")
    return placed


def host_expert_row(before: dict, after: dict, tokens: int) -> dict:
    """Per decode token, from two engine `host_experts` statuses: bytes over PCIe, the CPU's
    milliseconds in the experts' graphs, synchronizations (one a host layer and step), and the
    hot-expert cache's hit rate over those tokens."""
    def delta(k):
        return after.get(k, 0) - before.get(k, 0)

    n = max(tokens, 1)
    out = {"pcie_bytes_per_token": (delta("to_host") + delta("to_device")) / n,
           "cpu_expert_ms_per_token": delta("cpu_ms") / n, "syncs_per_token": delta("crossings") / n}
    if "lookups" in after:
        out["hit_rate"] = delta("hits") / delta("lookups") if delta("lookups") else 0.0
    return out


def cpu_layer_row(before: dict, after: dict, tokens: int) -> dict:
    """Per decode token, from two engine `cpu_layers` statuses (the first layers on the CPU beside
    the GPU, models/host_layers.py): the residual's bytes over PCIe, the host's milliseconds in
    its layers, and the crossings (one a forward; nothing comes back, no wait)."""
    n = max(tokens, 1)
    return {"layer_pcie_bytes_per_token": (after["to_device"] - before["to_device"]) / n,
            "cpu_layer_ms_per_token": (after["cpu_ms"] - before["cpu_ms"]) / n,
            "crossings_per_token": (after["crossings"] - before["crossings"]) / n}


def time_decode(engine, device, steps: int) -> float:
    """Seconds for `steps` engine steps of the running decode (the device synchronized before and
    after, so the figure holds every kernel the steps launched)."""
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    return time.perf_counter() - t


def _device_name(dev) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform
    return platform.processor() or platform.machine() or "cpu"


PREFILL_COLUMNS = (Column("prefill", 10, "d"), Column("tok/s", 12, ".1f"))
DECODE_COLUMNS = (Column("decode ctx", 10, "d"), Column("tok/s", 12, ".1f"), Column("MB read/tok", 12, ".1f"),
                  Column("GB/s", 9, ".2f"), Column("of peak", 8))


def _bench_table(o: dict) -> str:
    from ..memory_plan import fmt_size
    peak = o["peak_bandwidth_gbps"]
    lines = [f"{o['model']} on {o['device']} ({o['device_name']}), runtime {o['runtime']}: {o['dtype']} activations, "
             f"KV {o['kv_cache_dtype']} "
             f"(window {o['swa_kv_cache_dtype']}), embed weights on {o['embed_weights']}, fast prefill "
             f"{'on' if o['fast_prefill'] else 'off'}, prefill chunk {o['prefill_chunk']}",
             f"pools: full {o['full_pool_tokens']} tokens, window {o['window_pool_tokens']} tokens; "
             f"context limit {o['context_limit']}"
             + (f"; budget {fmt_size(o['budget'])}" if "budget" in o else ""),
             header(PREFILL_COLUMNS)]
    for r in o["prefill"]:
        lines.append(row(PREFILL_COLUMNS, (r["prompt_tokens"], r["tok_s"])) if "tok_s" in r else
                     row(PREFILL_COLUMNS, (r["prompt_tokens"],)) + f"   {r['skipped']}")
    lines.append(header(DECODE_COLUMNS))
    for r in o["decode"]:
        if "tok_s" not in r:
            lines.append(row(DECODE_COLUMNS, (r["context"],)) + f"   {r['skipped']}")
            continue
        share = f"{100 * r['bandwidth_share']:.1f}%" if r["bandwidth_share"] is not None else "n/a"
        lines.append(row(DECODE_COLUMNS, (r["context"], r["tok_s"], r["bytes_per_token"] / 1e6, r["achieved_gbps"],
                                          share)))
    for r in o["decode"]:
        if "pcie_bytes_per_token" in r:
            lines.append(f"  context {r['context']}: host experts {r['pcie_bytes_per_token'] / 1e3:.1f} KB over PCIe, "
                         f"{r['cpu_expert_ms_per_token']:.2f} ms of CPU experts, {r['syncs_per_token']:.0f} syncs a token"
                         + (f", {100 * r['hit_rate']:.0f}% cache hits" if "hit_rate" in r else ""))
    for r in o["decode"]:
        if "layer_pcie_bytes_per_token" in r:
            lines.append(f"  context {r['context']}: CPU layers {r['cpu_layer_ms_per_token']:.2f} ms, the residual "
                         f"{r['layer_pcie_bytes_per_token'] / 1e3:.1f} KB over PCIe, "
                         f"{r['crossings_per_token']:.0f} crossing a token")
    for r in o["decode"]:
        if "profile" in r:
            lines += profile_lines(r)
    lines.append(f"bytes read per decode token = device weights {o['weight_bytes_per_token'] / 1e6:.1f} MB "
                 f"(lookup tables excluded) + KV of every attending layer at that context; peak bandwidth "
                 + (f"{peak:.0f} GB/s" if peak else "n/a (unknown device; --peak-bandwidth GBps)"))
    lines.append(f"peak memory {fmt_size(o['peak_memory_bytes'])} ({o['peak_memory_source']})")
    return "\n".join(lines)
