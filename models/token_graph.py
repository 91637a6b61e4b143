"""The decode token of a Gemma model (Gemma 3; Gemma-4 E2B/E4B, 26B-A4B, 31B) on llama.cpp's CPU
kernels as one ggml graph: every layer, the final norm and the head, for B running sequences at
once, as llama.cpp's server decodes its parallel slots (src/models/gemma3.cpp, gemma4.cpp).

Why one graph: a layer as separate graph runs (the prologue, attention, two residuals) leaves Python
and a graph run's fixed costs between them (~140 runs a token on E2B), and each run opens its own
OpenMP region whose second thread has often gone to sleep in the meantime.
Why B sequences: decode is memory-bound; each matrix is one `mul_mat` of B rows, so a step reads
every weight once for all of them (26B-A4B: the chosen experts by `mul_mat_id` over the B tokens).
Attention stays per sequence: one `flash_attn_ext` node over each sequence's own window of the
slab (`SequenceKV.decode_window`), the very node a single sequence runs.

Per layer, for the residual h [d, B] and its attention pre-norm a:
    y = a QKV^T; q, k RMSNorm (their weights) + RoPE at each row's position; v RMSNorm (Gemma-4)
    K, V rows stored at each sequence's new slot (`ggml_set_rows`, ahead of the attention)
    o_b = flash_attn(q_b, window_b) for each sequence b;  h += rms_norm(o W_o^T) * post_attn
    h += rms_norm(mlp(rms_norm(h) * ffn_norm)) * post_ffw        (26B-A4B: the MoE block)
    h += rms_norm(proj(gelu(h G^T) * pl)) * post_norm             (E2B/E4B: the per-layer input)
    h *= layer_output_scale;  a = rms_norm(h) * next layer's attn_norm (or the final norm)
A KV-shared layer projects Q only and reads its source's window, stored earlier in the graph
(ggml computes nodes in the order they were added).

Numerics: those of the layer by layer graphs, node for node (tests/models/test_gemma4_step.py and
test_ggml_step.py: the engine's tokens and log-probabilities bit for bit). A sequence's numbers do
not depend on the others in its step while products of B rows take the kernel of one row
(ggml's K-quant products switch kernels from 8 rows: `MAX_ROWS`).

`fused_layers` builds the same graph through the first n layers only and gives the residual after
them: the layers a model keeps in host RAM beside a GPU (models/host_layers.py).

The graph is kept on the model, one at a time: its inputs' layouts change when a window grows by a
bucket (kernels/ggml/attention.py: every 64 steps) or the batch changes, and a new one is built then
(~35 x 60 nodes: a few ms). EDGEGEM_CPU_STEP_GRAPH=0 turns it off (the layer by layer path).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kernels.env import env
from kernels.ggml import Graph, Matrix, layout, mlp_nodes, norm_nodes, raw_v, rope_nodes
from kernels.ggml.ops import scalar

from .formats import is_ggml
from .ops import in_cpu_chains, rope_dtype
from .runtime import Runtime

MAX_ROWS = 7  # sequences in one step: ggml's K-quant products take another kernel from 8 rows


class RowGraph(Graph):
    """A graph of B rows in which a product by a float matrix (F32, F16, BF16: ggml's products of
    several rows round otherwise than one row's) is taken row by row, B nodes concatenated, so a
    row's bits do not hang on the other rows of its step; quantized matrices take all B rows in
    one product (their kernels are those of one row up to MAX_ROWS rows: measured per type in
    tests/engine/test_decode_together.py). Float matrices are the small ones (per-layer input
    projections, a router): the extra reads are a few hundred KB a step."""

    def __init__(self, max_nodes: int, rows: int):
        super().__init__(max_nodes)
        self.rows, self._float_nodes = rows, {}

    def matrix(self, m) -> int:
        node = super().matrix(m)
        if m.ggml_type in _FLOAT_TYPES:
            self._float_nodes[node] = m.shape[1]
        return node

    def mul_mat(self, w: int, x: int) -> int:
        k = self._float_nodes.get(w)
        if k is None or self.rows == 1:
            return self.lib.mul_mat(self.ctx, w, x)
        out = None
        for b in range(self.rows):  # x [k, B] contiguous: row b at 4·k·b bytes
            yb = self.lib.mul_mat(self.ctx, w, self.view(x, [k, 1], [4, 4 * k], 4 * k * b))
            out = yb if out is None else self.concat(out, yb, 1)
        return out


_FLOAT_TYPES = (0, 1, 30)  # GGML_TYPE_F32, F16, BF16


class Inputs:
    """A graph's per-run inputs, each tensor once (layers share cos/sin, slots, masks, windows)."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self._index: dict = {}

    def add(self, t: torch.Tensor, key=None) -> int:
        key = id(t) if key is None else key
        if key not in self._index:
            self._index[key] = len(self.tensors)
            self.tensors.append(t)
        return self._index[key]


def qk_weights(q_weight: torch.Tensor, k_weight: torch.Tensor, n_head: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """The q and k norm weights side by side [n_head + n_kv, hd] (a constant of the graph)."""
    return torch.cat([q_weight.expand(n_head, head_dim), k_weight.expand(n_kv, head_dim)])


def attention_nodes(g: Graph, gx: int, ga: int, B: int, qkv: Matrix, v_matrix: Optional[Matrix], n_head: int,
                    n_kv: int, head_dim: int, gqkw: int, eps: float, gc: int, gs: int, n_half: int, v_norm: bool,
                    store: Optional[tuple[int, int, int]], windows: Sequence[tuple[int, int, int]], scale: float,
                    w_o: Matrix, gpa: int) -> tuple[int, tuple[int, ...]]:
    """The attention half of a decode layer for B rows in graph g (handles: gx the residual [d, B],
    ga its attention pre-norm, gqkw the q and k norm weights [hd, n_head + n_kv] (q's alone
    [hd, n_head] without a store), gc/gs cos/sin [n_half, 1, B], store (gks, gvs, gslots): the
    slabs [n_kv·hd, capacity] and the rows' slots [B], or None (a KV-shared layer: `qkv` holds Q
    only), windows[b] = (gkh, gvh, gmask, two) row b's window [hd, S, n_kv] and mask [S, 1] (or
    [S, 2] with `two`: its second row fully masked, the query then goes in twice), gpa the
    post-attention norm weight) -> (h = x + rms_norm(o W_o^T) · post_attn, the store nodes): the
    stores are expanded ahead of the attention; the caller aliases them to the slab inputs."""
    nq, nk = n_head * head_dim, n_kv * head_dim
    y = g.mul_mat(g.matrix(qkv), ga)  # [width, B]
    width = qkv.shape[0]
    nb = [4, 4 * head_dim, 4 * width]
    stores: tuple[int, ...] = ()
    if store is None:
        heads = n_head
        q = rope_nodes(g, g.mul(g.rms_norm(g.view(y, [head_dim, n_head, B], nb, 0), eps), gqkw), head_dim, n_head,
                       B, gc, gs, n_half)
    else:
        # q and k side by side in the product: one RMSNorm, one weight product (q's weight on the
        # query heads, k's on the key heads) and one RoPE for both (the same values, half the nodes)
        heads = n_head + n_kv
        q = rope_nodes(g, g.mul(g.rms_norm(g.view(y, [head_dim, heads, B], nb, 0), eps), gqkw), head_dim, heads, B,
                       gc, gs, n_half)
        k = g.view(q, [nk, B], [4, 4 * head_dim * heads], 4 * nq)
        v = raw_v(g, y, ga, v_matrix, width, n_head, n_kv, head_dim, B)
        v = norm_nodes(g, v, None, eps) if v_norm else g.cont(v)
        gks, gvs, gslots = store  # the stores first: their nodes come before the attention's
        stores = (g.set_rows(gks, k, gslots), g.set_rows(gvs, g.view(v, [nk, B], [4, 4 * nk], 0), gslots))
        for s in stores:
            g.expand(s)
    o = None
    for b, (gkh, gvh, gmask, two) in enumerate(windows):
        qb = g.view(q, [head_dim, n_head, 1], [4, 4 * head_dim, 4 * head_dim * heads], 4 * head_dim * heads * b)
        if two:  # a mask [2, S]: the query twice, its second row fully masked (engine/kv/canonical.py)
            qb = g.concat(qb, qb, 2)
        ob = g.flash_attn_ext(g.permute(qb, 0, 2, 1, 3), gkh, gvh, gmask, float(scale), 0.0, 0.0)  # [hd, n_head, r]
        if two:
            ob = g.view(ob, [head_dim, n_head, 1], [4, 4 * head_dim, 4 * head_dim * n_head], 0)
        o = ob if o is None else g.concat(o, ob, 2)
    o2 = g.view(o, [nq, B], [4, 4 * nq], 0)
    return g.add(gx, norm_nodes(g, g.mul_mat(g.matrix(w_o), o2), gpa, eps)), stores


def token_ready(x: torch.Tensor, caches: Sequence, *tables: torch.Tensor) -> bool:
    """Rows inside `cpu_chains` (a ggml-runtime model's forward) with x and `tables` as the chains
    take them (float32, unit last stride: a float64 model keeps the torch ops), and caches that
    attend on ggml's kernel (`ggml_attention`; `host_ggml_attention` for the layers on the CPU
    beside a GPU, models/host_layers.py) and offer their windows (`decode_window`)."""
    return in_cpu_chains(x, *tables) and all(
        (getattr(c, "ggml_attention", False) or getattr(c, "host_ggml_attention", False))
        and hasattr(c, "decode_window") for c in caches)


# --- the model's layers as the graph takes them --------------------------------------------------
@dataclass
class StepLayer:
    """One layer's part of the token graph: its matrices for up to MAX_ROWS rows (kernels.ggml
    Matrix), norm weights (float32 tensors) and which rope set it reads."""
    qkv: Matrix  # rows Q, K[, V]; Q only for a KV-shared layer
    v: Optional[Matrix]
    w_o: Matrix
    heads: tuple[int, int, int]  # n_head, n_kv, head_dim
    qk_norm: torch.Tensor  # [n_head (+ n_kv), hd]: `qk_weights`, q's alone for a KV-shared layer
    ffn: dict  # dense: gate_up | gate + up, down; MoE: models.gemma4_ggml.moe_parts
    moe: bool
    ple: Optional[tuple[Matrix, Matrix]]  # inp_gate, proj
    scale: Optional[float]  # layer_output_scale
    norms: dict  # attn, post_attn, ffn (dense), post_ffw, post_norm (ple): float32 [d]
    rope: int
    own: bool  # owns its KV (stores this token's K and V), else reads its source's window
    window: Optional[int]
    src: tuple  # (weights, "blk.i."): the MoE block's tables


def _per_layer(v, i: int) -> int:
    return v[i] if isinstance(v, tuple) else v


def step_layers(model, n: Optional[int] = None) -> Optional[list[StepLayer]]:
    """The model's first n layers (default: all) as the token graph takes them, built once (kept on
    the model), or None where one cannot run in it (a matrix off ggml)."""
    n = model.cfg.n_layer if n is None else n
    kept = model.__dict__.setdefault("_ggml_step_layers", {})
    if n not in kept:
        set_of = {model._rope_key(i, None): r for r, i in enumerate(model.rope_sets())}
        layers = [_step_layer(model, i, set_of[model._rope_key(i, None)]) for i in range(n)]
        kept[n] = None if any(ly is None for ly in layers) else layers
    return kept[n]


def _step_layer(model, i: int, rope: int) -> Optional[StepLayer]:
    from .gemma4_ggml import moe_parts

    cfg, w, b = model.cfg, model.w, f"blk.{i}."
    nh, nkv, hd = _per_layer(cfg.n_head, i), _per_layer(cfg.n_kv_head, i), _per_layer(cfg.head_dim, i)
    own = cfg.has_kv(i)
    qkv = w.get(b + ("attn_qkv.weight" if own else "attn_q.weight"))
    v = w.get(b + "attn_v.weight") if own else None
    w_o = w[b + "attn_output.weight"]
    if not is_ggml(qkv, w_o) or (v is not None and not is_ggml(v)) or (own and qkv.shape[0] <= nh * hd):
        return None
    moe = b + "ffn_gate_inp.weight" in w
    if moe:
        ffn = moe_parts(w, b, MAX_ROWS)
        if ffn is None:
            return None
    else:
        mats = {k: w.get(b + f"ffn_{k}.weight") for k in ("gate_up", "gate", "up", "down")}
        if not is_ggml(mats["down"]) or not (is_ggml(mats["gate_up"]) or is_ggml(mats["gate"], mats["up"])):
            return None
        ffn = {k: m.matrix_for(MAX_ROWS) if is_ggml(m) else None for k, m in mats.items()}
        if ffn["gate_up"] is not None:
            ffn["gate"] = ffn["up"] = None
    ple = None
    if getattr(cfg, "ple_width", 0):
        gate, proj = w[b + "inp_gate.weight"], w[b + "proj.weight"]
        if not is_ggml(gate, proj):
            return None
        ple = (gate.matrix_for(MAX_ROWS), proj.matrix_for(MAX_ROWS))
    norms = {"attn": w[b + "attn_norm.weight"], "post_attn": w[b + "post_attention_norm.weight"],
             "post_ffw": w[b + "post_ffw_norm.weight"]}
    if not moe:
        norms["ffn"] = w[b + "ffn_norm.weight"]
    if ple is not None:
        norms["post_norm"] = w[b + "post_norm.weight"]
    qk = w[b + "attn_q_norm.weight"].expand(nh, hd) if not own else \
        qk_weights(w[b + "attn_q_norm.weight"], w[b + "attn_k_norm.weight"], nh, nkv, hd)
    return StepLayer(qkv.matrix_for(MAX_ROWS), None if v is None else v.matrix_for(MAX_ROWS),
                     w_o.matrix_for(MAX_ROWS), (nh, nkv, hd), qk.float().contiguous(), ffn, moe, ple,
                     scalar(w.get(b + "layer_output_scale.weight")), norms, rope, own, cfg.window(i), (w, b))


def _rows(caches: Sequence) -> list[int]:
    """Each row's index within its cache's forward: caches[b] may repeat one sequence for the
    consecutive rows of a draft's verify (its rows t = 0, 1, ...)."""
    seen: dict = {}
    out = []
    for c in caches:
        out.append(seen.get(id(c), 0))
        seen[id(c)] = out[-1] + 1
    return out


def _targets(ly: StepLayer, i: int, caches: Sequence, rows: Sequence[int]) -> Optional[list[tuple]]:
    """Per row (k slab, v slab, slot [1]) or (None, None, None) for a KV-shared layer, then
    (k window, v window, mask): layer i's part of this step's caches, or None where one gives none."""
    out = []
    for c, t in zip(caches, rows):
        got = c.decode_target(i, ly.window, t) if ly.own else c.decode_window(i, ly.window, t)
        if got is None:
            return None
        out.append(got if ly.own else (None, None, None, *got))
    return out


# --- the step -------------------------------------------------------------------------------------
def fused_decode_step(model, x: torch.Tensor, pl: Optional[torch.Tensor], pos: torch.Tensor, caches: Sequence,
                      v_norm: bool, attn_scale: float):
    """B decode tokens, one per sequence, as one ggml graph: x [B, d] embedded, pl [B, L, P] their
    per-layer inputs (E2B/E4B; else None), pos [B], caches[b] row b's `SequenceKV` (in a forward:
    `begin` done) -> (logits [B, vocab] after the final softcap, h [B, d] the last residual), or
    None where it does not apply (a model of another runtime, a matrix off ggml, a cache without
    float32 windows, float64 rows, more than MAX_ROWS rows). The slabs receive the tokens' K and V."""
    ready = _ready(model, x, pl, pos, caches, model.cfg.n_layer)
    if ready is None:
        return None
    layers, tensors, plan = ready
    cfg = model.cfg
    head = model.head_w.matrix_for(MAX_ROWS) if is_ggml(model.head_w) else None
    graph = _graph(model, tensors, plan, layers, model.w["output_norm.weight"], head, v_norm, attn_scale)
    h, y = torch.empty(x.shape), torch.empty(x.shape)
    if head is None:  # a head off ggml (a torch format): the graph gives the normed rows
        graph.run(tensors, [y, h])
        return model.head(y), h, y
    logits = torch.empty(x.shape[0], head.shape[0])
    graph.run(tensors, [logits, h, y])
    if cfg.final_softcap:  # in place, the ops of `softcap` (same bits): 0.35 ms less on 262,144 logits
        logits.div_(cfg.final_softcap).tanh_().mul_(cfg.final_softcap)
    return logits, h, y


def fused_layers(model, x: torch.Tensor, pos: torch.Tensor, caches: Sequence, n: int) -> Optional[torch.Tensor]:
    """`fused_decode_step` through layers 0..n-1 only, for a model without per-layer inputs: x [B,
    d] embedded -> the residual h [B, d] after layer n-1 (no final norm, no head), or None where
    the graph does not apply. The first layers of a model whose others run on a GPU
    (models/host_layers.py): their nodes are those of the whole token's graph, so h has its bits."""
    ready = _ready(model, x, None, pos, caches, n)
    if ready is None:
        return None
    layers, tensors, plan = ready
    h = torch.empty(x.shape)
    _graph(model, tensors, plan, layers, None, None, True, 1.0).run(tensors, [h])
    return h


def _ready(model, x, pl, pos, caches, n: int):
    """(the first n step layers, the graph's inputs, its plan) for B rows, or None (module doc)."""
    if getattr(model, "runtime", None) is not Runtime.GGML or not env().cpu_step_graph:
        return None
    B = x.shape[0]
    if not 1 <= B <= MAX_ROWS or len(caches) != B:
        return None
    ropes = [model.rope(i, pos, rope_dtype(x)) for i in model.rope_sets()]
    tables = [t for r in ropes for t in r] + ([] if pl is None else [pl])
    if any(c.shape[-1] == 0 for c, _ in ropes) or not token_ready(x, caches, *tables):
        return None
    layers = step_layers(model, n)
    if layers is None:
        return None
    targets, rows = [], _rows(caches)
    for i, ly in enumerate(layers):
        t = _targets(ly, i, caches, rows)
        if t is None:
            return None
        targets.append(t)
    tensors, plan = _plan(x, pl, ropes, layers, targets)
    return layers, tensors, plan


def _graph(model, tensors, plan, layers, final_norm, head, v_norm, attn_scale) -> Graph:
    """The graph for these inputs, kept on the model while their layouts stay (module doc)."""
    cfg = model.cfg
    key = (tuple(layout(t) for t in tensors), tuple(plan), id(layers), id(head), final_norm is None, v_norm,
           float(attn_scale))
    kept = getattr(model, "_ggml_step_graph", None)
    if kept is None or kept[0] != key:
        kept = (key, _build(tensors, plan, layers, final_norm, head, cfg.rms_eps, getattr(cfg, "n_expert_used", 0),
                            cfg.d_model, v_norm, attn_scale))
        model._ggml_step_graph = kept
    return kept[1]


def _plan(x, pl, ropes, layers, targets) -> tuple[list[torch.Tensor], list]:
    """The step's inputs, each tensor once, and per layer the indices its nodes read: ((cos, sin),
    store (k slab, v slab, slots) or None, per-layer input or None, ((k win, v win, mask) per row))."""
    B = x.shape[0]
    ins = Inputs()
    ins.add(x)
    pls = [None] * len(layers) if pl is None else [ins.add(pl[:, i], ("pl", i)) for i in range(len(layers))]
    rope_at = [(ins.add(c.reshape(B, 1, c.shape[-1]), ("cos", id(c))),
                ins.add(s.reshape(B, 1, s.shape[-1]), ("sin", id(s)))) for c, s in ropes]
    slots: dict = {}
    plan = []
    for i, (ly, rows) in enumerate(zip(layers, targets)):
        n_kv, hd = ly.heads[1], ly.heads[2]
        store = None
        k_slab, v_slab = rows[0][0], rows[0][1]
        if k_slab is not None:
            cap = k_slab.shape[0]
            ids = tuple(id(r[2]) for r in rows)
            if ids not in slots:  # the rows' slots in this pool, one tensor [B] for all its layers
                slots[ids] = rows[0][2].reshape(1) if B == 1 else torch.cat([r[2].reshape(1) for r in rows])
            store = (ins.add(k_slab.view(cap, n_kv * hd), ("slab", k_slab.data_ptr())),
                     ins.add(v_slab.view(cap, n_kv * hd), ("slab", v_slab.data_ptr())),
                     ins.add(slots[ids], ("slots", ids)))
        wins = tuple((ins.add(kw.permute(1, 0, 2), ("win", kw.data_ptr(), kw.shape)),
                      ins.add(vw.permute(1, 0, 2), ("win", vw.data_ptr(), vw.shape)), ins.add(mask))
                     for _, _, _, kw, vw, mask in rows)
        plan.append((rope_at[ly.rope], store, pls[i], wins))
    return ins.tensors, plan


def _build(tensors, plan, layers, final_norm, head, eps, n_used, d, v_norm, attn_scale) -> Graph:
    from .gemma4_ggml import moe_constants, moe_nodes

    B = tensors[0].shape[0]
    g = RowGraph((160 + 48 * B) * len(layers) + 64, B)  # float matrices add 3 nodes a row
    nodes = [g.input(t) for t in tensors]
    const: dict = {}

    def c(t: torch.Tensor) -> int:  # a norm weight, bound once (kept alive by the graph)
        if id(t) not in const:
            const[id(t)] = g.constant(t)
        return const[id(t)]

    h = nodes[0]
    a = norm_nodes(g, h, c(layers[0].norms["attn"]), eps)
    for i, (ly, ((ci, si), store, gpl, wins)) in enumerate(zip(layers, plan)):
        n_head, n_kv, hd = ly.heads
        h, stores = attention_nodes(g, h, a, B, ly.qkv, ly.v, n_head, n_kv, hd, g.constant(ly.qk_norm), eps,
                                    nodes[ci], nodes[si], tensors[ci].shape[-1], v_norm,
                                    None if store is None else tuple(nodes[j] for j in store),
                                    [(*(nodes[j] for j in win), tensors[win[2]].shape[0] == 2) for win in wins],
                                    attn_scale, ly.w_o,
                                    c(ly.norms["post_attn"]))
        for node, j in zip(stores, store or ()):
            g.alias(node, j)
        if ly.moe:
            f = moe_nodes(g, h, B, moe_constants(g, *ly.src, ly.ffn, d), eps, n_used)
        else:
            f = mlp_nodes(g, norm_nodes(g, h, c(ly.norms["ffn"]), eps), ly.ffn["gate_up"], ly.ffn["down"],
                          ly.ffn["gate"], ly.ffn["up"])
        h = g.add(h, norm_nodes(g, f, c(ly.norms["post_ffw"]), eps))
        if ly.ple is not None:  # Gemma-4's per-layer input: the gate reads the residual after the MLP
            e = g.mul(g.gelu(g.mul_mat(g.matrix(ly.ple[0]), h)), nodes[gpl])
            h = g.add(h, norm_nodes(g, g.mul_mat(g.matrix(ly.ple[1]), e), c(ly.norms["post_norm"]), eps))
        if ly.scale is not None:
            h = g.scale(h, ly.scale)
        if i + 1 == len(layers) and final_norm is None:  # the first layers only: h is the output
            g.output(h)
            return g.finish()
        a = norm_nodes(g, h, c(layers[i + 1].norms["attn"] if i + 1 < len(layers) else final_norm), eps)
    g.output(a if head is None else g.mul_mat(g.matrix(head), a))
    g.output(h)
    if head is not None:  # a copy: an output's data is the caller's, and the head's row views read `a`
        g.output(g.cont(a))
    return g.finish()
