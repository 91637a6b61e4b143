"""`make gpu-check`: the one command to run on a machine with an NVIDIA GPU. Writes one Markdown report.

Parts, in this order, each in its own process with its own time limit (one failing or running over
does not stop the others):
  1. install   the carried wheels of what the GPU parts import and this Python lacks (gguf,
               llama-cpp-python, diskcache on the workplace's GPU machine), into `.site/`
               (packaging/gpu_install.py says what and why);
  2. gemv      per-kernel bandwidth: each decode GEMV format at E2B (and E4B) shapes through
               `QuantWeight.linear` (engine/bench/gemv.py), GB/s and share of the device's peak
               (the kernels replayed in a CUDA graph, beside the eager per-call time; the FFN
               shapes also at other BLOCK_N x warps tiles and split over K 2, 4, 8 ways: is the
               default grid too thin for a big GPU?);
  3. bench     `edgegem --debug bench --synthetic e2b|e4b --device cuda --gpu-memory-budget 8GiB
               --rows --profile`, KV bf16 (and int8_per_token_head): engine.bench.throughput.gpu_bench,
               each decode context's top kernels and GPU busy time per step;
  3b. split    (--quick) the E2B bench again with EDGEGEM_GEMV_SPLIT=4 (decode end to end, K split);
  4. host      the 26B-A4B at real size beside a 10 GiB budget, built in memory: the plan's expert
               banks in host RAM, computed by llama.cpp's CPU kernels, the hot-expert cache in
               what the budget leaves; prefill and decode rows with PCIe bytes and CPU ms a token;
  5. pytest    `pytest -m cuda` on tests/engine/test_cuda.py and the host-layer tests, TRITON_INTERPRET=0.
The figures come first: the tests compile kernels the bench has already compiled. Each part has
planned seconds (PLAN); what one leaves unused rolls over to the next, and the whole run stays
inside --budget. `--quick` (what `make gpu-check` runs): the GEMV table at E2B's shapes and one E2B
bench (bf16 KV) and its split-K rerun, the 26B-A4B part and the CUDA tests, inside 470 s,
python's start and the report included in under 8.5 minutes (a device call's limit is 10).

Nothing finished is lost to a part killed at its limit: the gemv and bench parts print one JSON line
(`{"row": ...}`) per measured row the moment it is measured, this script collects the rows from the
stream and echoes each to its stdout at once, and the report (rows included) is rewritten after
every part. Each part's whole output, each line stamped with its second, goes to `<part>.log`
beside the report, and a part that fails prints its last lines here. The report goes to --out,
else $OUT/gpu-check.md when $OUT is set, else ./gpu-check.md; its path is printed last. A full run
writes the report and at most 7 logs.

`--dry-run`: every part on a machine without a GPU, as far as it gets there: the real install (with
.whl/: pip resolving its wheels for the GPU machine's Python as well), the GEMV sweep and a tiny
bench on the CPU under Triton's interpreter (the modules the CUDA run imports, and the streamed
rows), the real bench command stopping where it needs CUDA, the CUDA tests collected and their
quantizer imported. `make gpu-dry-run` runs it in a venv holding only the GPU machine's packages.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # gpu_install beside it, when loaded by path (the tests) not run
    sys.path.insert(0, str(HERE))
import gpu_install  # noqa: E402

REPO = HERE.parent
BENCH_RUNS = [(variant, kv) for variant in ("e2b", "e4b") for kv in ("bf16", "int8_per_token_head")]
QUICK_BENCH_RUNS = [("e2b", "bf16")]
# Planned seconds per part, in run order (one "bench" per bench run). A part may run until the sum
# of the plans up to it, so what earlier parts left unused rolls over. The first bench of a
# process also JIT-compiles every kernel it launches (~1 s each); later runs reuse Triton's cache.
PLAN = {"install": 30, "gemv": 150, "bench": 150, "host": 300, "pytest": 120}  # 1,200 s with four benches
QUICK_PLAN = {"install": 30, "gemv": 80, "bench": 80, "split": 40, "host": 140, "pytest": 100}  # 470 s
FULL_BUDGET = 1200.0
QUICK_BUDGET = 470.0
NO_CUDA = "torch sees no CUDA device"  # app/cli_bench.py's error: where the dry run's bench stops
TAIL_LINES = 25  # of a failing part, printed here
# the CUDA tests: the compiled kernels against the CPU, graph replay, host expert banks and layers
CUDA_TESTS = ("tests/engine/test_cuda.py", "tests/models/test_host_expert_layers.py",
              "tests/kernels/triton/test_host_layers.py", "tests/kernels/triton/test_gpu_arch.py")


@dataclass
class Part:
    """One step of the check: its command, exit code (None: did not finish), time, output and rows."""
    name: str
    cmd: list[str]
    rc: Optional[int] = None
    seconds: float = 0.0
    output: str = ""
    timed_out: bool = False
    skipped: Optional[str] = None
    rows: list[dict] = field(default_factory=list)  # the {"row": ...} lines it printed, in order
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.skipped is None and not self.timed_out and self.rc == 0

    @property
    def status(self) -> str:
        if self.skipped:
            return f"skipped ({self.skipped})"
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        return "ok" if self.rc == 0 else f"failed (exit {self.rc})"


def log_name(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "-", part) + ".log"


def _row(line: str) -> Optional[dict]:
    if not line.startswith('{"row"'):
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def run_part(name: str, cmd: list[str], timeout: float, env: Optional[dict] = None,
             log: Optional[Path] = None, echo=None) -> Part:
    """Run `cmd` in its own process group, reading its output as it comes: every line to `log`
    (stamped with its second), every row line into part.rows and to `echo`. Past `timeout` seconds
    the group is killed; what it printed until then is kept."""
    part = Part(name, cmd)
    if timeout <= 0:
        part.skipped = "no time left in the budget"
        return part
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            cwd=REPO, env=env, start_new_session=True)
    lines: list[str] = []

    def read() -> None:
        f = open(log, "w") if log is not None else None
        try:
            if f:
                f.write(f"$ {' '.join(cmd)}\n")
            for line in proc.stdout:
                lines.append(line)
                if f:
                    f.write(f"[{time.perf_counter() - t0:6.1f} s] {line}")
                    f.flush()
                row = _row(line)
                if row is not None:
                    part.rows.append(row)
                    if echo:
                        echo(json.dumps({"part": name, **row}))
        finally:
            if f:
                f.close()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        part.rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        part.timed_out = True
    reader.join(timeout=10)  # a grandchild outside the group may hold the pipe: do not wait for it
    part.output = "".join(lines)
    part.seconds = time.perf_counter() - t0
    if log is not None and part.timed_out:
        with open(log, "a") as f:
            f.write(f"[{part.seconds:6.1f} s] killed at its limit of {timeout:.0f} s\n")
    return part


# ----------------------------------------------------------------------------------- the parts

def part_env(site: Path, interpret: bool = False) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def bench_cmd(variant: str, kv: str, quick: bool = False) -> list[str]:
    return [sys.executable, "-m", "app.cli", "--debug", "bench", "--synthetic", variant, "--device", "cuda",
            "--gpu-memory-budget", "8GiB", "--kv-cache-dtype", kv, "--swa-kv-cache-dtype", kv,
            "--prompt-lengths", "512,2048", "--contexts", "0,4096" if quick else "0,4096,32768",
            "--decode-steps", "32", "--rows", "--profile"]


HOST_BENCH = "bench 26b-a4b host experts"
SPLIT = 4  # EDGEGEM_GEMV_SPLIT of the E2B bench's second run: the decode end to end with K split
SPLIT_BENCH = f"bench e2b bf16 split{SPLIT}"


def split_bench_cmd(quick: bool = False) -> list[str]:
    """The E2B bench again with every one-row GEMV split over K (kernels/env.py EDGEGEM_GEMV_SPLIT):
    the decode rows beside the default's; one prompt length, the prefill path does not change."""
    cmd = bench_cmd("e2b", "bf16", quick)
    cmd[cmd.index("--prompt-lengths") + 1] = "512"
    return ["env", f"EDGEGEM_GEMV_SPLIT={SPLIT}", *cmd]


