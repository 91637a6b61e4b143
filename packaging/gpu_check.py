"""`make gpu-check`: the one command to run on a machine with an NVIDIA GPU. Writes one Markdown report.

Parts, each in its own process with its own time limit (one failing or running over does not stop
the others; the whole run stays inside --budget seconds):
  1. install   what the project needs and this Python lacks (pyproject dependencies, pytest and
               llama-cpp-python, which tests/test_cuda.py quantizes its tiny model with);
  2. pytest    `pytest -m cuda tests/test_cuda.py` with TRITON_INTERPRET=0;
  3. gemv      per-kernel bandwidth: each decode GEMV format at E2B and E4B shapes through
               `QuantWeight.linear` (engine/bench/gemv.py), GB/s and share of the device's peak;
  4. bench     `edgegem bench --synthetic e2b|e4b --device cuda --gpu-memory-budget 8GiB`, KV bf16
               and int8_per_token_head (engine.bench.throughput.gpu_bench through the CLI).
`--quick` (what `make gpu-check` runs; a GPU machine may be lent for a quarter of an hour, install
included): the same parts with the GEMV table at E2B's shapes and one E2B bench (bf16 KV), inside
440 s. `--dry-run`: every step but the GPU ones, on any machine: the install (and, with `.whl/`,
a check that its wheels install on the GPU machine's Python), the CUDA tests collected but not
run, the GPU parts listed as skipped; tests/test_gpu_check.py runs it on the CPU.
The report is rewritten after every part, so a run cut short (the device's time limit) still leaves
the figures of the parts that finished. It goes to --out, else $OUT/gpu-check.md when $OUT is set,
else ./gpu-check.md; its path is printed last.

Installing without network. A GPU machine with no package index (the device machine of the
workplace this was written in has torch 2.11 + triton 3.6 but no gguf, textual or platformdirs)
installs the missing packages from wheels in `.whl/` at the repository root (git-ignored: name it in
the device run's `carry`), filled on a machine with pip's cache by `make wheels` (`python3
packaging/gpu_check.py wheels`): the pure-Python wheels of GPU_WHEELS at this machine's versions for
the GPU machine's Python (`--python-version`, 3.12 by default), downloaded with --no-deps (their
other dependencies, numpy, pyyaml, requests, rich, ..., are on that machine already), and
llama-cpp-python 0.3.36 as the wheel pip built here for `make test` (its library is loaded through
ctypes, so the wheel is py3-none-linux_x86_64 and serves any Python). About 26 MB in all.
When `.whl/` exists the install step runs `pip install --no-index --find-links .whl NAMES` (pip
takes what is already installed from the environment and the rest from the folder); otherwise a
plain `pip install NAMES`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO / ".whl"
BENCH_RUNS = [(variant, kv) for variant in ("e2b", "e4b") for kv in ("bf16", "int8_per_token_head")]
QUICK_BENCH_RUNS = [("e2b", "bf16")]
# Seconds per part (cut to what is left of --budget): the first bench of a process also JIT-compiles
# every kernel it launches (~1 s each), later ones reuse Triton's on-disk cache.
LIMITS = {"install": 120, "pytest": 180, "gemv": 120, "bench": 120}
# --quick: 440 s in all, so `make gpu-check` (python start, report) ends inside 8 minutes.
QUICK_LIMITS = {"install": 60, "pytest": 150, "gemv": 90, "bench": 140}
QUICK_BUDGET = 440.0
# What a GPU machine lacks (textual's markdown plugins with it) and `make wheels` carries in .whl/.
GPU_WHEELS = ("gguf", "textual", "platformdirs", "mdit-py-plugins", "linkify-it-py", "diskcache")
LLAMA = "llama-cpp-python==0.3.36"  # tests/test_cuda.py's quantizer; built once by `make test`


@dataclass
class Part:
    """One step of the check: its command, exit code (None: did not finish), time and output."""
    name: str
    cmd: list[str]
    rc: Optional[int] = None
    seconds: float = 0.0
    output: str = ""
    timed_out: bool = False
    skipped: Optional[str] = None
    data: dict = field(default_factory=dict)

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


def run_part(name: str, cmd: list[str], timeout: float, env: Optional[dict] = None) -> Part:
    """Run `cmd` in its own process group; past `timeout` seconds the group is killed."""
    part = Part(name, cmd)
    if timeout <= 0:
        part.skipped = "no time left in the budget"
        return part
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=env, start_new_session=True)
    try:
        part.output, _ = proc.communicate(timeout=timeout)
        part.rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        part.output, _ = proc.communicate()
        part.timed_out = True
    part.seconds = time.perf_counter() - t0
    return part


# ------------------------------------------------------------------------------------- install

def requirements() -> list[str]:
    """Distribution names the check needs: pyproject's dependencies, pytest and llama-cpp-python."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [re.match(r"[A-Za-z0-9_.\-]+", d).group(0) for d in deps] + ["pytest", "llama-cpp-python"]


