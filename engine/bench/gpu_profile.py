"""Where a decode step's time goes on a GPU: `edgegem bench --device cuda --profile`.

torch's profiler (CUPTI) records every kernel a few engine steps launch, graph replays included,
and every host-device copy. Per step: the wall time, the kernels' summed device time (when it is
far below the wall time the GPU waits on the host: Python, sampling, the step's inputs), the
kernel and copy counts, and the kernels that take the most time, by name. On the CPU the same
pass names the ops that take the most host time (a functional check of the row's shape).
"""
from __future__ import annotations

import time

import torch

TOP = 12  # kernels (or CPU ops) listed per profile


def decode_profile(engine, device, steps: int) -> dict:
    """Profile `steps` engine steps of the running decode; one dict of per-step figures."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(dev)
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize(dev)
        wall = time.perf_counter() - t
    return profile_row(prof.events(), wall, steps, cuda)


def profile_row(events, wall_s: float, steps: int, cuda: bool) -> dict:
    """Per-step figures from profiler events: device kernels (and copies) on CUDA, else the CPU
    ops' self time. Names are cut to 80 characters (Triton's kernel names carry their specializations)."""
    n = max(steps, 1)
    per_name: dict[str, list[float]] = {}
    kernels = copies = 0
    busy_us = 0.0
    for e in events:
        on_device = getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA"
        if cuda != on_device:
            continue
        name = e.name
        if cuda:
            us = e.time_range.elapsed_us()
            if "memcpy" in name.lower() or "memset" in name.lower():
                copies += 1
            else:
                kernels += 1
            busy_us += us
        else:
            us = e.self_cpu_time_total
            busy_us += us
        slot = per_name.setdefault(name[:80], [0, 0.0])
        slot[0] += 1
        slot[1] += us
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:TOP]
    row = {"profiled_steps": steps, "wall_ms_per_step": 1e3 * wall_s / n,
           "busy_ms_per_step": busy_us / 1e3 / n,
           "top": [{"name": k, "calls_per_step": c / n, "us_per_step": us / n} for k, (c, us) in top]}
    if cuda:
        row.update(kernels_per_step=kernels / n, copies_per_step=copies / n)
    return row


def profile_lines(row: dict) -> list[str]:
    """The table's lines for one decode row's profile."""
    p = row["profile"]
    what = "kernels" if "kernels_per_step" in p else "CPU ops"
    lines = [f"  context {row['context']}: {p['wall_ms_per_step']:.2f} ms/step wall, {what} busy "
             f"{p['busy_ms_per_step']:.2f} ms"
             + (f" ({p['kernels_per_step']:.0f} kernels, {p['copies_per_step']:.0f} copies a step)"
                if "kernels_per_step" in p else "")]
    for t in p["top"]:
        lines.append(f"    {t['us_per_step']:9.1f} us {t['calls_per_step']:6.1f}x  {t['name']}")
    return lines
