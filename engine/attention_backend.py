"""Attention backends: how K/V reach the pools and how attention reads them back.

`torch` is the reference (the CPU path): quantize with the KV format, gather the slots, run
`models.ops.attention`. `triton` stores with `kernels.triton.kv_store` (8-bit quantization on the fly)
and attends straight over the slabs through the slot lists (`kernels.triton.attention`): no gather.
Backends are picked by name from a registry that imports them lazily, so `import engine` works
without Triton or CUDA.
"""
from __future__ import annotations

import abc
from typing import Optional

import torch

from models.ops import attention

from .kv.pool import KVPool


class AttentionBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def store(self, pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, n_kv, hd] into `layer`'s slab at slots [T]."""

    @abc.abstractmethod
    def attend(self, pool: KVPool, slab: int, slots: torch.Tensor, k_pos: torch.Tensor, q: torch.Tensor,
               q_pos: torch.Tensor, window: Optional[int], scale: float,
               last_key: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [T, n_h, hd] at q_pos [T] over the keys at `slots` (positions k_pos) -> [T, n_h * hd].
        `last_key` [T]: the last position each query sees (models.ops.attention)."""


class TorchAttention(AttentionBackend):
    name = "torch"

    def store(self, pool, layer, slots, k, v):
        pool.write(layer, slots, k, v)

    def attend(self, pool, slab, slots, k_pos, q, q_pos, window, scale, last_key=None):
        k, v = pool.read(slab, slots, q.dtype)
        return attention(q, k, v, q_pos, k_pos.to(q.device), window, scale, last_key)


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self):
        from kernels.triton import attention as att, kv_store as store  # noqa: F401 - fails early without triton

        if att.triton is None or store.triton is None:
            raise RuntimeError("the triton attention backend needs the triton package")
        self._att, self._store = att, store

    def store(self, pool, layer, slots, k, v):
        scaled = pool.fmt.scaled
        self._store.kv_store(k.contiguous(), v.contiguous(), pool.k[layer], pool.v[layer], slots.to(pool.device),
                             pool.k_scale[layer] if scaled else None, pool.v_scale[layer] if scaled else None)

    def attend(self, pool, slab, slots, k_pos, q, q_pos, window, scale, last_key=None):
        if last_key is not None:
            # The image rows of a 26B/31B prefill chunk on a sliding layer (models/image_attention.py):
            # the kernels mask on positions alone, so this one chunk of this layer gathers its keys
            # (at most the window plus the chunk) and runs the reference (one copy of those K/V).
            return TorchAttention.attend(self, pool, slab, slots, k_pos, q, q_pos, window, scale, last_key)
        dev = q.device
        scales = ((pool.k_scale[slab], pool.v_scale[slab]) if pool.fmt.scaled else (None, None))
        args = (pool.k[slab], pool.v[slab], slots.to(dev), k_pos.to(dev))
        T, n_h, hd = q.shape
        if T == 1:  # decode: flash-decoding over the slots
            o = self._att.decode_attention(q[0].contiguous(), *args, q_pos.to(dev), scale, window,
                                           scales[0], scales[1])
        else:  # a prefill chunk (its K/V are already stored) or a verify batch
            o = self._att.extend_attention(q.contiguous(), *args, q_pos.to(dev), scale, window,
                                           scales[0], scales[1])
        return o.reshape(T, n_h * hd)


_REGISTRY = {"torch": TorchAttention, "triton": TritonAttention}


def get_attention_backend(name: str = "auto", device: str | torch.device = "cpu", runtime=None) -> AttentionBackend:
    """`auto`: triton for a model whose runtime (`models.runtime.Runtime`, decided at load) is
    triton, torch for every other runtime; a model built without the loader (no runtime) asks
    `kernels.arch.triton_supported(device)` (a CUDA GPU of sm_75 or newer, triton importable).
    `triton` named on an older GPU is a one-line ValueError saying why (on the CPU it stays
    allowed: the interpreter runs it in tests)."""
    from kernels.arch import triton_supported
    from models.runtime import Runtime

    device = torch.device(device)
    if name == "auto":
        triton = runtime is Runtime.TRITON if runtime is not None else triton_supported(device)[0]
        name = "triton" if triton else "torch"
    elif name == "triton" and device.type == "cuda":
        ok, why = triton_supported(device)
        if not ok:
            raise ValueError(f"attention backend triton: {why}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend '{name}' (auto, {', '.join(_REGISTRY)})")
    return _REGISTRY[name]()
