"""Synthetic random-weight Gemma-4 models (models/synthetic.py) and the engine bench (engine/bench/throughput.py
`gpu_bench`), on the CPU: the tiny variant runs through the kernels under Triton's interpreter and
through the bench on the plain torch path; E2B's byte accounting is checked from the plan alone."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from models.synthetic import (VARIANTS, synthetic_layout, synthetic_specs, synthetic_weights,  # noqa: E402
                              weight_bytes)
from models.quant import row_bytes  # noqa: E402
from models.formats import QuantWeight  # noqa: E402


@pytest.mark.parametrize("variant", ["e2b", "e4b", "26b-a4b", "31b", "tiny", "tiny-moe"])
def test_plan_bytes_match_layout(variant):
    """Without building anything: every tensor of the layout is read, and the quantized matrices'
    runtime bytes (rows x GGUF row bytes, as `synthetic_weights` allocates them) are the layout's."""
    layout = synthetic_layout(variant)
    specs = synthetic_specs(variant)
    assert {s["name"] for s in specs} == set(layout.tensors)
    quant = [s for s in specs if s["kind"] == "quant"]
    runtime = sum(s["shape"][0] * row_bytes(int(T[s["type"]]), s["shape"][1]) for s in quant)
    assert runtime == sum(s["n_bytes"] for s in quant) == sum(
        t.n_bytes for t in layout if len(t.ne) == 2 and t.type_name in QuantWeight.TYPES)
    assert sum(s["n_bytes"] for s in specs) == layout.total_bytes
    if variant == "e2b":
        assert layout.total_bytes == 3_400_303_756
        assert {s["type"] for s in specs if s["kind"] == "dense"} == {"BF16"}  # per_layer_model_proj


def test_tiny_layout_structure():
    from models.gemma4 import Gemma4Config
    cfg = Gemma4Config.from_gguf(synthetic_layout("tiny"))
    assert cfg.is_sliding == (True, True, False, True, True, False)
    assert cfg.kv_shared_layers == ((3, 1), (4, 1), (5, 2))
    assert cfg.ffn_width[-1] == 2 * cfg.ffn_width[0] and cfg.ple_width == 64
    types = {t.name: t.type_name for t in synthetic_layout("tiny")}
    assert types["blk.0.proj.weight"] == "Q5_0" and types["per_layer_token_embd.weight"] == "Q8_0"


def test_tiny_weights_bytes_and_scale():
    w = synthetic_weights("tiny", "cpu", dtype=torch.bfloat16)
    specs = {s["name"]: s for s in synthetic_specs("tiny")}
    got = weight_bytes(w)
    assert got["quant"] == sum(s["n_bytes"] for s in specs.values() if s["kind"] == "quant")
    assert got["dense"] == sum(s["n_bytes"] for s in specs.values() if s["kind"] == "dense")
    assert got["vector"] == sum(s["n_bytes"] for s in specs.values() if s["kind"] == "vector")
    q = w["blk.3.ffn_down.weight"]
    assert isinstance(q, QuantWeight)
    dense = q.rows(torch.arange(q.shape[0]))
    assert torch.isfinite(dense).all()
    assert 0.7 < float(dense.std()) * q.shape[1] ** 0.5 < 1.3 and abs(float(dense.mean())) < 0.01
    assert float(w["blk.0.layer_output_scale.weight"]) == pytest.approx(0.8)


def test_tiny_model_runs_on_kernels():
    pytest.importorskip("triton", reason="the kernel path needs triton")
    from engine.sampler import SamplingParams
    from engine.scheduler import Engine, EngineConfig
    from models.synthetic import synthetic_model

    model = synthetic_model("tiny", "cpu")
    assert isinstance(model.head_w, QuantWeight)
    eng = Engine(model, None, EngineConfig(full_tokens=32, window_tokens=32, prefill_chunk=8,
                                           attention_backend="triton"))
    logits = []
    forward = eng.runner.forward

    def spy(*a, **k):
        out = forward(*a, **k)
        if out is not None:
            logits.append(out)
        return out

    eng.runner.forward = spy
    req = eng.add([2, 17, 300, 41], SamplingParams(max_tokens=2))
    eng.run_to_completion()
    assert req.finish_reason == "length" and len(req.output_ids) == 2
    assert len(logits) == 2 and all(torch.isfinite(x).all() and x.shape == (VARIANTS["tiny"]["vocab"],)
                                    for x in logits)
    assert float(logits[0].std()) > 0.01  # not a degenerate model


