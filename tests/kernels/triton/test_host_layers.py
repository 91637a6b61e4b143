"""Whole layers on the CPU beside a GPU (models/host_layers.py: llama.cpp's `--n-gpu-layers N`) on a
tiny 31B-like dense model: no per-layer inputs, no KV sharing, no attn_v on the full layers (V =
raw K), GQA with fewer KV heads on the full layers, 5 layers [S, S, F, S, F], Q8_0, an FFN of 352.
The GPU's layers run as Triton kernels on CPU tensors (the interpreter, `kernels_on_cpu`); the
first k layers (k = 1, 3 with a full layer among them, L - 1) run as the ggml runtime runs them.

Pinned: a prompt chunk and one-row decode steps give the greedy tokens of the all-CPU ggml runtime
and of the float64 reference, logits no further from the reference than the ggml runtime's; the
residual that crosses is that runtime's after layer k-1, bit for bit; through the engine (prefill
chunks, the token graph for the host layers' decode, two sequences decoding together, fp32 pools)
the all-CPU engine's tokens; one crossing each forward of T rows, T x d x 4 bytes, nothing back;
`--n-gpu-layers` planned, loaded and run; refusals in one line.
"""
from __future__ import annotations

import triton_env  # noqa: F401  (TRITON_INTERPRET before triton is imported)

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.api import EngineOptions, engine_config, plan_placement  # noqa: E402
from engine.placement import PlacementFlags  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import Engine, EngineConfig  # noqa: E402
from kernels import ggml  # noqa: E402
from kernels.triton.launch import kernels_on_cpu  # noqa: E402
from models import host_layers, token_graph  # noqa: E402
from models.gguf import GGUFFile  # noqa: E402
from models.kv_cache import DenseKVCache  # noqa: E402
from models.loader import load_model, open_gguf  # noqa: E402
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4  # noqa: E402

pytestmark = pytest.mark.skipif(not ggml.available(), reason="the host layers run on llama.cpp's kernels")

DENSE = TinySpec(n_layer=5, pattern=[True, True, False, True, False], n_kv_shared=0, ple_width=0, n_head=4,
                 n_kv_head=[2, 2, 1, 2, 1], ffn=352, double_wide=False, v_on_full_layers=False, tied=False)
PROMPT = [2, 41, 7, 230, 99, 5, 311, 18, 64, 77, 120]  # 11 rows: past the sliding window of 8
STEPS = 3
FP32 = dict(kv_cache_dtype="fp32", swa_kv_cache_dtype="fp32")


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    """Seed 13: every top-2 logit gap of the reference's greedy rows >= 0.2 (most seeds have one
    under 0.1, which the ggml runtime's 8-bit activations may close)."""
    d = tmp_path_factory.mktemp("host-layers")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", DENSE, seed=13), d / "q8.gguf", "Q8_0")


def _first(path, k: int) -> frozenset:
    """Every tensor of layers 0..k-1: what `--n-gpu-layers L-k` places in host RAM."""
    return frozenset(n for n in GGUFFile(path).tensors if host_layers.layer_of(n) is not None
                     and host_layers.layer_of(n) < k)


def _hybrid(path, k: int):
    model = load_model(path, quantized=True, with_tokenizer=False, host_tensors=_first(path, k)).model
    assert model.runtime.value == "triton" and model.host_layers.n == k
    return model


@pytest.fixture(scope="module")
def runtimes(q8):
    cpu = load_model(q8, weight_dtype=torch.float16, cpu_quant=True, with_tokenizer=False).model
    ref = load_model(q8, dtype=torch.float64, with_tokenizer=False).model
    assert (cpu.runtime.value, ref.runtime.value) == ("ggml", "reference")
    return cpu, ref, _greedy(cpu), _greedy(ref)


