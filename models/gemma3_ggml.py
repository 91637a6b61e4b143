"""A Gemma 3 decode token on llama.cpp's CPU kernels as ggml graphs: one graph a layer
(`fused_decode_layer` -> `decode_layer`), or the whole token, every layer, the final norm and the
tied head in one graph (`fused_decode_step` -> `decode_step`), as llama.cpp computes a token (it
keeps one graph per family too: src/models/gemma3.cpp). Each `fused_*` returns None where it does
not apply (a matrix off ggml, a cache without float32 slabs, more than one token, ...): the model
then runs the layer op by op (models/ops.py), the same nodes in the same order.

Why a graph a layer: the three chains of kernels/ggml/ops.py and the attention of
kernels/ggml/attention.py are four graph runs a layer with Python between them; on the demo model
(18 layers) that is ~10 ms of a ~25 ms step besides the products and the head. One run a layer does
the same nodes in the same order: the projections, q/k RMSNorm + RoPE, the new K/V row stored into
the slabs (`ggml_set_rows` at the step's slot), flash attention over the slab window (the masked
window of `SequenceKV._masked`, read after the store: ggml computes nodes in the order they were
added), the output projection and residual, the gated MLP and its residual, the next layer's
pre-norm.

Why a graph a token: a graph a layer still leaves a graph run per layer and the Python between
them: on the demo model ~1 ms of Python and per-run costs a step, and each run opens its own OpenMP
parallel region, whose second thread has often gone to sleep in the meantime (a futex wake per run).
The step's graph is kept on the caller's `owner` (the model), one at a time: its inputs' layouts
change when a window grows by a bucket (kernels/ggml/attention.py: every 64 steps), and a new one
is built then (~18 x 45 nodes: a few ms).

Numerics: those of the four runs a layer replaces, node for node (tests/models/test_ggml_layer.py compares
them bit for bit), and for the token those of the per-layer graphs and the head's own product
(tests/models/test_ggml_step.py: the engine's tokens and log-probabilities bit for bit).

Switches, for tests and comparisons: EDGEGEM_CPU_STEP_GRAPH=0 runs a graph a layer,
EDGEGEM_CPU_LAYER_GRAPH=0 the four graphs a layer (prologue, attention, two residuals).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kernels.env import env
from kernels.ggml import (Graph, Matrix, cached_graph, check_cpu_float32, layout, norm_nodes, raw_v,
                          rope_nodes)

from .formats import is_ggml
from .ops import _chains


# --- the graph of one layer -------------------------------------------------------------------
def layer_nodes(g: Graph, gx: int, ga: int, qkv: Matrix, v_matrix: Optional[Matrix], n_head: int, n_kv: int,
                head_dim: int, gqkw: int, eps: float, gc: int, gs: int, n_half: int, v_norm: bool,
                gks: int, gvs: int, gslot: int, gkh: int, gvh: int, gmask: int, scale: float,
                w_o: Matrix, gpa: int, gfn: int, gate_up: Matrix, down: Matrix, gpf: int, gnw: int) -> tuple[int, int, tuple[int, int]]:
    """The nodes of one decode layer in graph g (handles of its inputs: gx the residual [d, 1],
    ga its attention pre-norm, gqkw the q and k norm weights side by side [hd, n_head + n_kv],
    gc/gs cos/sin [n_half, 1, 1], gks/gvs the slabs [n_kv·hd, capacity], gslot the slot, gkh/gvh
    the window [hd, S, n_kv], gmask [S, 1], the norm weights) -> (h, rms_norm(h) · gnw, the two
    stores): the stores are expanded ahead of the attention; the caller aliases them to the slab
    inputs (`Graph.alias`)."""
    nq, nk = n_head * head_dim, n_kv * head_dim
    y = g.mul_mat(g.matrix(qkv), ga)
    width = qkv.shape[0]
    nb = [4, 4 * head_dim, 4 * width]
    # q and k side by side in the product: one RMSNorm, one weight product (q's weight on the
    # query heads, k's on the key heads) and one RoPE for both (the same values, half the nodes)
    heads = n_head + n_kv
    qk = rope_nodes(g, g.mul(g.rms_norm(g.view(y, [head_dim, heads, 1], nb, 0), eps), gqkw), head_dim, heads, 1,
                    gc, gs, n_half)
    q = g.view(qk, [head_dim, n_head, 1], [4, 4 * head_dim, 4 * head_dim * heads], 0)
    k = g.view(qk, [nk, 1], [4, 4 * head_dim * heads], 4 * nq)
    v = raw_v(g, y, ga, v_matrix, width, n_head, n_kv, head_dim, 1)
    v = norm_nodes(g, v, None, eps) if v_norm else g.cont(v)
    # the stores first: their nodes come before the attention's in the graph's order
    store_k = g.set_rows(gks, k, gslot)
    store_v = g.set_rows(gvs, g.view(v, [nk, 1], [4, 4 * nk], 0), gslot)
    g.expand(store_k)
    g.expand(store_v)
    qp = g.permute(q, 0, 2, 1, 3)  # [hd, n_head, 1] -> [hd, 1, n_head]
    o = g.flash_attn_ext(qp, gkh, gvh, gmask, float(scale), 0.0, 0.0)  # [hd, n_head, 1]
    o2 = g.view(o, [nq, 1], [4, 4 * nq], 0)
    h = g.add(gx, norm_nodes(g, g.mul_mat(g.matrix(w_o), o2), gpa, eps))
    m = norm_nodes(g, h, gfn, eps)
    act = g.geglu(g.mul_mat(g.matrix(gate_up), m))
    h = g.add(h, norm_nodes(g, g.mul_mat(g.matrix(down), act), gpf, eps))
    return h, norm_nodes(g, h, gnw, eps), (store_k, store_v)


def check_target(who: str, x: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor, slot: torch.Tensor,
                 k_win: torch.Tensor, mask: torch.Tensor) -> None:
    """One token x and a layer's cache target as the graphs take it (float32 contiguous slabs, an
    int64 slot, float32 windows, a float16 mask), or a one-line ValueError naming `who`."""
    if (x.shape[0] != 1 or k_slab.dtype != torch.float32 or v_slab.dtype != torch.float32
            or not k_slab.is_contiguous() or not v_slab.is_contiguous() or slot.dtype != torch.int64
            or slot.numel() != 1 or k_win.dtype != torch.float32 or mask.dtype != torch.float16):
        raise ValueError(f"{who}: one row, float32 contiguous slabs, an int64 slot, float32 windows "
                         f"and a float16 mask; got x {tuple(x.shape)}, slabs {k_slab.dtype}/{v_slab.dtype}, "
                         f"slot {slot.dtype} {tuple(slot.shape)}, window {k_win.dtype}, mask {mask.dtype}")


def qk_weights(q_weight: torch.Tensor, k_weight: torch.Tensor, n_head: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """The q and k norm weights side by side [n_head + n_kv, hd] (a constant of the graph)."""
    return torch.cat([q_weight.expand(n_head, head_dim), k_weight.expand(n_kv, head_dim)])


def decode_layer(x: torch.Tensor, a: torch.Tensor, qkv: Matrix, v_matrix: Optional[Matrix], n_head: int,
                 n_kv: int, head_dim: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, v_norm: bool,
                 k_slab: torch.Tensor, v_slab: torch.Tensor, slot: torch.Tensor,
                 k_win: torch.Tensor, v_win: torch.Tensor, mask: torch.Tensor, scale: float,
                 w_o: Matrix, post_attn: torch.Tensor, ffn_norm: torch.Tensor, gate_up: Matrix, down: Matrix,
                 post_ffw: torch.Tensor, next_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, d] the residual, a [1, d] its attention pre-norm; qkv / v_matrix / norms / cos, sin as
    kernels.ggml.ops.attention_prologue; k_slab, v_slab [capacity, n_kv, hd] float32 the layer's
    slabs, slot int64 [1] this token's slot in them; k_win, v_win [S, n_kv, hd] views of the same
    slabs and mask float16 [1, S] (the window the query sees, this token's slot included); w_o,
    post_attn, ffn_norm as attn_residual; gate_up (stacked), down, post_ffw, next_weight as
    ffn_residual without a per-layer input -> (h [1, d], rms_norm(h) * next_weight). The slabs
    receive this token's K and V."""
    check_cpu_float32(x, a, q_weight, k_weight, cos, sin, post_attn, ffn_norm, post_ffw, next_weight)
    check_target("ggml decode_layer", x, k_slab, v_slab, slot, k_win, mask)
    n_half = cos.shape[-1]
    cos3, sin3 = cos.reshape(1, 1, n_half), sin.reshape(1, 1, n_half)
    cap = k_slab.shape[0]
    ks2, vs2 = k_slab.view(cap, n_kv * head_dim), v_slab.view(cap, n_kv * head_dim)
    slot = slot.reshape(1)
    kh, vh = k_win.permute(1, 0, 2), v_win.permute(1, 0, 2)  # ggml [hd, S, n_kv]
    ins = [x, a, cos3, sin3, ks2, vs2, slot, kh, vh, mask, post_attn, ffn_norm, post_ffw, next_weight]

    def build(big):
        g = Graph(160, big)
        gx, ga, gc, gs, gks, gvs, gslot, gkh, gvh, gmask, gpa, gfn, gpf, gnw = (g.input(t) for t in ins)
        gqkw = g.constant(qk_weights(q_weight, k_weight, n_head, n_kv, head_dim))
        g.keep(q_weight, k_weight)  # the key holds their ids: they must outlive the graph
        h, n, (store_k, store_v) = layer_nodes(g, gx, ga, qkv, v_matrix, n_head, n_kv, head_dim, gqkw, eps, gc, gs,
                                               n_half, v_norm, gks, gvs, gslot, gkh, gvh, gmask, scale, w_o, gpa,
                                               gfn, gate_up, down, gpf, gnw)
        g.alias(store_k, 4)
        g.alias(store_v, 5)
        g.output(h)
        g.output(n)
        return g.finish()

    key = ("layer", id(qkv), id(v_matrix), id(w_o), id(gate_up), id(down), id(q_weight), id(k_weight), layout(x), layout(cos3), layout(ks2),
           layout(kh), n_head, n_kv, head_dim, v_norm, eps, float(scale))
    h, n = torch.empty(x.shape), torch.empty(x.shape)
    cached_graph(key, build).run(ins, [h, n])
    return h, n


