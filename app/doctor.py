"""`edgegem doctor`: why the GPU is (not) used and what runs on it, in one screen.

`gather()` (app/doctor_probes.py) probes the machine into a `Facts` record; `evaluate(facts)` here
turns it into checks, each `OK|WARN|FAIL  <check>: <finding>` with a fix hint under WARN/FAIL, and
`report` prints them. Tests build `Facts` by hand for machines they do not have (a CPU-only torch
beside an NVIDIA driver, a driver older than the torch build, a GPU the wheel has no kernels for).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Optional

from .doctor_probes import Facts

GiB = 2 ** 30
OK, WARN, FAIL = "OK", "WARN", "FAIL"
# PyTorch's CUDA wheel indexes, newest first: (lowest driver CUDA version that runs it, index tag).
# A driver reports the newest CUDA it supports (nvidia-smi "CUDA Version"); any index at or below
# that works. CUDA 13 dropped Maxwell, Pascal and Volta (compute capability < 7.5).
TORCH_INDEXES = (((13, 0), "cu130"), ((12, 8), "cu128"), ((12, 6), "cu126"))
MIN_DRIVER_CUDA = (12, 6)
LOW_VRAM = 4 * GiB  # E2B Q4_K_M weights alone take about 3 GiB
LOW_HOST_RAM = 2 * GiB
LOW_DISK = 4 * GiB  # one E2B Q4_K_M download


@dataclass
class Check:
    status: str
    check: str
    finding: str
    hint: Optional[str] = None

    def line(self) -> str:
        return f"{self.status:4s}  {self.check}: {self.finding}"


def _version_tuple(v: Optional[str]) -> Optional[tuple[int, int]]:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def torch_index(driver_cuda: Optional[str], capability: Optional[tuple[int, int]] = None) -> Optional[str]:
    """The newest PyTorch CUDA index the driver runs (None: the driver is too old for any)."""
    have = _version_tuple(driver_cuda)
    if have is None:
        return None
    for need, tag in TORCH_INDEXES:
        if have >= need and not (tag == "cu130" and capability is not None and capability < (7, 5)):
            return tag
    return None


def pip_torch(executable: str, index: str) -> str:
    return f"{executable} -m pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/{index}"


# -- judgment ----------------------------------------------------------------------------------

def _torch_fix(f: Facts) -> str:
    """The pip command for the torch build this driver and GPU run, or the driver update it needs."""
    index = torch_index(f.driver_cuda, f.gpus[0].capability if f.gpus else None)
    if index is None:
        return (f"update the NVIDIA driver (CUDA {MIN_DRIVER_CUDA[0]}.{MIN_DRIVER_CUDA[1]} or newer, driver 560+), "
                "then see packaging/README.md for the torch index")
    return pip_torch(f.executable, index)


def _index_hint(f: Facts, why: str) -> str:
    return f"{why}: {_torch_fix(f)}"


def check_python(f: Facts) -> Check:
    v = ".".join(map(str, f.python))
    if f.python < (3, 10):
        return Check(FAIL, "python", f"{v} ({f.executable})", "edgegem needs Python 3.10 or newer")
    return Check(OK, "python", f"{v} ({f.executable})")


def check_torch(f: Facts) -> Check:
    if f.torch_version is None:
        hint = _index_hint(f, "install torch") if f.smi_gpus else f"{f.executable} -m pip install torch"
        return Check(FAIL, "torch", f"cannot import torch ({f.torch_error})", hint)
    if f.torch_cuda is None:
        if f.smi_gpus:
            return Check(FAIL, "torch", f"{f.torch_version} is a CPU-only build, but nvidia-smi sees {f.smi_gpus[0]}",
                         _index_hint(f, "install the CUDA build"))
        return Check(OK, "torch", f"{f.torch_version} (CPU-only build)")
    return Check(OK, "torch", f"{f.torch_version} (CUDA {f.torch_cuda} build)")


def check_cuda(f: Facts) -> Check:
    if f.cuda_available and not f.cuda_error:
        return Check(OK, "cuda", f"available, {len(f.gpus)} device(s)")
    if f.cuda_error:
        return Check(FAIL, "cuda", f"torch sees a GPU but cannot use it ({f.cuda_error})",
                     "reboot after a driver update, or check `nvidia-smi`; see packaging/README.md")
    if f.torch_version is None:
        return Check(FAIL, "cuda", "unknown: torch does not import", "fix the torch line first")
    if f.cuda_visible_devices is not None and f.cuda_visible_devices.strip() in ("", "-1") and f.smi_gpus:
        return Check(FAIL, "cuda", f"CUDA_VISIBLE_DEVICES={f.cuda_visible_devices!r} hides {f.smi_gpus[0]}",
                     "unset CUDA_VISIBLE_DEVICES (or set it to 0)")
    if not f.smi_gpus:
        return Check(WARN, "cuda", "no GPU: the CPU path will be used",
                     "with an NVIDIA GPU: install its driver (`nvidia-smi` must list it), then a CUDA torch "
                     "(packaging/README.md)")
    if f.torch_cuda is None:
        return Check(FAIL, "cuda", "not available: torch is a CPU-only build", "see the torch line")
    need, have = _version_tuple(f.torch_cuda), _version_tuple(f.driver_cuda)
    if need and have and have < need:
        return Check(FAIL, "cuda", f"not available: torch needs CUDA {f.torch_cuda}, the driver supports up to "
                     f"{f.driver_cuda}", _index_hint(f, "install a torch the driver runs (or update the driver)"))
    return Check(FAIL, "cuda", f"not available although nvidia-smi sees {f.smi_gpus[0]}",
                 "check `nvidia-smi` and dmesg for driver errors; reboot after a driver update")


def check_gpu(f: Facts) -> list[Check]:
    if not f.gpus:
        return []
    out = []
    for i, g in enumerate(f.gpus):
        sm = f"sm_{g.capability[0]}{g.capability[1]}"
        name = "gpu" if len(f.gpus) == 1 else f"gpu {i}"
        finding = f"{g.name}, compute capability {g.capability[0]}.{g.capability[1]}"
        ptx = [a for a in f.torch_arch_list if a.startswith("compute_") and _arch(a) <= g.capability]
        if f.torch_arch_list and sm not in f.torch_arch_list and not ptx:
            out.append(Check(FAIL, name, f"{finding}: this torch build has no kernels for {sm} "
                             f"(it has {', '.join(f.torch_arch_list)})",
                             _index_hint(f, "install a build that covers it") if g.capability >= (7, 5) else
                             f"older GPUs: {pip_torch(f.executable, 'cu126')}"))
        else:
            out.append(Check(OK, name, finding))
        vram = f"{g.free / GiB:.1f} GiB free of {g.total / GiB:.1f} GiB"
        vname = "vram" if len(f.gpus) == 1 else f"vram {i}"
        if g.total < LOW_VRAM:
            out.append(Check(WARN, vname, f"{vram}: small for Gemma-4 E2B (about 3 GiB of Q4_K_M weights)",
                             "try a smaller quant or --embed-weights host (the default); `edgegem models` "
                             "shows what fits"))
        elif g.free < 0.5 * g.total:
            out.append(Check(WARN, vname, f"{vram}: other processes hold {(g.total - g.free) / GiB:.1f} GiB",
                             "close them (`nvidia-smi` lists them) or the plan gets a smaller budget"))
        else:
            out.append(Check(OK, vname, vram))
    return out


def _arch(tag: str) -> tuple[int, int]:
    digits = re.sub(r"\D", "", tag)
    return (int(digits[:-1]), int(digits[-1])) if len(digits) >= 2 else (0, 0)


def check_driver(f: Facts) -> Check:
    if f.driver_version is None and f.driver_cuda is None:
        if f.smi_gpus or f.cuda_available:
            return Check(WARN, "driver", "version unknown", "install nvidia-smi (comes with the NVIDIA driver)")
        return Check(WARN, "driver", "no NVIDIA driver (nvidia-smi not found)",
                     "only needed with an NVIDIA GPU: install the distribution's NVIDIA driver package")
    finding = f"{f.driver_version or 'version unknown'}, supports CUDA up to {f.driver_cuda or '?'}"
    have = _version_tuple(f.driver_cuda)
    if have is not None and have < MIN_DRIVER_CUDA:
        return Check(WARN, "driver", f"{finding}: older than the CUDA {MIN_DRIVER_CUDA[0]}.{MIN_DRIVER_CUDA[1]} "
                     "the current torch wheels need", "update the NVIDIA driver (560 or newer)")
    return Check(OK, "driver", finding)


def check_triton(f: Facts) -> Check:
    if f.gpus:
        from engine.api import gpu_support  # torch imports: f.gpus came from it

        if not any(gpu_support(g.capability).triton for g in f.gpus):  # older than sm_75: never used
            archs = ", ".join(sorted({gpu_support(g.capability).name for g in f.gpus}))
            return Check(OK, "triton", f"{f.triton_version or 'not installed'}: not used on {archs} "
                         "(the torch path runs, see the kernels line)")
    if f.triton_version is None:
        if f.cuda_available:
            return Check(FAIL, "triton", f"cannot import triton ({f.triton_error})",
                         f"{f.executable} -m pip install triton (or --attention-backend torch, slower)")
        return Check(WARN, "triton", "not installed; no GPU: the CPU path will be used", None)
    if not f.cuda_available:
        return Check(WARN, "triton", f"{f.triton_version} imports; no GPU: the CPU path will be used",
                     "kernels compile only on a CUDA GPU")
    if f.triton_run != "ok":
        return Check(FAIL, "triton", f"{f.triton_version} cannot compile and run a kernel: {f.triton_run}",
                     "reinstall torch from its CUDA index so the matching triton comes with it: "
                     f"{_torch_fix(f)}; meanwhile --attention-backend torch avoids Triton attention")
    return Check(OK, "triton", f"{f.triton_version}: a test kernel compiled and ran on the GPU")


def check_kernels(f: Facts) -> list[Check]:
    """Per GPU: its arch and what the engine runs on it (engine.api.gpu_support): the Triton
    kernels (sm_75+) or the torch path and why, the attention dots' operand type, fp8 KV."""
    if not f.gpus:
        return []
    from engine.api import gpu_support  # torch imports: f.gpus came from it

    out = []
    for i, g in enumerate(f.gpus):
        s = gpu_support(g.capability, f.triton_version is not None)
        name = "kernels" if len(f.gpus) == 1 else f"kernels {i}"
        fp8 = "fp8 KV cache" if s.fp8_kv else "no fp8 KV cache (int8_per_token_head is the same size)"
        if s.triton:
            out.append(Check(OK, name, f"{s.name}: Triton kernels, {s.attention_dots} attention dots, {fp8}"))
        elif f.triton_version is None:
            out.append(Check(WARN, name, f"{s.name}: the torch path runs ({s.reason}); {fp8}", "see the triton line"))
        else:
            out.append(Check(WARN, name, f"{s.name}: the torch path runs ({s.reason}); {fp8}",
                             "nothing to fix: edgegem runs here on the torch path, slower; the Triton kernels need "
                             "a Turing (GTX 16xx, RTX 20xx) or newer GPU"))
    return out