def _greedy(model, trace=None):
    """The prompt as one chunk, then STEPS one-row steps over a KV cache -> (tokens, logits
    [STEPS, V] float64: the rows each token was picked from)."""
    cache, ids, rows = DenseKVCache(), [], []
    logits = model.forward(torch.tensor(PROMPT), cache=cache, trace=trace)[-1]
    for _ in range(STEPS):
        rows.append(logits.double().cpu())
        ids.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(ids[-1:]), torch.tensor([len(PROMPT) + len(ids) - 1]), cache,
                               trace=trace)[-1]
    return ids, torch.stack(rows)


def _dist(a, b) -> float:
    return float((1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).max())


def _outputs(k: int, into: list):
    """A trace keeping each forward's output of layer k-1 (what crosses to the device)."""
    def trace(name, layer, t):
        if name == "l_out" and layer == k - 1:
            into.append(t.detach().clone())
    return trace


@pytest.mark.parametrize("k", [1, 3, 4])
def test_the_first_layers_on_the_cpu_give_the_cpu_runtimes_tokens_and_its_residual_bit_for_bit(q8, runtimes, k):
    cpu, ref, (cpu_ids, cpu_logits), (ref_ids, ref_logits) = runtimes
    hybrid = _hybrid(q8, k)
    want, got = [], []
    _greedy(cpu, _outputs(k, want))
    with kernels_on_cpu():
        ids, logits = _greedy(hybrid, _outputs(k, got))
    assert ids == cpu_ids == ref_ids
    # the host layers are the ggml runtime's layers: the same residual leaves layer k-1, every forward
    assert len(got) == len(want) == 1 + STEPS
    assert all(torch.equal(g, w) for g, w in zip(got, want)), [float((g - w).abs().max()) for g, w in zip(got, want)]
    # the GPU's layers multiply in float32 where the ggml runtime quantizes activations to 8 bits for
    # its Q8_0 dots: no further from the float64 reference than that runtime (5% slack for where two
    # roundings happen to cancel), within twice its distance of the runtime itself
    assert _dist(logits, ref_logits) <= 1.05 * _dist(cpu_logits, ref_logits), (
        _dist(logits, ref_logits), _dist(cpu_logits, ref_logits))
    assert _dist(logits, cpu_logits) <= 2 * _dist(cpu_logits, ref_logits)


def test_each_forward_crosses_once_with_its_rows_and_nothing_comes_back(q8):
    hybrid = _hybrid(q8, 2)
    d, T = DENSE.d_model, len(PROMPT)
    cache = DenseKVCache()
    with kernels_on_cpu():
        hybrid.forward(torch.tensor(PROMPT), cache=cache)
        t = dict(hybrid.host_layers.traffic)
        assert (t["forwards"], t["crossings"], t["rows"], t["to_device"]) == (1, 1, T, T * d * 4)
        for step in range(2):
            hybrid.forward(torch.tensor([9 + step]), torch.tensor([T + step]), cache)
            now = hybrid.host_layers.traffic
            assert now["crossings"] - t["crossings"] == 1 and now["to_device"] - t["to_device"] == d * 4
            t = dict(now)
    assert t["cpu_ms"] > 0 and set(t) == {"forwards", "rows", "crossings", "to_device", "cpu_ms"}
    # what a 31B decode token moves (d 5376): 10,752 bytes in bf16, 21,504 in float32 (--exact)
    assert host_layers.crossing_bytes(5376, torch.bfloat16) == 10752
    assert host_layers.crossing_bytes(5376, torch.float32) == 21504


def test_the_bench_row_takes_per_token_figures_from_two_statuses():
    from engine.bench.throughput import cpu_layer_row

    before = {"layers": 28, "runtime": "ggml", "forwards": 3, "rows": 40, "crossings": 3, "to_device": 40 * 10752,
              "cpu_ms": 900.0}
    after = dict(before, forwards=7, rows=44, crossings=7, to_device=44 * 10752, cpu_ms=900.0 + 4 * 85.5)
    assert cpu_layer_row(before, after, 4) == {"layer_pcie_bytes_per_token": 10752, "cpu_layer_ms_per_token": 85.5,
                                               "crossings_per_token": 1.0}


