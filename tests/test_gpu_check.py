"""`make gpu-check` (packaging/gpu_check.py) and the GEMV bandwidth microbenchmark
(engine/bench/gemv.py), as far as they run without a GPU: argument handling, the install
command, parts that fail or run over their time without stopping the rest, the Markdown report,
and the microbenchmark's arithmetic on the interpreted kernel (its speed here means nothing)."""
from __future__ import annotations

import triton_env  # noqa: F401  (the microbenchmark runs the interpreted kernel on the CPU)

import importlib.util
import sys
from pathlib import Path

import pytest

from engine.bench.gemv import gemv_bandwidth, gemv_sweep, sweep_table

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


def test_quick_mode_runs_the_cuda_tests_the_e2b_gemv_table_and_one_e2b_bench():
    a = gpu_check.parse_args(["--quick"])
    assert a.quick and a.budget == gpu_check.QUICK_BUDGET <= 450  # + python start and report: < 8 min
    assert sum(gpu_check.QUICK_LIMITS.values()) <= a.budget
    assert gpu_check.parse_args([]).budget == 540.0 and gpu_check.parse_args(["--quick", "--budget", "99"]).budget == 99
    assert gpu_check.QUICK_BENCH_RUNS == [("e2b", "bf16")]
    cmd = gpu_check.bench_cmd("e2b", "bf16", quick=True)
    assert cmd[cmd.index("--contexts") + 1] == "0,4096" and "--synthetic" in cmd


REPO = _path.parents[1]


def test_make_gpu_check_is_quick_and_make_wheels_fills_the_wheel_folder():
    """`make gpu-check` runs the quick mode by default; `make wheels` runs gpu_check.py wheels."""
    text = (REPO / "Makefile").read_text()
    assert "GPU_CHECK_ARGS ?= --quick" in text and "$(VPY) packaging/gpu_check.py wheels" in text
    dl, wheel = gpu_check.wheel_commands(Path("/w"), "3.12")
    assert dl[3:5] == ["download", "--quiet"] and "--no-deps" in dl and dl[dl.index("--python-version") + 1] == "3.12"
    assert {p.split("==")[0] for p in dl if "==" in p} == set(gpu_check.GPU_WHEELS)  # this machine's versions
    assert wheel[3] == "wheel" and wheel[-1] == gpu_check.LLAMA and wheel[wheel.index("-w") + 1] == "/w"
    assert "llama-cpp-python" in gpu_check.requirements()  # tests/test_cuda.py quantizes with it


def test_the_report_is_written_after_every_part(monkeypatch, tmp_path):
    """A run cut short (the device's time limit) still leaves the figures of the parts that ended:
    the report is on disk, with every finished part, before the next part starts."""
    out = tmp_path / "gpu-check.md"
    seen = []

    def fake_run_part(name, cmd, timeout, env=None):
        seen.append((name, out.read_text() if out.exists() else ""))
        return gpu_check.Part(name, cmd, rc=0, seconds=0.1, output=f"{name} output")

    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    monkeypatch.setattr(gpu_check, "missing_distributions", lambda names: ["gguf"])
    monkeypatch.setattr(gpu_check, "_MACHINE", ["- GPU: test"])
    rc = gpu_check.main(["--quick", "--out", str(out)])
    assert rc == 0
    assert [name for name, _ in seen] == ["install", "pytest", "gemv", "bench e2b bf16"]
    for i, (name, report) in enumerate(seen[1:], 1):
        for earlier, _ in seen[:i]:
            assert f"| {earlier} | ok |" in report, (name, earlier)
        assert f"| {name} |" not in report
    assert "packaging/gpu_check.py --quick)" in out.read_text()


def test_dry_run_goes_through_every_step_but_the_gpu_ones(tmp_path):
    """`--dry-run` on the CPU: the install check, the CUDA tests collected (imported, not run), the
    GEMV table and the bench listed as skipped; with a wheel folder, pip checks that its wheels
    install on the GPU machine's Python (3.12) from the folder alone."""
    import time as _time

    out = tmp_path / "gpu-check.md"
    t0 = _time.perf_counter()
    rc = gpu_check.main(["--dry-run", "--quick", "--skip-install", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "| install | skipped (--skip-install) |" in text and "| pytest | ok |" in text
    assert "tests collected" in text or "test_cuda.py::" in text
    assert "| gemv | skipped (dry run: needs a GPU) |" in text
    assert "| bench e2b bf16 | skipped (dry run: needs a GPU) |" in text and "bench e4b" not in text
    assert "packaging/gpu_check.py --quick --dry-run)" in text
    assert _time.perf_counter() - t0 < 300  # no GPU step ran (a collection, an import of torch)


def test_dry_run_checks_the_wheel_folder_for_the_gpu_python(monkeypatch, tmp_path):
    """With `.whl/` present the dry run asks pip to resolve every GPU wheel from it alone; a folder
    missing one fails that part (and the run), naming it."""
    import subprocess

    whl = tmp_path / ".whl"
    whl.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "py", "--abi", "none", "--platform", "any",
                    "-d", str(whl), "platformdirs"], check=True, capture_output=True)
    monkeypatch.setattr(gpu_check, "WHEEL_DIR", whl)
    part = gpu_check.run_part("wheels", gpu_check.wheel_check_command(whl), timeout=120)
    assert part.rc != 0 and "gguf" in part.output  # the first wheel the folder lacks
    ok = gpu_check.run_part("wheels", gpu_check.wheel_check_command(whl)[:-len(gpu_check.GPU_WHEELS) - 1]
                            + ["platformdirs"], timeout=120)
    assert ok.rc == 0 and "platformdirs" in ok.output
