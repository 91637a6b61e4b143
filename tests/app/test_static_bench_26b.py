"""`edgegem bench --static --synthetic 26b-a4b`: one decode step of the full-size 26B-A4B with its
expert banks in host RAM (engine/bench/static_host.py), and with a hot-expert cache: the copies
between host and device the recorder intercepts are the design's two crossings per layer, the host
waits once per layer, and the kernels and bytes agree with independent counts of the layout."""
from __future__ import annotations

import triton_env  # noqa: F401  (the report's dry run and compiles go to a spawned TRITON_INTERPRET=0 worker)

import math

import pytest

from app.cli import main
from tests.app.test_static_bench import static_json

pytestmark = pytest.mark.slow

D, K, E, LAYERS = 2816, 8, 128, 30  # 26B-A4B: hidden width, top-k, experts, layers (spec §1.1)
# Per step besides the 30 expert sums: the token's embedding row (Q6_K, 2,310 B) and the batched
# decoder's staged inputs (one packed host buffer, 166,936 B at context 4096).
OTHER_TO_DEVICE = 2


@pytest.fixture(scope="module")
def report():
    return static_json("26b-a4b")


def _rows(report) -> dict:
    return {p["placement"]: p for p in report["placements"]}


def test_each_layer_crosses_twice_and_the_host_waits_once(report):
    host, cached = _rows(report)["experts on host"], _rows(report)["hot-expert cache"]
    assert report["n_layer"] == LAYERS and (report["n_expert"], report["n_expert_used"]) == (E, K)
    for p in (host, cached):
        assert p["host_layers"] == LAYERS
        assert p["syncs_per_token"] == LAYERS
        # device -> host: r [1, d] float32, ids [1, k] int32, weights [1, k] float32 per layer
        assert p["copies_to_host"] == 3 * LAYERS
        assert p["bytes_to_host"] == LAYERS * (4 * D + 4 * K + 4 * K)
    # host -> device: the expert sum [1, d] float32 per layer, plus the step's own inputs
    assert host["copies_to_device"] == LAYERS + OTHER_TO_DEVICE
    assert host["bytes_to_device"] == LAYERS * 4 * D + 2310 + 166936
    # with 4 of the 8 picks in device slots: the rest still comes back as one [1, d] sum, and the
    # hits' rows, slots and experts (one int64 [3, P]) and weights (float32 [P]) go over: 2 copies a
    # layer however many picks hit
    assert cached["hit_rate"] == pytest.approx(4 / 8)
    assert cached["copies_to_device"] == host["copies_to_device"] + LAYERS * 2
    assert cached["bytes_to_device"] == host["bytes_to_device"] + LAYERS * 4 * (3 * 8 + 4)


def test_kernels_and_breakdown(report):
    from engine.bench.dry_run import decode_step, dry_host_expert_model

    host, cached = _rows(report)["experts on host"], _rows(report)["hot-expert cache"]
    step = decode_step(dry_host_expert_model("26b-a4b"), batch=1, rows=1, kv="bf16")
    assert host["kernels_per_step"] == step.record.total == host["triton_kernels"] + host["torch_ops"]
    assert host["triton_breakdown"] == dict(step.record.triton_counts())
    for p in (host, cached):
        assert sum(p["triton_breakdown"].values()) == p["triton_kernels"] > 0
        assert sum(p["torch_breakdown"].values()) == p["torch_ops"] > 0
    # the router runs on the device, one softmax and top-k per layer; the experts do not
    assert host["torch_breakdown"]["topk"] == LAYERS
    assert cached["kernels_per_step"] > host["kernels_per_step"]  # the hits' products on the device
    # ... one grouped GEMV a bank and layer (kernels/triton/qgrouped.py), not a pass per hit
    assert cached["triton_breakdown"]["_grouped_gemv_kernel"] == 2 * LAYERS
    assert "_qdequant_kernel" not in host["triton_breakdown"] or \
        cached["triton_breakdown"]["_qdequant_kernel"] == host["triton_breakdown"]["_qdequant_kernel"]
    # compiled for the report's arch (sm_86) without an error or a spill, each bank type of the model
    assert {g["format"] for g in report["grouped_gemv"]} == {"Q4_K", "Q5_0", "Q8_0"}
    assert all(g["error"] is None and g["spill_bytes"] == 0 for g in report["grouped_gemv"])


def test_weight_bytes_split_between_gpu_and_cpu(report):
    from models.synthetic import synthetic_specs

    specs = synthetic_specs("26b-a4b")
    banks = sum(s["n_bytes"] for s in specs if s["name"].endswith("_exps.weight"))
    # on the device the F32 router matrices are dense bf16 (the model's dtype), the rest the file's bytes
    device = sum(math.prod(s["shape"]) * 2 if s["kind"] == "dense" else s["n_bytes"]
                 for s in specs if not s["name"].endswith("_exps.weight"))
    picked = banks * K // E  # every layer's k picks
    host, cached = _rows(report)["experts on host"], _rows(report)["hot-expert cache"]
    per_layer = {int(s["name"].split(".")[1]): 0 for s in specs if s["name"].endswith("_exps.weight")}
    for s in specs:
        if s["name"].endswith("_exps.weight"):
            per_layer[int(s["name"].split(".")[1])] += s["n_bytes"] // E
    assert report["expert_bytes"] == sorted(set(per_layer.values()))  # Q5_0 or Q8_0 down rows
    assert host["gpu_weight_bytes_per_token"] == device and host["cpu_weight_bytes_per_token"] == picked
    assert cached["cpu_weight_bytes_per_token"] == picked // 2
    assert cached["gpu_weight_bytes_per_token"] == device + picked // 2


def test_gemv_formats_compile_without_spills(report):
    rows = {g["format"]: g for g in report["gemv"]}
    # the Q4_K_M mix with its fallbacks for rows of 2112 (dense ffn_down: Q5_0, Q6_K -> Q8_0)
    assert set(report["gemv_formats_used"]) == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    assert [262144, D] in report["gemv_shapes"]  # the tied head
    for fmt in report["gemv_formats_used"]:
        g = rows[fmt]
        assert g["error"] is None, (fmt, g["error"])
        assert g["spill_stores"] == g["spill_loads"] == 0, fmt
        assert 0 < g["bandwidth_cap"] <= 1 and g["registers"] > 0


def test_the_cli_prints_the_table(capsys, report):
    table = report["table"]
    for p in report["placements"]:
        assert any(line.startswith(p["placement"]) and f" {p['syncs_per_token']} " in line
                   and f" {p['bytes_to_host']} " in line for line in table.splitlines())
    assert "Triton: _gemv_kernel" in table and "decode GEMV per format" in table


@pytest.mark.parametrize("args,message", [
    (("--static",), "--static needs --synthetic e2b, e4b or 26b-a4b"),
    (("--static", "--synthetic", "31b"), "--static needs --synthetic e2b, e4b or 26b-a4b, not '31b'"),
])
def test_static_bench_refuses_other_variants(capsys, args, message):
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err
