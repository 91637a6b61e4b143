"""Where a 26B-A4B MoE block's time goes on llama.cpp's kernels: the block is one ggml graph
(models/gemma4_ggml.py), so its parts are timed as graphs of their own on the same residual rows:
the dense branch (norm, gate/up, GEGLU, down, norm), the router (norm, scale, product, softmax,
top-k, renormalized weights), and the whole block; the experts (two `mul_mat_id` and the mix)
are the whole minus the other two. `edgegem bench --device cpu --profile` prints it under the
decode step's table for a model with MoE layers.
"""
from __future__ import annotations

import time

import numpy as np
import torch


def _best_ms(run, repeat: int) -> float:
    run()  # warm: the graph is built and its pages are in
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def part_runs(model, i: int, r: torch.Tensor) -> dict:
    """Layer i's block on rows r [T, d] as three runs, each returning its output: "dense branch"
    (h1 [T, d]), "router" (the renormalized top-k weights [T, k]) and "whole block" ([T, d])."""
    from kernels.ggml import Graph, mlp_nodes, norm_nodes
    from models.gemma4_ggml import moe_ffn, moe_parts

    cfg, w, b = model.cfg, model.w, f"blk.{i}."
    eps, k, (rows, d) = cfg.rms_eps, cfg.n_expert_used, r.shape
    parts = moe_parts(w, b, rows)
    if parts is None:
        raise ValueError(f"layer {i}'s MoE block is not on ggml (runtime {getattr(model, 'runtime', None)})")
    E = parts["down_exps"].shape[0]
    consts = {n: w[b + n].float().contiguous() for n in ("ffn_norm.weight", "post_ffw_norm_1.weight",
                                                          "ffn_gate_inp.scale")}
    g1 = Graph(64)
    gr = g1.input(r)
    cn = {n: g1.constant(t) for n, t in consts.items()}
    g1.output(norm_nodes(g1, mlp_nodes(g1, norm_nodes(g1, gr, cn["ffn_norm.weight"], eps), parts["gate_up"],
                                       parts["down"], parts["gate"], parts["up"]), cn["post_ffw_norm_1.weight"], eps))
    g1.finish()
    g2 = Graph(64)
    gr2 = g2.input(r)
    inv_sqrt_d = float(np.float32(1.0) / np.sqrt(np.float32(d)))  # as models/gemma4_ggml.py
    u = g2.mul(g2.scale(g2.rms_norm(gr2, eps), inv_sqrt_d), g2.constant(consts["ffn_gate_inp.scale"]))
    probs = g2.soft_max(g2.mul_mat(g2.matrix(parts["router"]), u))
    sel = g2.argsort_top_k(probs, k)
    top = g2.reshape_2d(g2.get_rows(g2.reshape_3d(probs, 1, E, rows), sel), k, rows)
    g2.output(g2.div(top, g2.sum_rows(top)))
    g2.finish()
    h1, wk = torch.empty(rows, d), torch.empty(rows, k)
    return {"dense branch": lambda: (g1.run([r], [h1]), h1)[1],
            "router": lambda: (g2.run([r], [wk]), wk)[1],
            "whole block": lambda: moe_ffn(r, w, b, eps, k, parts)}


def moe_block_split(model, rows: int = 1, layers=None, repeat: int = 5) -> dict:
    """ms of the dense branch, the router, the experts and the whole block for `rows` residual rows,
    summed over `layers` (default every MoE layer), each the best of `repeat` runs. The rows are
    random (RMS 1, a residual's scale after the block's norms): the router's choice then differs
    from layer to layer as a prompt's does."""
    cfg, w = model.cfg, model.w
    layers = [i for i in (layers if layers is not None else range(cfg.n_layer)) if f"blk.{i}.ffn_gate_inp.weight" in w]
    gen = torch.Generator().manual_seed(0)
    out = {"dense branch": 0.0, "router": 0.0, "whole block": 0.0}
    for i in layers:
        runs = part_runs(model, i, torch.randn(rows, cfg.d_model, generator=gen))
        for part, run in runs.items():
            out[part] += _best_ms(run, repeat)
    out["experts (mul_mat_id x2, GEGLU, mix)"] = out["whole block"] - out["dense branch"] - out["router"]
    return {"rows": rows, "layers": len(layers), "ms": out}
