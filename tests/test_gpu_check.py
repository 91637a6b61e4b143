"""`make gpu-check` (packaging/gpu_check.py) and the GEMV bandwidth microbenchmark
(engine/kernel_bench.py), as far as they run without a GPU: argument handling, the install
command, parts that fail or run over their time without stopping the rest, the Markdown report,
and the microbenchmark's arithmetic on the interpreted kernel (its speed here means nothing)."""
from __future__ import annotations

import triton_env  # noqa: F401  (the microbenchmark runs the interpreted kernel on the CPU)

import importlib.util
import sys
from pathlib import Path

import pytest

from engine.kernel_bench import gemv_bandwidth, gemv_sweep, sweep_table

_path = Path(__file__).resolve().parents[1] / "packaging" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _path)
gpu_check = sys.modules.setdefault("gpu_check", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(gpu_check)


def test_gemv_bandwidth_counts_the_weight_bytes_and_rotates_copies_past_the_cache():
    r = gemv_bandwidth("Q4_K", 16, 512, device="cpu", iters=2, warmup=1, rotate_bytes=10_000, peak_gbps=50.0)
    assert r["weight_bytes"] == 16 * 2 * 144  # 2 Q4_K blocks of 144 bytes per row
    assert r["copies"] == 3  # ceil(10000 / 4608)
    assert r["us_per_call"] > 0 and r["gbps"] > 0
    moved = r["weight_bytes"] + 512 * 2 + 16 * 2  # bf16 x and y
    assert r["gbps"] == pytest.approx(moved / (r["us_per_call"] / 1e6) / 1e9)
    assert r["peak_share"] == pytest.approx(r["gbps"] / 50.0)


def test_gemv_sweep_reports_a_failing_shape_and_goes_on():
    shapes = {"tiny": (("up", 24, 256), ("odd", 8, 100))}  # 100 is no whole number of blocks
    rows = gemv_sweep(["tiny"], ["Q8_0", "Q6_K"], device="cpu", iters=1, shapes=shapes)
    assert [(r["matrix"], r["format"], "error" in r) for r in rows] == [
        ("up", "Q8_0", False), ("up", "Q6_K", False), ("odd", "Q8_0", True), ("odd", "Q6_K", True)]
    assert all(r["peak_share"] is None for r in rows if "error" not in r)  # no peak known for a CPU
    table = sweep_table(rows)
    assert table.count("\n") == 1 + len(rows) and "| tiny | odd | Q6_K | 8x100 | error: " in table


def test_report_path_follows_out_then_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    a = gpu_check.parse_args([])
    assert a.out == tmp_path / "gpu-check.md" and a.work_dir == str(tmp_path.resolve())
    monkeypatch.delenv("OUT")
    assert gpu_check.parse_args([]).out == Path("gpu-check.md")
    assert gpu_check.parse_args(["--out", str(tmp_path / "r.md"), "--budget", "60"]).budget == 60.0


def test_install_uses_the_wheel_folder_without_network_when_there_is_one(tmp_path):
    assert "--no-index" not in gpu_check.install_command(["gguf"], tmp_path / ".whl")
    (tmp_path / ".whl").mkdir()
    cmd = gpu_check.install_command(["gguf", "textual"], tmp_path / ".whl")
    assert cmd[:3] == [sys.executable, "-m", "pip"] and cmd[-2:] == ["gguf", "textual"]
    assert cmd[cmd.index("--find-links") + 1] == str(tmp_path / ".whl") and "--no-index" in cmd
    assert {"gguf", "textual", "torch", "pytest"} <= set(gpu_check.requirements())
    assert gpu_check.missing_distributions(["torch", "no-such-distribution-edgegem"]) == \
        ["no-such-distribution-edgegem"]


def test_a_part_past_its_time_limit_is_killed_and_reported():
    slow = gpu_check.run_part("slow", [sys.executable, "-c", "print('started', flush=True); "
                                       "import time; time.sleep(60)"], timeout=2)
    assert slow.timed_out and slow.rc is None and slow.seconds < 30 and "started" in slow.output
    assert slow.status.startswith("timed out") and not slow.ok
    bad = gpu_check.run_part("bad", [sys.executable, "-c", "import sys; print('x'); sys.exit(3)"], timeout=30)
    assert (bad.rc, bad.output.strip(), bad.status) == (3, "x", "failed (exit 3)")
    assert gpu_check.run_part("late", ["true"], timeout=0).skipped == "no time left in the budget"


def test_the_report_has_every_part_its_figures_and_the_failures(tmp_path):
    rows = gemv_sweep(["tiny"], ["Q4_0"], device="cpu", iters=1, shapes={"tiny": (("up", 8, 64),)})
    bench = {"table": "synthetic E2B on cuda: ...", "decode": [
        {"context": 0, "tok_s": 80.0, "achieved_gbps": 118.0, "bandwidth_share": 0.33}],
        "prefill": [{"prompt_tokens": 512, "tok_s": 4000.0}]}
    parts = [gpu_check.Part("install", [], skipped="nothing missing", data={"missing": []}),
             gpu_check.Part("pytest", ["pytest", "-m", "cuda"], rc=1, seconds=12.0, output="1 failed, 3 passed"),
             gpu_check.Part("gemv", ["gpu_check.py", "_microbench"], rc=0, seconds=5.0,
                            data={"device": "NVIDIA H200", "rows": rows}),
             gpu_check.Part("bench e2b bf16", ["edgegem", "bench"], rc=0, seconds=50.0, data=bench),
             gpu_check.Part("bench e4b bf16", ["edgegem", "bench"], seconds=120.0, timed_out=True, output="loading")]
    path = gpu_check.write_report(parts, tmp_path / "sub" / "gpu-check.md", machine=["- GPU: test"])
    text = path.read_text()
    for line in ("| install | skipped (nothing missing) | 0.0 |", "| pytest | failed (exit 1) | 12.0 |",
                 "| gemv | ok | 5.0 |", "| bench e4b bf16 | timed out after 120 s | 120.0 |",
                 "1 failed, 3 passed", "| tiny | up | Q4_0 | 8x64 |", "synthetic E2B on cuda: ...",
                 "| e2b bf16 | 4000 (512) | 80.0 (0) | 118 | 33.0% |"):
        assert line in text, line


def test_without_a_gpu_every_part_fails_on_its_own_and_the_report_is_written(tmp_path):
    out = tmp_path / "gpu-check.md"
    rc = gpu_check.main(["--skip-install", "--budget", "150", "--iters", "1", "--out", str(out)])
    text = out.read_text()
    assert rc == 1
    assert "| install | skipped (--skip-install) |" in text
    assert text.count("| bench e") >= 4 and "torch sees no CUDA device" in text  # each bench ran and failed
    assert "## gemv" in text and "## pytest" in text
