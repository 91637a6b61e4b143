"""Compile recorded Triton launches for real GPUs without a GPU: registers, spills, shared memory, SASS.

A launch recorded by `kernels.triton.launch.record_launches` (kernel, grid, arguments) becomes a
`KernelSpec`: the kernel's module and name plus the signature, constexprs and `tt.divisibility`
attributes Triton's JIT would specialize that call to (`spec_of`, mirroring triton 3.9
`runtime/jit.py` `create_function_from_signature` and the C++ `specialize_impl`):
  * a tensor -> "*<dtype>" pointer ("*k<dtype>" for a `const` annotation), divisible by 16 when its
    address is (data_ptr already includes the storage offset; a meta tensor has no address, so its
    base counts as 256-aligned and only storage_offset * itemsize decides);
  * an int -> constexpr when it equals 1, else i32 / u64 / i64 by range, divisible when % 16 == 0;
  * a float -> fp32, a bool -> u1 (never specialized), None -> constexpr;
  * `do_not_specialize` / `do_not_specialize_on_alignment` parameters as Triton treats them;
  * parameters annotated `tl.constexpr` -> constexpr with the call's (or the default) value.
Identical specs from many launches are one compile (`KernelSpec` is hashable).

`compile_specs(specs, archs)` compiles each (spec, arch) with `triton.compile(ASTSource(...),
target=GPUTarget("cuda", cc, 32))` and the launch's num_warps/num_stages, and reads the result with
the tools inside the triton wheel: registers and spill bytes from ptxas's `-v` log (Triton runs
ptxas with -v; the log is captured), shared memory from the kernel metadata, and the cubin, which
`CompileResult.sass` disassembles with `cuobjdump -sass` when asked. A compile error is a result, not an exception. Results are cached on disk under
the sha256 of Triton's own cache key (source of the kernel and its callees, signature, constants,
attributes, options, ptxas version and arch), so a rerun compiles nothing that did not change.
Kernels must be `JITFunction`s: under TRITON_INTERPRET=1 the kernel modules hold the interpreter's
wrappers (and the launchers pick the interpreter's block sizes), so the compiles then run in
spawned worker processes with TRITON_INTERPRET=0 (`jobs` of them).

`kernels/triton/sass.py` reads the SASS (a kernel's main loop, its loads); with the reference GPUs in
`ARCHS`, `bandwidth_cap` turns instructions per weight byte into the share of peak bandwidth a
decode GEMV can reach at most.
"""
from __future__ import annotations

import base64
import contextlib
import functools
import gzip
import hashlib
import importlib
import inspect
import io
import json
import os
import pickle
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..env import env

__all__ = ["ARCHS", "Arch", "CompileResult", "KernelSpec", "bandwidth_cap", "compile_specs", "default_cache_dir",
           "gpu_pool", "spec_of", "specialize_value"]

ANALYSIS_VERSION = "2"  # bump when what is read out of a compile changes (invalidates the disk cache)


# ------------------------------------------------------------------------------------ arch facts

@dataclass(frozen=True)
class Arch:
    """A compile target and the consumer GPU its bandwidth cap is quoted for.

    smem_limit: the most shared memory one block can have (cudaDevAttrMaxSharedMemoryPerBlockOptin,
    CUDA C Programming Guide, "Technical Specifications per Compute Capability": 64 KB on 7.5,
    163 KB on 8.0, 99 KB on 8.6 and 8.9, 227 KB on 9.0, 99 KB on 12.0); Triton refuses a launch
    above it (`out of resource`)."""
    name: str
    cc: int
    smem_limit: int
    gpu: str
    sms: int
    boost_ghz: float
    bandwidth_gbps: float

    @property
    def issue_rate(self) -> float:
        """Warp-instructions per second the GPU can issue: 4 schedulers per SM (Turing through
        Blackwell), one warp-instruction per clock each."""
        return 4 * self.sms * self.boost_ghz * 1e9