@pytest.mark.parametrize("variant", ["tiny", "tiny-moe"])
def test_gpu_bench_on_cpu_tiny(variant):
    from engine.bench import gpu_bench

    # dense weights on the plain torch path: the kernel path under the interpreter is covered above
    out = gpu_bench(synthetic=variant, device="cpu", prompts=(8, 16), contexts=(0, 16), decode_steps=2,
                    quantized=False)
    for k in ("model", "device", "prefill", "decode", "peak_memory_bytes", "weight_bytes_per_token",
              "peak_bandwidth_gbps", "table"):
        assert k in out
    assert [r["prompt_tokens"] for r in out["prefill"]] == [8, 16]
    assert all(r["tok_s"] > 0 for r in out["prefill"])
    assert [r["context"] for r in out["decode"]] == [0, 16]
    for r in out["decode"]:
        assert r["tok_s"] > 0 and r["steps"] == 2 and r["achieved_gbps"] > 0
        assert r["bytes_per_token"] == out["weight_bytes_per_token"] + r["kv_bytes_per_token"]
        assert r["bandwidth_share"] is None  # no known peak on a CPU
    assert out["decode"][1]["kv_bytes_per_token"] > out["decode"][0]["kv_bytes_per_token"] > 0
    assert out["peak_memory_bytes"] > 0 and out["peak_bandwidth_gbps"] is None
    assert "n/a" in out["table"] and "decode ctx" in out["table"]


def test_kv_bytes_formula():
    """Full layers read context + 1 tokens, sliding ones at most the window; shared layers re-read
    their source's slab."""
    from engine.bench import kv_bytes_read
    from engine.kv import resolve_format
    from engine.kv import HybridKVPool
    from models.gemma4 import Gemma4Config

    cfg = Gemma4Config.from_gguf(synthetic_layout("tiny"))
    fmt = resolve_format("fp32")
    pools = HybridKVPool(cfg, 64, 64, fmt, fmt)
    unit = {i: fmt.unit_bytes(cfg.n_kv_head[i], cfg.head_dim[i]) for i in range(cfg.n_layer)}
    c, W = 100, cfg.sliding_window
    # layers 0, 1, 3, 4 sliding (3, 4 read layer 1); 2 and 5 full (5 reads layer 2)
    want = W * (unit[0] + 3 * unit[1]) + (c + 1) * 2 * unit[2]
    assert kv_bytes_read(cfg, pools, c) == want


def test_peak_bandwidth_table():
    from engine.bench import peak_bandwidth_gbps
    assert peak_bandwidth_gbps("NVIDIA H200") == 4800
    assert peak_bandwidth_gbps("NVIDIA H100 80GB HBM3") == 3350
    assert peak_bandwidth_gbps("NVIDIA GeForce RTX 3060 Ti") == 448
    assert peak_bandwidth_gbps("NVIDIA GeForce RTX 4060") == 272
    assert peak_bandwidth_gbps("Some Unknown GPU") is None


