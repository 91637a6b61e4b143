"""What `edgegem doctor` looks at: `gather()` probes the machine (torch and CUDA, nvidia-smi, Triton,
the CPU kernels, memory, the data and models folders) into a `Facts` record, which app/doctor.py
judges. Each probe records what it found or the first line of its error, and never raises: a broken
install must still get a report.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

TRITON_PROBE_TIMEOUT_S = 300  # a first Triton compile runs ptxas: seconds, minutes on a slow disk

# Compiled and run in a child process so a crashing driver or compiler cannot take doctor down.
TRITON_PROBE = '''
import sys
import torch
import triton
import triton.language as tl


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
x = torch.arange(1000, dtype=torch.float32, device=device)
_add_one_kernel[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
if device == "cuda":
    torch.cuda.synchronize()
assert torch.equal(x.cpu(), torch.arange(1000, dtype=torch.float32) + 1), "wrong result"
print("ok")
'''



@dataclass
class Gpu:
    name: str
    capability: tuple[int, int]
    free: int
    total: int


@dataclass
class Facts:
    python: tuple[int, int, int]
    executable: str
    torch_version: Optional[str] = None
    torch_error: Optional[str] = None
    torch_cuda: Optional[str] = None  # torch.version.cuda; None for a CPU-only build
    torch_arch_list: list[str] = field(default_factory=list)
    cuda_available: bool = False
    cuda_error: Optional[str] = None
    cuda_visible_devices: Optional[str] = None
    gpus: list[Gpu] = field(default_factory=list)
    driver_version: Optional[str] = None
    driver_cuda: Optional[str] = None  # newest CUDA the driver supports, e.g. "12.8"
    smi_gpus: list[str] = field(default_factory=list)  # names nvidia-smi lists
    triton_version: Optional[str] = None
    triton_error: Optional[str] = None
    triton_run: Optional[str] = None  # "ok", an error line, or None when not run
    mem_total: Optional[int] = None
    mem_available: Optional[int] = None
    data_dir: str = ""
    data_dir_error: Optional[str] = None
    data_dir_missing: bool = False  # created on first use
    models_dir: str = ""
    models: list[str] = field(default_factory=list)
    disk_free: Optional[int] = None
    cpu_kernels: Optional[dict] = None  # engine.cpu_runtime.kernels(): ggml or the torch formats, and why
    cpu_threads: int = 0
    # device -> engine.api.runtime_info(device): the runtime `edgegem run` loads with there (cpu; cuda with a GPU)
    runtimes: dict = field(default_factory=dict)



def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return f"{type(e).__name__}: {s.splitlines()[0]}" if s else type(e).__name__


def probe_torch(f: Facts) -> None:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken install raises anything from OSError (libcudart) to ImportError
        f.torch_error = _first_line(e)
        return
    f.torch_version = torch.__version__
    f.torch_cuda = torch.version.cuda
    f.cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        f.cuda_available = torch.cuda.is_available()
        if not f.cuda_available:
            return
        f.torch_arch_list = list(torch.cuda.get_arch_list())
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            f.gpus.append(Gpu(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)), free, total))
    except Exception as e:  # noqa: BLE001 - RuntimeError (driver), AssertionError (no CUDA build)...: reported
        f.cuda_error = _first_line(e)
        return
    if f.driver_cuda is None:  # no nvidia-smi: the driver's CUDA version through torch (private API)
        try:
            v = torch._C._cuda_getDriverVersion()  # e.g. 12080
            f.driver_cuda = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:  # noqa: BLE001 - a private API: missing or failing, the version stays unknown
            pass


def probe_nvidia_smi(f: Facts) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return
    try:
        head = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
        rows = subprocess.run([smi, "--query-gpu=driver_version,name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    m = re.search(r"CUDA Version:\s*([0-9.]+)", head)
    f.driver_cuda = m.group(1) if m else None
    for row in rows.strip().splitlines():
        version, _, name = row.partition(",")
        f.driver_version = f.driver_version or version.strip()
        f.smi_gpus.append(name.strip())


def probe_triton(f: Facts) -> None:
    try:
        import triton
        f.triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001 - as torch's import: a broken install raises anything
        f.triton_error = _first_line(e)
        return
    if f.cuda_available:
        f.triton_run = run_triton_probe("cuda")


def run_triton_probe(device: str, env: Optional[dict] = None) -> str:
    """'ok' when a trivial kernel compiles and adds 1 correctly on `device`, else the error line."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "edgegem_triton_probe.py"
        script.write_text(TRITON_PROBE)
        try:
            r = subprocess.run([sys.executable, str(script), device], capture_output=True, text=True,
                               timeout=TRITON_PROBE_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            return f"no result after {TRITON_PROBE_TIMEOUT_S} s"
    if r.returncode == 0 and r.stdout.strip().endswith("ok"):
        return "ok"
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else f"exit code {r.returncode}"


def probe_memory(f: Facts) -> None:
    try:
        with open("/proc/meminfo") as fh:
            info = {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in fh) if v.strip()}
    except OSError:
        return
    f.mem_total, f.mem_available = info.get("MemTotal"), info.get("MemAvailable")


def probe_dirs(f: Facts, data: Optional[str], models: Optional[str]) -> None:
    from engine.models_dir import data_dir, local_models, models_dir
    d = data_dir(data)
    f.data_dir = str(d)
    if d.is_dir():
        try:
            with tempfile.NamedTemporaryFile(dir=d, prefix=".doctor-"):
                pass
        except OSError as e:
            f.data_dir_error = e.strerror or str(e)
    else:  # not created yet: doctor changes nothing, so judge the folder it would be created in
        parent = next((p for p in d.parents if p.exists()), None)
        f.data_dir_missing = True
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            f.data_dir_error = f"cannot create it in {parent}"
    m = models_dir(models, data)
    f.models_dir = str(m)
    f.models = [x.rel for x in local_models(m)]
    existing = next((p for p in (m, *m.parents) if p.exists()), None)
    if existing is not None:
        f.disk_free = shutil.disk_usage(existing).free


def probe_cpu_kernels(f: Facts) -> None:
    """Which kernels the CPU runtime multiplies with (llama.cpp's ggml, smoke-tested, or the torch
    formats) and its default thread count."""
    if f.torch_version is None:
        return
    try:
        from engine.cpu_runtime import default_threads, kernels
        f.cpu_kernels, f.cpu_threads = kernels(), default_threads()
    except Exception as e:  # noqa: BLE001 - a broken install must still give a report
        f.cpu_kernels = {"name": "torch", "reason": str(e).splitlines()[0] if str(e) else type(e).__name__,
                         "detail": "torch formats"}


def probe_runtimes(f: Facts) -> None:
    """The runtime a model loads with on the CPU and, with a GPU, on CUDA (models/runtime.py's
    rules, through engine.api.runtime_info)."""
    if f.torch_version is None:
        return
    try:
        from engine.api import runtime_info
        for device in ("cpu", "cuda") if f.cuda_available else ("cpu",):
            f.runtimes[device] = runtime_info(device)
    except Exception as e:  # noqa: BLE001 - a broken install must still give a report
        f.runtimes = {"error": {"name": "unknown", "detail": _first_line(e)}}


def gather(data_dir: Optional[str] = None, models_dir: Optional[str] = None) -> Facts:
    f = Facts(python=tuple(sys.version_info[:3]), executable=sys.executable)
    probe_nvidia_smi(f)
    probe_torch(f)
    probe_triton(f)
    probe_cpu_kernels(f)
    probe_runtimes(f)
    probe_memory(f)
    probe_dirs(f, data_dir, models_dir)
    return f