# Reference GPUs: vendor spec sheets (SM count, boost clock, memory bandwidth).
ARCHS = {
    "sm_75": Arch("sm_75", 75, 64 * 1024, "RTX 2060 (6 GB)", 30, 1.68, 336.0),
    "sm_80": Arch("sm_80", 80, 163 * 1024, "A100 40GB (PCIe)", 108, 1.41, 1555.0),
    "sm_86": Arch("sm_86", 86, 99 * 1024, "RTX 3060 (12 GB)", 28, 1.777, 360.0),
    "sm_89": Arch("sm_89", 89, 99 * 1024, "RTX 4060 (8 GB)", 24, 2.46, 272.0),
    # Hopper: the GPU machines this project is lent (H200: 132 SMs, 4.8 TB/s HBM3e).
    "sm_90": Arch("sm_90", 90, 227 * 1024, "H200 (141 GB)", 132, 1.98, 4800.0),
    # Blackwell consumer cards: the 8 GB RTX 5060 is the small-VRAM card of 2026 (30 SMs, 448 GB/s GDDR7).
    "sm_120": Arch("sm_120", 120, 99 * 1024, "RTX 5060 (8 GB)", 30, 2.497, 448.0),
}


def bandwidth_cap(instructions_per_byte: float, arch: Arch) -> float:
    """The share of peak memory bandwidth a kernel issuing `instructions_per_byte` warp-instructions
    per weight byte can reach at most on `arch`'s reference GPU: issue rate / (instructions per
    byte x bytes per second), capped at 1."""
    if instructions_per_byte <= 0:
        return 1.0
    return min(1.0, arch.issue_rate / (instructions_per_byte * arch.bandwidth_gbps * 1e9))


# -------------------------------------------------------------------------------- specialization

_TORCH_TO_TRITON = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.uint16: "u16", torch.uint32: "u32", torch.uint64: "u64", torch.bool: "u1",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}
META_BASE_ALIGN = 256  # a meta tensor's storage is taken to start 256-aligned (the caching allocator's 512 B)


@dataclass(frozen=True)
class KernelSpec:
    """What one compile needs: the kernel (module + name), its specialized signature (param ->
    Triton type or "constexpr"), constexpr values, the parameters with tt.divisibility 16, and the
    compile options (num_warps, num_stages, ...). Hashable: identical launches dedupe."""
    module: str
    name: str
    signature: tuple  # ((param, type), ...) in parameter order
    constexprs: tuple  # ((param, value), ...)
    divisible: tuple  # (param, ...)
    options: tuple  # ((option, value), ...), sorted

    @property
    def num_warps(self) -> int:
        return int(dict(self.options).get("num_warps", 4))

    def label(self) -> str:
        """kernel[CONST=v, ...] option=v ...: how reports name a spec."""
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        opts = " ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}[{consts}] {opts}".strip()


def _kernel_fn(kernel):
    """The python function behind a JITFunction, an InterpretedFunction or an autotuner wrapper."""
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def _kernel_params(kernel) -> list:
    """Triton's own KernelParam for each parameter (constexpr / const / annotated type, and the
    do_not_specialize(_on_alignment) lists, kept on a JITFunction or an InterpretedFunction's kwargs)."""
    from triton.runtime.jit import KernelParam

    extra = getattr(kernel, "kwargs", None) or {}
    dns = getattr(kernel, "do_not_specialize", None) or extra.get("do_not_specialize") or []
    dnsoa = getattr(kernel, "do_not_specialize_on_alignment", None) or extra.get("do_not_specialize_on_alignment") or []
    params = inspect.signature(_kernel_fn(kernel)).parameters.values()
    return [KernelParam(i, p, i in dns or p.name in dns, i in dnsoa or p.name in dnsoa) for i, p in enumerate(params)]


def _tensor_address_mod16(t: torch.Tensor) -> int:
    if t.device.type == "meta":
        return (META_BASE_ALIGN + t.storage_offset() * t.element_size()) % 16
    return t.data_ptr() % 16