def check_cpu_kernels(f: Facts) -> Check:
    """The CPU path's matrix products: llama.cpp's own kernels (the `cpu` extra) or the torch
    formats, with the reason in one line when ggml does not run."""
    k = f.cpu_kernels
    if k is None:
        if f.torch_version is None:
            return Check(FAIL, "cpu kernels", "unknown: torch does not import", "fix the torch line first")
        return Check(WARN, "cpu kernels", "not probed")
    threads = f", {f.cpu_threads} threads (--threads N)" if f.cpu_threads else ""
    if k["name"] == "ggml":
        return Check(OK, "cpu kernels", f"{k['detail']}{threads}")
    hint = "unset EDGEGEM_CPU_KERNELS" if k["reason"].startswith("EDGEGEM_CPU_KERNELS") else (
        f"{f.executable} -m pip install 'edgegem[cpu]': llama.cpp's kernels, the CPU fast path (builds "
        "llama-cpp-python once, 5-15 min; the 26B-A4B and 31B load without it but run many times slower; "
        "docs/benchmarks.md, \"CPU: edgegem beside llama.cpp\", has what it gains)")
    return Check(WARN, "cpu kernels", f"{k['detail']}{threads}: llama.cpp's kernels not used ({k['reason']})", hint)


def check_runtime(f: Facts) -> Check:
    """The runtime a model loads with here, per device (models/runtime.py names five): the line a
    bug report needs first."""
    if not f.runtimes:
        return Check(WARN, "runtime", "not probed" if f.torch_version is not None else "unknown: torch does not import")
    if "error" in f.runtimes:
        return Check(WARN, "runtime", f"unknown: {f.runtimes['error']['detail']}")
    return Check(OK, "runtime", "; ".join(f"{dev}: {r['name']} ({r['detail']})" for dev, r in f.runtimes.items()))


