"""Where the Triton kernels run, and a recorder that counts every kernel launch without a GPU.

Dispatch (`use_kernels`, `check_device`): the models take the kernel path for tensors on
  - CUDA (the product) of sm_75 or newer (`kernels.arch.triton_supported`),
  - the CPU inside `kernels_on_cpu()` under TRITON_INTERPRET=1 (tests: the whole model through the
    interpreted kernels, against the torch reference),
  - the meta device inside `record_launches()` (a dry run: shapes only, nothing computed).

`record_launches()` intercepts every Triton launch (`kernel[grid](...)`: recorded, not run) and,
through a TorchDispatchMode, every torch op on a device tensor (CUDA or meta: on a GPU each of these
is a kernel launch or a copy; host-side CPU ops are bookkeeping and are not counted). Views and
allocations (`empty`, `view`, `slice`, ...) launch nothing and are skipped. So one decode step run
on the meta device says how many kernels the GPU would launch for it, and the recorded Triton
launches (kernel, grid, arguments, constexprs, num_warps) can be compiled for real GPU targets
(`kernels/triton/compile_check.py`) with exactly the parameters the engine uses.

TRITON_INTERPRET is Triton's own variable, and `interpreting()` is the one place our code reads it.
Triton (3.6 and 3.9 alike) reads it through `triton.knobs.runtime.interpret`, from os.environ at
each access, in two places: `@triton.jit`, when a kernel module is imported (the interpreter's
`InterpretedFunction` or a compiling `JITFunction`: fixed for that module from then on), and
constexpr functions while a kernel is traced. So it is set before the kernel modules are imported
(tests/triton_env.py, the Makefile) and left alone after. `interpreting()` parses it once, at its
first call (not at this module's import, which may come before a test module sets the variable),
and keeps the answer: the launchers ask it at every launch for their block sizes, and no module
holds a copy of its own. The one writer is `triton_interpret()` below, a context manager that
switches the variable and the kept answer together and restores both. `reload_interpret()`
parses the variable again (tests/conftest.py does around every test, as it re-reads the
EDGEGEM_* switches; a test that sets the variable itself calls it after).
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from ..arch import triton_supported

__all__ = ["Launch", "LaunchRecord", "check_device", "host_compute", "interpreting", "kernels_on_cpu",
           "record_launches", "recording", "reload_interpret", "triton_interpret", "use_kernels"]

_state = threading.local()  # cpu_kernels: depth of kernels_on_cpu(); record: the active LaunchRecord
# The values Triton's getenv_bool takes as true (any case; anything else is false): the same
# parse as triton.knobs.runtime.interpret, without importing triton on CPU-only installs.
_TRUE = ("1", "true", "on", "yes", "y")


_interpret: Optional[bool] = None  # TRITON_INTERPRET as parsed by interpreting(); None: not read yet


def _parse_interpret(raw: Optional[str]) -> bool:
    return (raw or "").lower() in _TRUE


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on the CPU through the interpreter (parsed as Triton
    does, once at the first call and kept; `triton_interpret()` switches it, `reload_interpret()`
    parses it again: module doc)."""
    global _interpret
    if _interpret is None:
        _interpret = _parse_interpret(os.environ.get("TRITON_INTERPRET"))
    return _interpret


def reload_interpret() -> bool:
    """Parse TRITON_INTERPRET again (after a test set it) -> `interpreting()`'s new answer."""
    global _interpret
    _interpret = None
    return interpreting()


@contextlib.contextmanager
def triton_interpret(on: bool) -> Iterator[None]:
    """Inside: TRITON_INTERPRET is "1" or "0" and `interpreting()` says so; on exit both are what
    they were (the variable unset if it was unset). For work that must see Triton as another
    machine does: the compile check's workers record and compile as a GPU machine (JITFunctions,
    the GPU block sizes) from a test process that runs the interpreter. A kernel module first
    imported inside keeps the kind it got there."""
    global _interpret
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    _interpret = on
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
        _interpret = _parse_interpret(before)


def recording() -> Optional["LaunchRecord"]:
    return getattr(_state, "record", None)


