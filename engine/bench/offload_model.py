"""A model of one decode token's time for the 26B-A4B with its expert banks in host RAM, computed
by the CPU beside a GPU that holds everything else (llama.cpp `-ngl 99 --n-cpu-moe N` / `-cmoe`),
built from measured parts (engine/bench/expert_mix.py) and stated hardware figures, to predict
tok/s on cards this project has no run on (`edgegem bench --offload-model`).

Per token (`predict`), for each of the 30 layers:
  GPU part   attention (its weights and the KV it reads at `context`), the dense MLP, the router,
             norms: bytes / (card bandwidth x efficiency) + a fixed launch cost per layer
  crossing   device -> host: the normed residual (d float32) + 8 ids + 8 weights; host ->
             device: the experts' sum (d float32): each one PCIe latency (a small copy with the
             stream sync before it) + bytes / PCIe bandwidth
  CPU part   expert bytes / (host bandwidth x efficiency), or the measured per-core rate x the
             host's core speed x cores when that is slower (compute-bound), + the graph's fixed
             cost (thread wake-up and barriers, measured here)
then the head (the tied Q6_K embedding, 605 MB) on the GPU. Two schedules:
  sequential  llama.cpp's: GPU part, crossing, CPU part, crossing, one after the other
  overlapped  the dense MLP (and the experts a hot cache holds) on the GPU while the CPU computes
              the other experts: attention and the router must finish first, the sum after both
A hot-expert cache with hit rate h moves h of the expert bytes to the GPU (read at its bandwidth).
Overlapped, a layer is fastest where the GPU's share (dense MLP + hits) takes as long as the CPU's
misses (h ~0.65 and ~0.9 on the two systems below); past it more hits only lengthen the GPU's side.
The crossings stay: a layer whose 8 experts all hit would skip them, which a hit rate of 0.3
makes rare (0.3^8).

The functions are pure: bytes come from a tensor table (`model_bytes`), rates from `Measured`
and the hardware `System` profiles below, each figure with its source.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Gpu:
    name: str
    bandwidth_gbps: float  # peak memory bandwidth
    efficiency: float  # share of it decode's small GEMVs reach
    layer_overhead_us: float  # launches/gaps of a layer's ~20 kernels not hidden by the bytes


@dataclass(frozen=True)
class Host:
    name: str
    bandwidth_gbps: float  # peak DRAM bandwidth
    efficiency: float  # share of it ggml's expert reads reach when bandwidth-bound
    cores: int  # threads llama.cpp runs the experts on (physical cores)
    core_speed: float  # one core's ggml rate relative to one core of the measuring machine


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_gbps: float  # one direction
    latency_us: float  # one small cudaMemcpy plus its sync, each way


@dataclass(frozen=True)
class System:
    name: str
    gpu: Gpu
    host: Host
    link: Link
    anchor: Optional[tuple[float, float]] = None  # the published llama.cpp decode tok/s, low and high

    @property
    def anchor_label(self) -> str:
        if self.anchor is None:
            return "-"
        low, high = self.anchor
        return f"~{low:g}" if low == high else f"{low:g}-{high:g}"


# --- hardware figures ------------------------------------------------------------------------
# RTX 4060 Laptop: 128-bit GDDR6 at 16 Gbps = 256 GB/s (NVIDIA's laptop spec sheet; the desktop
# card is 17 Gbps, 272 GB/s); the AD107 has 8 PCIe 4.0 lanes: 16 GT/s x 8 x 128/130 = 15.75 GB/s.
# RTX 3060 12 GB: 192-bit GDDR6 at 15 Gbps = 360 GB/s; x16 lanes, in a PCIe 3.0 host
# 8 GT/s x 16 x 128/130 = 15.75 GB/s (the same as 4.0 x8).
# Anchors (docs/benchmarks.md, users.md): llama.cpp -ngl 99 --n-cpu-moe / -cmoe, 26B-A4B Q4_K_M:
# ~20 tok/s on an RTX 4060 Laptop (host CPU not published; reported "at 248K context", the context
# allocated, not the depth of the measured tokens), 12-15 on an RTX 3060 12 GB in a PCIe 3.0 host.
# Efficiency 0.70: a decode layer's matrices are 1-7 MB each (attn_q 6.5 MB, the dense MLP
# 11-13 MB in three), too small to stream at the 80-90% a large GEMV reaches; llama.cpp's dense
# decode on these cards is usually quoted at 70-80% of peak on 7-8B models. Not calibrated: no GPU
# run exists (docs/benchmarks.md). Layer overhead 40 us: ~20 kernels a layer at ~2 us of launch
# gap each that the bytes do not hide (an assumption; CUDA graphs cover one split at a time).
RTX_4060_LAPTOP = Gpu("RTX 4060 Laptop 8 GB", 256.0, 0.70, 40.0)
RTX_3060 = Gpu("RTX 3060 12 GB", 360.0, 0.70, 40.0)
PCIE4_X8 = Link("PCIe 4.0 x8", 15.75, 15.0)
PCIE3_X16 = Link("PCIe 3.0 x16", 15.75, 15.0)
# DDR5-5600 dual channel: 5600 MT/s x 8 B x 2 = 89.6 GB/s peak; DDR4-3200 dual channel 51.2.
# Efficiency 0.65: llama.cpp's CPU decode of a dense 7B Q4_0 (3.8 GB) on dual-channel DDR5-5600
# runs at ~15 tok/s, ~57 GB/s, ~65% of peak; scattered 2.2 MB expert slices do no better.
# Core speed against one core of the measuring VM (AMD EPYC Zen 3, 2.45 GHz base): an 8-core
# Zen 4 / Raptor Lake laptop part sustains ~4.0 GHz all-core (x1.6) with ~10% more IPC on ggml's
# AVX2 dot products: x1.8 (an assumption, not measured); a 6-core Zen 2 desktop (Ryzen 5 3600,
# the usual PCIe 3.0 host) ~4.0 GHz at ~10% less IPC: x1.45.
DDR5_8_CORE = Host("8-core laptop, DDR5-5600 x2", 89.6, 0.65, 8, 1.8)
DDR4_6_CORE = Host("6-core desktop, DDR4-3200 x2", 51.2, 0.65, 6, 1.45)

SYSTEMS = (
    System("RTX 4060 Laptop 8 GB + 8-core DDR5", RTX_4060_LAPTOP, DDR5_8_CORE, PCIE4_X8, (20.0, 20.0)),
    System("RTX 3060 12 GB + 6-core DDR4, PCIe 3", RTX_3060, DDR4_6_CORE, PCIE3_X16, (12.0, 15.0)),
)


@dataclass(frozen=True)
class Measured:
    """What expert_mix.py measured on this machine, per token-layer: the bytes one layer's mix
    reads, its rate on one core, and the graph's fixed cost."""
    layer_bytes: int  # mean bytes of one layer's 8 chosen experts
    per_core_gbps: float  # one thread, fresh experts: GB/s of expert bytes a core gets through
    fixed_us: float  # one graph run's fixed cost (8 tiny experts)
    threads: int = 1  # the threads of `this_host`'s rate
    effective_gbps: float = 0.0  # the measured rate on `threads` threads (fresh experts)
    read_gbps: float = 0.0  # a plain streaming read on `threads` threads (the DRAM roof here)