def missing_distributions(names: list[str]) -> list[str]:
    out = []
    for name in names:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(name)
    return out


def install_command(missing: list[str], wheel_dir: Path = WHEEL_DIR) -> list[str]:
    """pip from the wheels in `wheel_dir` when it exists (no network), else from the index."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet"]
    if wheel_dir.is_dir():
        cmd += ["--no-index", "--find-links", str(wheel_dir)]
    return cmd + missing


def wheel_commands(wheel_dir: Path = WHEEL_DIR, python_version: str = "3.12") -> list[list[str]]:
    """What `make wheels` runs: pip download of GPU_WHEELS (this machine's versions, pure-Python
    wheels for `python_version`, from pip's cache where it has them) and pip wheel of LLAMA (the
    wheel pip's cache holds from building it for `make test`; built again, ~5 minutes, if not)."""
    pins = []
    for name in GPU_WHEELS:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    pip = [sys.executable, "-m", "pip"]
    return [pip + ["download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
                   "--implementation", "py", "--abi", "none", "--platform", "any", "-d", str(wheel_dir), *pins],
            pip + ["wheel", "--quiet", "--no-deps", "-w", str(wheel_dir), LLAMA]]


def wheels_main(wheel_dir: Path = WHEEL_DIR, python_version: str = "3.12") -> int:
    """`make wheels`: fill `wheel_dir` (created) for a GPU machine without a package index."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for cmd in wheel_commands(wheel_dir, python_version):
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd).returncode
        if rc:
            return rc
    wheels = sorted(wheel_dir.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels in {wheel_dir} ({total / 2**20:.1f} MiB): " + ", ".join(w.name for w in wheels))
    return 0


def wheel_check_command(wheel_dir: Path = WHEEL_DIR, python_version: str = "3.12") -> list[str]:
    """Dry run: pip resolves every GPU wheel (and llama-cpp-python) from `wheel_dir` alone for the
    GPU machine's Python, as the install step there would, installing nothing."""
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
            "--no-index", "--find-links", str(wheel_dir), "--only-binary=:all:", "--python-version", python_version,
            *GPU_WHEELS, LLAMA]


# ----------------------------------------------------------------------------------- the parts

def _env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def bench_cmd(variant: str, kv: str, quick: bool = False) -> list[str]:
    return [sys.executable, "-m", "app.cli", "bench", "--synthetic", variant, "--device", "cuda",
            "--gpu-memory-budget", "8GiB", "--kv-cache-dtype", kv, "--swa-kv-cache-dtype", kv,
            "--prompt-lengths", "512,2048", "--contexts", "0,4096" if quick else "0,4096,32768",
            "--decode-steps", "32", "--json"]


def _json_tail(text: str) -> dict:
    """The JSON object a command printed last (after any warnings), or {}."""
    start = text.find("\n{")
    start = 0 if text.startswith("{") else start + 1 if start >= 0 else -1
    try:
        return json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        return {}


