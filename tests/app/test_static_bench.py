"""`edgegem bench --static`: kernels per decode step, weight bytes per token and the decode GEMV's
SASS instructions per weight byte, read without a GPU; the figures equal independent counts."""
from __future__ import annotations

import triton_env  # noqa: F401  (the report's dry run and compiles go to a spawned TRITON_INTERPRET=0 worker)

import contextlib
import io
import json
import os

import pytest

from app.cli import main
from conftest import CACHE
from kernels.env import reload

pytestmark = pytest.mark.slow


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(args))
    return rc, out.getvalue()


def static_json(variant: str, arch: str = "sm_86") -> dict:
    """`edgegem bench --static --synthetic VARIANT --json`, compiled into the suite's cache."""
    old = os.environ.get("EDGEGEM_COMPILE_CACHE")
    os.environ["EDGEGEM_COMPILE_CACHE"] = str(CACHE / "compile-check")
    reload()
    try:
        rc, text = _cli("bench", "--static", "--synthetic", variant, "--arch", arch, "--json")
    finally:
        if old is None:
            del os.environ["EDGEGEM_COMPILE_CACHE"]
        else:
            os.environ["EDGEGEM_COMPILE_CACHE"] = old
        reload()
    assert rc == 0, text
    return json.loads(text)


@pytest.fixture(scope="module")
def e2b_report():
    return static_json("e2b")


def test_kernels_per_step_is_the_dry_runs_count(e2b_report):
    from engine.bench.dry_run import decode_step, dry_model

    r = e2b_report
    step = decode_step(dry_model("e2b"), batch=1, rows=1, kv="bf16")
    assert r["kernels_per_step"] == step.record.total == r["triton_kernels"] + r["torch_ops"]
    assert r["kernels_per_step_target"] == 450
    assert sum(r["triton_breakdown"].values()) == r["triton_kernels"] == step.record.n_triton
    assert sum(r["torch_breakdown"].values()) == r["torch_ops"] == step.record.n_torch
    assert r["triton_breakdown"] == dict(step.record.triton_counts())


def test_weight_bytes_per_token_is_the_layouts_device_tensors(e2b_report):
    from models.synthetic import synthetic_specs

    # every tensor the model reads, the per-layer embedding table (host lookups) excepted; the
    # token table counts once, as the tied LM head every step reads whole
    device = [s for s in synthetic_specs("e2b") if s["name"] != "per_layer_token_embd.weight"]
    assert e2b_report["weight_bytes_per_token"] == sum(s["n_bytes"] for s in device)


def test_every_gemv_format_has_instructions_per_byte_and_a_bandwidth_cap(e2b_report):
    from kernels.triton.compile_check import ARCHS, bandwidth_cap

    r = e2b_report
    rows = {g["format"]: g for g in r["gemv"]}
    assert {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"} <= set(rows)
    assert set(r["gemv_formats_used"]) == {"Q4_K", "Q6_K"}  # the Q4_K_M mix
    assert [f for f, g in rows.items() if g["used_by_model"]] == r["gemv_formats_used"]
    assert len(r["gemv_shapes"]) >= 8 and [256 * 1024, 1536] in r["gemv_shapes"]  # the tied head
    for fmt, g in rows.items():
        assert g["error"] is None, (fmt, g["error"])
        assert g["instructions_per_byte"] == pytest.approx(g["loop_instructions"] * g["num_warps"] / g["loop_bytes"])
        assert g["bandwidth_cap"] == pytest.approx(bandwidth_cap(g["instructions_per_byte"], ARCHS["sm_86"]))
        assert 0 < g["bandwidth_cap"] <= 1 and g["ldg"] > 0
        assert g["target"] == (0.35 if fmt in ("Q4_K", "Q6_K") else 0.5)  # shown beside it, not asserted
        # the worst of the shapes it runs at is the format's figure
        assert g["instructions_per_byte"] == max(s["instructions_per_byte"] for s in g["shapes"])


def test_human_table_lists_the_counts_and_every_format(e2b_report):
    table = e2b_report["table"]
    assert f"kernels per step: {e2b_report['kernels_per_step']}" in table
    for g in e2b_report["gemv"]:
        assert any(line.startswith(g["format"]) and f"{g['instructions_per_byte']:.3f}" in line
                   for line in table.splitlines())


@pytest.mark.parametrize("args,message", [
    (("--static",), "--static needs --synthetic e2b, e4b or 26b-a4b"),
    (("--static", "--synthetic", "e2b", "--arch", "sm_70"), "unknown arch 'sm_70'"),
])
def test_static_bench_refuses_bad_arguments(capsys, args, message):
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err
