"""Whole layers in host RAM beside a GPU (llama.cpp's `--n-gpu-layers N`, `-ngl`): the first k
layers of a dense Gemma-4 (31B) held and computed by the CPU in the CPU runtime's form, the other
L - k, the final norm and the head on the GPU as without offload (engine/placement.py picks k, the
memory plan counts those layers' weights and KV in host memory). Per forward of T rows:

  host    x0 = E[t]·√d, the rows read from the file's token table (the CPU runtime's lookup)
  host    layers 0..k-1 as the CPU runtime runs them: llama.cpp's kernels on the file's bytes
          (`Gemma4Model.layer` under `cpu_chains`; a decode token, B tokens of B sequences or a
          verify's rows: one ggml graph, models/token_graph.py `fused_layers`), their K/V in the
          host slabs of the engine's pools (engine/kv/pool.py `host_layers`)
  host -> device  the residual x [T, d] once, in the device's dtype, from pinned memory
                  (asynchronous): 31B decode in bf16, 5376 x 2 = 10,752 bytes
  device  layers k..L-1, the final norm, the head

The host part reads nothing the GPU computed (the token ids, the positions and its own KV are the
host's), so it waits for nothing on the device, and the device's layers are enqueued behind the
copy: no synchronization beyond the sampler's read of the logits, which any forward has.
`HostLayers.traffic` counts the forwards, the crossings and their bytes, and the host's time.

The host layers compute what the all-CPU runtime computes for those layers, bit for bit (same
weights, same graphs, float32 K/V in their slabs where the pools are fp32): the residual that
crosses is that runtime's after layer k-1 (tests/models/test_host_layers.py). Models with
per-layer inputs (E2B/E4B: they fit small GPUs whole, their tables in host RAM already) and MoE
layers (26B-A4B: its banks go to the host first, `--cpu-moe`) are refused in one line.
"""
from __future__ import annotations

import re
import time
from typing import Optional, Sequence

import torch

from kernels.triton.launch import host_compute

from .decoder import FiniteWatch, Trace
from .ops import cpu_chains
from .token_graph import fused_layers

_LAYER = re.compile(r"^blk\.(\d+)\.")


