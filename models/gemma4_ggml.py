"""The Gemma-4 26B-A4B MoE block (spec §3.8) on llama.cpp's CPU kernels: the dense MLP, the
router and the experts as one ggml graph, the nodes of llama.cpp's src/models/gemma4.cpp and
llm_graph_context::build_moe_ffn in their order (so the same placement gives the same bits).

For the residual r [T, d] after attention (decode T = 1, a prefill chunk T rows):

    h1      = rms_norm(mlp(rms_norm(r) * ffn_norm)) * post_ffw_norm_1          (dense branch)
    u       = rms_norm(r) * d^-1/2 * ffn_gate_inp.scale;  logits = u R^T        [E, T]
    p       = softmax(logits) over all E;  sel = argsort_top_k(p, k)           [k, T] int32
    w       = p[sel] / max(sum_k p[sel], 2^-14)                                 [1, k, T]
    z       = rms_norm(r) * pre_ffw_norm_2                                      [d, 1, T]
    gu      = mul_mat_id(gate_up_exps, z, sel)                                  [2I, k, T]
    y       = mul_mat_id(down_exps, geglu(gu[:I], gu[I:]), sel)                 [d, k, T]
    y       = y * down_exps.scale[sel] * w;  h2 = sum over the k slots, in slot order
    return  h1 + rms_norm(h2) * post_ffw_norm_2                                 [T, d]

`ggml_mul_mat_id` groups the (token, slot) pairs by expert: each chosen expert's bytes are read
once per run whatever T is, where the torch path loops over experts in Python and dequantizes
each (models/gemma4.py `_moe_ffn`, which is also what this graph is tested against, in float64).
GELU is ggml's f16 table, as everywhere on this runtime: on random weights a near-tied routing
can then pick another expert than the exact GELU would (tests/models/test_gemma4_moe.py).

`fused_moe_ffn` returns None where the graph does not apply (a model of another runtime, float64
rows, a matrix or a bank off ggml): the torch block then runs.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kernels.ggml import Graph, cached_graph, check_cpu_float32, layout, mlp_nodes, norm_nodes

from .formats import ExpertBank, is_ggml
from .runtime import Runtime

_MIN_SUM = 6.103515625e-5  # llama.cpp clamps the top-k sum to float16's smallest normal (no 0/0)


def moe_nodes(g: Graph, gr: int, T: int, m: dict, eps: float, n_used: int) -> int:
    """The block's nodes on the residual node gr [d, T] -> [d, T] (module doc); `m` holds the
    Matrix/Bank objects and the constant nodes (`moe_parts`)."""
    h1 = norm_nodes(g, mlp_nodes(g, norm_nodes(g, gr, m["ffn_norm"], eps), m["gate_up"], m["down"],
                                 m["gate"], m["up"]), m["post_1"], eps)
    sel, w = router_nodes(g, gr, T, m, eps, n_used)
    return g.add(h1, expert_nodes(g, gr, sel, w, T, m, eps, n_used))


def router_nodes(g: Graph, gr: int, T: int, m: dict, eps: float, n_used: int) -> tuple[int, int]:
    """The router's nodes on the residual gr [d, T] -> (sel [k, T] int32 best first, w [1, k, T]
    renormalized over the k): logits [E, T], softmax over all E, top-k by probability."""
    inv_sqrt_d = float(np.float32(1.0) / np.sqrt(np.float32(m["d"])))  # llama.cpp's 1.0f / sqrtf(n_embd)
    u = g.mul(g.scale(g.rms_norm(gr, eps), inv_sqrt_d), m["router_scale"])
    probs = g.soft_max(g.mul_mat(g.matrix(m["router"]), u))
    sel = g.argsort_top_k(probs, n_used)
    w = g.get_rows(g.reshape_3d(probs, 1, m["E"], T), sel)
    w2 = g.reshape_2d(w, n_used, T)
    return sel, g.reshape_3d(g.div(w2, g.clamp(g.sum_rows(w2), _MIN_SUM, float("inf"))), 1, n_used, T)


def expert_nodes(g: Graph, gr: int, sel: int, w: int, T: int, m: dict, eps: float, n_used: int,
                 normed: bool = True) -> int:
    """The experts' part of the block for the residual gr [d, T], the chosen experts sel [k, T]
    int32 and their weights w [1, k, T]: rms_norm(sum_k w * down(geglu(gate_up(z)))) * post_2, z
    the pre_2-normed residual (module doc). A host-experts layer beside a GPU runs just this
    (models/host_experts.py), the router's choice given; `normed` False: the sum h2 itself (the
    experts a GPU cache computed are added to it before the norm)."""
    d, E = m["d"], m["E"]
    z3 = g.reshape_3d(norm_nodes(g, gr, m["pre_2"], eps), d, 1, T)
    # experts: gate/up, GEGLU, down, each one mul_mat_id over the chosen experts
    if m["gate_up_exps"] is not None:
        gu = g.mul_mat_id(g.matrix(m["gate_up_exps"]), z3, sel)  # [2I, k, T]
        I2 = m["gate_up_exps"].shape[1]
        I = I2 // 2
        nb = [4, 4 * I2, 4 * I2 * n_used]
        act = g.geglu_split(g.view(gu, [I, n_used, T], nb, 0), g.view(gu, [I, n_used, T], nb, 4 * I))
    else:
        up = g.mul_mat_id(g.matrix(m["up_exps"]), z3, sel)
        act = g.geglu_split(g.mul_mat_id(g.matrix(m["gate_exps"]), z3, sel), up)
    y = g.mul_mat_id(g.matrix(m["down_exps"]), act, sel)  # [d, k, T]
    if m["down_scale"] is not None:  # per-expert scale, on the product (build_lora_mm_id's w_s)
        s = g.repeat_4d(m["down_scale"], 1, E, T, 1)
        y = g.mul(y, g.get_rows(s, sel))
    y = g.mul(y, w)
    nb = [4, 4 * d * n_used]
    h2 = g.view(y, [d, T], nb, 0)
    for j in range(1, n_used):  # the slots summed in order, as llama.cpp adds its views
        h2 = g.add(h2, g.view(y, [d, T], nb, 4 * d * j))
    if n_used == 1:
        h2 = g.cont(h2)
    return norm_nodes(g, h2, m["post_2"], eps) if normed else h2


def moe_parts(w, b: str, rows: int) -> Optional[dict]:
    """The layer's matrices (ggml Matrix for `rows` rows) and banks (ggml Bank), or None where one
    is not on ggml (the torch block then runs)."""
    def mat(name):
        v = w.get(b + name)
        return v.matrix_for(rows) if is_ggml(v) else None

    def bank(name):
        v = w.get(b + name)
        if not isinstance(v, ExpertBank):
            return None
        from kernels import ggml

        return v.ggml_bank() if ggml.supported(v.ggml_type) else None

    p = {"router": mat("ffn_gate_inp.weight"), "down": mat("ffn_down.weight"), "gate_up": mat("ffn_gate_up.weight"),
         "gate": mat("ffn_gate.weight"), "up": mat("ffn_up.weight"), "down_exps": bank("ffn_down_exps.weight"),
         "gate_up_exps": bank("ffn_gate_up_exps.weight"), "gate_exps": bank("ffn_gate_exps.weight"),
         "up_exps": bank("ffn_up_exps.weight")}
    dense_ok = p["gate_up"] is not None or (p["gate"] is not None and p["up"] is not None)
    exps_ok = p["gate_up_exps"] is not None or (p["gate_exps"] is not None and p["up_exps"] is not None)
    if p["router"] is None or p["down"] is None or p["down_exps"] is None or not dense_ok or not exps_ok:
        return None
    return p


def _moe_norms(w, b: str) -> dict:
    return {k: w[b + n] for k, n in (("ffn_norm", "ffn_norm.weight"), ("post_1", "post_ffw_norm_1.weight"),
                                     ("pre_2", "pre_ffw_norm_2.weight"), ("post_2", "post_ffw_norm_2.weight"),
                                     ("router_scale", "ffn_gate_inp.scale"))}


def moe_constants(g: Graph, w, b: str, parts: dict, d: int) -> dict:
    """`moe_nodes`' `m`: the layer's matrices and banks (`moe_parts`) with its norm weights, router
    scale and per-expert down scale bound as constants of graph g."""
    E = parts["down_exps"].shape[0]
    m = dict(parts, d=d, E=E, **{k: g.constant(t.float().contiguous()) for k, t in _moe_norms(w, b).items()})
    down_scale = w.get(b + "ffn_down_exps.scale")
    m["down_scale"] = None if down_scale is None else g.constant(down_scale.float().reshape(1, E, 1))
    return m


def moe_ffn(r: torch.Tensor, w, b: str, eps: float, n_used: int, parts: dict) -> torch.Tensor:
    """The block for residual rows r [T, d] float32 -> [T, d] (one graph run)."""
    check_cpu_float32(r)
    T, d = r.shape
    norms = _moe_norms(w, b)
    down_scale = w.get(b + "ffn_down_exps.scale")

    def build(big):
        g = Graph(64 + 2 * n_used, big)
        gr = g.input(r)
        g.output(moe_nodes(g, gr, T, moe_constants(g, w, b, parts, d), eps, n_used))
        return g.finish()

    key = ("moe", b, *(id(v) for v in parts.values()), *(id(t) for t in norms.values()), id(down_scale),
           layout(r), n_used)
    out = torch.empty(T, d)
    cached_graph(key, build, T).run([r], [out])
    return out


def ggml_route(model, i: int, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-CPU runtime's router alone for layer i of a ggml-runtime model: r [T, d] float32
    CPU -> (ids [T, k] int32, weights [T, k] float32), the nodes `moe_nodes` runs (the choice a
    host-experts layer's device router must agree with: tests/models/test_host_expert_layers.py)."""
    check_cpu_float32(r)
    T, d = r.shape
    b, k = f"blk.{i}.", model.cfg.n_expert_used
    g = Graph(32)
    parts = moe_parts(model.w, b, T)
    if parts is None:
        raise ValueError(f"{b}: the router runs on ggml only for a model of the ggml runtime")
    m = moe_constants(g, model.w, b, parts, d)
    sel, w = router_nodes(g, g.input(r), T, m, model.cfg.rms_eps, k)
    g.output(g.cont(sel))  # both are views (top-k of the argsort, a reshape): an output is a tensor of its own
    g.output(g.cont(w))
    g.finish()
    ids, wts = torch.empty(T, k, dtype=torch.int32), torch.empty(T, k)
    g.run([r], [ids, wts])
    return ids, wts


def fused_moe_ffn(model, i: int, r: torch.Tensor) -> Optional[torch.Tensor]:
    """Layer i's MoE block as one ggml graph for a model of the ggml runtime (`model.runtime`), else None."""
    if getattr(model, "runtime", None) is not Runtime.GGML or r.dim() != 2 or r.dtype != torch.float32 \
            or r.device.type != "cpu" or r.stride(-1) != 1:
        return None
    b = f"blk.{i}."
    parts = moe_parts(model.w, b, r.shape[0])
    if parts is None:
        return None
    return moe_ffn(r, model.w, b, model.cfg.rms_eps, model.cfg.n_expert_used, parts)