# --- the graph of one token: every layer, the final norm, the head ------------------------------
@dataclass
class StepLayer:
    """One layer's part of the step: its weights (matrices on ggml, norm weights float32) and the
    cache's target (`decode_layer`'s k_slab .. mask)."""
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
    check_cpu_float32(x, final_norm, *(t for c, s in ropes for t in (c, s)))
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
        kept = (key, _build_step(tensors, plan, layers, final_norm, head, n_head, n_kv, head_dim, eps, scale, v_norm,
                                 n_half))
        owner._ggml_step_graph = kept
    logits, h = torch.empty(1, head.shape[0]), torch.empty(x.shape)
    kept[1].run(tensors, [logits, h])
    return logits, h


def _build_step(tensors, plan, layers, final_norm, head, n_head, n_kv, head_dim, eps, scale, v_norm, n_half) -> Graph:
    g = Graph(64 * len(layers) + 32)
    nodes = [g.input(t) for t in tensors]
    const: dict = {}

    def c(t: torch.Tensor) -> int:  # a norm weight, bound once (kept alive by the graph)
        if id(t) not in const:
            const[id(t)] = g.constant(t)
        return const[id(t)]

    h = nodes[0]
    a = norm_nodes(g, h, c(layers[0].attn_norm), eps)
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