def layer_of(name: str) -> Optional[int]:
    """The layer index of a `blk.N.` tensor name, else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def whole_layers(plan, host_tensors) -> tuple[int, ...]:
    """The layers every tensor of which `plan` (the names a model reads) is in `host_tensors`."""
    by_layer: dict[int, list[str]] = {}
    for name in plan:
        if layer_of(name) is not None:
            by_layer.setdefault(layer_of(name), []).append(name)
    host = set(host_tensors)
    return tuple(sorted(i for i, names in by_layer.items() if all(n in host for n in names)))


def check_cpu_layers(cfg, layers: Sequence[int], arch: str = "gemma4") -> None:
    """Whole layers on the CPU beside a GPU that do not run are a one-line ValueError: not the
    first layers (one crossing a forward), a model with per-layer inputs or expert banks."""
    layers = sorted(layers)
    if not layers:
        return
    if arch != "gemma4":
        raise ValueError(f"whole layers in host RAM beside a GPU run for Gemma-4 models, not a {arch} model")
    if layers != list(range(len(layers))):
        raise ValueError(f"whole layers {', '.join(map(str, layers))} in host RAM: the CPU runs the first layers "
                         f"beside a GPU, as --n-gpu-layers places them (here: layers 0-{len(layers) - 1})")
    if getattr(cfg, "ple_width", 0):
        raise ValueError("whole layers in host RAM beside a GPU run for models without per-layer inputs (31B); "
                         "E2B/E4B keep every layer on the GPU (their tables are in host RAM already)")
    if getattr(cfg, "n_expert", 0):
        raise ValueError("whole layers of a mixture of experts do not run beside a GPU yet (its expert banks do: "
                         "--cpu-moe)")


def host_plan(plan: dict, n: int, n_layer: int) -> dict:
    """The part of `plan` (name -> shape) the host side loads for layers 0..n-1: their tensors,
    the norm after the last of them (the next layer's attention norm or the final norm: its last
    residual update gives that norm too) and the final norm (`Gemma4Model.embed` reads it)."""
    after = f"blk.{n}.attn_norm.weight" if n < n_layer else "output_norm.weight"
    return {name: shape for name, shape in plan.items()
            if (layer_of(name) is not None and layer_of(name) < n) or name in (after, "output_norm.weight")}


class HostLayers:
    """Layers 0..n-1 of a model in host RAM beside a GPU (module doc): `cpu` the model they run on
    (the CPU runtime: its weights, float32, its own RoPE tables), `device` and `dtype` where the
    model's other layers run."""

    def __init__(self, cpu, n: int, device, dtype: torch.dtype):
        self.cpu, self.n, self.device, self.dtype = cpu, n, torch.device(device), dtype
        self.traffic = {"forwards": 0, "rows": 0, "crossings": 0, "to_device": 0, "cpu_ms": 0.0}

    @property
    def runtime(self):
        """The host layers' runtime (models/runtime.py): ggml, or cpu_torch without llama.cpp's kernels."""
        return self.cpu.runtime

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(range(self.n))

    def front(self, tokens: torch.Tensor, pos: torch.Tensor, caches: Sequence, media=None, decode: bool = False,
              trace: Trace = None) -> torch.Tensor:
        """The embedding and layers 0..n-1 on the host, then the one crossing: tokens [T] int64,
        pos [T] int64 (CPU: the host's bookkeeping), caches[t] row t's KV store (one store
        repeated: the T rows of one sequence), `decode` the rows are a decode token each or a
        verify's rows (each attends as a decode step at its position: the token graph) ->
        x [T, d] on the device in its dtype, ready for layer n."""
        t0 = time.perf_counter()
        with torch.no_grad(), host_compute(), cpu_chains(self.cpu):
            x = self._layers(tokens.cpu(), pos.cpu(), caches, media, decode, trace)
        return self._cross(x, t0)

    def _layers(self, tokens, pos, caches, media, decode, trace) -> torch.Tensor:
        cpu, n = self.cpu, self.n
        x, _ = cpu.embed(tokens) if media is None else cpu.embed(tokens, media)
        if trace:
            trace("inp_scaled", -1, x)
        watch = FiniteWatch(cpu.device, cpu.cfg.n_layer)
        if decode and media is None and trace is None:
            h = fused_layers(cpu, x, pos, caches, n)  # None: a cache without float32 windows, no ggml
            if h is not None:
                watch.layer(n - 1, h)
                watch.check()
                return h
        if all(c is caches[0] for c in caches):  # one sequence's rows: every row through a layer at once
            last_key = cpu.attention_limits(pos, media)
            for i in range(n):
                x = cpu.layer(i, x, pos, None, caches[0], trace, last_key)
                watch.layer(i, x)
        else:  # B sequences, a decode token each, outside the token graph: a row at a time
            rows = []
            for b, cache in enumerate(caches):
                xb = x[b:b + 1]
                for i in range(n):
                    xb = cpu.layer(i, xb, pos[b:b + 1], None, cache, trace)
                rows.append(xb)
            x = torch.cat(rows)
            watch.layer(n - 1, x)
        watch.check()
        return x

    def _cross(self, x: torch.Tensor, t0: float) -> torch.Tensor:
        """x [T, d] float32 on the host -> [T, d] in the device's dtype there: cast on the host
        into pinned memory (half the bytes for bf16), one asynchronous copy (torch's pinned
        allocator keeps the buffer until the copy is done). The interpreter's stand-in device,
        the CPU, gets the cast copy itself."""
        cuda = self.device.type == "cuda"
        staged = torch.empty(x.shape, dtype=self.dtype, pin_memory=cuda)
        staged.copy_(x)
        out = staged.to(self.device, non_blocking=True) if cuda else staged
        t = self.traffic
        t["forwards"] += 1
        t["rows"] += x.shape[0]
        t["crossings"] += 1
        t["to_device"] += staged.numel() * staged.element_size()
        t["cpu_ms"] += (time.perf_counter() - t0) * 1e3
        return out


def load_host_layers(source, cfg, plan: dict, on_host: dict, n: int, model, progress=None) -> HostLayers:
    """Layers 0..n-1 of `model` (its class, config and file) as the CPU runtime loads them:
    `on_host` (`host_plan`) through `load_weights` with `cpu_quant` (llama.cpp's kernels on the
    file's bytes where they are here, else the torch CPU formats: `runtime_of_flags`), the token
    table's rows looked up from the file as that runtime does (`token_embd.weight` names the same
    table there: the host model never computes a head)."""
    from .runtime import runtime_of_flags
    from .weights import load_weights, lookup_table

    w = load_weights(source, on_host, torch.float32, "cpu", torch.float16, progress=progress, cpu_quant=True)
    w["token_embd.host"] = w["token_embd.weight"] = lookup_table(source, "token_embd.weight",
                                                                 plan["token_embd.weight"])
    cpu = type(model)(cfg, w, dtype=torch.float32, device="cpu")
    cpu.runtime = runtime_of_flags("cpu", torch.float16, cpu_quant=True)
    return HostLayers(cpu, n, model.device, model.dtype)


def crossing_bytes(d: int, dtype: torch.dtype, T: int = 1) -> int:
    """Host -> device bytes of one forward of T rows (the residual in the device's dtype); nothing
    crosses back."""
    return T * d * torch.empty((), dtype=dtype).element_size()