def _engine_run(model, backend: str, prompts, max_tokens=4):
    eng = Engine(model, None, EngineConfig(full_tokens=64, window_tokens=64, prefill_chunk=6,
                                           attention_backend=backend, **FP32))
    reqs = [eng.add(p, SamplingParams(temperature=0.0, max_tokens=max_tokens)) for p in prompts]
    eng.run_to_completion()
    return [r.output_ids for r in reqs], eng.status()


@pytest.mark.parametrize("k", [1, 4])
def test_through_the_engine_the_host_layers_decode_the_cpu_engines_tokens(q8, runtimes, k, monkeypatch):
    """Two prompts of 11 and 10 tokens (prefill chunks of up to 6 rows, then the two sequences
    decoding together): the all-CPU engine's greedy tokens; each decode step's host layers are one
    ggml graph over both rows (`fused_layers`), their K/V in host slabs of the engine's pools."""
    prompts = [PROMPT, PROMPT[:-1]]
    want, plain = _engine_run(runtimes[0], "torch", prompts)
    graphs = []
    fused = token_graph.fused_layers

    def counting(model, x, pos, caches, n):
        out = fused(model, x, pos, caches, n)
        graphs.append((x.shape[0], n, out is not None))
        return out

    monkeypatch.setattr(host_layers, "fused_layers", counting)
    hybrid = _hybrid(q8, k)
    with kernels_on_cpu():
        got, status = _engine_run(hybrid, "triton", prompts)
    assert got == want and plain["cpu_layers"] is None
    assert graphs and all(ran and n == k for _, n, ran in graphs) and (2, k, True) in graphs
    full, window = status["pools"]["full"], status["pools"]["window"]
    assert full["host_slabs"] + window["host_slabs"] == k  # the layers' own slabs, in host memory
    # the host model holds layers 0..k-1 (and layer k's attention norm, its last residual's)
    assert {host_layers.layer_of(n) for n in hybrid.host_layers.cpu.w} - {None} == set(range(k + (k < DENSE.n_layer)))
    cl = status["cpu_layers"]
    assert cl["layers"] == k and cl["runtime"] == "ggml" and cl["crossings"] == cl["forwards"] > 0
    assert cl["to_device"] == cl["rows"] * DENSE.d_model * 4


def test_the_host_layers_token_graph_crosses_the_layer_by_layer_residual(q8, monkeypatch):
    """Decode steps with the host layers as one ggml graph (`fused_layers`, 2 rows together) and
    with it off (EDGEGEM_CPU_STEP_GRAPH=0: layer by layer, a row at a time) cross the same
    residuals, bit for bit, so the engine's host part is the ggml runtime's layers either way."""
    from kernels.env import reload

    crossed = {}
    cross = host_layers.HostLayers._cross

    def keeping(self, x, t0):
        crossed.setdefault(graph, []).append(x.clone())
        return cross(self, x, t0)

    monkeypatch.setattr(host_layers.HostLayers, "_cross", keeping)
    for graph in ("1", "0"):
        monkeypatch.setenv("EDGEGEM_CPU_STEP_GRAPH", graph)
        reload()
        with kernels_on_cpu():
            _engine_run(_hybrid(q8, 3), "triton", [PROMPT, PROMPT[:-2]], max_tokens=3)
    assert len(crossed["1"]) == len(crossed["0"]) and any(x.shape[0] == 2 for x in crossed["1"])
    assert all(torch.equal(a, b) for a, b in zip(crossed["1"], crossed["0"]))