def host_bench_cmd(quick: bool = False) -> list[str]:
    """The 26B-A4B beside a 10 GiB budget, built in memory: the plan keeps expert banks in host RAM
    (auto placement) and, room kept for a 32K context (at the model's 262K none would be left), the
    GPU memory it leaves holds 2.4 GiB of hot experts. Prompts of 16 rows (experts on the CPU) and
    64 and 512 (banks streamed to the GPU, models/expert_stream.py STREAM_ROWS = 32) put the two
    prefill paths side by side: where they cross is the threshold to set."""
    return [sys.executable, "-m", "app.cli", "--debug", "bench", "--synthetic", "26b-a4b", "--device", "cuda",
            "--gpu-memory-budget", "10GiB", "--ctx-size", "32768", "--prompt-lengths", "16,64,512",
            "--contexts", "0,4096",
            "--decode-steps", "16" if quick else "32", "--rows", "--profile"]


def _print_row(row: dict) -> None:
    print(json.dumps(row), flush=True)


def microbench_main(iters: int, variants: str = "e2b,e4b", cpu: bool = False) -> int:
    """The gemv part, in its own process: one JSON line per row as it is measured. `cpu` (the dry
    run): one small shape per format on the CPU (TRITON_INTERPRET=1 in the part's environment)."""
    import torch

    from engine.bench import gemv_sweep

    if cpu:
        _interpreter_compat()
        _print_row({"row": "device", "name": "cpu (dry run)"})
        rows = gemv_sweep(["tiny"], device="cpu", iters=1, shapes={"tiny": (("ffn_up", 16, 256),)},
                          on_row=lambda r: _print_row({"row": "gemv", **r}))
    else:
        _print_row({"row": "device", "name": torch.cuda.get_device_name()})
        rows = gemv_sweep(variants.split(","), iters=iters, on_row=lambda r: _print_row({"row": "gemv", **r}))
    return 1 if any("error" in r for r in rows) else 0


