"""A Gemma 3 decode layer on llama.cpp's CPU kernels as one ggml graph (`fused_decode_layer` ->
`decode_layer`), where the whole token's graph (models/token_graph.py) does not run (turned off
by EDGEGEM_CPU_STEP_GRAPH=0, or a head or a layer it cannot take). `fused_decode_layer` returns
None where it does not apply (a matrix off ggml, a cache without float32 slabs, more than one
token, ...): the model then runs the layer op by op (models/ops.py), the same nodes in the same order.

Why a graph a layer: the three chains of kernels/ggml/ops.py and the attention of
kernels/ggml/attention.py are four graph runs a layer with Python between them; on the demo model
(18 layers) that is ~10 ms of a ~25 ms step besides the products and the head. One run a layer does
the same nodes in the same order: the projections, q/k RMSNorm + RoPE, the new K/V row stored into
the slabs (`ggml_set_rows` at the step's slot), flash attention over the slab window (the masked
window of `SequenceKV._masked`, read after the store: ggml computes nodes in the order they were
added), the output projection and residual, the gated MLP and its residual, the next layer's
pre-norm.

Numerics: those of the four runs a layer replaces, node for node (tests/models/test_ggml_layer.py
compares them bit for bit).

Switch, for tests and comparisons: EDGEGEM_CPU_LAYER_GRAPH=0 runs the four graphs a layer
(prologue, attention, two residuals).
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.env import env
from kernels.ggml import Graph, Matrix, cached_graph, check_cpu_float32, layout, norm_nodes

from .formats import is_ggml
from .ops import _chains
from .token_graph import attention_nodes, qk_weights


# --- the graph of one layer -------------------------------------------------------------------
def layer_nodes(g: Graph, gx: int, ga: int, qkv: Matrix, v_matrix: Optional[Matrix], n_head: int, n_kv: int,
                head_dim: int, gqkw: int, eps: float, gc: int, gs: int, n_half: int, v_norm: bool,
                gks: int, gvs: int, gslot: int, gkh: int, gvh: int, gmask: int, scale: float,
                w_o: Matrix, gpa: int, gfn: int, gate_up: Matrix, down: Matrix, gpf: int, gnw: int,
                two: bool = False) -> tuple[int, int, tuple[int, int]]:
    """A Gemma 3 decode layer in graph g: `attention_nodes` (its handles), then the MLP residual
    (gfn, gpf its norm weights) -> (h, rms_norm(h) · gnw, the two stores)."""
    h, stores = attention_nodes(g, gx, ga, 1, qkv, v_matrix, n_head, n_kv, head_dim, gqkw, eps, gc, gs, n_half,
                                v_norm, (gks, gvs, gslot), [(gkh, gvh, gmask, two)], scale, w_o, gpa)
    m = norm_nodes(g, h, gfn, eps)
    act = g.geglu(g.mul_mat(g.matrix(gate_up), m))
    h = g.add(h, norm_nodes(g, g.mul_mat(g.matrix(down), act), gpf, eps))
    return h, norm_nodes(g, h, gnw, eps), stores


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
                                               gfn, gate_up, down, gpf, gnw, mask.shape[0] == 2)
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
