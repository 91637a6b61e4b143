"""Per-kernel bandwidth microbenchmark: each decode GEMV format through `QuantWeight.linear` at the
matrix shapes of E2B and E4B, in GB/s and as a share of the device's peak memory bandwidth.

A GEMV for one token reads every weight byte once, so its speed is weight bytes / time. The
weights are random blocks of the format (`models.synthetic.random_quant_bytes`: real scales,
numerically tame values). A matrix that fits in L2 (an H200 has 60 MB) would be served from the
cache after the first call, so each measurement cycles through enough copies of the matrix to
exceed `ROTATE_BYTES`: every timed call reads its weights from DRAM, as a decode step does (it
reads 1.5 GB of weights per token). Timing: CUDA events around `iters` calls after `warmup` ones
(on the CPU, under TRITON_INTERPRET=1, wall clock: a functional check only). On a GPU two figures:
`us_per_call` replays the `iters` calls captured in one CUDA graph (what a decode step's graph
pays: the kernels alone), `host_us_per_call` launches them one by one from Python (what an eager
caller pays; when it exceeds the kernel time the GPU waits on the host). GB/s is of the first.

Variants (`VARIANTS`, on the FFN shapes and the formats E2B's matrices mostly take), timed the same
way: the one-row GEMV at other BLOCK_N x warps tiles (`kernels.triton.qmatmul.gemv_blocks`: more,
thinner programs cover more SMs; an N = 1,536 matrix gets 96 programs of 2 warps by default, fewer
than an H200's 132 SMs) and split over K (`gemv_split`: 2, 4, 8 times the loads in flight, which a
tile alone does not change, plus one reduction launch). Which reads the bytes fastest is measured,
not assumed: the row's `variants_us`.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Optional

import torch

BLOCKS = ((4, 1), (8, 1), (8, 2), (16, 4))  # (BLOCK_N, warps) tiles of the one-row GEMV
SPLITS = (2, 4, 8)  # K splits at the default tile
# name -> (tile or None: the default, splits)
VARIANTS = {**{f"{n}x{w}": ((n, w), 1) for n, w in BLOCKS}, **{f"split{k}": (None, k) for k in SPLITS}}
BLOCK_FORMATS = ("Q4_K", "Q6_K", "Q8_0")
BLOCK_MATRICES = ("ffn_up", "ffn_down")
ROTATE_BYTES = 512 << 20  # > 8x the largest L2 of the GPUs in PEAK_BANDWIDTH_GBPS (H100/H200: 50-60 MB)

# (name, n_out, n_in): per variant the FFN up/gate, FFN down and the tied LM head.
SHAPES = {
    "e2b": (("ffn_up", 6144, 1536), ("ffn_down", 1536, 6144), ("head", 262144, 1536)),
    "e4b": (("ffn_up", 10240, 2560), ("ffn_down", 2560, 10240), ("head", 262144, 2560)),
}


def _timer(device: torch.device):
    """start(), stop() -> seconds since start; CUDA events on a GPU, perf_counter elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def stop() -> float:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return start.record, stop
    t0 = [0.0]

    def begin() -> None:
        t0[0] = time.perf_counter()
    return begin, lambda: time.perf_counter() - t0[0]