def _device_ok(device: torch.device) -> bool:
    if device.type == "cuda":  # sm_75+ (kernels.arch.triton_supported); older GPUs take the torch path
        return triton_supported(device)[0]
    if device.type == "meta":
        return recording() is not None
    return device.type == "cpu" and getattr(_state, "cpu_kernels", 0) > 0 and interpreting()


def use_kernels(*tensors: Optional[torch.Tensor]) -> bool:
    """True when every tensor given (None is skipped) lives where the Triton kernels run now."""
    return all(t is None or _device_ok(t.device) for t in tensors)


def check_device(fn: str, device: torch.device, triton_module) -> None:
    """The launchers' guard: ValueError unless triton imports and `device` can run a kernel (CUDA;
    the CPU under TRITON_INTERPRET=1; meta while recording)."""
    if triton_module is None:
        raise ValueError(f"{fn}: triton is not installed; use {fn}_ref")
    if device.type == "cuda" or (device.type == "cpu" and interpreting()) or \
            (device.type == "meta" and recording() is not None):
        return
    raise ValueError(f"{fn}: tensors on {device} need TRITON_INTERPRET=1 (or use {fn}_ref); the kernel runs on CUDA")


@contextlib.contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """Inside: CPU tensors take the models' kernel path (needs TRITON_INTERPRET=1 set before triton
    is imported); tests use it to run every fused kernel the CUDA path runs."""
    if interpreting():  # triton 3.6's interpreter with numpy >= 2.3 (kernels/triton/interpreter_compat.py)
        from .interpreter_compat import install

        install()
    _state.cpu_kernels = getattr(_state, "cpu_kernels", 0) + 1
    try:
        yield
    finally:
        _state.cpu_kernels -= 1


@contextlib.contextmanager
def host_compute() -> Iterator[None]:
    """Inside: CPU tensors keep the CPU path even within `kernels_on_cpu()`: the work a GPU's host
    does beside it (whole layers in host RAM, models/host_layers.py), which on a real machine never
    meets a kernel (its tensors are not CUDA ones). Outside `kernels_on_cpu()` it changes nothing."""
    depth = getattr(_state, "cpu_kernels", 0)
    _state.cpu_kernels = 0
    try:
        yield
    finally:
        _state.cpu_kernels = depth


@dataclass
class Launch:
    """One Triton launch: the JIT function (a JITFunction, or the interpreter's wrapper), its grid
    (a tuple, or a callable of the meta-parameters) and the call's arguments."""
    kernel: Any
    grid: Any
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        fn = getattr(self.kernel, "fn", self.kernel)
        return getattr(fn, "__name__", repr(fn))


# aten ops that launch nothing on a GPU: views, metadata, allocations (an `empty` is an allocator
# call; `zeros`/`full` decompose to empty + fill_, and the fill_ is counted).
_FREE_OPS = frozenset("""
    empty empty_like empty_strided new_empty new_empty_strided view _unsafe_view reshape alias
    as_strided slice select unsqueeze squeeze permute transpose t expand expand_as split split_with_sizes
    chunk unbind narrow detach lift_fresh _reshape_alias view_as unflatten flatten movedim diagonal
    _to_copy_noop real imag conj _conj _neg_view resolve_conj resolve_neg set_ is_nonzero
    sym_size sym_stride sym_numel sym_storage_offset size stride dim numel storage_offset
    is_same_size _has_compatible_shallow_copy_type
""".split())


@dataclass
class LaunchRecord:
    """What `record_launches` saw: Triton launches (in order) and device-side torch ops by name."""
    triton: list[Launch] = field(default_factory=list)
    torch_ops: Counter = field(default_factory=Counter)
    host_copies: int = 0  # host -> device copies among torch_ops (each a sync point when pageable)
    # every copy between host memory and the device, in order: ("to_host" | "to_device", bytes)
    copies: list = field(default_factory=list)
    # groups of device -> host copies with no other device op between them: on a GPU the host reads
    # such a group after one wait on its event (models/host_experts.py `_send`/`_receive`)
    host_waits: int = 0
    _after_to_host: bool = False

    def copy_bytes(self, direction: str) -> int:
        return sum(n for d, n in self.copies if d == direction)

    def copy_count(self, direction: str) -> int:
        return sum(1 for d, _ in self.copies if d == direction)

    @property
    def n_triton(self) -> int:
        return len(self.triton)

    @property
    def n_torch(self) -> int:
        return sum(self.torch_ops.values())

    @property
    def total(self) -> int:
        return self.n_triton + self.n_torch

    def triton_counts(self) -> Counter:
        return Counter(launch.name for launch in self.triton)


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type in ("cuda", "meta")


