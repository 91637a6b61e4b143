"""What the GPU parts of `make gpu-check` import, and how a GPU machine without a package index gets
the part of it that it lacks (packaging/gpu_check.py runs the install; `make wheels` fills `.whl/`).

The GPU parts import, at run time: torch, numpy, triton, gguf, tokenizers and jinja2 (the bench goes
through `python -m app.cli bench`, whose subcommand modules import their packages inside the
commands, so textual, fastapi, platformdirs, llguidance and soundfile are never loaded on its way),
pytest for tests/engine/test_cuda.py and, for that file's tiny-model quantizer, llama-cpp-python, which
imports diskcache when it is imported. GPU_IMPORTS maps each distribution to the module imported.

A GPU machine such as the workplace's H200 (python 3.12 with torch 2.11 + triton 3.6, numpy, jinja2,
tokenizers, pytest, pyyaml, tqdm, requests and typing-extensions among many others; no network)
lacks gguf, llama-cpp-python and diskcache: CARRIED, the wheels `make wheels` puts in `.whl/` at the
repository root (git-ignored: name it in the device run's `carry`). gguf and diskcache are
pure-Python wheels downloaded at this machine's versions for the GPU machine's Python
(`--python-version`, 3.12 by default); llama-cpp-python 0.3.36 is the wheel pip built here for `make
test` (its library is loaded through ctypes, so the wheel is py3-none-linux_x86_64 and serves any
Python). About 25 MB in all.

The install: the GPU_IMPORTS modules that no folder of the path has, each of them CARRIED, with
`pip install --no-deps --target SITE`, from `.whl/` alone when it exists, else from the index.
--no-deps: pip resolves every requirement before it installs anything, and these wheels' own
requirements (numpy, pyyaml, tqdm, requests, typing-extensions, jinja2) are on the machine already.
--target: a folder of our own (`.site/`, git-ignored), first on the parts' PYTHONPATH; the machine's
Python is never written to, and a second run finds the wheels there.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
from importlib import metadata
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO / ".whl"
SITE_DIR = REPO / ".site"
# distribution -> the module the GPU parts import from it
GPU_IMPORTS = {"torch": "torch", "numpy": "numpy", "triton": "triton", "gguf": "gguf", "tokenizers": "tokenizers",
               "jinja2": "jinja2", "pytest": "pytest", "llama-cpp-python": "llama_cpp", "diskcache": "diskcache"}
PURE_WHEELS = ("gguf", "diskcache")  # pip download: pure-Python wheels for the GPU machine's Python
LLAMA = "llama-cpp-python==0.3.36"  # pip wheel: tests/engine/test_cuda.py's quantizer, built once by `make test`
CARRIED = PURE_WHEELS + ("llama-cpp-python",)


def missing(site: Path = SITE_DIR, path: Optional[list[str]] = None) -> list[str]:
    """The GPU_IMPORTS distributions whose module no folder of `path` (default sys.path) nor `site` holds."""
    folders = list(sys.path if path is None else path) + [str(site)]
    importlib.invalidate_caches()  # a folder looked at before it existed is cached as holding nothing
    return [dist for dist, module in GPU_IMPORTS.items() if PathFinder.find_spec(module, folders) is None]


def wheel_name(dist: str) -> str:
    """How a wheel file's name starts for `dist` (PEP 427: runs of -_. become _)."""
    return dist.replace("-", "_").replace(".", "_")


def install_command(names: list[str], site: Path = SITE_DIR, wheel_dir: Path = WHEEL_DIR) -> list[str]:
    """pip installing `names` (CARRIED ones) into `site` without their dependencies: from the wheels
    in `wheel_dir` alone when that folder exists (no network), else from the index."""
    assert names and set(names) <= set(CARRIED), f"only the carried wheels are installed, not {names}"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--upgrade", "--target", str(site)]
    if wheel_dir.is_dir():
        cmd += ["--no-index", "--find-links", str(wheel_dir)]
    return cmd + names


def wheel_commands(wheel_dir: Path = WHEEL_DIR, python_version: str = "3.12") -> list[list[str]]:
    """What `make wheels` runs: pip download of PURE_WHEELS (this machine's versions, pure-Python
    wheels for `python_version`, from pip's cache where it has them) and pip wheel of LLAMA (the
    wheel pip's cache holds from building it for `make test`; built again, ~5 minutes, if not)."""
    pins = []
    for name in PURE_WHEELS:
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
    lacking = [d for d in CARRIED if not any(w.name.startswith(wheel_name(d) + "-") for w in wheels)]
    if lacking:
        print(f"missing from {wheel_dir}: {', '.join(lacking)}")
    return 1 if lacking else 0


def wheel_check_command(wheel_dir: Path = WHEEL_DIR, python_version: str = "3.12") -> list[str]:
    """Dry run: pip resolves every CARRIED wheel from `wheel_dir` alone for the GPU machine's
    Python, as the install step there would, installing nothing (pip before 24 takes
    --python-version only with a --target, which --dry-run never writes to)."""
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
            "--target", str(wheel_dir / "dry-run-target"), "--no-index", "--find-links", str(wheel_dir),
            "--only-binary=:all:", "--python-version", python_version, *PURE_WHEELS, LLAMA]
