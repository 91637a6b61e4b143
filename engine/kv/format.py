"""KV cache storage formats: what one token of K and V costs, and how values go in and out.

8-bit formats keep one float32 scale per token per head (separately for K and V), so a
layer-token costs 2 · n_kv · (head_dim · 1 + 4) bytes: E2B full/sliding 1032/520 B against
2048/1024 B in bf16 (spec §1.4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FORMAT_NAMES = ("auto", "bf16", "fp16", "fp32", "int8_per_token_head", "fp8_per_token_head")

_FP8_MAX = 448.0  # float8_e4m3fn
_INT8_MAX = 127.0


@dataclass(frozen=True)
class KVFormat:
    name: str
    value_dtype: torch.dtype
    scaled: bool  # one float32 scale per token per head

    @property
    def value_bytes(self) -> int:
        return torch.empty((), dtype=self.value_dtype).element_size()

    def unit_bytes(self, n_kv: int, head_dim: int) -> int:
        """Bytes of K and V for one token of one layer."""
        return 2 * n_kv * (head_dim * self.value_bytes + (4 if self.scaled else 0))

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x [T, n_kv, hd] float -> (values [T, n_kv, hd] value_dtype, scales [T, n_kv] fp32 or None)."""
        if not self.scaled:
            return x.to(self.value_dtype), None
        xf = x.float()
        amax = xf.abs().amax(dim=-1).clamp_min(1e-12)  # [T, n_kv]
        if self.value_dtype == torch.int8:
            scale = amax / _INT8_MAX
            q = torch.round(xf / scale[..., None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        else:
            scale = amax / _FP8_MAX
            q = (xf / scale[..., None]).clamp_(-_FP8_MAX, _FP8_MAX).to(self.value_dtype)
        return q, scale

    def dequantize(self, values: torch.Tensor, scales: Optional[torch.Tensor], dtype) -> torch.Tensor:
        if not self.scaled:
            return values.to(dtype)
        return (values.float() * scales[..., None]).to(dtype)


_FORMATS = {
    "bf16": KVFormat("bf16", torch.bfloat16, False),
    "fp16": KVFormat("fp16", torch.float16, False),
    "fp32": KVFormat("fp32", torch.float32, False),
    "int8_per_token_head": KVFormat("int8_per_token_head", torch.int8, True),
    "fp8_per_token_head": KVFormat("fp8_per_token_head", torch.float8_e4m3fn, True),
}


def resolve_format(name: str, device: str | torch.device = "cpu") -> KVFormat:
    """A format by name; `auto` is bf16 on CUDA and fp32 on the CPU (exact reference numerics).
    fp8 on a GPU older than sm_80 is a one-line ValueError naming int8_per_token_head."""
    if name == "auto":
        name = "bf16" if torch.device(device).type == "cuda" else "fp32"
    try:
        fmt = _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV cache format '{name}' (choose from {', '.join(FORMAT_NAMES)})") from None
    if fmt.value_dtype == torch.float8_e4m3fn:
        _check_fp8(device)
    return fmt


class FormatUnsupported(ValueError):
    """A KV format not offered on this device (fp8 below sm_80: kernels.arch.fp8_kv_supported)."""


def _check_fp8(device) -> None:
    """On the CPU the torch path converts fp8 itself; a GPU (or a dry run's assumed one: meta, or
    "cuda" without a GPU) must be sm_80+ (kernels.arch.fp8_kv_supported)."""
    device = torch.device(device)
    if device.type not in ("cuda", "meta"):
        return
    from kernels.arch import arch_name, fp8_kv_supported, gpu_of

    arch = gpu_of(device).arch
    if not fp8_kv_supported(arch):
        raise FormatUnsupported(f"fp8_per_token_head KV cache needs an sm_80 or newer GPU, this one is "
                                f"{arch_name(arch)}: use int8_per_token_head (the same size)")


def owning_layers(cfg, sliding: bool, share_kv: bool = True) -> list[int]:
    """Layers of one attention type that get a slab: KV owners only, or every layer of the type when
    sharing is off (the debug mode where shared layers keep their own copies)."""
    return [i for i in range(cfg.n_layer)
            if bool(cfg.is_sliding[i]) == sliding and (cfg.has_kv(i) or not share_kv)]


def _per_layer(value, i):
    return value[i] if isinstance(value, (tuple, list)) else value


def pool_unit_bytes(cfg, fmt: KVFormat, sliding: bool, share_kv: bool = True, layers=None) -> int:
    """Bytes per token of the full (sliding=False) or window (sliding=True) pool for a model config
    (only its owning layers among `layers`, when given: the CPU layers' host part)."""
    return sum(fmt.unit_bytes(_per_layer(cfg.n_kv_head, i), _per_layer(cfg.head_dim, i))
               for i in owning_layers(cfg, sliding, share_kv) if layers is None or i in layers)
