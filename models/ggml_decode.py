"""A decode token of a Gemma-3-shaped model on llama.cpp's CPU kernels as ggml graphs: one graph
a layer (kernels/ggml_layer.py) or the whole token, every layer and the head, in one graph
(kernels/ggml_step.py). Each returns None where it does not apply (a matrix off ggml, a cache
without float32 slabs, more than one token, ...): the models then run the layer op by op
(models/ops.py), the same nodes in the same order.

Switches, for tests and comparisons: EDGEGEM_CPU_STEP_GRAPH=0 runs a graph a layer,
EDGEGEM_CPU_LAYER_GRAPH=0 the four graphs a layer (prologue, attention, two residuals).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kernels.env import env

from .ops import _chains, cpu_kernels_attend


def _token_ready(x: torch.Tensor, cache, *tables: torch.Tensor) -> bool:
    """One token inside `cpu_chains` with ggml attention, `tables` (norm weights, cos/sin) as the
    chains take them, and a cache that offers its slabs (`decode_target`)."""
    return x.shape[0] == 1 and cpu_kernels_attend(x) and _chains(*tables) is not None \
        and hasattr(cache, "decode_target")


def _layer_graph_parts(w, b: str, n_head: int, head_dim: int, cache, layer: int, window: Optional[int]):
    """What a layer needs to run inside a ggml graph as a decode token (`_token_ready` checked):
    (qkv, v, w_o, gate_up, down matrices for one row, the cache's `decode_target`), or None where
    any of it is missing: a matrix not on llama.cpp's kernels, q/k not stacked, a cache without
    float32 slabs or a window `_masked` does not give."""
    qkv, v_m = w.get(b + "attn_qkv.weight"), w.get(b + "attn_v.weight")
    gate_up, down, w_o = w.get(b + "ffn_gate_up.weight"), w[b + "ffn_down.weight"], w[b + "attn_output.weight"]
    mats = (qkv, gate_up, down, w_o) + (() if v_m is None else (v_m,))
    if not all(hasattr(m, "matrix_for") for m in mats) or qkv.shape[0] <= n_head * head_dim:
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
    (kernels/ggml_layer.py): inside `cpu_chains` with ggml attention, the stacked q/k(/v) and
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
    from kernels.ggml_layer import decode_layer

    qkv, v_m, w_o, gate_up, down, target = parts
    return decode_layer(x, a, qkv, v_m, n_head, n_kv, head_dim, w[b + "attn_q_norm.weight"],
                        w[b + "attn_k_norm.weight"], eps, cos, sin, v_norm, *target, scale, w_o,
                        w[b + "post_attention_norm.weight"], w[b + "ffn_norm.weight"], gate_up, down,
                        w[b + "post_ffw_norm.weight"], next_weight)


def fused_decode_step(x: torch.Tensor, w, n_layer: int, n_head: int, n_kv: int, head_dim: int, eps: float,
                      ropes: list, rope_of: Sequence[int], windows: Sequence[Optional[int]], scale: float,
                      v_norm: bool, cache, head, owner):
    """A Gemma-3-shaped decode token whole (every layer, the final norm, the head) as one ggml
    graph (kernels/ggml_step.py) where every layer can run as `fused_decode_layer` does and the
    head is on llama.cpp's kernels: x [1, d] embedded; ropes (cos, sin) per rope set, rope_of the
    set of each layer -> (logits [1, vocab] before any softcap, h [1, d]), or None (the layer by
    layer path then runs; EDGEGEM_CPU_STEP_GRAPH=0 forces it)."""
    if not env().cpu_step_graph or not hasattr(head, "matrix_for") \
            or any(c.shape[-1] == 0 for c, _ in ropes) or not _token_ready(x, cache, *(t for r in ropes for t in r)):
        return None
    from kernels.ggml_step import StepLayer, decode_step

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
