"""The decoder pass shared by the model families: embed -> layers -> final norm -> head, and the
per-forward RoPE table memo."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .kv_cache import DenseKVCache, KVStore
from .ops import rope_cos_sin

Trace = Optional[Callable[[str, int, torch.Tensor], None]]  # trace(name, layer, tensor); layer -1 = none


class DecoderModel:
    """The whole pass, shared by the model files; each family provides embed / layer / norm / head.

    `embed(tokens)` -> (x [T, d], per-layer inputs [T, L, P] or None); `layer(i, x, pos, pl_i, cache,
    trace)` -> x; `norm(x)` -> post-final-norm y; `head(y)` -> logits.
    """

    cfg: object
    device: torch.device
    inv_freq: list  # [n_layer] inverse-frequency tensors (layers of one type share one object)
    pos_scale: Optional[list] = None  # [n_layer] position multipliers (linear RoPE scaling)
    _rope_memo: tuple = (None, {})

    def rope(self, i: int, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for layer i at `pos`, computed once per forward for each distinct frequency set."""
        if self._rope_memo[0] is not pos:
            self._rope_memo = (pos, {})
        scale = self.pos_scale[i] if self.pos_scale else 1.0
        key = (id(self.inv_freq[i]), scale, dtype)
        memo = self._rope_memo[1]
        if key not in memo:
            memo[key] = rope_cos_sin(pos, self.inv_freq[i], dtype, scale)
        return memo[key]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos: Optional[torch.Tensor] = None,
                cache: Optional[KVStore] = None, logits_rows: Optional[torch.Tensor] = None,
                trace: Trace = None) -> torch.Tensor:
        """tokens [T] int64 at positions pos [T] (default 0..T-1) -> logits [R, V] for `logits_rows`
        (default: every row). Writes K/V of the owning layers into `cache` (a fresh one if None)."""
        tokens = tokens.to(self.device)
        pos = torch.arange(tokens.shape[0], device=self.device) if pos is None else pos.to(self.device)
        cache = DenseKVCache() if cache is None else cache
        x, pl = self.embed(tokens)
        if trace:
            trace("inp_scaled", -1, x)
        for i in range(self.cfg.n_layer):
            x = self.layer(i, x, pos, None if pl is None else pl[:, i], cache, trace)
        if logits_rows is not None:
            x = x[logits_rows]
        y = self.norm(x)
        if trace:
            trace("result_norm", -1, y)
        return self.head(y)