def check_memory(f: Facts) -> Check:
    if f.mem_total is None:
        return Check(WARN, "host ram", "unknown (no /proc/meminfo)")
    finding = f"{(f.mem_available or 0) / GiB:.1f} GiB available of {f.mem_total / GiB:.1f} GiB"
    if f.mem_available is not None and f.mem_available < LOW_HOST_RAM:
        return Check(WARN, "host ram", f"{finding}: embedding tables stay in host memory by default",
                     "close other programs, or --embed-weights device when VRAM allows")
    return Check(OK, "host ram", finding)


def check_data_dir(f: Facts) -> Check:
    if f.data_dir_error:
        return Check(FAIL, "data dir", f"{f.data_dir} is not writable ({f.data_dir_error})",
                     "pass --data-dir DIR or set EDGEGEM_DATA_DIR to a writable folder")
    return Check(OK, "data dir", f"{f.data_dir} ({'created on first use' if f.data_dir_missing else 'writable'})")


def check_models_dir(f: Facts) -> Check:
    free = f" ({f.disk_free / GiB:.1f} GiB free)" if f.disk_free is not None else ""
    if not f.models:
        return Check(WARN, "models", f"no GGUF in {f.models_dir}{free}",
                     "edgegem pull unsloth/gemma-4-E2B-it-GGUF:Q4_K_M (or --model PATH)")
    finding = f"{len(f.models)} GGUF in {f.models_dir}{free}"
    if f.disk_free is not None and f.disk_free < LOW_DISK:
        return Check(WARN, "models", f"{finding}: little room for another model",
                     "free disk space or --models-dir / EDGEGEM_MODELS_DIR on a larger disk")
    return Check(OK, "models", finding)


def evaluate(f: Facts) -> list[Check]:
    return [check_python(f), check_torch(f), check_cuda(f), *check_gpu(f), check_driver(f), check_triton(f),
            *check_kernels(f), check_cpu_kernels(f), check_runtime(f), check_memory(f), check_data_dir(f),
            check_models_dir(f)]


def report(checks: list[Check], as_json: bool = False) -> str:
    if as_json:
        return json.dumps({"ok": all(c.status != FAIL for c in checks), "checks": [asdict(c) for c in checks]},
                          indent=1)
    lines = []
    for c in checks:
        lines.append(c.line())
        if c.hint and c.status != OK:
            lines.append(f"      fix: {c.hint}")
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0
