"""Runs the model over one chunk of one sequence against its pooled KV, with fast prefill.

Fast prefill (spec §6): KV-shared layers write no KV, so a token's pass through them only feeds
that token's own logits. Chunks with no sampled row skip those layers entirely; the chunk that
ends the prompt runs them for its last token only. Logits are computed only where a token is
sampled. With `fast_prefill=False` every row goes through every layer (the plain path).
"""
from __future__ import annotations


import torch

from models.decoder import FiniteWatch
from models.ops import cpu_chains
from models.token_graph import MAX_ROWS as TOKEN_ROWS

from . import failpoints
from .kv.sequence import SequenceKV


class ModelRunner:
    def __init__(self, model, fast_prefill: bool = True):
        self.model, self.fast_prefill = model, fast_prefill
        cfg = model.cfg
        # Gemma 3 has no KV-shared layers: its "shared part" is empty and only logits shrink.
        self.first_shared = getattr(cfg, "first_shared", cfg.n_layer)

    @torch.no_grad()  # not inference_mode: slot bookkeeping tensors made here are updated in place later
    def forward(self, kv: SequenceKV, tokens: list[int], start: int, want_logits: bool,
                all_rows: bool = False, return_hidden: bool = False, media=None):
        """Compute `tokens` at positions start.. into `kv`; logits [V] of the last row if
        `want_logits` ([T, V] for every row if `all_rows`, e.g. speculative verification).
        `return_hidden`: (logits, y) with y the post-final-norm rows (the assistant's h).
        `media`: models.gemma4.MediaRows of this chunk (image/audio soft tokens replace its rows)."""
        with cpu_chains(self.model):
            return self._forward(kv, tokens, start, want_logits, all_rows, return_hidden, media)

    @torch.no_grad()
    def decode_together(self, kvs: list[SequenceKV], tokens: list[int]) -> torch.Tensor:
        """One decode token per sequence (tokens[b] at the position `kvs[b].begin` was given: the
        caller begins and ends each forward) in one forward -> logits [B, V]: on llama.cpp's CPU
        kernels the model's token graph takes the B rows at once (models/token_graph.py: each
        weight read once for all of them); where it does not apply, each row runs as `forward`
        runs a decode token."""
        with cpu_chains(self.model):
            model, L = self.model, self.model.cfg.n_layer
            if failpoints.ACTIVE:
                failpoints.maybe_fail("forward.oom")
            # a token at a time: the per-layer inputs' projection is a float matrix (F32/BF16),
            # whose ggml product of several rows rounds otherwise than one row's
            rows = [model.embed(torch.tensor([t], dtype=torch.long)) for t in tokens]
            x = torch.cat([r[0] for r in rows])
            pl = None if rows[0][1] is None else torch.cat([r[1] for r in rows])
            pos = torch.cat([kv.positions(model.device) for kv in kvs])
            host = getattr(model, "host_layers", None)
            if host is not None:  # the first layers on the CPU beside a GPU: B rows in one host pass
                x = host.front(torch.tensor(tokens, dtype=torch.long), torch.cat([kv.positions("cpu") for kv in kvs]),
                               kvs, decode=True)
                return torch.stack([self._layers(kv, x[b:b + 1], None, pos[b:b + 1], True, False, False, None, host.n)
                                    for b, kv in enumerate(kvs)])
            step = getattr(model, "decode_step", None)
            out = step(x, pos, kvs, pl) if step is not None else None
            if out is not None:  # (logits, h, y)
                watch = FiniteWatch(model.device, L)
                watch.layer(L - 1, out[1])
                watch.check()
                return out[0]
            return torch.stack([self._layers(kv, x[b:b + 1], None if pl is None else pl[b:b + 1], pos[b:b + 1],
                                             True, False, False, None) for b, kv in enumerate(kvs)])

    def _forward(self, kv, tokens, start, want_logits, all_rows, return_hidden, media):
        model, L = self.model, self.model.cfg.n_layer
        ids = torch.tensor(tokens, dtype=torch.long)
        pos_host = torch.arange(start, start + len(tokens))  # CPU int64 [T]: slot bookkeeping, no device sync
        kv.begin(pos_host)
        pos = kv.positions(model.device)  # with the step's slot tables: one host -> device copy a forward
        watch = FiniteWatch(model.device, L)  # one check a step (CPU), naming the layer
        try:
            if failpoints.ACTIVE:
                failpoints.maybe_fail("forward.oom")
            # a decode token, the prompt's last token, a draft's verify rows: one ggml graph (on
            # llama.cpp's CPU kernels), each row attending as a decode step at its position would
            decode = want_logits and media is None and (len(tokens) == 1 or (all_rows and len(tokens) <= TOKEN_ROWS))
            last_key = model.attention_limits(pos, media)  # 26B/31B image rows: their whole image
            host = getattr(model, "host_layers", None)
            if host is not None:  # the embedding and the first layers on the CPU beside a GPU, one crossing
                x = host.front(ids, pos_host, [kv] * len(tokens), media, decode)
                return self._layers(kv, x, None, pos, want_logits, all_rows, return_hidden, last_key, host.n)
            x, pl = model.embed(ids) if media is None else model.embed(ids, media)
            step = getattr(model, "decode_step", None) if decode else None
            out = step(x, pos, [kv] * len(tokens), pl) if step is not None else None
            if out is not None:
                logits, h, y = out
                watch.layer(L - 1, h)
                watch.check()
                if return_hidden:
                    return (logits, y) if all_rows else (logits[0], y[0])
                return logits if all_rows else logits[0]
            return self._layers(kv, x, pl, pos, want_logits, all_rows, return_hidden, last_key)
        finally:
            kv.end()

    def _layers(self, kv, x, pl, pos, want_logits, all_rows, return_hidden, last_key, first: int = 0):
        """The layers one by one from `first` over rows x [T, d] of `kv`'s forward (begun), fast
        prefill's cut included, the final norm and the head."""
        model, L = self.model, self.model.cfg.n_layer
        watch = FiniteWatch(model.device, L)  # one check a step (CPU), naming the layer
        for i in range(first, self.first_shared):
            x = model.layer(i, x, pos, None if pl is None else pl[:, i], kv, last_key=last_key)
            watch.layer(i, x)
        if self.fast_prefill and not all_rows and self.first_shared < L:
            if not want_logits:
                watch.check()
                return None  # an intermediate chunk: the shared layers would feed nothing
            x, pos = x[-1:], pos[-1:]
            pl = None if pl is None else pl[-1:]
            last_key = None  # one row sees up to itself
        for i in range(self.first_shared, L):
            x = model.layer(i, x, pos, None if pl is None else pl[:, i], kv, last_key=last_key)
            watch.layer(i, x)
        watch.check()
        if not want_logits:
            return None
        y = model.norm(x if all_rows else x[-1:])
        logits = model.head(y)
        if return_hidden:
            return (logits, y) if all_rows else (logits[0], y[0])
        return logits if all_rows else logits[0]