@dataclass(frozen=True)
class ModelBytes:
    """Bytes one decode token reads, from a tensor table (`model_bytes`)."""
    n_layer: int
    d_model: int
    n_used: int
    expert_bytes: int  # all layers: 8 chosen experts' gate_up + down rows
    dense_mlp_bytes: int  # all layers: ffn_gate/up/down (the branch that can overlap)
    gpu_layer_bytes: int  # all layers: every other layer tensor (attention, router, norms) + KV
    head_bytes: int  # the tied head (token_embd, Q6_K) and the final norm

    def per_layer(self, total: int) -> float:
        return total / self.n_layer


def model_bytes(layout, context: int = 4096, kv_bytes_per_value: int = 2) -> ModelBytes:
    """Bytes per decode token of the layout's tensors: an expert bank [d, n, E] is read n_used/E
    (its chosen experts' rows); the KV at `context` tokens (f16, K and V both stored: llama.cpp's
    cache keeps V even where the model has V = K) on min(context, window) tokens of sliding
    layers and all of them on full ones."""
    from models.gemma4 import Gemma4Config

    cfg = Gemma4Config.from_gguf(layout)
    E, k = cfg.n_expert, cfg.n_expert_used
    experts = dense = other = 0
    for t in layout:
        if not t.name.startswith("blk."):
            continue
        if t.name.endswith(("_exps.weight",)):
            experts += t.n_bytes // E * k
        elif t.name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")):
            dense += t.n_bytes
        else:
            other += t.n_bytes
    for i in range(cfg.n_layer):
        seen = context if cfg.window(i) is None else min(context, cfg.window(i))
        other += seen * 2 * cfg.n_kv_head[i] * cfg.head_dim[i] * kv_bytes_per_value
    head = sum(layout.tensor(n).n_bytes for n in ("token_embd.weight", "output_norm.weight"))
    return ModelBytes(cfg.n_layer, cfg.d_model, k, experts, dense, other, head)