# --- the model's side: when a layer or a token can run as one graph ------------------------------
def _token_ready(x: torch.Tensor, cache, *tables: torch.Tensor) -> bool:
    """One token inside `cpu_chains` (a ggml-runtime model's forward) with x and `tables` (norm
    weights, cos/sin) as the chains take them (float32, unit last stride: a float64 model keeps
    the torch ops), and a cache that attends on ggml's kernel (`ggml_attention`: the engine's
    SequenceKV, told so once from the model's runtime) and offers its slabs (`decode_target`)."""
    return x.shape[0] == 1 and getattr(cache, "ggml_attention", False) and _chains(x, *tables) is not None \
        and hasattr(cache, "decode_target")


def _layer_graph_parts(w, b: str, n_head: int, head_dim: int, cache, layer: int, window: Optional[int]):
    """What a layer needs to run inside a ggml graph as a decode token (`_token_ready` checked):
    (qkv, v, w_o, gate_up, down matrices for one row, the cache's `decode_target`), or None where
    any of it is missing: a matrix not on llama.cpp's kernels, q/k not stacked, a cache without
    float32 slabs or a window `_masked` does not give."""
    qkv, v_m = w.get(b + "attn_qkv.weight"), w.get(b + "attn_v.weight")
    gate_up, down, w_o = w.get(b + "ffn_gate_up.weight"), w[b + "ffn_down.weight"], w[b + "attn_output.weight"]
    mats = (qkv, gate_up, down, w_o) + (() if v_m is None else (v_m,))
    if not is_ggml(*mats) or qkv.shape[0] <= n_head * head_dim:
        return None
    target = cache.decode_target(layer, window)
    if target is None:
        return None
    return (qkv.matrix_for(1), None if v_m is None else v_m.matrix_for(1), w_o.matrix_for(1),
            gate_up.matrix_for(1), down.matrix_for(1), target)