def _interpreter_compat() -> None:
    """The dry run's interpreted parts: triton 3.6's interpreter with numpy >= 2.3, as the kernel
    tests set it up (kernels/triton/interpreter_compat.py); the GPU's compiled path needs nothing."""
    from kernels.triton.interpreter_compat import install

    install()


def cpu_bench_main() -> int:
    """The dry run's bench: gpu_bench on the tiny synthetic model on the CPU with the quantized
    weights and the batched decode, as the CUDA run takes them (TRITON_INTERPRET=1: the kernels
    interpreted), rows streamed as `bench --rows` streams them."""
    from engine.bench import gpu_bench

    _interpreter_compat()
    gpu_bench(synthetic="tiny", device="cpu", quantized=True, batched_decode=True, prompts=(8,), contexts=(0,),
              decode_steps=1, on_row=lambda kind, r: _print_row({"row": kind, **r}))  # ~1 min interpreted
    return 0


def plan_parts(args) -> list[tuple[str, list[str], str, bool]]:
    """(name, command, PLAN key, interpreted) of every part after the install, in run order."""
    me = [sys.executable, str(Path(__file__).resolve())]
    runs = QUICK_BENCH_RUNS if args.quick else BENCH_RUNS
    pytest = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rA", "-p", "no:cacheprovider",
              "--durations=5", *CUDA_TESTS]
    if not args.dry_run:
        return ([("gemv", me + ["_microbench", str(args.iters), "e2b" if args.quick else "e2b,e4b"], "gemv", False)]
                + [(f"bench {v} {kv}", bench_cmd(v, kv, args.quick), "bench", False) for v, kv in runs]
                + [(SPLIT_BENCH, split_bench_cmd(args.quick), "split", False)] * args.quick
                + [(HOST_BENCH, host_bench_cmd(args.quick), "host", False), ("pytest", pytest, "pytest", False)])
    v, kv = runs[0]
    return [("gemv", me + ["_microbench", "1", "tiny", "--cpu"], "gemv", True),
            (f"bench {v} {kv}", bench_cmd(v, kv, args.quick), "bench", False),
            *[(SPLIT_BENCH, split_bench_cmd(args.quick), "split", False)] * args.quick,
            (HOST_BENCH, host_bench_cmd(args.quick), "host", False),
            ("bench tiny cpu", me + ["_cpu_bench"], "bench", True),
            ("pytest", pytest + ["--collect-only"], "pytest", False),
            ("quantizer", [sys.executable, "-c", "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"],
             "pytest", False)]