def crossing_us(link: Link, n_bytes: int) -> float:
    return link.latency_us + n_bytes / (link.bandwidth_gbps * 1e3)


def cpu_expert_us(host: Host, measured: Measured, n_bytes: float) -> float:
    """One layer's experts on the host: bandwidth- or compute-bound, whichever is slower, plus the
    graph's fixed cost."""
    memory = n_bytes / (host.bandwidth_gbps * host.efficiency * 1e3)
    compute = n_bytes / (measured.per_core_gbps * host.core_speed * host.cores * 1e3)
    return max(memory, compute) + measured.fixed_us


def gpu_us(gpu: Gpu, n_bytes: float) -> float:
    return n_bytes / (gpu.bandwidth_gbps * gpu.efficiency * 1e3)


def predict(system: System, mb: ModelBytes, measured: Measured, hit_rate: float = 0.0,
            overlapped: bool = False) -> dict:
    """ms per token and tok/s, with the parts per token (module doc)."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit rate {hit_rate} is not in [0, 1]")
    L = mb.n_layer  # below: bytes and us per layer
    experts = mb.per_layer(mb.expert_bytes)
    cpu = cpu_expert_us(system.host, measured, experts * (1 - hit_rate)) if hit_rate < 1 else 0.0
    hits = gpu_us(system.gpu, experts * hit_rate)
    dense = gpu_us(system.gpu, mb.per_layer(mb.dense_mlp_bytes))
    attention = gpu_us(system.gpu, mb.per_layer(mb.gpu_layer_bytes)) + system.gpu.layer_overhead_us
    # d float32 down with 8 int32 ids and 8 float32 weights; the sum back
    cross = crossing_us(system.link, 4 * mb.d_model + 8 * mb.n_used) + crossing_us(system.link, 4 * mb.d_model)
    if overlapped:
        layer = attention + cross + max(cpu, dense + hits)
    else:
        layer = attention + dense + hits + cross + cpu
    head = gpu_us(system.gpu, mb.head_bytes)
    ms = (L * layer + head) / 1e3
    return {"ms": ms, "tok_s": 1e3 / ms, "gpu_ms": L * (attention + dense + hits) / 1e3 + head / 1e3,
            "cpu_ms": L * cpu / 1e3, "crossing_ms": L * cross / 1e3, "cpu_bound": cpu_bound(system.host, measured)}


def cpu_bound(host: Host, measured: Measured) -> str:
    """What limits the host's expert reads: "memory" or "compute" (the slower of the two rates)."""
    memory = host.bandwidth_gbps * host.efficiency
    compute = measured.per_core_gbps * host.core_speed * host.cores
    return "compute" if compute <= memory else "memory"


