"""The measured part of the offload model (engine/bench/offload_model.py): what one decode token's
expert mix of a 26B-A4B layer costs on this CPU through llama.cpp's kernels, and what the CPU
reads while doing it.

One layer's mix, T = 1 row, as a host-experts layer runs it (models/gemma4_ggml.py
`expert_nodes`, without the norms and the per-expert scale, which are a few KB):

    gu = mul_mat_id(gate_up_exps, z, sel)       Q4_K [128, 1408, 2816]: 8 x 2.23 MB read
    y  = mul_mat_id(down_exps, geglu(gu), sel)  Q5_0 or Q8_0 [128, 2816, 704]: 8 x 1.36 / 2.11 MB
    h2 = sum of the 8 slots

The banks are full size with random blocks of the file's types (`synthetic_layout("26b-a4b")`:
the down banks' rows of 704 are not whole 256-value blocks, so llama.cpp's Q4_K_M gives them
Q5_0, or Q8_0 on the layers that get "more bits"). Both kinds of layer are built and timed in
turn, each run with 8 fresh random experts, so that the bytes come from DRAM and not from the
32 MB L3 (one layer's choice is ~29-35 MB; the banks ~0.46-0.56 GB a layer). The same 8 experts
run again and again ("hot") give the kernels' rate on cache-resident bytes. A plain read of a
1 GiB tensor gives the DRAM roof the reads could reach here. And the same graph on 8 tiny experts
gives the fixed cost of a graph run (thread wake-up, barriers) that a real layer pays on top.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

_GATE_UP, _DOWN = "ffn_gate_up_exps.weight", "ffn_down_exps.weight"


def expert_layer_types(layout) -> dict:
    """{layer: (gate_up type name, down type name)} from a tensor table (ggml type names)."""
    from gguf import GGMLQuantizationType as T

    out = {}
    for t in layout:
        if t.name.endswith(_GATE_UP):
            i = int(t.name.split(".")[1])
            out[i] = (T(t.ggml_type).name, T(layout.tensor(f"blk.{i}.{_DOWN}").ggml_type).name)
    return out


def _bank(type_name: str, E: int, n: int, k: int, gen):
    from gguf import GGMLQuantizationType as T

    from kernels.ggml import Bank
    from models.synthetic import random_quant_bytes

    raw = random_quant_bytes(type_name, E * n, k, 1 / math.sqrt(k), gen, "cpu")
    return Bank(raw.reshape(-1), int(T[type_name]), (E, n, k))


class ExpertMix:
    """One layer's expert mix as a ggml graph over its two banks (module doc), for T = 1 row."""

    def __init__(self, gate_up_type: str, down_type: str, E: int, d: int, width: int, n_used: int, gen):
        from kernels.ggml import Graph

        self.gate_up = _bank(gate_up_type, E, 2 * width, d, gen)  # [E, 2I, d]
        self.down = _bank(down_type, E, d, width, gen)  # [E, d, I]
        self.E, self.d, self.n_used = E, d, n_used
        self.bytes_per_expert = (self.gate_up.nbytes + self.down.nbytes) // E
        self.z = torch.randn(1, 1, d, generator=gen)  # float32 [T, 1, d] cpu: the normed residual
        # int32 [T, k] cpu, written through numpy between runs: a torch op there would wake torch's
        # OpenMP workers, whose spin-wait after it took a core from ggml's two threads (2-thread
        # runs measured 90 ms instead of ~2 ms on the 2-core VM)
        self._ids = np.zeros((1, n_used), dtype=np.int32)
        self.ids = torch.from_numpy(self._ids)
        self.out = torch.empty(1, d)
        g = Graph(16 + n_used, True)
        gz, gi = g.input(self.z), g.input(self.ids)
        gu = g.mul_mat_id(g.matrix(self.gate_up), gz, gi)  # [2I, k, T]
        nb = [4, 8 * width, 8 * width * n_used]
        act = g.geglu_split(g.view(gu, [width, n_used, 1], nb, 0), g.view(gu, [width, n_used, 1], nb, 4 * width))
        y = g.mul_mat_id(g.matrix(self.down), act, gi)  # [d, k, T]
        nb = [4, 4 * d * n_used]
        h2 = g.view(y, [d, 1], nb, 0)
        for j in range(1, n_used):  # the slots summed in order, as llama.cpp adds its views
            h2 = g.add(h2, g.view(y, [d, 1], nb, 4 * d * j))
        g.output(h2)
        self.graph = g.finish()

    def choose(self, rng: np.random.Generator) -> None:
        self._ids[0] = rng.choice(self.E, self.n_used, replace=False)

    def run(self) -> None:
        self.graph.run([self.z, self.ids], [self.out])