def specialize_value(value, is_const: bool = False, specialize: bool = True, align: bool = True) -> tuple:
    """(type, key) as Triton's specialize_impl gives for a non-constexpr argument; key "D" means
    tt.divisibility 16, "" not divisible, None not specialized."""
    if value is None:
        return ("constexpr", None)
    if isinstance(value, bool):
        return ("u1", None)
    if isinstance(value, int):
        if specialize and value == 1:
            return ("constexpr", 1)
        key = ("D" if align and value % 16 == 0 else "") if specialize else None
        if -(2 ** 31) <= value <= 2 ** 31 - 1:
            return ("i32", key)
        if 2 ** 63 <= value <= 2 ** 64 - 1:
            return ("u64", key)
        return ("i64", key)
    if isinstance(value, float):
        return ("fp32", None)
    if isinstance(value, torch.Tensor):
        ty = "*" + ("k" if is_const else "") + _TORCH_TO_TRITON[value.dtype]
        key = ("D" if align and _tensor_address_mod16(value) == 0 else "") if specialize else None
        return (ty, key)
    raise TypeError(f"cannot specialize an argument of type {type(value).__name__}")


def spec_of(launch) -> KernelSpec:
    """The KernelSpec Triton's JIT would compile for a recorded launch (`kernels.triton.launch.Launch`)."""
    fn = _kernel_fn(launch.kernel)
    sig = inspect.signature(fn)
    call_kwargs = {k: v for k, v in launch.kwargs.items() if k in sig.parameters}
    options = tuple(sorted((k, v) for k, v in launch.kwargs.items() if k not in sig.parameters))
    bound = sig.bind(*launch.args, **call_kwargs)
    bound.apply_defaults()
    signature, constexprs, divisible = [], [], []
    for kp in _kernel_params(launch.kernel):
        value = bound.arguments[kp.name]
        if kp.is_constexpr:
            ty, key = "constexpr", None
        else:
            ty, key = specialize_value(value, kp.is_const, not kp.do_not_specialize,
                                       not kp.do_not_specialize_on_alignment)
            if kp.annotation_type:  # `x: tl.int32`-style: the annotation is the type; floats/bools unspecialized
                unspecialized = kp.annotation_type == "u1" or kp.annotation_type[:2] in ("fp", "bf")
                ty, key = kp.annotation_type, None if unspecialized or key not in ("D", "") else key
        signature.append((kp.name, ty))
        if ty == "constexpr":
            constexprs.append((kp.name, getattr(value, "value", value)))
        elif key == "D":
            divisible.append(kp.name)
    return KernelSpec(fn.__module__, fn.__name__, tuple(signature), tuple(constexprs), tuple(divisible), options)


# -------------------------------------------------------------------------------------- compiling

@dataclass
class CompileResult:
    """One (spec, arch) compile. `error` is the compiler's message when it failed (then the rest is
    empty). Registers and spill bytes are per thread as ptxas reports them; `shared` is the shared
    memory Triton allocates per program (bytes); `sass` disassembles `cubin` on first use."""
    spec: KernelSpec
    arch: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared: int = 0
    cubin: bytes = field(default=b"", repr=False)
    error: Optional[str] = None
    cached: bool = field(default=False, compare=False)

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    @property
    def smem_limit(self) -> int:
        return ARCHS[self.arch].smem_limit

    @property
    def smem_over(self) -> bool:
        return self.shared > self.smem_limit

    @functools.cached_property
    def sass(self) -> str:
        """cuobjdump -sass of the cubin ("" when the compile failed)."""
        return _sass(self.cubin) if self.cubin else ""

    def as_dict(self) -> dict:
        """JSON-able facts (no cubin, no SASS)."""
        return {"kernel": self.spec.name, "spec": self.spec.label(), "arch": self.arch, "registers": self.registers,
                "spill_stores": self.spill_stores, "spill_loads": self.spill_loads, "stack": self.stack,
                "shared": self.shared, "smem_limit": self.smem_limit, "error": self.error}

    def summary(self) -> str:
        if self.error:
            return f"{self.arch} {self.spec.label()}: ERROR {self.error.splitlines()[0]}"
        return (f"{self.arch} {self.spec.label()}: {self.registers} regs, spill {self.spill_stores}/"
                f"{self.spill_loads} B st/ld, smem {self.shared} B (limit {self.smem_limit})")