def this_host(measured: Measured) -> Host:
    """The measuring machine as the host, at the expert-mix rate measured on its threads. Its DRAM
    figure is the plain read's roof or the mix's own rate, whichever is higher (the mix reached
    that much from DRAM, so the memory gives at least it; on the 2-core VM a torch sum reads
    slower than ggml's products do), at efficiency 1: both are measured, not peaks."""
    return Host(f"this CPU ({measured.threads} threads, measured)", max(measured.read_gbps, measured.effective_gbps),
                1.0, measured.threads, measured.effective_gbps / measured.per_core_gbps / measured.threads)


def systems_with_this_host(measured: Measured) -> tuple:
    return SYSTEMS + (System(f"RTX 4060 Laptop 8 GB + this CPU ({measured.threads} thr)", RTX_4060_LAPTOP,
                             this_host(measured), PCIE4_X8),)


def implied_host_efficiency(system: System, mb: ModelBytes, measured: Measured) -> Optional[float]:
    """The host efficiency (share of its DRAM peak) at which the sequential schedule gives the
    anchor's mid tok/s, everything else as stated: what the anchors say the expert reads really
    run at, if the rest of the model is right. None without an anchor or when no efficiency fits."""
    if system.anchor is None:
        return None
    target_ms = 2e3 / sum(system.anchor)
    rest = predict(system, mb, measured)
    cpu_us = (target_ms - (rest["ms"] - rest["cpu_ms"])) * 1e3 / mb.n_layer - measured.fixed_us
    if cpu_us <= 0:
        return None
    return mb.per_layer(mb.expert_bytes) / (cpu_us * 1e3) / system.host.bandwidth_gbps


def prediction_rows(mb: ModelBytes, measured: Measured, hit_rate: float = 0.3,
                    systems: Optional[tuple] = None) -> list[dict]:
    rows = []
    for s in systems or systems_with_this_host(measured):
        seq, ovl = predict(s, mb, measured), predict(s, mb, measured, overlapped=True)
        hot = predict(s, mb, measured, hit_rate=hit_rate, overlapped=True)
        rows.append({"system": s.name, "sequential": seq["tok_s"], "overlapped": ovl["tok_s"],
                     "overlapped_hot": hot["tok_s"], "anchor": s.anchor_label, "gpu_ms": seq["gpu_ms"],
                     "cpu_ms": seq["cpu_ms"], "crossing_ms": seq["crossing_ms"], "cpu_bound": seq["cpu_bound"],
                     "host_efficiency": s.host.efficiency,
                     "implied_host_efficiency": implied_host_efficiency(s, mb, measured)})
    return rows


# --- the report (`edgegem bench --offload-model`) ------------------------------------------------
def measured_from(mix: dict) -> Measured:
    """`Measured` from expert_mix.measure_expert_mix's rows: the per-core rate from the one-thread
    row (else the fewest threads, divided by them); this host's rate and read roof from the row
    with the best rate; the fixed cost from the row where it is least. On a shared 2-core VM the
    2-thread runs can lose a core to another job mid-graph, and ggml's spinning barriers then wait
    for it (2026-12-04: the 8-tiny-expert graph took 25 us on 1 thread, 0.1 s on 2 at load 6)."""
    one = min(mix["rows"], key=lambda r: r["threads"])
    best = max(mix["rows"], key=lambda r: r["fresh_gbps"])
    return Measured(layer_bytes=one["bytes"], per_core_gbps=one["fresh_gbps"] / one["threads"],
                    fixed_us=min(r["fixed_ms"] for r in mix["rows"]) * 1e3, threads=best["threads"],
                    effective_gbps=best["fresh_gbps"], read_gbps=best["read_gbps"])


