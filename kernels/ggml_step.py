"""A whole decode step of a Gemma-3-shaped model (every layer, the final norm and the head) as one
ggml graph, as llama.cpp computes a token.

Why: one graph a layer (kernels/ggml_layer.py) still leaves a graph run per layer and the Python
between them: on the demo model (18 layers) ~1 ms of Python and per-run costs a step, and each
run opens its own OpenMP parallel region, whose second thread has often gone to sleep in the
meantime (a futex wake per run). One run a step does the same nodes in the same order: layer 0's
pre-norm, each layer's nodes (`layer_nodes`: its stores into the KV slabs ahead of its attention),
the final norm (the last layer's next-norm) and the tied head's product.

Numerics: those of the per-layer graphs and the head's own product, node for node
(tests/test_ggml_step.py compares the engine's tokens and log-probabilities bit for bit).

The graph is kept on the caller's `owner` (the model), one at a time: its inputs' layouts change
when a window grows by a bucket (kernels/ggml_attention: every 64 steps), and a new one is built
then (~18 x 45 nodes: a few ms).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .ggml import Matrix
from .ggml_graph import Graph, layout
from .ggml_layer import check_target, layer_nodes, qk_weights
from .ggml_ops import _check, _norm


@dataclass
class StepLayer:
    """One layer's part of the step: its weights (matrices on ggml, norm weights float32) and the
    cache's target (kernels.ggml_layer.decode_layer's k_slab .. mask)."""
    qkv: Matrix
    v_matrix: Optional[Matrix]
    w_o: Matrix
    gate_up: Matrix
    down: Matrix
    attn_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    post_attn: torch.Tensor
    ffn_norm: torch.Tensor
    post_ffw: torch.Tensor
    rope: int  # index into decode_step's `ropes`
    k_slab: torch.Tensor  # [capacity, n_kv, hd] float32
    v_slab: torch.Tensor
    slot: torch.Tensor  # int64 [1]
    k_win: torch.Tensor  # [S, n_kv, hd] views of the slabs
    v_win: torch.Tensor
    mask: torch.Tensor  # float16 [1, S]


class _Inputs:
    """The step's per-run inputs, each tensor once (layers share cos/sin, slots and masks)."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self._index: dict = {}

    def add(self, t: torch.Tensor, key=None) -> int:
        key = id(t) if key is None else key
        if key not in self._index:
            self._index[key] = len(self.tensors)
            self.tensors.append(t)
        return self._index[key]


def decode_step(owner, x: torch.Tensor, layers: Sequence[StepLayer], ropes: Sequence[tuple[torch.Tensor, torch.Tensor]],
                final_norm: torch.Tensor, head: Matrix, n_head: int, n_kv: int, head_dim: int, eps: float,
                scale: float, v_norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, d] the embedded token; layers in order; ropes (cos, sin) [1, 1, n_half] per rope set ->
    (logits [1, vocab] float32 of the head, h [1, d] the last layer's residual). The slabs receive
    this token's K and V."""
    _check(x, final_norm, *(t for c, s in ropes for t in (c, s)))
    if x.shape[0] != 1 or not layers:
        raise ValueError(f"ggml decode_step: one token and at least one layer, got x {tuple(x.shape)}")
    for ly in layers:
        check_target("ggml decode_step", x, ly.k_slab, ly.v_slab, ly.slot, ly.k_win, ly.mask)
    n_half = ropes[0][0].shape[-1]
    ins = _Inputs()
    ins.add(x)
    rope_at = [(ins.add(c.reshape(1, 1, n_half), ("cos", id(c))), ins.add(s.reshape(1, 1, n_half), ("sin", id(s))))
               for c, s in ropes]
    nk = n_kv * head_dim
    plan = []
    for ly in layers:
        cap = ly.k_slab.shape[0]
        plan.append((rope_at[ly.rope],
                     ins.add(ly.k_slab.view(cap, nk), ("slab", ly.k_slab.data_ptr())),
                     ins.add(ly.v_slab.view(cap, nk), ("slab", ly.v_slab.data_ptr())),
                     ins.add(ly.slot.reshape(1), ("slot", id(ly.slot))),
                     ins.add(ly.k_win.permute(1, 0, 2)), ins.add(ly.v_win.permute(1, 0, 2)),  # ggml [hd, S, n_kv]
                     ins.add(ly.mask)))
    tensors = ins.tensors
    key = (tuple(layout(t) for t in tensors), tuple(plan), tuple(id(m) for ly in layers for m in (
        ly.qkv, ly.v_matrix, ly.w_o, ly.gate_up, ly.down, ly.attn_norm)), id(head), id(final_norm),
        n_head, n_kv, head_dim, eps, float(scale), v_norm)
    kept = getattr(owner, "_ggml_step_graph", None)
    if kept is None or kept[0] != key:
        kept = (key, _build(tensors, plan, layers, final_norm, head, n_head, n_kv, head_dim, eps, scale, v_norm,
                            n_half))
        owner._ggml_step_graph = kept
    logits, h = torch.empty(1, head.shape[0]), torch.empty(x.shape)
    kept[1].run(tensors, [logits, h])
    return logits, h


def _build(tensors, plan, layers, final_norm, head, n_head, n_kv, head_dim, eps, scale, v_norm, n_half) -> Graph:
    g = Graph(64 * len(layers) + 32)
    nodes = [g.input(t) for t in tensors]
    const: dict = {}

    def c(t: torch.Tensor) -> int:  # a norm weight, bound once (kept alive by the graph)
        if id(t) not in const:
            const[id(t)] = g.constant(t)
        return const[id(t)]

    h = nodes[0]
    a = _norm(g, h, c(layers[0].attn_norm), eps)
    for i, (ly, ((ci, si), ks, vs, slot, kh, vh, mask)) in enumerate(zip(layers, plan)):
        nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else final_norm
        qkw = qk_weights(ly.q_norm, ly.k_norm, n_head, n_kv, head_dim)
        h, a, (store_k, store_v) = layer_nodes(
            g, h, a, ly.qkv, ly.v_matrix, n_head, n_kv, head_dim, g.constant(qkw), eps, nodes[ci], nodes[si],
            n_half, v_norm, nodes[ks], nodes[vs], nodes[slot], nodes[kh], nodes[vh], nodes[mask], scale, ly.w_o,
            c(ly.post_attn), c(ly.ffn_norm), ly.gate_up, ly.down, c(ly.post_ffw), c(nxt))
        g.alias(store_k, ks)
        g.alias(store_v, vs)
    g.output(g.mul_mat(g.matrix(head), a))
    g.output(h)
    return g.finish()