def default_cache_dir() -> Path:
    """$EDGEGEM_COMPILE_CACHE, else ~/.cache/edgegem/compile-check (XDG_CACHE_HOME honoured)."""
    if env().compile_cache is not None:
        return env().compile_cache
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgegem" / "compile-check"


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _jit_function(spec: KernelSpec):
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(spec.module), spec.name)
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(f"{spec.module}.{spec.name} is a {type(kernel).__name__}, not a JITFunction: "
                           "compile with TRITON_INTERPRET=0 (compile_specs does, in worker processes)")
    return kernel


def _source(spec: KernelSpec):
    from triton.compiler.compiler import ASTSource

    fn = _jit_function(spec)
    index = {name: (i,) for i, name in enumerate(fn.arg_names)}
    attrs = {index[p]: [["tt.divisibility", 16]] for p in spec.divisible}
    return ASTSource(fn, dict(spec.signature), {index[k]: v for k, v in spec.constexprs}, attrs)


def _cache_key(src, arch: Arch, options: dict) -> str:
    """sha256 of Triton's own cache key for this compile (what `triton.compile` hashes)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key

    backend = make_backend(GPUTarget("cuda", arch.cc, 32))
    key = get_cache_key(src, backend, backend.parse_options(dict(options)), get_cache_invalidating_env_vars())
    return hashlib.sha256(f"{ANALYSIS_VERSION}-{key}".encode()).hexdigest()


def _nvidia_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_nvidia_tool("cuobjdump"), "-sass", f.name], check=True, capture_output=True,
                              text=True).stdout


def _ptxas_log(ptx: str, arch: Arch) -> str:
    """ptxas -v on the kernel's PTX (only when Triton's own compile was a cache hit: no log then),
    with the ptxas Triton uses for the arch (triton 3.9: `ptxas-blackwell`, a newer one, from sm_90)
    and the PTX's own target (sm_90a, sm_120a: Triton builds the arch-specific variants there)."""
    m = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
    target = m.group(1) if m else f"sm_{arch.cc}"
    tool = _nvidia_tool("ptxas")
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(arch.cc).path
    except (ImportError, AttributeError):  # older triton: one ptxas for every arch
        pass
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        p = subprocess.run([tool, "-v", "--regAllocOptLevel=2", f"--gpu-name={target}",
                            str(src), "-o", str(Path(d) / "k.o")], capture_output=True, text=True, check=True)
        return p.stdout + p.stderr


def _short_error(e: BaseException) -> str:
    """The compiler's message, each distinct line once: no repro command, no temp-file names and
    line numbers (ptxas repeats one error for every PTX line that has it)."""
    lines = []
    for ln in f"{type(e).__name__}: {e}".splitlines():
        ln = re.sub(r"^ptxas \S+, line \d+; ", "ptxas: ", ln.strip())
        if ln and not ln.startswith("Repro command") and ln not in lines:
            lines.append(ln)
    return "\n".join(lines[:12])