def _time_ms(mixes: list, seconds: float, rng, fresh: bool, min_runs: int = 3) -> tuple[float, float, int]:
    """Median and 10th-percentile ms of one mix run over `seconds` (at least `min_runs` per mix),
    the mixes in turn; `fresh`: new random experts before each run (DRAM), else the same ones
    (cache-hot). On a shared machine the median carries the other jobs' share of the cores; the
    10th percentile is the runs that had them to themselves, the figure the rates are taken from."""
    for m in mixes:  # warm: pages in, graphs allocated
        m.choose(rng)
        m.run()
    times, stop = [], time.perf_counter() + seconds
    while len(times) < min_runs * len(mixes) or time.perf_counter() < stop:
        m = mixes[len(times) % len(mixes)]
        if fresh:
            m.choose(rng)
        t = time.perf_counter()
        m.run()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3, times[len(times) // 10] * 1e3, len(times)


def read_bandwidth_gbps(threads: int, n_bytes: int = 1 << 30, repeat: int = 3) -> float:
    """GB/s of a plain read of `n_bytes` (an int64 sum with torch on `threads` threads), best of
    `repeat`: the DRAM roof this machine gives a simple streaming kernel."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(n_bytes // 8, dtype=torch.int64)
        x.sum()
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return n_bytes / best / 1e9
    finally:
        torch.set_num_threads(old)


def measure_expert_mix(threads=(1, 2), seconds: float = 2.0, variant: str = "26b-a4b", seed: int = 0) -> dict:
    """Per thread count: ms of one layer's mix with fresh experts (DRAM; median and 10th
    percentile) and hot ones (10th percentile), over both kinds of layer of the file; the bytes one
    mix reads and the GB/s that makes; the graph's fixed cost (8 tiny experts); the plain read roof.
    `seconds` per measurement (the runs' time, not the banks' building)."""
    from kernels import ggml
    from models.synthetic import VARIANTS, synthetic_layout

    v = VARIANTS[variant]
    E, d, width, k = v["n_expert"], v["d"], v["expert_ffn"], v["n_expert_used"]
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    kinds = sorted(set(expert_layer_types(synthetic_layout(variant)).values()))
    mixes = [ExpertMix(gu, dn, E, d, width, k, gen) for gu, dn in kinds]
    tiny = ExpertMix(kinds[0][0], "Q8_0", k, 256, 32, k, gen)  # the fixed cost: 8 experts of 24 KB
    old, rows = ggml.threads(), []
    try:
        for n in threads:
            ggml.set_threads(n)
            fresh_median, fresh, runs = _time_ms(mixes, seconds, rng, fresh=True)
            _, hot, _ = _time_ms(mixes, seconds / 2, rng, fresh=False)
            _, fixed, _ = _time_ms([tiny], seconds / 4, rng, fresh=False)
            mean_bytes = sum(m.bytes_per_expert for m in mixes) * k / len(mixes)
            rows.append({"threads": n, "fresh_median_ms": fresh_median, "fresh_ms": fresh, "hot_ms": hot,
                         "fixed_ms": fixed, "runs": runs, "bytes": int(mean_bytes),
                         "fresh_gbps": mean_bytes / fresh / 1e6, "hot_gbps": mean_bytes / hot / 1e6,
                         "read_gbps": read_bandwidth_gbps(n)})
    finally:
        ggml.set_threads(old)
    return {"kinds": [f"{gu} gate_up + {dn} down" for gu, dn in kinds], "rows": rows}