def microbench_main(out_path: str, iters: int, variants: str = "e2b,e4b") -> int:
    """The gemv part, in its own process: the sweep as JSON to `out_path`."""
    import torch

    from engine.bench import gemv_sweep

    rows = gemv_sweep(variants.split(","), iters=iters)
    Path(out_path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


def run_all(args, report: Optional[Path] = None) -> list[Part]:
    """Every part in order; the report (when given) is rewritten after each one."""
    deadline = time.perf_counter() + args.budget
    limits = QUICK_LIMITS if args.quick else LIMITS
    left = lambda part: min(limits[part], deadline - time.perf_counter())  # noqa: E731
    env, parts = _env(), []

    def done(part: Part) -> None:
        parts.append(part)
        if report is not None:
            write_report(parts, report, quick=args.quick, dry_run=args.dry_run)

    missing = missing_distributions(requirements())
    if args.skip_install or not missing:
        install = Part("install", [], skipped="--skip-install" if args.skip_install else "nothing missing")
    else:
        install = run_part("install", install_command(missing), left("install"), env)
    install.data["missing"] = missing
    done(install)
    if args.dry_run and WHEEL_DIR.is_dir():
        done(run_part("wheels", wheel_check_command(), left("install"), env))

    pytest_cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rA", "-p", "no:cacheprovider",
                  "tests/test_cuda.py"]
    done(run_part("pytest", pytest_cmd + (["--collect-only"] if args.dry_run else []), left("pytest"), env))

    gemv_json = Path(args.work_dir) / "gemv.json"
    gemv_cmd = [sys.executable, str(Path(__file__).resolve()), "_microbench", str(gemv_json), str(args.iters),
                "e2b" if args.quick else "e2b,e4b"]
    runs = [(f"bench {variant} {kv}", bench_cmd(variant, kv, args.quick))
            for variant, kv in (QUICK_BENCH_RUNS if args.quick else BENCH_RUNS)]
    if args.dry_run:  # the GPU parts: listed with their commands, not run
        for name, cmd in [("gemv", gemv_cmd)] + runs:
            done(Part(name, cmd, skipped="dry run: needs a GPU"))
        return parts
    gemv = run_part("gemv", gemv_cmd, left("gemv"), env)
    if gemv_json.exists():
        gemv.data = json.loads(gemv_json.read_text())
    done(gemv)
    for name, cmd in runs:
        p = run_part(name, cmd, left("bench"), env)
        p.data = _json_tail(p.output) if p.rc == 0 else {}
        done(p)
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
    rows = ["| run | prefill tok/s (prompt) | decode tok/s (context) | GB/s | of peak |",
            "| --- | --- | --- | --- | --- |"]
    for p in parts:
        if not p.name.startswith("bench") or not p.data:
            continue
        d = p.data
        pre = ", ".join(f"{r['tok_s']:.0f} ({r['prompt_tokens']})" for r in d.get("prefill", []) if "tok_s" in r)
        dec = [r for r in d.get("decode", []) if "tok_s" in r]
        rows.append(f"| {p.name[6:]} | {pre} | " + ", ".join(f"{r['tok_s']:.1f} ({r['context']})" for r in dec)
                    + " | " + ", ".join(f"{r['achieved_gbps']:.0f}" for r in dec) + " | "
                    + ", ".join(f"{100 * r['bandwidth_share']:.1f}%" if r.get("bandwidth_share") is not None
                                else "n/a" for r in dec) + " |")
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
             "## Parts", "| part | status | seconds |", "| --- | --- | ---: |"]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.1f} |" for p in parts]
    for p in parts:
        lines += ["", f"## {p.name}", ""]
        if p.cmd:
            lines += [f"`{' '.join(p.cmd)}`", ""]
        if p.name == "install" and p.data.get("missing") is not None:
            lines += [f"missing before: {', '.join(p.data['missing']) or 'nothing'}", ""]
        if p.name == "gemv" and p.data.get("rows"):
            lines += [f"device: {p.data.get('device', '?')}", "", sweep_table(p.data["rows"]), ""]
        if p.name.startswith("bench") and p.data.get("table"):
            lines += ["```", p.data["table"], "```"]
            continue
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
                   help=f"the CUDA tests, the E2B GEMV table and one E2B bench, inside {QUICK_BUDGET:.0f} s")
    p.add_argument("--dry-run", action="store_true", help="every step but the GPU ones (runs on any machine)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all parts together (default 540, {QUICK_BUDGET:.0f} with --quick)")
    p.add_argument("--iters", type=int, default=100, help="timed calls per GEMV measurement")
    p.add_argument("--skip-install", action="store_true")
    p.add_argument("--work-dir", default=None, help="scratch folder (default: next to the report)")
    a = p.parse_args(argv)
    a.budget = a.budget if a.budget is not None else QUICK_BUDGET if a.quick else 540.0
    a.out = a.out or default_out()
    a.work_dir = a.work_dir or str(Path(a.out).resolve().parent)
    return a


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_microbench"]:
        return microbench_main(argv[1], int(argv[2]), *argv[3:4])
    if argv[:1] == ["wheels"]:
        w = argparse.ArgumentParser(prog="gpu_check.py wheels", description="fill .whl/ for a GPU machine")
        w.add_argument("--wheel-dir", type=Path, default=WHEEL_DIR)
        w.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
        wa = w.parse_args(argv[1:])
        return wheels_main(wa.wheel_dir, wa.python_version)
    args = parse_args(argv)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    path = Path(args.out)
    parts = run_all(args, path)
    write_report(parts, path, quick=args.quick, dry_run=args.dry_run)
    for p in parts:
        print(f"{p.name:28s} {p.status}")
    print(f"report: {path.resolve()}")
    return 0 if all(p.ok or p.skipped for p in parts) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
