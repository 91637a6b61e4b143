"""The CPU runtime's machine-level settings: thread count, and which kernels run the products.

Threads: one count for torch's intra-op pool and ggml's CPU backend (they share torch's libgomp,
models/formats/ggml.py), the physical cores by default, or $OMP_NUM_THREADS where it is set (as torch
reads it; `--threads N` overrides both). On a quiet
machine every core helps (products are memory-bound and split by rows); on a busy one an
OpenMP team of 2 waits at every barrier for a thread the scheduler has parked (measured on the
2-core VM with other jobs holding both cores: a 2-thread E2B decode step took seconds where one
thread took ~90 ms: docs/benchmarks.md#cpu-runtime-figures-quoted-in-its-design), so `--threads 1`
is the setting for a machine shared with other work.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def physical_cores() -> int:
    """Cores this process may run on, counting SMT siblings once (sysfs topology; the CPU count
    when sysfs does not say)."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return max(1, len(allowed))
    return max(1, len(cores))


def default_threads() -> int:
    """Threads when `--threads` is not given: $OMP_NUM_THREADS where it is a positive count (torch's
    own pool already follows it; a test runner sharing the cores between workers sets it), else
    the physical cores."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        n = 0
    return n if n > 0 else physical_cores()


_threads: list = []


def _openmp():
    """The OpenMP runtime torch (and, sharing it, ggml) runs on, as a ctypes library, or None: the
    libgomp / libiomp the process has loaded (read off /proc/self/maps)."""
    import ctypes

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.strip() else ""
        if "/libgomp" in path or "/libiomp" in path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None


def release_idle_openmp_threads() -> bool:
    """Give back this thread's OpenMP team (made while it loaded the model: dequantizing and
    repacking run parallel regions), before another thread (the engine's) takes over the compute.
    Why: libgomp keeps one team per thread that ever ran a parallel region, and once all teams'
    threads outnumber the cores it stops spinning at barriers (throttled waits): the demo model's
    decode step through the engine thread took 42 ms against 26 ms in the loading thread at 2
    threads on the 2-core VM. `omp_pause_resource_all(omp_pause_soft)` (OpenMP 5.0) frees the
    calling thread's team (libgomp frees no other thread's: it must run in the thread that loaded);
    its next parallel region would make a new one. Returns whether the runtime did it."""
    lib = _openmp()
    fn = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None
    if fn is None:
        return False
    import ctypes

    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn(1) == 0  # omp_pause_soft


def set_threads(n: Optional[int] = None) -> int:
    """Threads for torch and ggml from now on: n, or `default_threads()` for None/0. Returns it."""
    import torch

    n = int(n) if n else default_threads()
    if n < 1:
        raise ValueError(f"--threads {n}: needs at least 1")
    torch.set_num_threads(n)
    from models.runtime import ggml_available

    if ggml_available():
        from kernels import ggml

        ggml.set_threads(n)
    _threads[:] = [n]
    return n


def threads() -> int:
    """The count set_threads last chose (torch's own default before that)."""
    import torch

    return _threads[0] if _threads else torch.get_num_threads()


def kernels() -> dict:
    """Which kernels the CPU runtime multiplies with: {"name": "ggml" | "torch", "detail": one line,
    "reason": why not ggml ('' when it is), "features": ggml's CPU features}."""
    from kernels import ggml
    from kernels.env import env
    from models.formats.ggml import describe_huge_pages
    from models.runtime import ggml_available

    if ggml_available():
        feats = ggml.cpu_features()
        names = [n.upper().replace("_", "-") for n in ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx_vnni")
                 if feats.get(n)]
        pages = describe_huge_pages(env().cpu_hugepages)
        return {"name": "ggml", "reason": "", "features": feats, "pages": pages,
                "detail": f"llama.cpp's ggml (llama-cpp-python {ggml.PINNED}; {', '.join(names) or 'no AVX2'}); {pages}"}
    return {"name": "torch", "reason": ggml.reason() or "disabled", "features": {},
            "detail": "torch formats (int4pack Q4_K, float16 5-8-bit types, int8-ranked head)"}