def run_all(args, report: Optional[Path] = None, echo=print) -> list[Part]:
    """Every part in order, each until the sum of the plans so far (the budget's end at most); the
    report (when given) is rewritten after each part."""
    start = time.perf_counter()
    deadline = start + args.budget
    plan = QUICK_PLAN if args.quick else PLAN
    planned = 0.0
    work, site = Path(args.work_dir), Path(args.site)
    parts: list[Part] = []

    def run(name: str, cmd: list[str], key: str, env: dict) -> Part:
        nonlocal planned
        planned += plan[key]
        cap = min(start + planned, deadline) - time.perf_counter()
        return run_part(name, cmd, cap, env, work / log_name(name), echo)

    def done(part: Part) -> None:
        parts.append(part)
        echo(f"== {part.name}: {part.status} ({part.seconds:.0f} s)")
        if not part.ok and not part.skipped and part.output.strip():
            echo(_tail(part.output, TAIL_LINES))
        if report is not None:
            write_report(parts, report, quick=args.quick, dry_run=args.dry_run)

    lacking = gpu_install.missing(site)
    carried = [d for d in lacking if d in gpu_install.CARRIED]
    if args.skip_install or not carried:
        install = Part("install", [], skipped="--skip-install" if args.skip_install else "nothing to install")
        planned += plan["install"]
    else:
        install = run("install", gpu_install.install_command(carried, site, gpu_install.WHEEL_DIR), "install",
                      part_env(site))
    absent = [d for d in lacking if d not in gpu_install.CARRIED]
    install.note = f"missing before: {', '.join(lacking) or 'nothing'}" + \
        (f"; not carried in .whl/, so the parts needing them fail: {', '.join(absent)}" if absent else "")
    done(install)
    if args.dry_run and gpu_install.WHEEL_DIR.is_dir():
        done(run_part("wheels", gpu_install.wheel_check_command(gpu_install.WHEEL_DIR), 120, part_env(site)))
    for name, cmd, key, interpret in plan_parts(args):
        part = run(name, cmd, key, part_env(site, interpret))
        if args.dry_run and part.rc and NO_CUDA in part.output:
            part.skipped = "dry run: stopped where it needs CUDA"
        done(part)
    return parts


# ------------------------------------------------------------------------------------- report