def compile_one(spec: KernelSpec, arch_name: str, cache_dir: Optional[str] = None) -> CompileResult:
    """Compile `spec` for `arch_name` in this process (kernels must be JITFunctions), or read the
    result from `cache_dir`."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    arch = ARCHS[arch_name]
    options = dict(spec.options)
    # Triton <= 3.9 fuses a*b+c into FMAs unless told otherwise (3.9 warns that 3.10 will not):
    # the engine's launches do not say, so compile as the triton 3.6 on the GPU machines would.
    options.setdefault("enable_fp_fusion", True)
    src = _source(spec)
    key = _cache_key(src, arch, options)
    path = Path(cache_dir) / f"{key}.json.gz" if cache_dir else None
    if path is not None and path.exists():
        data = json.loads(gzip.decompress(path.read_bytes()))
        data["cubin"] = base64.b64decode(data["cubin"])
        return CompileResult(spec, arch_name, cached=True, **data)
    out = io.StringIO()
    prev = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas -v's log: registers and spills
    try:
        with contextlib.redirect_stdout(out):
            k = triton.compile(src, target=GPUTarget("cuda", arch.cc, 32), options=options)
        err = None
    except Exception as e:  # noqa: BLE001 - a compile error is the answer for this spec, not a failure of the check
        k, err = None, _short_error(e)
    finally:
        knobs.nvidia.dump_ptxas_log = prev
    if err is not None:
        res = CompileResult(spec, arch_name, error=err)
    else:
        log = out.getvalue()
        if not _PTXAS_REGS.search(log):  # Triton's cache had it: no ptxas run, no log
            log = _ptxas_log(k.asm["ptx"], arch)
        spill = _PTXAS_SPILL.search(log)
        stack, st, ld = map(int, spill.groups()) if spill else (0, 0, 0)
        res = CompileResult(spec, arch_name, registers=int(_PTXAS_REGS.search(log).group(1)), spill_stores=st,
                            spill_loads=ld, stack=stack, shared=int(k.metadata.shared), cubin=k.asm["cubin"])
    if path is not None:
        data = {k_: v for k_, v in asdict(res).items() if k_ not in ("spec", "arch", "cached", "cubin")}
        data["cubin"] = base64.b64encode(res.cubin).decode()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(gzip.compress(json.dumps(data).encode()))
        tmp.replace(path)
    return res


def _worker_init() -> None:
    torch.set_num_threads(1)  # the workers share the machine's cores; meta-device dry runs compute nothing


def _as_on_gpu(task: bytes):
    """Run a pickled (fn, args, kwargs) with TRITON_INTERPRET=0, restored after. The task is
    unpickled inside: unpickling `fn` imports its module, and with it triton and our kernel
    modules, whose `@triton.jit` (triton.language's own helpers too) must see the 0 to make
    JITFunctions (kernels/triton/launch.py, kernels/triton/interpreter_compat.py)."""
    from .launch import triton_interpret

    with triton_interpret(False):
        fn, args, kwargs = pickle.loads(task)
        return fn(*args, **kwargs)


class _GpuPool(ProcessPoolExecutor):
    """A ProcessPoolExecutor whose tasks run as on a GPU machine (`_as_on_gpu`)."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_as_on_gpu, pickle.dumps((fn, args, kwargs)))


def gpu_pool(jobs: int = 2) -> ProcessPoolExecutor:
    """Worker processes in which the kernel modules import as they do on a GPU machine
    (TRITON_INTERPRET=0: JITFunctions, and the launchers' GPU block sizes): for recording engine
    launches and compiling them from a process that runs the interpreter (the test suite). The
    variable is switched off around each task in the worker (`_as_on_gpu`), not in this process,
    whose own kernel modules and launchers keep the interpreter."""
    import multiprocessing

    return _GpuPool(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_init)


def compile_specs(specs: Iterable[KernelSpec], archs: Iterable[str] = tuple(ARCHS), jobs: int = 2,
                  cache_dir: Optional[os.PathLike] = "default",
                  pool: Optional[ProcessPoolExecutor] = None) -> dict[tuple[KernelSpec, str], CompileResult]:
    """Compile every distinct spec for every arch: {(spec, arch): CompileResult}. In `pool` (see
    `gpu_pool`) if given, else in this process when `jobs` <= 1 and the kernels here are not
    interpreted, else in a `gpu_pool(jobs)` of its own. `cache_dir`: "default"
    (`default_cache_dir()`), a folder, or None (no disk cache)."""
    from .launch import interpreting

    cache = str(default_cache_dir() if cache_dir == "default" else cache_dir) if cache_dir else None
    work = list(dict.fromkeys((s, a) for s in specs for a in archs))
    if pool is None and jobs <= 1 and not interpreting():
        return {(s, a): compile_one(s, a, cache) for s, a in work}
    own = pool is None
    pool = gpu_pool(jobs) if own else pool
    try:
        # Biggest signatures (the attention kernels) first, so the pool does not end on one slow compile.
        order = sorted(work, key=lambda w: -len(w[0].signature))
        futures = {w: pool.submit(compile_one, w[0], w[1], cache) for w in order}
        return {w: futures[w].result() for w in work}
    finally:
        if own:
            pool.shutdown()