def fused_decode_layer(x: torch.Tensor, a: torch.Tensor, w, b: str, n_head: int, n_kv: int, head_dim: int,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, v_norm: bool, cache, layer: int,
                       window: Optional[int], scale: float, next_weight: torch.Tensor):
    """A Gemma-3-shaped layer (no per-layer input) of one decode token as one ggml graph
    (`decode_layer`): inside `cpu_chains` with ggml attention, the stacked q/k(/v) and
    gate/up matrices on llama.cpp's kernels, and a cache that offers the layer's slabs and window
    (`decode_target`: the engine's float32 pools). -> (h, rms_norm(h) * next_weight), or None
    where any of that is missing (the four-run path then runs; EDGEGEM_CPU_LAYER_GRAPH=0 forces it)."""
    if cos.shape[-1] == 0 or not env().cpu_layer_graph:
        return None
    if not _token_ready(x, cache, a, cos, sin, next_weight):
        return None
    parts = _layer_graph_parts(w, b, n_head, head_dim, cache, layer, window)
    if parts is None:
        return None
    qkv, v_m, w_o, gate_up, down, target = parts
    return decode_layer(x, a, qkv, v_m, n_head, n_kv, head_dim, w[b + "attn_q_norm.weight"],
                        w[b + "attn_k_norm.weight"], eps, cos, sin, v_norm, *target, scale, w_o,
                        w[b + "post_attention_norm.weight"], w[b + "ffn_norm.weight"], gate_up, down,
                        w[b + "post_ffw_norm.weight"], next_weight)


def fused_decode_step(x: torch.Tensor, w, n_layer: int, n_head: int, n_kv: int, head_dim: int, eps: float,
                      ropes: list, rope_of: Sequence[int], windows: Sequence[Optional[int]], scale: float,
                      v_norm: bool, cache, head, owner):
    """A Gemma-3-shaped decode token whole (every layer, the final norm, the head) as one ggml
    graph (`decode_step`) where every layer can run as `fused_decode_layer` does and the
    head is on llama.cpp's kernels: x [1, d] embedded; ropes (cos, sin) per rope set, rope_of the
    set of each layer -> (logits [1, vocab] before any softcap, h [1, d]), or None (the layer by
    layer path then runs; EDGEGEM_CPU_STEP_GRAPH=0 forces it)."""
    if not env().cpu_step_graph or not is_ggml(head) \
            or any(c.shape[-1] == 0 for c, _ in ropes) or not _token_ready(x, cache, *(t for r in ropes for t in r)):
        return None
    layers = []
    for i in range(n_layer):
        b = f"blk.{i}."
        parts = _layer_graph_parts(w, b, n_head, head_dim, cache, i, windows[i])
        if parts is None:
            return None
        qkv, v_m, w_o, gate_up, down, (k_slab, v_slab, slot, k_win, v_win, mask) = parts
        layers.append(StepLayer(qkv, v_m, w_o, gate_up, down, w[b + "attn_norm.weight"], w[b + "attn_q_norm.weight"],
                                w[b + "attn_k_norm.weight"], w[b + "post_attention_norm.weight"],
                                w[b + "ffn_norm.weight"], w[b + "post_ffw_norm.weight"], rope_of[i],
                                k_slab, v_slab, slot, k_win, v_win, mask))
    return decode_step(owner, x, layers, ropes, w["output_norm.weight"], head.matrix_for(1), n_head, n_kv, head_dim,
                       eps, scale, v_norm)