def _host_to_device(func, args, out) -> bool:
    """A `_to_copy` (tensor.to(device)) or `copy_` (dst.copy_(src)) from CPU memory to a device."""
    if func.overloadpacket.__name__ == "copy_":
        src, dst = args[1], args[0]
    else:
        src, dst = args[0], out
    return isinstance(src, torch.Tensor) and src.device.type == "cpu" and _on_device(dst)


def _meta_to_host(func, args, kwargs):
    """A copy out of a meta tensor into CPU memory (`dst.copy_(src)` or `src.to("cpu")`), else None.
    Meta holds no values, so the host gets stand-ins (`_host_values`) -> (dst, src)."""
    name = func.overloadpacket.__name__
    if name == "copy_":
        dst, src = args[0], args[1]
    elif name == "_to_copy" and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
        src = args[0]
        dst = torch.empty(src.shape, dtype=kwargs.get("dtype") or src.dtype)
    else:
        return None
    ok = isinstance(src, torch.Tensor) and src.device.type == "meta" and dst.device.type == "cpu"
    return (dst, src) if ok else None


def _host_values(dst: torch.Tensor) -> torch.Tensor:
    """What a dry run's host reads from the device: integers 0, 1, ... k-1 along the last dim
    (distinct top-k picks of a router: experts 0..k-1), floats 1 / last dim (equal top-k weights
    summing to 1; a residual row of mean square 1/d^2)."""
    if dst.dtype.is_floating_point:
        return dst.fill_(1.0 / max(dst.shape[-1], 1) if dst.dim() else 1.0)
    if dst.dtype == torch.bool:
        return dst.fill_(True)
    if dst.dim() == 0:
        return dst.fill_(0)
    return dst.copy_(torch.arange(dst.shape[-1]).expand(dst.shape))


def _make_mode(rec: LaunchRecord):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            to_host = _meta_to_host(func, args, kwargs)
            if to_host is not None:  # a device -> host copy (on meta: stand-in values)
                dst, src = to_host
                rec.torch_ops[name] += 1
                # bytes in the destination's dtype: a copy off the GPU converts there first (ATen's
                # copy_requires_temporaries branch), so bf16 r into a float32 buffer moves 4 B a value
                rec.copies.append(("to_host", dst.numel() * dst.element_size()))
                rec.host_waits += not rec._after_to_host
                rec._after_to_host = True
                return _host_values(dst)
            out = func(*args, **kwargs)
            if name not in _FREE_OPS:
                flat_in, _ = tree_flatten((args, kwargs))
                flat_out, _ = tree_flatten(out)
                if any(map(_on_device, flat_in)) or any(map(_on_device, flat_out)):
                    rec.torch_ops[name] += 1
                    rec._after_to_host = False
                    if name in ("_to_copy", "copy_") and _host_to_device(func, args, out):
                        rec.host_copies += 1
                        dst = args[0] if name == "copy_" else out
                        rec.copies.append(("to_device", dst.numel() * dst.element_size()))
            return out

    return _Count()


@contextlib.contextmanager
def record_launches(torch_ops: bool = True) -> Iterator[LaunchRecord]:
    """Record Triton launches (not run: their outputs keep whatever the allocation held) and, with
    `torch_ops`, count device-side torch ops. Meant for meta-device dry runs (nothing computes);
    on CUDA or the interpreter the Triton kernels are skipped all the same."""
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("record_launches needs the triton package") from e
    rec = LaunchRecord()
    prev_rec = recording()
    original = KernelInterface.__getitem__

    def getitem(self, grid):
        if recording() is None:  # another thread's launch while this one records
            return original(self, grid)
        return lambda *args, **kwargs: recording().triton.append(Launch(self, grid, args, kwargs))

    KernelInterface.__getitem__ = getitem
    _state.record = rec
    mode = _make_mode(rec) if torch_ops else contextlib.nullcontext()
    try:
        with mode:
            yield rec
    finally:
        _state.record = prev_rec
        KernelInterface.__getitem__ = original