def test_n_gpu_layers_is_planned_loaded_and_generates(q8, runtimes):
    """`--n-gpu-layers 2` as open_model takes it on a GPU: the plan keeps layers 0-2 whole in host
    RAM (their KV there too), the load puts them on the CPU runtime, the engine configured from the
    plan generates the all-CPU engine's tokens."""
    opts = replace(EngineOptions(), gpu_memory_budget="1GiB", placement=PlacementFlags(n_gpu_layers=2), **FP32)
    placed = plan_placement(open_gguf(q8), opts)
    assert placed["cpu_layers"] == [0, 1, 2] and placed["gpu_layers"] == 2
    assert placed["summary"].startswith("whole layers 0-2 in host RAM; 2 of 5 layers on the GPU")
    lm = load_model(q8, host_tensors=frozenset(placed["host_tensors"]), quantized=True, dtype=torch.float32)
    assert lm.model.host_layers.n == 3 and lm.model.host_layers.runtime.value == "ggml"
    want, _ = _engine_run(runtimes[0], "torch", [PROMPT])
    with kernels_on_cpu():
        eng = Engine(lm.model, lm.tokenizer, replace(engine_config(lm, opts), attention_backend="triton"))
        req = eng.add(PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
        eng.run_to_completion()
    assert req.output_ids == want[0] and eng.decoder is None  # no graph captures the host's layers


def test_whole_layers_that_do_not_run_are_refused_in_one_line(q8, tmp_path):
    with pytest.raises(ValueError) as e:  # not the first layers: two crossings a forward
        load_model(q8, quantized=True, with_tokenizer=False, host_tensors=_first(q8, 3) - _first(q8, 1))
    assert "the CPU runs the first layers" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:  # part of a layer
        load_model(q8, quantized=True, with_tokenizer=False, host_tensors=frozenset({"blk.0.attn_q.weight"}))
    assert "only MoE expert banks and whole layers" in str(e.value) and "\n" not in str(e.value)
    e2b = write_tiny_gemma4(tmp_path / "e.gguf", TinySpec(), seed=1)  # per-layer inputs
    with pytest.raises(ValueError) as e:
        load_model(e2b, quantized=True, with_tokenizer=False, host_tensors=_first(e2b, 2))
    assert "without per-layer inputs" in str(e.value) and "\n" not in str(e.value)
    moe = write_tiny_gemma4(tmp_path / "moe.gguf", replace(DENSE, n_expert=5, n_expert_used=2, expert_ffn=64), seed=1)
    with pytest.raises(ValueError) as e:
        load_model(moe, quantized=True, with_tokenizer=False, host_tensors=_first(moe, 2))
    assert "mixture of experts" in str(e.value) and "--cpu-moe" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.cuda
@pytest.mark.skipif(triton_env.INTERPRET or not torch.cuda.is_available(),
                    reason="a CUDA device with compiled kernels: TRITON_INTERPRET=0 pytest -m cuda")
def test_on_a_gpu_open_model_runs_n_gpu_layers_without_a_wait_in_the_host_part(q8, runtimes, monkeypatch):
    """`open_model(device="cuda", options=--n-gpu-layers 2)`: layers 0-2 on the CPU, their slabs in
    host memory; the host part makes no implicit synchronization (torch's sync debug mode raises on
    one) and the engine decodes the all-CPU engine's tokens."""
    from engine.api import open_model

    opts = replace(EngineOptions(), gpu_memory_budget="1GiB", placement=PlacementFlags(n_gpu_layers=2), **FP32)
    lm = open_model(q8, exact=True, device="cuda", options=opts)
    host = lm.model.host_layers
    assert host.n == 3 and host.cpu.w["blk.0.attn_norm.weight"].device.type == "cpu"
    front = host.front

    def strict(*a, **k):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return front(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(host, "front", strict)
    want, _ = _engine_run(runtimes[0], "torch", [PROMPT])
    eng = Engine(lm.model, lm.tokenizer, engine_config(lm, opts))
    req = eng.add(PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
    eng.run_to_completion()
    assert req.output_ids == want[0]
    pools = eng.pools
    assert all(pools.full.k[i].device.type == "cpu" for i in pools.full.host_layers)
    assert eng.status()["cpu_layers"]["crossings"] == host.traffic["forwards"]