@torch.inference_mode()
def gemv_bandwidth(fmt: str, n_out: int, n_in: int, device="cuda", iters: int = 100, warmup: int = 5,
                   dtype=torch.bfloat16, rotate_bytes: int = ROTATE_BYTES, peak_gbps: Optional[float] = None,
                   seed: int = 0, variants=()) -> dict:
    """GB/s of `QuantWeight.linear` for one token on an [n_out, n_in] `fmt` matrix (weight bytes
    plus x and y, per call), its time per call and its share of `peak_gbps` (None: unknown);
    `variants`: names of VARIANTS also timed (µs a call in "variants_us")."""
    from gguf import GGMLQuantizationType as T

    from models.formats import QuantWeight

    from models.synthetic import random_quant_bytes

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    first = random_quant_bytes(fmt, n_out, n_in, 1 / math.sqrt(n_in), gen, device)
    copies = max(1, min(64, -(-rotate_bytes // first.numel())))
    weights = [QuantWeight(first if i == 0 else first.clone(), int(T[fmt]), (n_out, n_in)) for i in range(copies)]
    x = torch.randn((1, n_in), generator=gen, device=device).to(dtype)
    for i in range(warmup):
        weights[i % copies].linear(x)

    def calls():
        for i in range(iters):
            weights[i % copies].linear(x)

    host_seconds = _eager_seconds(calls, device) / iters
    seconds = _graph_seconds(calls, device) / iters if device.type == "cuda" else host_seconds
    moved = first.numel() + x.numel() * x.element_size() + n_out * x.element_size()
    gbps = moved / seconds / 1e9
    row = {"format": fmt, "n_out": n_out, "n_in": n_in, "weight_bytes": first.numel(), "copies": copies,
           "iters": iters, "us_per_call": seconds * 1e6, "host_us_per_call": host_seconds * 1e6, "gbps": gbps,
           "peak_share": gbps / peak_gbps if peak_gbps else None}
    if variants:
        row["variants_us"] = {}
        for name in variants:
            with variant(name):
                calls()  # compiles this variant outside the timing (and the graph's capture)
                t = _graph_seconds(calls, device) if device.type == "cuda" else _eager_seconds(calls, device)
            row["variants_us"][name] = t / iters * 1e6
    return row


@contextlib.contextmanager
def variant(name: str):
    """One-row GEMVs inside run as VARIANTS[name] says (a tile, a K split)."""
    from kernels.triton.qmatmul import gemv_blocks, gemv_split

    tile, splits = VARIANTS[name]
    with gemv_blocks(*tile) if tile else contextlib.nullcontext(), gemv_split(splits):
        yield


def _eager_seconds(calls, device: torch.device) -> float:
    """Seconds of `calls()` launched from Python (CUDA events on a GPU, wall clock elsewhere)."""
    start, stop = _timer(device)
    start()
    calls()
    return stop()


def _graph_seconds(calls, device: torch.device, replays: int = 3) -> float:
    """Seconds of one replay of `calls()` captured in a CUDA graph (the best of `replays`)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        calls()  # warm on a side stream, as a capture wants
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    best = float("inf")
    for _ in range(replays):
        start, stop = _timer(device)
        start()
        graph.replay()
        best = min(best, stop())
    del graph
    return best


def gemv_sweep(variants=("e2b", "e4b"), formats=None, device="cuda", iters: int = 100,
               peak_gbps: Optional[float] = None, shapes=SHAPES, on_row=None) -> list[dict]:
    """`gemv_bandwidth` for every format (default: every one QuantWeight reads) at each variant's
    shapes; a format or shape that fails gives a row with "error" instead of stopping the sweep.
    `on_row(row)` is called with each row as soon as it is measured (gpu_check streams them)."""
    from models.formats import QuantWeight

    from .throughput import peak_bandwidth_gbps

    device = torch.device(device)
    if peak_gbps is None and device.type == "cuda":
        peak_gbps = peak_bandwidth_gbps(torch.cuda.get_device_name(device))
    formats = formats or sorted(QuantWeight.TYPES)
    rows = []
    for variant in variants:
        for name, n_out, n_in in shapes[variant]:
            for fmt in formats:
                row = {"variant": variant, "matrix": name}
                named = tuple(VARIANTS) if fmt in BLOCK_FORMATS and name in BLOCK_MATRICES else ()
                try:
                    row.update(gemv_bandwidth(fmt, n_out, n_in, device, iters=iters, peak_gbps=peak_gbps,
                                              variants=named))
                except Exception as e:  # noqa: BLE001 - one format failing must not hide the others' figures
                    row.update(format=fmt, n_out=n_out, n_in=n_in, error=f"{type(e).__name__}: {e}")
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def sweep_table(rows: list[dict]) -> str:
    """Markdown table of `gemv_sweep` rows."""
    lines = ["| model | matrix | format | shape | weight MB | µs/call (graph) | µs/call (eager) | GB/s | of peak "
             f"| µs as {' / '.join(VARIANTS)} |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        head = f"| {r['variant']} | {r['matrix']} | {r['format']} | {r['n_out']}x{r['n_in']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'].splitlines()[0]} | | | | | |")
            continue
        share = f"{100 * r['peak_share']:.1f}%" if r["peak_share"] is not None else "n/a"
        eager = r.get("host_us_per_call", r["us_per_call"])
        alt = " / ".join(f"{us:.1f}" for us in r.get("variants_us", {}).values())
        lines.append(f"{head} {r['weight_bytes'] / 1e6:.1f} | {r['us_per_call']:.1f} | {eager:.1f} | {r['gbps']:.0f} "
                     f"| {share} | {alt} |")
    return "\n".join(lines)