def _machine() -> list[str]:
    lines = [f"- python {sys.version.split()[0]}"]
    for dist in ("torch", "triton"):
        try:
            lines.append(f"- {dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            lines.append(f"- {dist}: not installed")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        lines.append(f"- GPU: {out.stdout.strip() or out.stderr.strip()}")
    except (OSError, subprocess.SubprocessError) as e:
        lines.append(f"- GPU: nvidia-smi unavailable ({e})")
    return lines


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _bench_rows(parts: list[Part]) -> list[str]:
    """The decode summary: one line per bench part from the rows it streamed (a part killed
    half-way shows what it finished)."""
    rows = ["| run | prefill tok/s (prompt) | decode tok/s (context) | GB/s | of peak | load + warm-up s "
            "| GPU busy / wall ms a step |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in parts:
        if not p.name.startswith("bench") or not p.rows:
            continue
        pre = ", ".join(f"{r['tok_s']:.0f} ({r['prompt_tokens']})" for r in p.rows
                        if r["row"] == "prefill" and "tok_s" in r)
        dec = [r for r in p.rows if r["row"] == "decode" and "tok_s" in r]
        warm = [f"{r['load_s']:.0f} + {r['warmup_s']:.0f}" for r in p.rows if r["row"] == "warmup"]
        rows.append(f"| {p.name[6:]} | {pre} | " + ", ".join(f"{r['tok_s']:.1f} ({r['context']})" for r in dec)
                    + " | " + ", ".join(f"{r['achieved_gbps']:.0f}" for r in dec) + " | "
                    + ", ".join(f"{100 * r['bandwidth_share']:.1f}%" if r.get("bandwidth_share") is not None
                                else "n/a" for r in dec) + f" | {''.join(warm)} | "
                    + ", ".join(f"{r['profile']['busy_ms_per_step']:.2f} / {r['profile']['wall_ms_per_step']:.2f}"
                                for r in dec if "profile" in r) + " |")
    return rows


_MACHINE: list[str] = []  # _machine() once a run (nvidia-smi takes a moment)


def write_report(parts: list[Part], path: Path, machine: Optional[list[str]] = None, quick: bool = False,
                 dry_run: bool = False) -> Path:
    """One Markdown file: machine, a status line per part, then each part's figures and output."""
    from engine.bench import sweep_table

    if machine is None:
        _MACHINE[:] = _MACHINE or _machine()
        machine = _MACHINE
    mode = " --quick" * quick + " --dry-run" * dry_run
    lines = ["# edgegem gpu-check", "", f"{time.strftime('%Y-%m-%d %H:%M:%S')}, from `make gpu-check` "
             f"(packaging/gpu_check.py{mode})", "", "## Machine", *machine, "",
             "## Parts", "| part | status | seconds | rows |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.1f} | {len(p.rows)} |" for p in parts]
    for p in parts:
        lines += ["", f"## {p.name}", ""]
        if p.cmd:
            lines += [f"`{' '.join(p.cmd)}`", ""]
        if p.note:
            lines += [p.note, ""]
        gemv = [r for r in p.rows if r["row"] == "gemv"]
        if gemv:
            device = next((r["name"] for r in p.rows if r["row"] == "device"), "?")
            lines += [f"device: {device}", "", sweep_table(gemv), ""]
        if p.output.strip():
            lines += ["```", _tail(p.output), "```"]
    bench = _bench_rows(parts)
    if len(bench) > 2:
        lines += ["", "## Decode summary", *bench]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def default_out() -> Path:
    return Path(os.environ["OUT"]) / "gpu-check.md" if os.environ.get("OUT") else Path("gpu-check.md")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPU checks and benchmarks, one Markdown report")
    p.add_argument("--out", type=Path, help="report path (default: $OUT/gpu-check.md, else ./gpu-check.md)")
    p.add_argument("--quick", action="store_true",
                   help=f"the E2B GEMV table, one E2B bench, the 26B-A4B host-experts bench and the CUDA tests, "
                        f"inside {QUICK_BUDGET:.0f} s")
    p.add_argument("--dry-run", action="store_true", help="every part as far as it gets without a GPU")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all parts together (default {FULL_BUDGET:.0f}, {QUICK_BUDGET:.0f} with --quick)")
    p.add_argument("--iters", type=int, default=100, help="timed calls per GEMV measurement")
    p.add_argument("--skip-install", action="store_true")
    p.add_argument("--site", type=Path, default=gpu_install.SITE_DIR,
                   help="where the install puts the carried wheels (default .site/ in the repository)")
    p.add_argument("--work-dir", default=None, help="folder of the part logs (default: the report's)")
    a = p.parse_args(argv)
    a.budget = a.budget if a.budget is not None else QUICK_BUDGET if a.quick else FULL_BUDGET
    a.out = a.out or default_out()
    a.work_dir = a.work_dir or str(Path(a.out).resolve().parent)
    a.site = a.site.resolve()
    return a


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_microbench"]:
        return microbench_main(int(argv[1]), argv[2], "--cpu" in argv)
    if argv[:1] == ["_cpu_bench"]:
        return cpu_bench_main()
    if argv[:1] == ["wheels"]:
        w = argparse.ArgumentParser(prog="gpu_check.py wheels", description="fill .whl/ for a GPU machine")
        w.add_argument("--wheel-dir", type=Path, default=gpu_install.WHEEL_DIR)
        w.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
        wa = w.parse_args(argv[1:])
        return gpu_install.wheels_main(wa.wheel_dir, wa.python_version)
    args = parse_args(argv)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    path = Path(args.out)
    parts = run_all(args, path, echo=lambda s: print(s, flush=True))
    write_report(parts, path, quick=args.quick, dry_run=args.dry_run)
    print(f"report: {path.resolve()}")
    return 0 if all(p.ok or p.skipped for p in parts) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
