"""Host experts beside a GPU (llama.cpp's `--cpu-moe` / `--n-cpu-moe`): a 26B-A4B MoE layer whose
expert banks stay in host RAM (`Gemma4Model.host_expert_layers`; the memory plan's placement,
engine/placement.py). Per layer, for the residual r [T, d] after attention:

  device  router: u = rms_norm(r) d^-1/2 * scale; p = softmax(u R^T); top-k ids and weights
  device -> host  r [T, d], ids [T, k] int32, weights [T, k] float32 (pinned buffers on CUDA):
                  26B-A4B decode, T = 1: 11,264 + 32 + 32 bytes
  device  h1 = the dense branch, enqueued after the copies: it runs while the CPU works
  host    h2 = rms_norm(sum_k w * down(geglu(gate_up(rms_norm(r) * pre_2)))) * post_2, llama.cpp's
          nodes (models/gemma4_ggml.py `expert_nodes`, one graph, `mul_mat_id` over the file's bytes)
  host -> device  h2 [T, d]: 11,264 bytes at decode
  device  h1 + h2

One synchronization a layer: the host waits for the copies' event (not for h1). The ids and weights
are the device router's (float32 top-k, renormalized with llama.cpp's 2^-14 floor), so a near-tied
choice can differ from the all-CPU graph's (its own softmax); the tests use tame weights.
"""
from __future__ import annotations

import torch

from kernels.ggml import Graph, cached_graph, layout

from .formats import ExpertBank
from .gemma4_ggml import expert_nodes
from .ops import gated_mlp, linear, rms_norm

_MIN_SUM = 6.103515625e-5  # llama.cpp clamps the top-k sum to float16's smallest normal
_BANKS = ("gate_up_exps", "gate_exps", "up_exps", "down_exps")


def _banks(w, b: str) -> dict:
    """The layer's banks as ggml Banks (None where absent)."""
    out = {}
    for k in _BANKS:
        v = w.get(f"{b}ffn_{k}.weight")
        out[k] = v.ggml_bank() if isinstance(v, ExpertBank) else None
    if out["down_exps"] is None or (out["gate_up_exps"] is None and (out["gate_exps"] is None or out["up_exps"] is None)):
        raise ValueError(f"{b}: the expert banks are not in host memory (file bytes) for the CPU's products")
    return out


def expert_mix(w, b: str, r: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, eps: float) -> torch.Tensor:
    """The host part: r [T, d] float32, ids [T, k] int32, wts [T, k] float32 (CPU tensors) ->
    rms_norm(h2) * post_2 [T, d] float32, one ggml graph (cached per layer and row count)."""
    T, d = r.shape
    k = ids.shape[1]
    banks = _banks(w, b)
    pre, post = w[b + "pre_ffw_norm_2.weight"], w[b + "post_ffw_norm_2.weight"]
    scale = w.get(b + "ffn_down_exps.scale")
    E = banks["down_exps"].shape[0]
    wts3 = wts.reshape(T, k, 1)

    def build(big):
        g = Graph(48 + 2 * k, big)
        # the weights come in as [T, k, 1] (ggml [1, k, T]): a view of an input would keep the
        # data pointer of the build, not the run's
        gr, sel, gw = g.input(r), g.input(ids), g.input(wts3)
        m = dict(banks, d=d, E=E, pre_2=g.constant(pre.float().cpu().contiguous()),
                 post_2=g.constant(post.float().cpu().contiguous()),
                 down_scale=None if scale is None else g.constant(scale.float().cpu().reshape(1, E, 1)))
        g.output(expert_nodes(g, gr, sel, gw, T, m, eps, k))
        return g.finish()

    key = ("host-experts", b, *(id(v) for v in banks.values()), id(pre), id(post), id(scale),
           layout(r), layout(ids), layout(wts3))
    out = torch.empty(T, d)
    cached_graph(key, build, T).run([r, ids, wts3], [out])
    return out


class _Staging:
    """The host buffers of one row count: pinned on CUDA so the copies are asynchronous."""

    def __init__(self, T: int, d: int, k: int, pin: bool):
        def buf(*shape, dtype=torch.float32):
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        self.r, self.ids, self.wts, self.out = buf(T, d), buf(T, k, dtype=torch.int32), buf(T, k), buf(T, d)


def _staging(model, T: int, d: int, k: int) -> _Staging:
    cache = model.__dict__.setdefault("_host_staging", {})
    if T not in cache:
        if len(cache) >= 8:  # prefill chunks of many lengths: keep the few most recent
            cache.pop(next(iter(cache)))
        cache[T] = _Staging(T, d, k, model.device.type == "cuda")
    return cache[T]


def route(model, i: int, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of layer i on r's device -> (ids [T, k] int64, weights [T, k] float32), the
    weights renormalized over the k as llama.cpp does (sum floored at 2^-14)."""
    cfg, w, b = model.cfg, model.w, f"blk.{i}."
    u = rms_norm(r, None, cfg.rms_eps) * (cfg.d_model ** -0.5) * w[b + "ffn_gate_inp.scale"].to(r.dtype)
    probs = torch.softmax(linear(u, w[b + "ffn_gate_inp.weight"]).float(), dim=-1)
    top_p, top_e = probs.topk(cfg.n_expert_used, dim=-1)
    return top_e, top_p / top_p.sum(-1, keepdim=True).clamp_min(_MIN_SUM)


def host_moe_ffn(model, i: int, r: torch.Tensor) -> torch.Tensor:
    """Layer i's MoE block with its experts on the CPU (module doc): r [T, d] on the model's
    device -> [T, d] there. `model.host_traffic` counts the crossings (bench: bytes over PCIe)."""
    cfg, w, b, eps = model.cfg, model.w, f"blk.{i}.", model.cfg.rms_eps
    T, d = r.shape
    ids, wts = route(model, i, r)
    st = _staging(model, T, d, cfg.n_expert_used)
    cuda = r.device.type == "cuda"
    st.r.copy_(r, non_blocking=cuda)
    st.ids.copy_(ids, non_blocking=cuda)
    st.wts.copy_(wts, non_blocking=cuda)
    copied = torch.cuda.Event() if cuda else None
    if copied is not None:
        copied.record()
    # the dense branch, enqueued behind the copies: on a GPU it runs while the CPU does the experts
    h1 = rms_norm(gated_mlp(rms_norm(r, w[b + "ffn_norm.weight"], eps), w, b), w[b + "post_ffw_norm_1.weight"], eps)
    if copied is not None:
        copied.synchronize()  # the layer's one wait: for the copies, not for h1
    h2 = expert_mix(w, b, st.r, st.ids, st.wts, eps)
    st.out.copy_(h2)
    traffic = model.__dict__.setdefault("host_traffic", {"layers": 0, "to_host": 0, "to_device": 0})
    up, down = crossing_bytes(d, cfg.n_expert_used, T)
    traffic["layers"] += 1
    traffic["to_host"] += up
    traffic["to_device"] += down
    return h1 + st.out.to(r.device, r.dtype, non_blocking=cuda)


def crossing_bytes(d: int, k: int, T: int = 1) -> tuple[int, int]:
    """(device->host, host->device) bytes a host-experts layer moves for T rows."""
    return int(T * d * 4 + 2 * T * k * 4), int(T * d * 4)