def test_cli_bench_argument_errors(capsys):
    from app.cli import main
    assert main(["bench", "--synthetic", "e2b", "--model", "x.gguf"]) == 2
    assert main(["bench", "--synthetic", "e2b", "--contexts", "0,x"]) == 2
    if not torch.cuda.is_available():
        assert main(["bench", "--synthetic", "e2b", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "not both" in err and "--contexts" in err


def test_the_timed_decode_starts_after_the_slot_tables_grew_to_the_context(monkeypatch):
    """The batched decode's static buffers (a CUDA graph's, re-captured with them) grow to a power of
    two >= the context on the first step past their capacity: the warm-up leaves them at 64 slots,
    a decode at context 80 needs 128. That step must be the untimed one after the prefill, never one
    inside `time_decode`; the rows reach `on_row` in the order measured, equal to the result's.
    (Dense weights on the torch path: the same static-buffer code, without the interpreter's cost.)"""
    from engine.batch_decode import BatchDecoder
    from engine.bench import throughput

    events, timing = [], [False]
    static = BatchDecoder._static

    def spy_static(self, B, T, full_need, win_need):
        before = self.statics.get((B, T))
        st = static(self, B, T, full_need, win_need)
        if st is not before:
            events.append(("alloc", st.full_cap, timing[0]))
        return st

    def spy_time_decode(engine, device, steps):
        timing[0] = True
        try:
            return time_decode(engine, device, steps)
        finally:
            timing[0] = False
            events.append(("timed", steps))

    time_decode = throughput.time_decode
    monkeypatch.setattr(BatchDecoder, "_static", spy_static)
    monkeypatch.setattr(throughput, "time_decode", spy_time_decode)
    rows = []
    out = throughput.gpu_bench(synthetic="tiny", device="cpu", quantized=False, batched_decode=True, prompts=(16,),
                               contexts=(0, 80), decode_steps=2, on_row=lambda kind, r: rows.append((kind, r)))
    assert [e for e in events if e[0] == "alloc"] == [("alloc", 64, False), ("alloc", 128, False)]
    assert not any(e[0] == "alloc" and e[2] for e in events)  # none while a decode was timed
    assert events[-1] == ("timed", 2) and events.index(("alloc", 128, False)) < len(events) - 1
    assert [r["steps"] for r in out["decode"]] == [2, 2]
    assert [k for k, _ in rows] == ["warmup", "prefill", "decode", "decode"]
    assert [r for k, r in rows if k == "decode"] == out["decode"] and rows[1][1] is out["prefill"][0]


def test_profile_rows_name_the_decode_steps_ops_per_context():
    """`gpu_bench(profile=True)`: after each timed decode, 8 more steps under torch's profiler; on
    the CPU the row lists the ops with the most host time per step (the same pass lists kernels on
    CUDA), the table prints them under the decode rows."""
    from engine.bench import gpu_bench
    from engine.bench.throughput import PROFILE_STEPS

    out = gpu_bench(synthetic="tiny", device="cpu", prompts=(8,), contexts=(0, 16), decode_steps=2,
                    quantized=False, profile=True)
    for r in out["decode"]:
        p = r["profile"]
        assert p["profiled_steps"] == PROFILE_STEPS and r["steps"] == 2
        assert p["wall_ms_per_step"] > 0 and 0 < p["busy_ms_per_step"]
        assert 0 < len(p["top"]) <= 12 and "kernels_per_step" not in p
        times = [t["us_per_step"] for t in p["top"]]
        assert times == sorted(times, reverse=True) and all(t["calls_per_step"] > 0 for t in p["top"])
    assert "context 16:" in out["table"] and "CPU ops busy" in out["table"]


def test_profile_row_counts_kernels_and_copies_of_the_device_only():
    """The CUDA branch of `profile_row` on recorded events: device kernels and copies counted per
    step apart, host events ignored, names cut to 80 characters, the top sorted by time."""
    from types import SimpleNamespace as NS

    from engine.bench.gpu_profile import profile_row

    cuda, cpu = NS(name="CUDA"), NS(name="CPU")

    def ev(name, us, dev=cuda):
        return NS(name=name, device_type=dev, time_range=NS(elapsed_us=lambda: us), self_cpu_time_total=us)

    long = "_qmatmul_kernel_" + "x" * 100
    events = [ev(long, 30.0), ev(long, 34.0), ev("attention", 10.0), ev("Memcpy HtoD (Pageable -> Device)", 4.0),
              ev("aten::mm", 500.0, cpu)]
    row = profile_row(events, wall_s=0.002, steps=2, cuda=True)
    assert row["kernels_per_step"] == 1.5 and row["copies_per_step"] == 0.5
    assert row["busy_ms_per_step"] == pytest.approx(78.0 / 1e3 / 2) and row["wall_ms_per_step"] == pytest.approx(1.0)
    assert [t["name"] for t in row["top"]] == [long[:80], "attention", "Memcpy HtoD (Pageable -> Device)"]
    assert row["top"][0] == {"name": long[:80], "calls_per_step": 1.0, "us_per_step": 32.0}
