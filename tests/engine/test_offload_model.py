"""The host-experts decode model (engine/bench/offload_model.py) and its measured part
(engine/bench/expert_mix.py): the bytes it counts are the tensor table's, its schedules and cache
term move the time the way they must, the timed graph computes the expert mix, and `edgegem bench
--offload-model` runs briefly and prints the table. Timings themselves are not asserted."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from engine.bench.offload_model import (SYSTEMS, Measured, cpu_expert_us, model_bytes, predict, prediction_rows,
                                        this_host)
from models.synthetic import synthetic_layout

MEASURED = Measured(layer_bytes=31_719_424, per_core_gbps=9.0, fixed_us=40.0, threads=2, effective_gbps=12.0,
                    read_gbps=15.0)


def _row_bytes(ggml_type: int, n_values: int) -> int:
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    return n_values // block * size


def test_expert_bytes_per_token_are_the_chosen_experts_rows_over_all_layers():
    layout = synthetic_layout("26b-a4b")
    d, width, used, layers = 2816, 704, 8, 30
    expected = 0
    for i in range(layers):
        gate_up = layout.tensor(f"blk.{i}.ffn_gate_up_exps.weight")
        down = layout.tensor(f"blk.{i}.ffn_down_exps.weight")
        # one expert: 2 x 704 rows of d values (gate and up), then d rows of 704 values (down)
        per_expert = 2 * width * _row_bytes(gate_up.ggml_type, d) + d * _row_bytes(down.ggml_type, width)
        expected += used * per_expert
    mb = model_bytes(layout)
    assert mb.expert_bytes == expected
    assert mb.n_layer == layers and mb.n_used == used
    # the head is the tied Q6_K embedding: 262144 rows of 2816 values, plus the final norm
    assert mb.head_bytes == 262144 * _row_bytes(T.Q6_K, d) + 4 * d


def test_kv_bytes_grow_only_on_full_layers_past_the_window():
    layout = synthetic_layout("26b-a4b")
    at_window, longer = model_bytes(layout, context=1024), model_bytes(layout, context=2048)
    # 5 full layers, 2 KV heads of 512, K and V in f16: 4 KB a token a layer
    assert longer.gpu_layer_bytes - at_window.gpu_layer_bytes == 1024 * 5 * 2 * 2 * 512 * 2
    assert longer.expert_bytes == at_window.expert_bytes


@pytest.mark.parametrize("system", SYSTEMS, ids=lambda s: s.name)
@pytest.mark.parametrize("hit_rate", [0.0, 0.3, 0.9])
def test_overlapped_is_never_slower_than_sequential(system, hit_rate):
    mb = model_bytes(synthetic_layout("26b-a4b"))
    seq = predict(system, mb, MEASURED, hit_rate=hit_rate)
    ovl = predict(system, mb, MEASURED, hit_rate=hit_rate, overlapped=True)
    assert ovl["ms"] <= seq["ms"]


@pytest.mark.parametrize("system", SYSTEMS, ids=lambda s: s.name)
def test_more_hot_expert_hits_make_decode_faster(system):
    mb = model_bytes(synthetic_layout("26b-a4b"))
    seq = [predict(system, mb, MEASURED, hit_rate=h / 10)["ms"] for h in range(11)]
    assert all(a > b for a, b in zip(seq, seq[1:]))
    # overlapped: faster with every hit up to the balance point, where the GPU's share (dense MLP +
    # hits) takes as long as the CPU's misses (~0.6 here); past it the hits are the GPU's wait, and
    # still every hit rate beats none
    ovl = [predict(system, mb, MEASURED, hit_rate=h / 10, overlapped=True)["ms"] for h in range(11)]
    assert all(a > b for a, b in zip(ovl[:6], ovl[1:6]))
    assert all(t < ovl[0] for t in ovl[1:])


def test_a_bandwidth_bound_cpu_part_scales_with_host_bandwidth():
    host = SYSTEMS[0].host
    fast_cores = replace(MEASURED, per_core_gbps=1e3)  # compute never the limit
    n_bytes = 30e6
    base = cpu_expert_us(host, fast_cores, n_bytes) - fast_cores.fixed_us
    doubled = cpu_expert_us(replace(host, bandwidth_gbps=2 * host.bandwidth_gbps), fast_cores, n_bytes)
    assert math.isclose(doubled - fast_cores.fixed_us, base / 2, rel_tol=1e-12)
    assert math.isclose(base, n_bytes / (host.bandwidth_gbps * host.efficiency * 1e3), rel_tol=1e-12)


def test_a_compute_bound_cpu_part_ignores_host_bandwidth_and_scales_with_cores():
    host = replace(SYSTEMS[0].host, bandwidth_gbps=1e4)
    slow_cores = replace(MEASURED, per_core_gbps=0.5)
    n_bytes = 30e6
    base = cpu_expert_us(host, slow_cores, n_bytes)
    assert cpu_expert_us(replace(host, bandwidth_gbps=2e4), slow_cores, n_bytes) == base
    twice = cpu_expert_us(replace(host, cores=2 * host.cores), slow_cores, n_bytes) - slow_cores.fixed_us
    assert math.isclose(twice, (base - slow_cores.fixed_us) / 2, rel_tol=1e-12)


def test_this_machine_as_host_runs_at_its_measured_rate():
    host = this_host(MEASURED)
    n_bytes = MEASURED.layer_bytes
    us = cpu_expert_us(replace(host, bandwidth_gbps=1e6), MEASURED, n_bytes) - MEASURED.fixed_us
    assert math.isclose(us, n_bytes / (MEASURED.effective_gbps * 1e3), rel_tol=1e-9)


def test_measured_rates_come_from_the_one_thread_row_and_the_best_row():
    from engine.bench.offload_model import measured_from

    rows = [{"threads": 1, "bytes": 100, "fresh_gbps": 10.0, "fixed_ms": 0.025, "read_gbps": 12.0},
            {"threads": 2, "bytes": 100, "fresh_gbps": 15.0, "fixed_ms": 110.0, "read_gbps": 9.0}]
    m = measured_from({"rows": rows})
    assert (m.per_core_gbps, m.threads, m.effective_gbps, m.read_gbps) == (10.0, 2, 15.0, 9.0)
    assert m.fixed_us == 25.0  # a loaded 2-thread run's barrier waits are not the graph's cost
    # the host made of it is compute-bound at the measured rate, above the plain read's roof
    host = this_host(m)
    assert host.bandwidth_gbps == 15.0
    assert math.isclose(cpu_expert_us(host, m, 15e6) - m.fixed_us, 1e3, rel_tol=1e-12)


def test_prediction_rows_name_every_system_and_its_anchor():
    rows = prediction_rows(model_bytes(synthetic_layout("26b-a4b")), MEASURED)
    assert [r["system"] for r in rows[:2]] == [s.name for s in SYSTEMS]
    assert rows[0]["anchor"] == "~20" and rows[1]["anchor"] == "12-15"
    assert "this CPU" in rows[2]["system"] and rows[2]["anchor"] == "-"
    assert rows[2]["implied_host_efficiency"] is None


@pytest.mark.parametrize("system", SYSTEMS, ids=lambda s: s.name)
def test_the_implied_host_efficiency_reproduces_the_anchor(system):
    from engine.bench.offload_model import implied_host_efficiency

    mb = model_bytes(synthetic_layout("26b-a4b"))
    fast_cores = replace(MEASURED, per_core_gbps=1e3)  # memory-bound, as the targets are
    eff = implied_host_efficiency(system, mb, fast_cores)
    calibrated = replace(system, host=replace(system.host, efficiency=eff))
    assert math.isclose(predict(calibrated, mb, fast_cores)["tok_s"], sum(system.anchor) / 2, rel_tol=1e-9)


def test_the_timed_graph_computes_the_expert_mix():
    from kernels import ggml

    if not ggml.available():
        pytest.skip(f"ggml binding unavailable: {ggml.reason()}")
    from engine.bench.expert_mix import ExpertMix
    from kernels.ggml import mul_mat_id_ref

    gen = torch.Generator().manual_seed(0)
    E, d, width, used = 12, 256, 64, 4
    mix = ExpertMix("Q4_K", "Q8_0", E, d, width, used, gen)
    mix.choose(np.random.default_rng(0))
    mix.run()
    gu = mul_mat_id_ref(mix.gate_up.raw, mix.gate_up.ggml_type, mix.gate_up.shape, mix.z, mix.ids)  # [1, k, 2I]
    act = torch.nn.functional.gelu(gu[..., :width], approximate="tanh") * gu[..., width:]
    y = mul_mat_id_ref(mix.down.raw, mix.down.ggml_type, mix.down.shape, act.float(), mix.ids)  # [1, k, d]
    ref = y.sum(1)
    rel = float((mix.out.double() - ref).norm() / ref.norm())
    assert rel < 0.03, rel  # 8-bit activations in both products, ggml's f16 GELU table


def test_bench_offload_model_measures_briefly_and_prints_the_table(capsys):
    from kernels import ggml

    if not ggml.available():
        pytest.skip(f"ggml binding unavailable: {ggml.reason()}")
    from app.cli import main

    assert main(["bench", "--offload-model", "--measure-seconds", "0.02", "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    table = out["table"]
    for s in SYSTEMS:
        assert s.name in table
    for title in ("sequential", "overlapped", "ovl+30% hot", "llama.cpp", "flags:", "load average"):
        assert title in table
    assert [r["threads"] for r in out["measured"]["rows"]] == [1]
    assert out["bytes"]["expert_bytes"] == model_bytes(synthetic_layout("26b-a4b")).expert_bytes


def test_bench_offload_model_rejects_a_bad_hit_rate():
    from app.cli import main

    assert main(["bench", "--offload-model", "--hit-rate", "1.5"]) == 2
