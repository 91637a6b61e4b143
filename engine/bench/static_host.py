"""`edgegem bench --static --synthetic 26b-a4b`: one 26B-A4B decode step with its expert banks in
host RAM beside a GPU (`--cpu-moe`, models/host_experts.py), read without a GPU.

A dry run of the synthetic model on the meta device (`engine/bench/dry_run.py:
dry_host_expert_model`): attention, router and dense branch are recorded as the GPU would launch
them; every layer's MoE block sends r [1, d] float32, ids [1, k] int32 and weights [1, k] float32 to
host memory, ggml computes the expert mix on this CPU over the full-size banks (uninitialised bytes:
only the k picked experts' pages are touched), and the [1, d] float32 sum comes back. The recorder
(`kernels.triton.launch.record_launches`) intercepts each copy between host and device as it
intercepts launches: count and bytes each way, and the host's waits (one per group of device ->
host copies). A meta tensor holds no values, so the host reads stand-ins: the router's picks are
experts 0..k-1 and its weights 1/k (`launch._host_values`).

Two placements: every expert on the host, and a steady hot-expert cache of CACHE_SLOTS device slots
per layer holding experts 0..CACHE_SLOTS-1 (so CACHE_SLOTS of the k picks hit: 4 of 8). Weight bytes
per token: on the GPU every device tensor (`device_weight_bytes`: the banks are not there) plus the
hit experts' slot bytes; on the CPU the missed experts' bytes (`expert_bytes` each: the layer's
banks / E). The decode GEMV formats of the device matrices are compiled for `arch` as for E2B
(`static_gemv.gemv_cost`).
"""
from __future__ import annotations

from collections import Counter

from .table import Column, header, row

CACHE_SLOTS = 4  # 4 x 4.1 MiB x 30 layers = 0.5 GB of GPU memory; 4 of the step's 8 picks hit


def expert_bytes(model, layer: int) -> int:
    """Bytes one expert of `layer` reads: its rows of every bank (gate_up and down: the file's bytes)."""
    from models.host_experts import layer_banks

    return sum(b.raw[0].numel() for b in layer_banks(model.w, f"blk.{layer}."))


def _placement(model, label: str, kv: str) -> dict:
    from .dry_run import decode_step
    from .throughput import device_weight_bytes

    step = decode_step(model, batch=1, rows=1, kv=kv)
    rec, cfg = step.record, model.cfg
    layers = sorted(model.host_expert_layers)
    cache = getattr(model, "expert_cache", None)
    hit_rate = cache.stats.hit_rate if cache is not None else 0.0
    k = cfg.n_expert_used
    per_token = sum(expert_bytes(model, i) for i in layers) * k  # the k picks of every host layer
    return {
        "placement": label, "cache_slots_per_layer": cache.slots if cache is not None else 0,
        "hit_rate": hit_rate, "context": step.context,
        "kernels_per_step": rec.total, "triton_kernels": rec.n_triton, "torch_ops": rec.n_torch,
        "triton_breakdown": dict(rec.triton_counts().most_common()),
        "torch_breakdown": dict(Counter(rec.torch_ops).most_common()),
        "copies_to_host": rec.copy_count("to_host"), "bytes_to_host": rec.copy_bytes("to_host"),
        "copies_to_device": rec.copy_count("to_device"), "bytes_to_device": rec.copy_bytes("to_device"),
        "syncs_per_token": rec.host_waits, "host_layers": len(layers),
        "gpu_weight_bytes_per_token": device_weight_bytes(model) + round(per_token * hit_rate),
        "cpu_weight_bytes_per_token": round(per_token * (1 - hit_rate)),
        "record": rec,
    }


