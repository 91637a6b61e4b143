"""`make gpu-check` (packaging/gpu_check.py, packaging/gpu_install.py) and the GEMV bandwidth
microbenchmark (engine/bench/gemv.py), as far as they run without a GPU: argument handling, the
install (only carried wheels, without dependencies, into a folder of its own), the run order and
the budget's roll-over, rows streamed by a part surviving its kill, the per-part logs, the Markdown
report, the dry run, and the microbenchmark's arithmetic on the interpreted kernel (its speed here
means nothing)."""
from __future__ import annotations

import triton_env  # noqa: F401  (the microbenchmark runs the interpreted kernel on the CPU)

import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

from engine.bench.gemv import gemv_bandwidth, gemv_sweep, sweep_table

_path = Path(__file__).resolve().parents[2] / "packaging" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _path)
gpu_check = sys.modules.setdefault("gpu_check", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(gpu_check)
gpu_install = gpu_check.gpu_install
REPO = _path.parents[1]


def test_gemv_bandwidth_counts_the_weight_bytes_and_rotates_copies_past_the_cache():
    r = gemv_bandwidth("Q4_K", 16, 512, device="cpu", iters=2, warmup=1, rotate_bytes=10_000, peak_gbps=50.0)
    assert r["weight_bytes"] == 16 * 2 * 144  # 2 Q4_K blocks of 144 bytes per row
    assert r["copies"] == 3  # ceil(10000 / 4608)
    assert r["us_per_call"] > 0 and r["gbps"] > 0
    moved = r["weight_bytes"] + 512 * 2 + 16 * 2  # bf16 x and y
    assert r["gbps"] == pytest.approx(moved / (r["us_per_call"] / 1e6) / 1e9)
    assert r["peak_share"] == pytest.approx(r["gbps"] / 50.0)


def test_the_ffn_rows_of_the_main_formats_time_every_variant():
    """The table's variants (BLOCK_N x warps tiles, K splits): on the FFN shapes for Q4_K/Q6_K/Q8_0
    only (the head fills the GPU as it is; the other formats are fallbacks), one figure per variant
    in the row and the table's last column."""
    from engine.bench.gemv import VARIANTS

    shapes = {"tiny": (("ffn_up", 24, 512), ("head", 16, 512))}
    rows = gemv_sweep(["tiny"], ["Q8_0", "Q4_0"], device="cpu", iters=1, shapes=shapes)
    by = {(r["matrix"], r["format"]): r for r in rows}
    assert list(by["ffn_up", "Q8_0"]["variants_us"]) == list(VARIANTS) and len(VARIANTS) == 7
    assert all(us > 0 for us in by["ffn_up", "Q8_0"]["variants_us"].values())
    assert "variants_us" not in by["ffn_up", "Q4_0"] and "variants_us" not in by["head", "Q8_0"]
    line = next(ln for ln in sweep_table(rows).splitlines() if "| ffn_up | Q8_0 |" in ln)
    assert line.endswith(" / ".join(f"{us:.1f}" for us in by["ffn_up", "Q8_0"]["variants_us"].values()) + " |")


def test_gemv_sweep_reports_a_failing_shape_and_goes_on():
    shapes = {"tiny": (("up", 24, 256), ("odd", 8, 100))}  # 100 is no whole number of blocks
    streamed = []
    rows = gemv_sweep(["tiny"], ["Q8_0", "Q6_K"], device="cpu", iters=1, shapes=shapes, on_row=streamed.append)
    assert streamed == rows  # each row handed on as it is measured
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
    assert gpu_check.parse_args([]).site == REPO / ".site"


def _wheel(folder: Path, dist: str, version: str = "1.0") -> Path:
    """A minimal pure-Python wheel of `dist` with one module that records it was imported."""
    name = gpu_install.wheel_name(dist)
    module = gpu_install.GPU_IMPORTS.get(dist, name)
    info = f"{name}-{version}.dist-info"
    files = {f"{module}/__init__.py": "LOADED = True\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_the_install_passes_only_wheels_that_make_wheels_fetches(monkeypatch, tmp_path):
    """What the install hands pip is the GPU parts' imports the machine lacks and .whl/ carries, each
    a wheel `make wheels` fetches, without dependencies (pip resolves all before installing: one
    unresolvable name and nothing is installed), into the site folder."""
    dl, wheel = gpu_install.wheel_commands(tmp_path / ".whl", "3.12")
    fetched = {p.split("==")[0] for p in dl if "==" in p} | {wheel[-1].split("==")[0]}
    assert fetched == set(gpu_install.CARRIED)
    assert set(gpu_install.CARRIED) < set(gpu_install.GPU_IMPORTS)
    cmd = gpu_install.install_command(list(gpu_install.CARRIED), tmp_path / "site", tmp_path / ".whl")
    assert cmd[cmd.index("--target") + 1] == str(tmp_path / "site") and "--no-deps" in cmd
    assert "--no-index" not in cmd and cmd[-3:] == list(gpu_install.CARRIED)  # no .whl/: the index
    (tmp_path / ".whl").mkdir()
    cmd = gpu_install.install_command(["gguf"], tmp_path / "site", tmp_path / ".whl")
    assert "--no-index" in cmd and cmd[cmd.index("--find-links") + 1] == str(tmp_path / ".whl")
    with pytest.raises(AssertionError):
        gpu_install.install_command(["gguf", "textual"], tmp_path / "site", tmp_path / ".whl")

    # A machine without gguf, llama-cpp-python and tokenizers: the first two are installed, the
    # third (not carried) is named in the report; every part still runs.
    seen = []
    monkeypatch.setattr(gpu_install, "missing", lambda site: ["gguf", "tokenizers", "llama-cpp-python"])
    monkeypatch.setattr(gpu_check, "run_part",
                        lambda name, cmd, timeout, env=None, log=None, echo=None:
                        seen.append((name, cmd)) or gpu_check.Part(name, cmd, rc=0))
    monkeypatch.setattr(gpu_check, "_MACHINE", ["- GPU: test"])
    out = tmp_path / "gpu-check.md"
    assert gpu_check.main(["--quick", "--out", str(out)]) == 0
    assert seen[0][0] == "install" and seen[0][1][-2:] == ["gguf", "llama-cpp-python"]
    assert "not carried in .whl/, so the parts needing them fail: tokenizers" in out.read_text()


def test_the_install_puts_the_carried_wheels_into_the_site_folder_from_the_wheel_folder_alone(tmp_path):
    whl, site = tmp_path / ".whl", tmp_path / "site"
    whl.mkdir()
    for dist in gpu_install.CARRIED:
        _wheel(whl, dist)
    assert gpu_install.missing(site, path=[]) == list(gpu_install.GPU_IMPORTS)  # nothing on an empty path
    part = gpu_check.run_part("install", gpu_install.install_command(list(gpu_install.CARRIED), site, whl), 120,
                              log=tmp_path / "install.log")
    assert part.rc == 0, part.output
    assert set(gpu_install.missing(site, path=[])) == set(gpu_install.GPU_IMPORTS) - set(gpu_install.CARRIED)
    assert (site / "llama_cpp" / "__init__.py").exists() and "install --no-deps" in (tmp_path / "install.log").read_text()


def test_a_part_past_its_time_limit_is_killed_and_keeps_the_rows_it_printed(tmp_path):
    """A part prints a row, then hangs: killed at its limit, the row is in part.rows, was echoed at
    once, and the log holds every line (stamped) and the kill."""
    echoed = []
    code = ("import json, time; print('loading', flush=True); "
            "print(json.dumps({'row': 'decode', 'context': 0, 'tok_s': 80.0}), flush=True); time.sleep(60)")
    slow = gpu_check.run_part("bench x", [sys.executable, "-c", code], timeout=3, log=tmp_path / "bench-x.log",
                              echo=echoed.append)
    assert slow.timed_out and slow.rc is None and slow.seconds < 30 and "loading" in slow.output
    assert slow.rows == [{"row": "decode", "context": 0, "tok_s": 80.0}] and slow.status.startswith("timed out")
    assert [json.loads(e) for e in echoed] == [{"part": "bench x", **slow.rows[0]}]
    log = (tmp_path / "bench-x.log").read_text()
    assert "s] loading" in log and '"tok_s": 80.0' in log and "killed at its limit of 3 s" in log
    bad = gpu_check.run_part("bad", [sys.executable, "-c", "import sys; print('x'); sys.exit(3)"], timeout=30)
    assert (bad.rc, bad.output.strip(), bad.status) == (3, "x", "failed (exit 3)")
    assert gpu_check.run_part("late", ["true"], timeout=0).skipped == "no time left in the budget"


def test_the_bench_rows_it_prints_are_the_rows_gpu_check_collects(capsys):
    from app.cli import _parser
    from app.cli_bench import _print_row

    assert _parser().parse_args(["--debug", "bench", "--synthetic", "e2b", "--device", "cuda", "--rows"]).rows
    _print_row("decode", {"context": 4096, "tok_s": 70.5})
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and gpu_check._row(line) == {"row": "decode", "context": 4096, "tok_s": 70.5}
    assert gpu_check._row("{not a row}") is None and gpu_check._row('{"row": broken') is None


class _Clock:
    """time for gpu_check: perf_counter advanced by hand (strftime as is)."""
    strftime = staticmethod(__import__("time").strftime)

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_figures_come_first_and_unused_seconds_roll_over_to_the_next_part(monkeypatch, tmp_path):
    """--quick: gemv, the E2B bench, the 26B host-experts bench, then pytest; each may run until the
    sum of the plans so far, so the seconds the install and gemv leave unused go to the bench, and
    so on."""
    clock, caps = _Clock(), []
    host, split = gpu_check.HOST_BENCH, gpu_check.SPLIT_BENCH
    used = {"gemv": 20.0, "bench e2b bf16": 100.0, split: 30.0, host: 150.0, "pytest": 10.0}

    def fake_run_part(name, cmd, timeout, env=None, log=None, echo=None):
        caps.append((name, round(timeout, 6)))
        clock.now += min(used[name], timeout)
        return gpu_check.Part(name, cmd, rc=0, seconds=used[name])

    monkeypatch.setattr(gpu_check, "time", clock)
    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    monkeypatch.setattr(gpu_install, "missing", lambda site: [])
    monkeypatch.setattr(gpu_check, "_MACHINE", ["- GPU: test"])
    assert gpu_check.main(["--quick", "--out", str(tmp_path / "r.md")]) == 0
    q = gpu_check.QUICK_PLAN
    assert caps == [("gemv", q["install"] + q["gemv"]), ("bench e2b bf16", q["install"] + q["gemv"] + q["bench"] - 20),
                    (split, q["install"] + q["gemv"] + q["bench"] + q["split"] - 120),
                    (host, gpu_check.QUICK_BUDGET - q["pytest"] - 150), ("pytest", gpu_check.QUICK_BUDGET - 300)]
    caps.clear()
    clock.now = 0.0
    gpu_check.main(["--quick", "--budget", "200", "--out", str(tmp_path / "r.md")])  # the budget's end caps
    assert caps == [("gemv", 110), ("bench e2b bf16", 170), (split, 80), (host, 50), ("pytest", 0)]


def test_the_report_has_every_part_its_figures_and_the_failures(tmp_path):
    rows = gemv_sweep(["tiny"], ["Q4_0"], device="cpu", iters=1, shapes={"tiny": (("up", 8, 64),)})
    bench = [{"row": "warmup", "load_s": 12.0, "warmup_s": 40.0}, {"row": "prefill", "prompt_tokens": 512,
             "tok_s": 4000.0}, {"row": "decode", "context": 0, "tok_s": 80.0, "achieved_gbps": 118.0,
                                "bandwidth_share": 0.33,
                                "profile": {"busy_ms_per_step": 2.5, "wall_ms_per_step": 12.5}}]
    parts = [gpu_check.Part("install", [], skipped="nothing to install", note="missing before: nothing"),
             gpu_check.Part("gemv", ["gpu_check.py", "_microbench"], rc=0, seconds=5.0,
                            rows=[{"row": "device", "name": "NVIDIA H200"}] + [{"row": "gemv", **r} for r in rows]),
             gpu_check.Part("bench e2b bf16", ["edgegem", "bench"], rc=0, seconds=50.0, rows=bench,
                            output="synthetic E2B on cuda: ..."),
             gpu_check.Part("bench e4b bf16", ["edgegem", "bench"], seconds=120.0, timed_out=True, output="loading",
                            rows=bench[:2]),
             gpu_check.Part("pytest", ["pytest", "-m", "cuda"], rc=1, seconds=12.0, output="1 failed, 3 passed")]
    path = gpu_check.write_report(parts, tmp_path / "sub" / "gpu-check.md", machine=["- GPU: test"])
    text = path.read_text()
    for line in ("| install | skipped (nothing to install) | 0.0 | 0 |", "| pytest | failed (exit 1) | 12.0 | 0 |",
                 "| gemv | ok | 5.0 | 2 |", "| bench e4b bf16 | timed out after 120 s | 120.0 | 2 |",
                 "missing before: nothing", "1 failed, 3 passed", "device: NVIDIA H200", "| tiny | up | Q4_0 | 8x64 |",
                 "synthetic E2B on cuda: ...", "| e2b bf16 | 4000 (512) | 80.0 (0) | 118 | 33.0% | 12 + 40 | 2.50 / 12.50 |",
                 "| e4b bf16 | 4000 (512) |  |  |  | 12 + 40 |  |"):
        assert line in text, line


def test_without_a_gpu_every_part_fails_on_its_own_logs_it_and_prints_its_last_lines(tmp_path, capsys):
    out = tmp_path / "gpu-check.md"
    rc = gpu_check.main(["--skip-install", "--budget", "300", "--iters", "1", "--out", str(out)])
    text, printed = out.read_text(), capsys.readouterr().out
    assert rc == 1
    assert "| install | skipped (--skip-install) |" in text and "## gemv" in text and "## pytest" in text
    assert text.count("| bench e") >= 4
    logs = sorted(p.name for p in tmp_path.glob("*.log"))
    assert logs == ["bench-26b-a4b-host-experts.log", "bench-e2b-bf16.log", "bench-e2b-int8_per_token_head.log",
                    "bench-e4b-bf16.log", "bench-e4b-int8_per_token_head.log", "gemv.log", "pytest.log"]
    assert len(logs) + 1 <= 8  # what a device run brings back
    bench_log = (tmp_path / "bench-e2b-bf16.log").read_text()
    assert "Traceback" in bench_log and "RuntimeError: --device cuda: torch sees no CUDA device" in bench_log  # --debug
    assert "== bench e2b bf16: failed (exit 1)" in printed and "torch sees no CUDA device" in printed


def test_quick_mode_runs_the_e2b_gemv_table_one_e2b_bench_and_the_cuda_tests():
    a = gpu_check.parse_args(["--quick"])
    assert a.quick and a.budget == gpu_check.QUICK_BUDGET <= 480  # + python start and report: < 8.5 min
    assert sum(gpu_check.QUICK_PLAN.values()) == a.budget
    assert gpu_check.parse_args([]).budget == 1200.0 == sum(gpu_check.PLAN.values()) + 3 * gpu_check.PLAN["bench"] and gpu_check.parse_args(["--quick", "--budget", "99"]).budget == 99
    assert [name for name, *_ in gpu_check.plan_parts(a)] == ["gemv", "bench e2b bf16", gpu_check.SPLIT_BENCH,
                                                              gpu_check.HOST_BENCH, "pytest"]
    split = gpu_check.split_bench_cmd(quick=True)
    assert split[:2] == ["env", "EDGEGEM_GEMV_SPLIT=4"] and split[split.index("--prompt-lengths") + 1] == "512"
    assert gpu_check.SPLIT_BENCH not in [n for n, *_ in gpu_check.plan_parts(gpu_check.parse_args([]))]
    cmd = gpu_check.bench_cmd("e2b", "bf16", quick=True)
    assert cmd[cmd.index("--contexts") + 1] == "0,4096" and "--synthetic" in cmd and "--rows" in cmd
    assert "--profile" in cmd
    host = gpu_check.host_bench_cmd(quick=True)
    assert host[host.index("--synthetic") + 1] == "26b-a4b" and host[host.index("--gpu-memory-budget") + 1] == "10GiB"
    assert "--keep-gguf" not in host  # built in memory: no 16.8 GB file to write first
    assert cmd.index("--debug") < cmd.index("bench")  # the CLI's --debug is a top-level flag: tracebacks


def test_make_gpu_check_is_quick_make_wheels_fills_the_wheel_folder_and_gpu_dry_run_has_its_venv():
    text = (REPO / "Makefile").read_text()
    assert "GPU_CHECK_ARGS ?= --quick" in text and "$(VPY) packaging/gpu_check.py wheels" in text
    assert "gpu-dry-run: $(DEVPY)" in text and "DEV := .venv-device" in text
    assert "DEVICE_SPEC ?= torch==2.11.* triton==3.6.* numpy jinja2 tokenizers pytest" in text
    ignored = (REPO / ".gitignore").read_text().split()
    assert {"/.venv-device/", "/.site/", "/.whl/"} <= set(ignored)
    dl, wheel = gpu_install.wheel_commands(Path("/w"), "3.12")
    assert dl[3:5] == ["download", "--quiet"] and "--no-deps" in dl and dl[dl.index("--python-version") + 1] == "3.12"
    assert wheel[3] == "wheel" and wheel[-1] == gpu_install.LLAMA and wheel[wheel.index("-w") + 1] == "/w"


def test_the_report_is_written_after_every_part(monkeypatch, tmp_path):
    """A run cut short (the device's time limit) still leaves the figures of the parts that ended:
    the report is on disk, with every finished part, before the next part starts."""
    out = tmp_path / "gpu-check.md"
    seen = []

    def fake_run_part(name, cmd, timeout, env=None, log=None, echo=None):
        seen.append((name, out.read_text() if out.exists() else ""))
        return gpu_check.Part(name, cmd, rc=0, seconds=0.1, output=f"{name} output")

    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    monkeypatch.setattr(gpu_install, "missing", lambda site: ["gguf"])
    monkeypatch.setattr(gpu_check, "_MACHINE", ["- GPU: test"])
    assert gpu_check.main(["--quick", "--out", str(out)]) == 0
    assert [name for name, _ in seen] == ["install", "gemv", "bench e2b bf16", gpu_check.SPLIT_BENCH,
                                          gpu_check.HOST_BENCH, "pytest"]
    for i, (name, report) in enumerate(seen[1:], 1):
        for earlier, _ in seen[:i]:
            assert f"| {earlier} | ok |" in report, (name, earlier)
        assert f"| {name} |" not in report
    assert "packaging/gpu_check.py --quick)" in out.read_text()


def test_dry_run_reaches_every_gpu_part_and_stops_where_cuda_is_needed(tmp_path):
    """`--dry-run` on the CPU: the GEMV sweep and a tiny bench interpreted (their rows streamed), the
    real bench command up to its CUDA check, the CUDA tests collected, their quantizer imported."""
    import time as _time

    out = tmp_path / "gpu-check.md"
    t0 = _time.perf_counter()
    rc = gpu_check.main(["--dry-run", "--quick", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "| install | skipped (nothing to install) |" in text  # this venv has every GPU import
    assert "| bench e2b bf16 | skipped (dry run: stopped where it needs CUDA) |" in text and "bench e4b" not in text
    assert f"| {gpu_check.HOST_BENCH} | skipped (dry run: stopped where it needs CUDA) |" in text
    assert f"| {gpu_check.SPLIT_BENCH} | skipped (dry run: stopped where it needs CUDA) |" in text
    for line in ("| gemv | ok |", "| bench tiny cpu | ok |", "| pytest | ok |", "| quantizer | ok |"):
        assert line in text, line
    assert "test_cuda.py::" in text and "llama_cpp 0.3.36" in text and "| tiny | ffn_up | Q4_K | 16x256 |" in text
    assert "| tiny cpu |" in text  # its rows in the decode summary
    assert {p.name for p in tmp_path.glob("*.log")} >= {"gemv.log", "bench-e2b-bf16.log", "pytest.log"}
    assert "packaging/gpu_check.py --quick --dry-run)" in text
    assert _time.perf_counter() - t0 < 300


def test_dry_run_checks_the_wheel_folder_for_the_gpu_python(tmp_path):
    """pip resolves every carried wheel from `.whl/` alone for Python 3.12; a folder missing one
    fails, naming it."""
    whl = tmp_path / ".whl"
    whl.mkdir()
    _wheel(whl, "diskcache")
    part = gpu_check.run_part("wheels", gpu_install.wheel_check_command(whl), timeout=120)
    assert part.rc != 0 and "gguf" in part.output  # the first wheel the folder lacks
    _wheel(whl, "gguf")
    _wheel(whl, "llama-cpp-python", "0.3.36")
    ok = gpu_check.run_part("wheels", gpu_install.wheel_check_command(whl), timeout=120)
    assert ok.rc == 0 and "llama-cpp-python" in ok.output.replace("_", "-")
