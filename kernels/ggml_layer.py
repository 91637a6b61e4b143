"""A whole decoder layer of one decode token as one ggml graph (Gemma 3 shape: no per-layer input).

Why: the three chains of kernels/ggml_ops.py and the attention of kernels/ggml_attention.py are
four graph runs a layer with Python between them; on the demo model (18 layers) that is ~10 ms of
a ~25 ms step besides the products and the head. One run a layer does the same nodes in the same
order: the projections, q/k RMSNorm + RoPE, the new K/V row stored into the slabs
(`ggml_set_rows` at the step's slot), flash attention over the slab window (the masked window of
`SequenceKV._masked`, read after the store: ggml computes nodes in the order they were added),
the output projection and residual, the gated MLP and its residual, the next layer's pre-norm.

Numerics: those of the four runs it replaces, node for node (tests/test_ggml_layer.py compares
them bit for bit).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .ggml import Matrix
from .ggml_attention import _flash
from .ggml_graph import Graph, _fns, layout
from .ggml_ops import _cached, _check, _norm, _rope, raw_v


def _set_rows():
    f = _fns()
    if "set_rows" not in f:
        from .ggml import _load

        lib, P = _load(), ctypes.c_void_p
        f["set_rows"] = lib._fn(lib.base, "ggml_set_rows", P, P, P, P, P)
        f["permute"] = lib._fn(lib.base, "ggml_permute", P, P, P, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int)
    return f


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
    f = _set_rows()
    nq, nk = n_head * head_dim, n_kv * head_dim
    y = g.mul_mat(g.matrix(qkv), ga)
    width = qkv.shape[0]
    nb = [4, 4 * head_dim, 4 * width]
    # q and k side by side in the product: one RMSNorm, one weight product (q's weight on the
    # query heads, k's on the key heads) and one RoPE for both (the same values, half the nodes)
    heads = n_head + n_kv
    qk = _rope(g, g.mul(g.rms_norm(g.view(y, [head_dim, heads, 1], nb, 0), eps), gqkw), head_dim, heads, 1,
               gc, gs, n_half)
    q = g.view(qk, [head_dim, n_head, 1], [4, 4 * head_dim, 4 * head_dim * heads], 0)
    k = g.view(qk, [nk, 1], [4, 4 * head_dim * heads], 4 * nq)
    v = raw_v(g, y, ga, v_matrix, width, n_head, n_kv, head_dim, 1)
    v = _norm(g, v, None, eps) if v_norm else g.cont(v)
    # the stores first: their nodes come before the attention's in the graph's order
    store_k = f["set_rows"](g.ctx, gks, k, gslot)
    store_v = f["set_rows"](g.ctx, gvs, g.view(v, [nk, 1], [4, 4 * nk], 0), gslot)
    g.expand(store_k)
    g.expand(store_v)
    qp = f["permute"](g.ctx, q, 0, 2, 1, 3)  # [hd, n_head, 1] -> [hd, 1, n_head]
    o = _flash()(g.ctx, qp, gkh, gvh, gmask, float(scale), 0.0, 0.0)  # [hd, n_head, 1]
    o2 = g.view(o, [nq, 1], [4, 4 * nq], 0)
    h = g.add(gx, _norm(g, g.mul_mat(g.matrix(w_o), o2), gpa, eps))
    m = _norm(g, h, gfn, eps)
    act = g.geglu(g.mul_mat(g.matrix(gate_up), m))
    h = g.add(h, _norm(g, g.mul_mat(g.matrix(down), act), gpf, eps))
    return h, _norm(g, h, gnw, eps), (store_k, store_v)


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
    kernels.ggml_ops.attention_prologue; k_slab, v_slab [capacity, n_kv, hd] float32 the layer's
    slabs, slot int64 [1] this token's slot in them; k_win, v_win [S, n_kv, hd] views of the same
    slabs and mask float16 [1, S] (the window the query sees, this token's slot included); w_o,
    post_attn, ffn_norm as attn_residual; gate_up (stacked), down, post_ffw, next_weight as
    ffn_residual without a per-layer input -> (h [1, d], rms_norm(h) * next_weight). The slabs
    receive this token's K and V."""
    _check(x, a, q_weight, k_weight, cos, sin, post_attn, ffn_norm, post_ffw, next_weight)
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
        g._keep += [q_weight, k_weight]  # the key holds their ids: they must outlive the graph
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
    _cached(key, build).run(ins, [h, n])
    return h, n