def static_host_report(variant: str, arch: str, kv: str, cache_dir) -> dict:
    from kernels.triton.compile_check import ARCHS
    from kernels.triton.qmatmul import gemv_launch_info

    from .dry_run import dry_host_expert_model
    from .static_gemv import gemv_cost, gemv_formats, model_gemv_shapes

    rows = [_placement(dry_host_expert_model(variant), "experts on host", kv),
            _placement(dry_host_expert_model(variant, cache_slots=CACHE_SLOTS), "hot-expert cache", kv)]
    model = dry_host_expert_model(variant)  # the device matrices (the cache's slots are no GEMV's)
    launches = [launch for r in rows for launch in r.pop("record").triton]
    used = list(dict.fromkeys(info["format"] for info in map(gemv_launch_info, launches) if info))
    grouped = _grouped_costs([launch for launch in launches if launch.name == "_grouped_gemv_kernel"], arch,
                             cache_dir)
    shapes = model_gemv_shapes(model)
    ref = ARCHS[arch]
    return {
        "model": f"synthetic {variant.upper()} (Q4_K_M mix), every expert bank in host RAM", "variant": variant,
        "arch": arch, "kv_cache_dtype": kv, "context": rows[0]["context"],
        "reference_gpu": {"name": ref.gpu, "sms": ref.sms, "boost_ghz": ref.boost_ghz,
                          "bandwidth_gbps": ref.bandwidth_gbps, "smem_limit": ref.smem_limit},
        "n_layer": model.cfg.n_layer, "n_expert": model.cfg.n_expert, "n_expert_used": model.cfg.n_expert_used,
        # one expert's bytes: its down rows are Q8_0 on use_more_bits layers, Q5_0 on the others
        "expert_bytes": sorted({expert_bytes(model, i) for i in model.host_expert_layers}), "placements": rows,
        "gemv_formats_used": used, "gemv_shapes": [list(s) for s in shapes],
        "gemv": [gemv_cost(f, shapes, arch, cache_dir, used=f in used) for f in gemv_formats(used)],
        "grouped_gemv": grouped,
    }


def _grouped_costs(launches, arch: str, cache_dir) -> list[dict]:
    """The hot cache's grouped GEMV launches compiled for `arch`: per distinct specialization its
    format, registers, spills and error (kernels/triton/qgrouped.py)."""
    from kernels.triton.compile_check import compile_specs, spec_of
    from kernels.triton.qformats import LAYOUT

    specs = list(dict.fromkeys(spec_of(launch) for launch in launches))
    results = compile_specs(specs, [arch], jobs=1, cache_dir=cache_dir)
    out = []
    for spec in specs:
        r = results[(spec, arch)]
        out.append({"format": LAYOUT[dict(spec.constexprs)["GGML"]][0], "registers": r.registers,
                    "spill_bytes": r.spill_stores + r.spill_loads, "error": r.error})
    return out


PLACEMENT_COLUMNS = (Column("placement", 16, align="<"), Column("hit", 4), Column("kernels", 7, "d"),
                     Column("Triton", 6, "d"), Column("torch", 6, "d"), Column("D->H n", 6, "d"),
                     Column("D->H B", 8, "d"), Column("H->D n", 6, "d"), Column("H->D B", 8, "d"),
                     Column("syncs", 5, "d"), Column("GPU MB/tok", 10, ".1f"), Column("CPU MB/tok", 10, ".1f"))


def static_host_table(o: dict) -> str:
    from .static_gemv import gemv_table_lines, title_line

    lines = [title_line(o),
             f"{o['n_layer']} layers, {o['n_expert']} experts of "
             f"{'-'.join(f'{b / 2**20:.2f}' for b in o['expert_bytes'][::max(len(o['expert_bytes']) - 1, 1)])} MiB, top "
             f"{o['n_expert_used']}; copies per step counted as intercepted (D->H: device to host, H->D: host "
             "to device), syncs = host waits on a group of D->H copies",
             header(PLACEMENT_COLUMNS)]
    for p in o["placements"]:
        lines.append(row(PLACEMENT_COLUMNS, (p["placement"], f"{100 * p['hit_rate']:.0f}%", p["kernels_per_step"],
                                             p["triton_kernels"], p["torch_ops"], p["copies_to_host"],
                                             p["bytes_to_host"], p["copies_to_device"], p["bytes_to_device"],
                                             p["syncs_per_token"], p["gpu_weight_bytes_per_token"] / 1e6,
                                             p["cpu_weight_bytes_per_token"] / 1e6)))
    for p in o["placements"]:
        lines += [f"{p['placement']}:",
                  "  Triton: " + ", ".join(f"{k} {v}" for k, v in p["triton_breakdown"].items()),
                  "  torch:  " + ", ".join(f"{k} {v}" for k, v in p["torch_breakdown"].items())]
    for g in o.get("grouped_gemv", ()):
        lines.append(f"hot cache grouped GEMV {g['format']} on {o['arch']}: "
                     + (f"error {g['error'].splitlines()[0]}" if g["error"] else
                        f"{g['registers']} registers, {g['spill_bytes']} B spilled"))
    return "\n".join(lines + gemv_table_lines(o))
