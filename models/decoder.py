"""The decoder pass shared by the model families: embed -> layers -> final norm -> head, and the
per-forward RoPE table memo."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .kv_cache import DenseKVCache, KVStore
from .ops import cpu_chains, rms_norm, rope_cos_sin
from .runtime import Runtime

Trace = Optional[Callable[[str, int, torch.Tensor], None]]  # trace(name, layer, tensor); layer -1 = none


class NonFiniteError(RuntimeError):
    """inf/NaN activations in a step: `str()` is one line naming the first layer whose output was not
    finite; `details` lists every layer's output sum (a note of the exception: the traceback that
    `--debug` prints shows it)."""

    def __init__(self, layer: int, n_layer: int, details: str):
        super().__init__(f"non-finite activations (inf/NaN) from layer {layer} of {n_layer} on: the file's "
                         f"weights or metadata give values out of range (try --exact for float32 throughout)")
        self.layer, self.details = layer, details
        if hasattr(self, "add_note"):  # Python >= 3.11
            self.add_note(details)


class FiniteWatch:
    """Non-finite activations found once per step, not per matmul: each layer leaves the sum of its
    output (one small reduction, no sync; inf and NaN survive a sum), and `check()` reads only the
    last one (one sync a step). Only when that is not finite are the others read, to name the first
    layer that went bad. Off (no work at all) where the sums would be extra kernels: CUDA."""

    def __init__(self, device: torch.device, n_layer: int):
        self.sums: Optional[list] = [] if device.type == "cpu" else None
        self.n_layer = n_layer

    def layer(self, i: int, x: torch.Tensor) -> None:
        if self.sums is not None:
            self.sums.append((i, x.sum()))

    def check(self) -> None:
        if not self.sums or bool(torch.isfinite(self.sums[-1][1])):
            return
        values = [(i, float(v)) for i, v in self.sums]
        first = next(i for i, v in values if not math.isfinite(v))
        raise NonFiniteError(first, self.n_layer, "\n".join(f"  layer {i}: output sum {v:.6g}" for i, v in values))


class DecoderModel:
    """The whole pass, shared by the model files; each family provides embed / layer / norm / head.

    `embed(tokens)` -> (x [T, d], per-layer inputs [T, L, P] or None); `layer(i, x, pos, pl_i, cache,
    trace)` -> x; `norm(x)` -> post-final-norm y; `head(y)` -> logits.

    Two per-forward memos keep work out of the layers: `rope` computes cos/sin once per distinct
    frequency set (keyed on the identity of `pos`), and `pre_norm` returns the normed residual a
    layer's fused residual kernel already wrote (`keep_norm`, keyed on the identity of x), so on
    the kernel path no layer runs its attention norm (or the final norm) as a kernel of its own.
    """

    cfg: object
    device: torch.device
    runtime: Runtime = Runtime.REFERENCE  # set at load (models/runtime.py); on ggml the ops run ggml chains
    inv_freq: list  # [n_layer] inverse-frequency tensors on the device (one object per distinct set)
    inv_freq_host: list  # the same on the CPU (float64): host-side tables for the batched decoder
    pos_scale: Optional[list] = None  # [n_layer] position multipliers (linear RoPE scaling)
    _rope_memo: tuple = (None, {})
    _norm_memo: tuple = (None, None, None)  # (x, weight, rms_norm(x) * weight) of the last layer

    def set_rope(self, inv_freq_host: list, pos_scale: Optional[list] = None) -> None:
        """Per-layer inverse frequencies given on the CPU (layers of one type share one object)."""
        dev: dict = {}
        self.inv_freq_host = list(inv_freq_host)
        self.inv_freq = [dev.setdefault(id(f), f.to(self.device)) for f in self.inv_freq_host]
        self.pos_scale = pos_scale

    def _rope_key(self, i: int, dtype) -> tuple:
        return (id(self.inv_freq[i]), self.pos_scale[i] if self.pos_scale else 1.0, dtype)

    def rope(self, i: int, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for layer i at `pos`, computed once per forward for each distinct frequency set."""
        if self._rope_memo[0] is not pos:
            self._rope_memo = (pos, {})
        key = self._rope_key(i, dtype)
        memo = self._rope_memo[1]
        if key not in memo:
            memo[key] = rope_cos_sin(pos, self.inv_freq[i], dtype, key[1])
        return memo[key]

    def rope_sets(self) -> list[int]:
        """One layer of each distinct frequency set (inverse frequencies and position scale)."""
        first: dict = {}
        for i in range(self.cfg.n_layer):
            first.setdefault(self._rope_key(i, None), i)
        return list(first.values())

    def rope_host(self, pos: torch.Tensor, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin [T, 1, n_rot/2] on the CPU for CPU positions `pos`, per `rope_sets()` entry."""
        return [rope_cos_sin(pos, self.inv_freq_host[i], dtype, self._rope_key(i, None)[1])
                for i in self.rope_sets()]

    def seed_rope(self, pos: torch.Tensor, tables: list, dtype=torch.float32) -> None:
        """Make `rope(i, pos, dtype)` return `tables` (one (cos, sin) per `rope_sets()` entry, e.g.
        `rope_host` copied to the device with the step's other inputs) for this forward."""
        self._rope_memo = (pos, {self._rope_key(i, dtype): t for i, t in zip(self.rope_sets(), tables)})

    def keep_norm(self, x: torch.Tensor, weight: torch.Tensor, normed: Optional[torch.Tensor]) -> None:
        """Remember rms_norm(x) * weight when a fused kernel produced it with x (None: forget)."""
        self._norm_memo = (x, weight, normed) if normed is not None else (None, None, None)

    def pre_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rms_norm(x) * weight: the kept one when x is the last layer's output, else computed."""
        kept_x, kept_w, normed = self._norm_memo
        if kept_x is x and kept_w is weight:
            return normed
        return rms_norm(x, weight, self.cfg.rms_eps)

    def attention_limits(self, pos: torch.Tensor, media) -> Optional[torch.Tensor]:
        """The last key position each row of a forward with `media` sees ([T]; None: causal). A
        family whose image tokens attend both ways overrides it (models/gemma4.py)."""
        return None

    def embed_into(self, tokens: torch.Tensor, x_out: torch.Tensor, pl_out: Optional[torch.Tensor]) -> None:
        """`embed(tokens)` written into preallocated buffers (the batched decoder's static inputs)."""
        x, pl = self.embed(tokens)
        x_out.copy_(x)
        if pl_out is not None:
            pl_out.copy_(pl)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos: Optional[torch.Tensor] = None,
                cache: Optional[KVStore] = None, logits_rows: Optional[torch.Tensor] = None,
                trace: Trace = None, media=None) -> torch.Tensor:
        """tokens [T] int64 at positions pos [T] (default 0..T-1) -> logits [R, V] for `logits_rows`
        (default: every row). Writes K/V of the owning layers into `cache` (a fresh one if None).
        `media` (Gemma 4: models.gemma4.MediaRows): image/audio rows merged into the embedding."""
        with cpu_chains(self):
            return self._forward(tokens, pos, cache, logits_rows, trace, media)

    def _forward(self, tokens, pos, cache, logits_rows, trace, media) -> torch.Tensor:
        cache = DenseKVCache() if cache is None else cache
        host = getattr(self, "host_layers", None)  # the first layers on the CPU beside a GPU (models/host_layers.py)
        first, pl = 0, None
        if host is not None:
            pos_host = torch.arange(tokens.shape[0]) if pos is None else pos.cpu()
            x, first = host.front(tokens, pos_host, [cache] * tokens.shape[0], media, trace=trace), host.n
        tokens = tokens.to(self.device)
        pos = torch.arange(tokens.shape[0], device=self.device) if pos is None else pos.to(self.device)
        if host is None:
            x, pl = self.embed(tokens) if media is None else self.embed(tokens, media)
            if trace:
                trace("inp_scaled", -1, x)
        last_key = self.attention_limits(pos, media)
        watch = FiniteWatch(self.device, self.cfg.n_layer)
        for i in range(first, self.cfg.n_layer):
            x = self.layer(i, x, pos, None if pl is None else pl[:, i], cache, trace, last_key)
            watch.layer(i, x)
        watch.check()
        if logits_rows is not None:
            x = x[logits_rows]
        y = self.norm(x)
        if trace:
            trace("result_norm", -1, y)
        return self.head(y)
