"""Which GPU a launch is built for: compute capability and SM count, and where Triton runs at all.

Launchers choose tile sizes, dot operand types and split counts from the GPU they launch on:
  - a CUDA tensor's device answers for itself (`torch.cuda.get_device_capability`, the SM count);
  - a launch with no GPU behind it (meta-device dry runs, the interpreter on the CPU, compile
    checks) uses the target set by `assume_gpu(...)`, else `REFERENCE`: an RTX 3060 (sm_86, 28 SMs),
    the card the project's bandwidth figures are taken for. `with assume_gpu((7, 5)):` records the
    launches a Turing card would get.

`triton_supported(device)` is the one rule for whether the Triton kernels run on a device: CUDA at
sm_75 (Turing) or newer, with triton importable. Older GPUs (Pascal, Volta) take the torch path; the
engine, the model loader and `edgegem doctor` all ask this function.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

__all__ = ["ArchSupport", "Gpu", "REFERENCE", "MIN_TRITON_ARCH", "arch_name", "assume_gpu", "dot_fp16",
           "fp8_kv_supported", "gpu_of", "support", "triton_supported"]

MIN_TRITON_ARCH = (7, 5)  # Turing: the oldest tensor cores Triton's fp16 tl.dot targets
BF16_DOT_ARCH = (8, 0)  # Ampere: bf16 MMA and bf16 conversions (cvt.bf16.f32 needs sm_80)


@dataclass(frozen=True)
class Gpu:
    arch: tuple[int, int]  # compute capability (major, minor)
    sms: int  # streaming multiprocessors

    @property
    def name(self) -> str:
        return arch_name(self.arch)


REFERENCE = Gpu((8, 6), 28)  # RTX 3060 12 GB: 28 SMs, 360 GB/s
_state = threading.local()  # assumed: the Gpu set by assume_gpu on this thread


def arch_name(arch: tuple[int, int]) -> str:
    return f"sm_{arch[0]}{arch[1]}"


@contextlib.contextmanager
def assume_gpu(arch: tuple[int, int], sms: Optional[int] = None) -> Iterator[Gpu]:
    """Inside (this thread): launches with no GPU behind them are built for compute capability
    `arch` with `sms` SMs (default: REFERENCE's count). CUDA tensors still answer for themselves."""
    prev = getattr(_state, "assumed", None)
    _state.assumed = Gpu(tuple(arch), sms or REFERENCE.sms)
    try:
        yield _state.assumed
    finally:
        _state.assumed = prev


@functools.lru_cache(maxsize=None)
def _cuda_gpu(index: int) -> Gpu:
    props = torch.cuda.get_device_properties(index)
    return Gpu((props.major, props.minor), props.multi_processor_count)


def gpu_of(device: torch.device | str) -> Gpu:
    """The GPU a launch on `device` is built for: a CUDA device's own, else (meta, CPU, or "cuda"
    named on a machine without one, as dry runs do) the assumed one (see the module docstring)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type == "cuda" and _have_cuda():
        return _cuda_gpu(device.index if device.index is not None else torch.cuda.current_device())
    return getattr(_state, "assumed", None) or REFERENCE


@functools.lru_cache(maxsize=None)
def _have_cuda() -> bool:
    return torch.cuda.is_available()


def dot_fp16(arch: tuple[int, int]) -> bool:
    """Below sm_80 there is no bf16 MMA: bf16 operands would fall back to FMA loops that spill;
    attention casts its (RMS-normed, so fp16-safe) q, k, v operands to fp16 there instead."""
    return tuple(arch) < BF16_DOT_ARCH


def fp8_kv_supported(arch: tuple[int, int]) -> bool:
    """fp8_per_token_head is offered from sm_80 on. Below, it would buy nothing over
    int8_per_token_head (the same bytes) and cost more: no GPU before sm_89 converts e4m3 in
    hardware, so attention decodes it in four integer ops an element (int8: one conversion), on
    GPUs where Triton runs the attention dots on FMA units anyway. (It did not even compile on
    sm_75 while the attention dots took bf16 operands: `.bf16 requires sm_80`.)"""
    return tuple(arch) >= BF16_DOT_ARCH


@dataclass(frozen=True)
class ArchSupport:
    """What the engine runs on a GPU of compute capability `arch` (what `edgegem doctor` reports)."""
    arch: tuple[int, int]
    triton: bool  # the Triton kernels (quantized GEMV, fused ops, KV store, attention)
    reason: str  # why (not), without the arch: "older than sm_75 (Turing), ..."
    fp8_kv: bool  # fp8_per_token_head KV cache
    attention_dots: str  # operand type of the attention dots: "bf16" (or q's) / "fp16" below sm_80

    @property
    def name(self) -> str:
        return arch_name(self.arch)


@functools.lru_cache(maxsize=None)
def support(arch: tuple[int, int], triton_installed: bool = True) -> ArchSupport:
    arch = tuple(arch)
    if not triton_installed:
        ok, why = False, "triton is not installed"
    elif arch < MIN_TRITON_ARCH:
        ok, why = False, (f"older than {arch_name(MIN_TRITON_ARCH)} (Turing), the oldest GPU the Triton kernels "
                          "are built for")
    else:
        ok, why = True, "Triton kernels"
    return ArchSupport(arch, ok, why, fp8_kv_supported(arch), "fp16" if dot_fp16(arch) else "bf16")


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_supported(device: torch.device | str) -> tuple[bool, str]:
    """(True, why) when the Triton kernels run on `device`, else (False, why not) in one line.
    Cheap after the first call per GPU (the models ask it per op through kernels.triton.launch)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type != "cuda":
        return False, f"{device.type} is not a CUDA device"
    s = support(gpu_of(device).arch, _triton_installed())
    return s.triton, f"{s.name}: {s.reason}" + ("" if s.triton else ": the torch path runs")
