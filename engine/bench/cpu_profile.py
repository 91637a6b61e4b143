"""`edgegem bench --device cpu --profile`: where one CPU decode step's time goes, per op.

The engine decodes as `run` and the app do (scheduler, pooled KV); the step's pieces are timed by
wrapping them for the measured steps only: the layer stretches the models call through
models/ops.py (the attention prologue, the residual after attention, the MLP and everything after
it: each one ggml graph with its products on llama.cpp's kernels, several torch ops and products on
the torch formats), the attention over the KV slabs, the KV writes (made inside the prologue, so
counted there too), the embedding lookups, the head (product + softcap) and sampling; "other" is
the rest of the step (Python, the scheduler).
Wall time, so a busy machine shows up in it (the table says the load average). torch's own
profiler adds the top aten ops (it does not see ggml, which runs under ctypes).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict

PIECES = {  # label -> (module, attribute) wrapped; layer stretches are patched where the models bound them
    "attention prologue (projections, q/k norm + RoPE, v norm)": ("attention_prologue",),
    "residual after attention (o projection + norms)": ("attn_residual",),
    "MLP + per-layer input + norms": ("ffn_residual",),
    "whole layer in one ggml graph (Gemma 3 decode: all of the above and the attention)": ("fused_decode_layer",),
    "whole token in one ggml graph (every layer, the final norm, the head)": ("fused_decode_step",),
    "MoE block in one ggml graph (router, 8 of 128 experts, dense branch)": ("fused_moe_ffn",),
    "o projection (MoE layers)": ("linear",),
    "residual adds + norms (MoE layers)": ("add_rms_norm",),
}


@contextlib.contextmanager
def _timed(acc: dict, obj, name: str, label: str):
    orig = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            v = acc[label]
            v[0] += time.perf_counter() - t
            v[1] += 1

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        setattr(obj, name, orig)


def cpu_flags() -> str:
    """The CPU model and the flags that pick kernels (AVX2, AVX-512 F/VNNI/BF16, AMX)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown CPU")
    flags = set(info.split("flags", 2)[1].split("\n", 1)[0].split()) if "flags" in info else set()
    picked = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16",
                          "amx_int8") if f in flags]
    return f"{name}, {os.cpu_count()} CPUs, flags: {' '.join(picked) or 'none of avx2/avx512/amx'}"


def profile_decode(lm, context: int = 1024, steps: int = 16, aten_rows: int = 12) -> dict:
    """Time `steps` decode steps after a `context`-token prompt (greedy) through the engine."""
    import torch

    import models.gemma3 as g3
    import models.gemma4 as g4

    from .. import cpu_runtime
    from ..scheduler import Engine, EngineConfig
    from ..sampler import SamplingParams
    from ..kv.sequence import SequenceKV

    model = lm.model
    eng = Engine(model, None, EngineConfig(full_tokens=max(4096, context + steps + 64)))
    vocab = lm.config.vocab_size
    prompt = [2] + [(7 * i + 11) % (vocab - 10) + 5 for i in range(context - 1)]
    req = eng.add(prompt, SamplingParams(temperature=0.0, max_tokens=steps + 4))
    while req.state.name != "DECODE":
        eng.step()
    eng.step()  # warm: graphs and buffers built
    acc: dict = defaultdict(lambda: [0.0, 0])
    family = type(model)
    with contextlib.ExitStack() as stack:
        for label, (name,) in PIECES.items():
            for mod in (g4, g3):
                if hasattr(mod, name):
                    stack.enter_context(_timed(acc, mod, name, label))
        stack.enter_context(_timed(acc, SequenceKV, "attend", "attention (ggml flash attention over the slab)"))
        stack.enter_context(_timed(acc, SequenceKV, "write", "KV writes into the pools"))
        stack.enter_context(_timed(acc, family, "embed", "embedding rows + per-layer inputs"))
        stack.enter_context(_timed(acc, family, "head", "head (tied embedding product + softcap)"))
        stack.enter_context(_timed(acc, Engine, "_postprocess", "sampling + stop checks"))
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        total = (time.perf_counter() - t0) / steps
    rows = [(label, v[0] / steps, v[1] / steps) for label, v in acc.items()]
    rows.sort(key=lambda r: -r[1])
    rows.append(("other (Python, scheduler, bookkeeping)", total - sum(r[1] for r in rows), 0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            eng.step()
    aten = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:aten_rows]
    kern = cpu_runtime.kernels()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"{lm.path.name}: one decode step at {context} tokens of context, {steps} steps, "
             f"{cpu_runtime.threads()} threads, runtime {lm.runtime.value}, {kern['name']} kernels; "
             f"load average {load:.1f}",
             f"  {cpu_flags()}",
             f"  step {total * 1e3:.2f} ms ({1 / total:.2f} tok/s)",
             f"  {'piece':58s} {'ms/step':>8s} {'share':>6s} {'calls/step':>10s}"]
    for label, t, n in rows:
        lines.append(f"  {label:58s} {t * 1e3:8.2f} {t / total:6.1%} {n:10.0f}")
    split = None
    if getattr(lm.config, "n_expert", 0) and lm.runtime.value == "ggml":
        from .moe_profile import moe_block_split

        split = moe_block_split(model, rows=1)
        whole = split["ms"]["whole block"]
        lines.append(f"  the MoE block's parts, each its own graph on one row, summed over its {split['layers']} layers "
                     f"(engine/bench/moe_profile.py):")
        for part, ms in split["ms"].items():
            lines.append(f"    {part:56s} {ms:8.2f} {ms / whole:6.1%} of the block")
    lines.append("  top torch ops (torch.profiler, 4 steps; ggml runs under ctypes and is not listed):")
    for e in aten:
        lines.append(f"    {e.key:40s} {e.self_cpu_time_total / 4e3:8.2f} ms/step {e.count // 4:6d} calls/step")
    return {"model": lm.path.name, "context": context, "threads": cpu_runtime.threads(), "runtime": lm.runtime.value,
            "kernels": kern["name"],
            "step_ms": total * 1e3, "pieces": [{"piece": lbl, "ms": t * 1e3, "calls": n} for lbl, t, n in rows],
            "load_average": load, "cpu": cpu_flags(), "moe_split": split, "table": "\n".join(lines)}

