"""Dry runs of the CUDA path on the meta device: every kernel a decode step (or a prefill chunk)
launches, counted and recorded without a GPU.

The model is the synthetic E2B/E4B layout (`models/synthetic.py`) with uninitialised weights on the
meta device (host embedding tables on the CPU, as `--embed-weights host` keeps them), the KV pools
on meta, and the Triton attention backend. Inside `kernels.triton.launch.record_launches` the model takes
exactly the branches it takes on CUDA (the kernel dispatch treats meta like CUDA while recording),
torch ops on meta compute nothing, and Triton launches are recorded instead of run. What comes out:
the number of kernels per step (Triton + device-side torch ops) and the Triton launches with their
real arguments, which `kernels/triton/compile_check.py` compiles for sm_75..sm_120.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.triton.launch import LaunchRecord, record_launches

META = torch.device("meta")


@dataclass
class DryRun:
    """One recorded forward: what ran (`record`) and what it was (`kind`, batch, rows, context)."""
    kind: str  # "decode" (B sequences x T rows through the batched decoder) or "prefill"
    batch: int
    rows: int
    context: int
    kv: str
    record: LaunchRecord

    @property
    def kernels(self) -> int:
        return self.record.total


def dry_model(variant: str, dtype=torch.bfloat16, host_tensors: frozenset = frozenset()):
    """The synthetic `variant` model on the meta device, quantized matrices, host embedding tables
    (and `host_tensors`: expert banks in host RAM, uninitialised)."""
    from models.synthetic import synthetic_model

    return synthetic_model(variant, META, dtype=dtype, host_embeddings=True, quantized=True, fill="empty",
                           host_tensors=host_tensors)


def dry_host_expert_model(variant: str = "26b-a4b", cache_slots: int = 0, dtype=torch.bfloat16):
    """The synthetic MoE `variant` on the meta device with every layer's expert banks in host RAM
    (`--cpu-moe`: models/host_experts.py), and with `cache_slots` > 0 a hot-expert cache of that many
    device slots per layer holding experts 0..cache_slots-1 (no admissions during a step: a steady
    cache). The banks are the layout's GGUF bytes at full size, uninitialised: 26B-A4B's 30 layers
    x (gate_up Q4_K 285 MB + down 282 MB) are 17 GB of address space, but a step touches only the
    k picked experts' pages (fresh pages read as zeros), so RSS grows by about k/E of it."""
    from models.expert_cache import ExpertCache
    from models.host_experts import cache_banks
    from models.synthetic import synthetic_specs

    banks = frozenset(s["name"] for s in synthetic_specs(variant) if s["name"].endswith("_exps.weight"))
    if not banks:
        raise ValueError(f"{variant}: no expert banks (an MoE variant has them: 26b-a4b)")
    model = dry_model(variant, dtype, host_tensors=banks)  # banks [E, out, row bytes], 64-byte aligned
    if cache_slots:
        cache = ExpertCache(cache_banks(model), cache_slots, device=META)
        held = torch.arange(cache.slots).reshape(1, -1)
        for i in cache.layers:
            cache.admit(i, held, torch.zeros_like(held, dtype=torch.bool))
        cache.admit_after = 2 ** 62
        cache.stats = type(cache.stats)()
        model.expert_cache = cache
    return model


def _pools(model, context: int, rows: int, batch: int, kv: str, swa_kv: Optional[str]):
    from ..kv.format import resolve_format
    from ..kv.pool import HybridKVPool

    cfg = model.cfg
    fmt = resolve_format(kv, "cuda")
    swa = resolve_format(swa_kv or kv, "cuda")
    need = batch * (context + rows) + 64
    window = getattr(cfg, "sliding_window", 0) or 0
    win_need = batch * (min(context, window + 64) + max(rows, 256)) + 64
    return HybridKVPool(cfg, need, win_need, fmt, swa, device=META)


def _sequences(model, pools, backend, batch: int, context: int):
    from ..kv.sequence import SequenceKV

    kvs = []
    for _ in range(batch):
        kv = SequenceKV(pools, getattr(model.cfg, "sliding_window", None), model.dtype, backend=backend)
        for start in range(0, context, 256):  # slots for the prefix (its K/V are never computed here)
            kv.begin(torch.arange(start, min(context, start + 256)))
            kv.end()  # drops the window slots no later query sees
        kvs.append(kv)
    return kvs


def decode_step(model, batch: int = 1, rows: int = 1, context: int = 4096, kv: str = "bf16",
                swa_kv: Optional[str] = None, torch_ops: bool = True) -> DryRun:
    """One step of the batched decoder (`engine/batch_decode.py`, what a CUDA graph captures plus
    the host-side fill around it) for `batch` sequences of `context` tokens, `rows` new tokens each
    (1: decode; 1 + K: a speculative verify). A first step, not recorded, builds the static buffers."""
    from ..attention_backend import TritonAttention
    from ..batch_decode import BatchDecoder

    backend = TritonAttention()
    pools = _pools(model, context, 2 * rows, batch, kv, swa_kv)
    kvs = _sequences(model, pools, backend, batch, context)
    dec = BatchDecoder(model, pools, backend=backend, graphs=False)
    for step in range(2):
        start = context + step * rows
        for s in kvs:
            s.begin(torch.arange(start, start + rows))
        with record_launches(torch_ops=torch_ops) as record:  # the first one is discarded
            dec.forward(kvs, tokens=[[5] * rows for _ in kvs], T=rows)
        for s in kvs:
            s.end()
    return DryRun("decode", batch, rows, context, kv, record)


def prefill_chunk(model, chunk: int = 2048, context: int = 0, kv: str = "bf16", swa_kv: Optional[str] = None,
                  want_logits: bool = True, torch_ops: bool = True) -> DryRun:
    """One prefill chunk of `chunk` tokens after `context` cached ones through the engine's runner
    (fast prefill: the KV-shared layers run for the last row only)."""
    from ..attention_backend import TritonAttention
    from ..runner import ModelRunner

    backend = TritonAttention()
    pools = _pools(model, context, chunk, 1, kv, swa_kv)
    (seq,) = _sequences(model, pools, backend, 1, context)
    runner = ModelRunner(model, fast_prefill=True)
    with record_launches(torch_ops=torch_ops) as record:
        runner.forward(seq, [5] * chunk, context, want_logits)
    return DryRun("prefill", 1, chunk, context, kv, record)