def offload_model_bench(seconds: float = 2.0, threads=(1, 2), context: int = 4096, hit_rate: float = 0.3,
                        variant: str = "26b-a4b") -> dict:
    """Measure the expert mix here (`seconds` a measurement), then print the predicted table."""
    import os

    from models.synthetic import synthetic_layout

    from .cpu_profile import cpu_flags
    from .expert_mix import measure_expert_mix
    from .table import Column, header, row

    load_before = os.getloadavg()
    mix = measure_expert_mix(threads, seconds, variant)
    measured = measured_from(mix)
    mb = model_bytes(synthetic_layout(variant), context)
    rows = prediction_rows(mb, measured, hit_rate)
    load = os.getloadavg()
    lines = [f"CPU: {cpu_flags()}",
             f"load average {load_before[0]:.2f} before, {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} after",
             f"expert mix of one {variant} layer, T=1, 8 of 128 experts ({', '.join(mix['kinds'])}), "
             f"{measured.layer_bytes / 1e6:.2f} MB read a layer, {mb.expert_bytes / 1e9:.3f} GB a token:"]
    mcols = [Column("threads", 7, "d"), Column("median ms", 9, ".2f"), Column("fresh ms", 9, ".2f"),
             Column("GB/s", 6, ".2f"),
             Column("hot ms", 7, ".2f"), Column("GB/s", 6, ".2f"), Column("fixed us", 8, ".0f"),
             Column("read GB/s", 9, ".1f"), Column("runs", 5, "d")]
    lines.append(header(mcols))
    for r in mix["rows"]:
        lines.append(row(mcols, [r["threads"], r["fresh_median_ms"], r["fresh_ms"], r["fresh_gbps"], r["hot_ms"],
                                 r["hot_gbps"], r["fixed_ms"] * 1e3, r["read_gbps"], r["runs"]]))
    lines += ["(fresh: 8 new random experts a run, 10th percentile; hot: the same 8 again; fixed: 8 tiny experts)",
              f"per-core rate {measured.per_core_gbps:.2f} GB/s; this host: {measured.threads} threads at "
              f"{measured.effective_gbps:.2f} GB/s; GPU bytes a token {mb.gpu_layer_bytes / 1e9:.3f} GB "
              f"(attention, router, norms, KV at {context} tokens) + dense MLP {mb.dense_mlp_bytes / 1e9:.3f} GB "
              f"+ head {mb.head_bytes / 1e9:.3f} GB",
              "", f"predicted decode tok/s (hot: {hit_rate:.0%} of expert bytes served from VRAM):"]
    cols = [Column("system", 40, "s", "<"), Column("sequential", 10, ".1f"), Column("overlapped", 10, ".1f"),
            Column(f"ovl+{hit_rate:.0%} hot", 11, ".1f"), Column("llama.cpp", 9, "s"), Column("GPU ms", 7, ".2f"),
            Column("CPU ms", 7, ".2f"), Column("PCIe ms", 7, ".2f"), Column("CPU is", 8, "s"),
            Column("host eff.", 9, "s"), Column("anchor eff.", 11, "s")]
    lines.append(header(cols))
    for r in rows:
        implied = r["implied_host_efficiency"]
        lines.append(row(cols, [r["system"], r["sequential"], r["overlapped"], r["overlapped_hot"], r["anchor"],
                                r["gpu_ms"], r["cpu_ms"], r["crossing_ms"], r["cpu_bound"],
                                f"{r['host_efficiency']:.2f}", "-" if implied is None else f"{implied:.2f}"]))
    lines.append("host eff.: the share of the host's DRAM peak assumed for the expert reads; anchor eff.: the "
                 "share at which the sequential schedule would give the llama.cpp figure")
    return {"cpu": cpu_flags(), "load_average": list(load), "context": context, "hit_rate": hit_rate,
            "measured": {**mix, **measured.__dict__},
            "bytes": mb.__dict__, "predicted": rows, "table": "\n".join(lines)}
