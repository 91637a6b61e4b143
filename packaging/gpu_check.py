"""`make gpu-check`: the one command to run on a machine with an NVIDIA GPU. Writes one Markdown report.

Parts, each in its own process with its own time limit (one failing or running over does not stop
the others; the whole run stays inside --budget seconds, 540 by default):
  1. install   what the project needs and this Python lacks (pyproject dependencies + pytest);
  2. pytest    `pytest -m cuda tests/test_cuda.py` with TRITON_INTERPRET=0;
  3. gemv      per-kernel bandwidth: each decode GEMV format at E2B and E4B shapes through
               `QuantWeight.linear` (engine/kernel_bench.py), GB/s and share of the device's peak;
  4. bench     `edgegem bench --synthetic e2b|e4b --device cuda --gpu-memory-budget 8GiB`, KV bf16
               and int8_per_token_head (engine.bench.gpu_bench through the CLI).
The report goes to --out, else $OUT/gpu-check.md when $OUT is set, else ./gpu-check.md; its path
is printed last.

Installing without network. A GPU machine with no package index (the device machine of the
workplace this was written in has torch 2.11 + triton 3.6 but no gguf, textual or platformdirs)
gets the missing packages as wheels in `.whl/` at the repository root, downloaded beforehand on a
machine with network, for the GPU machine's Python (3.12 there), e.g.:
    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl gguf==0.19.0 textual==8.2.8 platformdirs==4.14.9 mdit-py-plugins==0.7.0 linkify-it-py==2.2.0
(pure-Python wheels, 1.1 MB together; gguf's numpy/pyyaml/requests/tqdm and textual's rich, pygments,
markdown-it-py and typing-extensions were on that machine already; `unzip -p .whl/NAME-*.whl
'*/METADATA' | grep ^Requires-Dist` lists what each needs, to add any another machine lacks). When `.whl/` exists the install step runs
`pip install --no-index --find-links .whl NAMES` (pip takes what is already installed from the
environment and the rest from the folder); otherwise a plain `pip install NAMES`.
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
BENCH_RUNS = [(variant, kv) for variant in ("e2b", "e4b") for kv in ("bf16", "int8_per_token_head")]
# Seconds per part (cut to what is left of --budget): the first bench of a process also JIT-compiles
# every kernel it launches (~1 s each), later ones reuse Triton's on-disk cache.
LIMITS = {"install": 120, "pytest": 180, "gemv": 120, "bench": 120}


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
    """Distribution names the check needs: pyproject's dependencies, plus pytest."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [re.match(r"[A-Za-z0-9_.\-]+", d).group(0) for d in deps] + ["pytest"]


def missing_distributions(names: list[str]) -> list[str]:
    out = []
    for name in names:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(name)
    return out


def install_command(missing: list[str], wheel_dir: Path = REPO / ".whl") -> list[str]:
    """pip from the wheels in `wheel_dir` when it exists (no network), else from the index."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet"]
    if wheel_dir.is_dir():
        cmd += ["--no-index", "--find-links", str(wheel_dir)]
    return cmd + missing


# ----------------------------------------------------------------------------------- the parts

def _env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def bench_cmd(variant: str, kv: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "bench", "--synthetic", variant, "--device", "cuda",
            "--gpu-memory-budget", "8GiB", "--kv-cache-dtype", kv, "--swa-kv-cache-dtype", kv,
            "--prompt-lengths", "512,2048", "--contexts", "0,4096", "--decode-steps", "32", "--json"]


def _json_tail(text: str) -> dict:
    """The JSON object a command printed last (after any warnings), or {}."""
    start = text.find("\n{")
    start = 0 if text.startswith("{") else start + 1 if start >= 0 else -1
    try:
        return json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        return {}


def microbench_main(out_path: str, iters: int) -> int:
    """The gemv part, in its own process: the sweep as JSON to `out_path`."""
    import torch

    from engine.kernel_bench import gemv_sweep

    rows = gemv_sweep(iters=iters)
    Path(out_path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


def run_all(args) -> list[Part]:
    deadline = time.perf_counter() + args.budget
    left = lambda part: min(LIMITS[part], deadline - time.perf_counter())  # noqa: E731
    env, parts = _env(), []

    missing = missing_distributions(requirements())
    if args.skip_install or not missing:
        parts.append(Part("install", [], skipped="--skip-install" if args.skip_install else "nothing missing"))
    else:
        parts.append(run_part("install", install_command(missing), left("install"), env))
    parts[-1].data["missing"] = missing

    parts.append(run_part("pytest", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rA", "-p",
                                     "no:cacheprovider", "tests/test_cuda.py"], left("pytest"), env))

    gemv_json = Path(args.work_dir) / "gemv.json"
    gemv = run_part("gemv", [sys.executable, str(Path(__file__).resolve()), "_microbench", str(gemv_json),
                             str(args.iters)], left("gemv"), env)
    if gemv_json.exists():
        gemv.data = json.loads(gemv_json.read_text())
    parts.append(gemv)

    for variant, kv in BENCH_RUNS:
        p = run_part(f"bench {variant} {kv}", bench_cmd(variant, kv), left("bench"), env)
        p.data = _json_tail(p.output) if p.rc == 0 else {}
        parts.append(p)
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


def write_report(parts: list[Part], path: Path, machine: Optional[list[str]] = None) -> Path:
    """One Markdown file: machine, a status line per part, then each part's figures and output."""
    from engine.kernel_bench import sweep_table

    lines = ["# edgegem gpu-check", "", f"{time.strftime('%Y-%m-%d %H:%M:%S')}, from `make gpu-check` "
             "(packaging/gpu_check.py)", "", "## Machine", *(machine if machine is not None else _machine()), "",
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
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all parts together")
    p.add_argument("--iters", type=int, default=100, help="timed calls per GEMV measurement")
    p.add_argument("--skip-install", action="store_true")
    p.add_argument("--work-dir", default=None, help="scratch folder (default: next to the report)")
    a = p.parse_args(argv)
    a.out = a.out or default_out()
    a.work_dir = a.work_dir or str(Path(a.out).resolve().parent)
    return a


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_microbench"]:
        return microbench_main(argv[1], int(argv[2]))
    args = parse_args(argv)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    parts = run_all(args)
    path = write_report(parts, Path(args.out))
    for p in parts:
        print(f"{p.name:28s} {p.status}")
    print(f"report: {path.resolve()}")
    return 0 if all(p.ok or p.skipped for p in parts) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
