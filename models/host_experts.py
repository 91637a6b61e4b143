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

import time

import torch

from kernels.ggml import Graph, cached_graph, layout

from .formats import ExpertBank
from .expert_stream import streamed_mix
from .gemma4_ggml import expert_nodes
from .ops import gated_mlp, gelu_tanh, linear, rms_norm
from .quant import type_name

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


def check_host_banks(model) -> None:
    """At load: the banks of every host-experts layer are the file's bytes in host memory, of types
    llama.cpp's CPU kernels multiply, and those kernels are here (else one line, not a crash at the
    first forward: ggml given a CUDA bank's pointer, or a type it has no product for)."""
    if not model.host_expert_layers:
        return
    from kernels import ggml

    if not ggml.available():
        raise ValueError(f"expert banks in host RAM run on llama.cpp's kernels, unavailable here ({ggml.reason()}): "
                         "pip install 'edgegem[cpu]'")
    for i in sorted(model.host_expert_layers):
        for k in _BANKS:
            name = f"blk.{i}.ffn_{k}.weight"
            v = model.w.get(name)
            if v is None:
                continue
            if not isinstance(v, ExpertBank) or v.raw.device.type != "cpu":
                raise ValueError(f"{name}: not the file's bytes in host memory, as the host experts need")
            if not ggml.supported(v.ggml_type):
                raise ValueError(f"{name}: llama.cpp's CPU kernels here do not multiply {type_name(v.ggml_type)} banks")


_host_copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (it, its CPU float32 copy)


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """A layer's small constant (a norm weight [d], the per-expert scale [E]) as a CPU float32
    tensor, copied once per weight: a prefill chunk's graph (over CACHED_ROWS rows) is built per run,
    and a copy from the GPU there would wait for all the queued work, the dense branch included."""
    hit = _host_copies.get(id(t))
    if hit is None or hit[0] is not t:  # the weight is held in the entry: its id is not reused
        hit = _host_copies[id(t)] = (t, t.detach().float().cpu().contiguous())
    return hit[1]


def expert_mix(w, b: str, r: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, eps: float,
               normed: bool = True) -> torch.Tensor:
    """The host part: r [T, d] float32, ids [T, k] int32, wts [T, k] float32 (CPU tensors) ->
    rms_norm(h2) * post_2 [T, d] float32 (`normed` False: h2), one ggml graph (cached per layer,
    row count and k)."""
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
        m = dict(banks, d=d, E=E, pre_2=g.constant(_on_host(pre)), post_2=g.constant(_on_host(post)),
                 down_scale=None if scale is None else g.constant(_on_host(scale).reshape(1, E, 1)))
        g.output(expert_nodes(g, gr, sel, gw, T, m, eps, k, normed))
        return g.finish()

    key = ("host-experts", b, *(id(v) for v in banks.values()), id(pre), id(post), id(scale),
           layout(r), layout(ids), layout(wts3), normed)
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
    if (T, k) not in cache:
        if len(cache) >= 16:  # prefill chunks of many lengths, miss counts: keep the most recent
            cache.pop(next(iter(cache)))
        cache[T, k] = _Staging(T, d, k, model.device.type == "cuda")
    return cache[T, k]


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
    ids, wts = route(model, i, r)
    stream = getattr(model, "expert_stream", None)
    if stream is not None and r.shape[0] >= stream.rows:  # a long chunk: the banks come to the GPU
        w, b, eps = model.w, f"blk.{i}.", model.cfg.rms_eps
        h2 = streamed_mix(stream, i, rms_norm(r, w[b + "pre_ffw_norm_2.weight"], eps), ids, wts,
                          w.get(b + "ffn_down_exps.scale"), model.cfg.expert_ffn_width)
        return _dense(model, i, r) + rms_norm(h2, w[b + "post_ffw_norm_2.weight"], eps).to(r.dtype)
    cache = getattr(model, "expert_cache", None)
    if cache is not None and cache.covers(i):
        return _cached_moe_ffn(model, i, r, ids, wts, cache)
    sent = _send(model, r, ids, wts)
    h1 = _dense(model, i, r)  # enqueued behind the copies: on a GPU it runs while the CPU does the experts
    return h1 + _receive(model, i, r, sent, normed=True).to(r.dtype)


def _send(model, r: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor):
    """r, ids and weights into the host staging (pinned, asynchronous on CUDA) -> (staging, the
    copies' event or None)."""
    st = _staging(model, r.shape[0], r.shape[1], ids.shape[1])
    cuda = r.device.type == "cuda"
    st.r.copy_(r, non_blocking=cuda)
    st.ids.copy_(ids, non_blocking=cuda)
    st.wts.copy_(wts, non_blocking=cuda)
    copied = torch.cuda.Event() if cuda else None
    if copied is not None:
        copied.record()
    return st, copied


def _receive(model, i: int, r: torch.Tensor, sent, normed: bool) -> torch.Tensor:
    """Wait for the copies (the layer's one synchronization: not for what was enqueued after
    them), run the CPU graph, and bring its [T, d] float32 back to r's device."""
    st, copied = sent
    if copied is not None:
        copied.synchronize()
    t0 = time.perf_counter()
    st.out.copy_(expert_mix(model.w, f"blk.{i}.", st.r, st.ids, st.wts, model.cfg.rms_eps, normed))
    _count(model, *crossing_bytes(r.shape[1], st.ids.shape[1], r.shape[0]), t0)
    return st.out.to(r.device, non_blocking=r.device.type == "cuda")


def _count(model, to_host: int, to_device: int, t0: float) -> None:
    """One layer's crossing in `model.host_traffic` (the engine's status, the bench): its bytes
    each way and the CPU's milliseconds since t0."""
    traffic = model.__dict__.setdefault("host_traffic", {"crossings": 0, "to_host": 0, "to_device": 0, "cpu_ms": 0.0})
    traffic["crossings"] += 1
    traffic["to_host"] += to_host
    traffic["to_device"] += to_device
    traffic["cpu_ms"] += (time.perf_counter() - t0) * 1e3


def _gated_ffn(product, mats, x: torch.Tensor, I: int) -> torch.Tensor:
    """down(gelu_tanh(gate) * up) of rows x, `mats` [gate_up, down] or [gate, up, down] and
    product(m, rows) their product; I the expert's FFN width."""
    if len(mats) == 3:
        gate, up = product(mats[0], x), product(mats[1], x)
    else:
        gu = product(mats[0], x)
        gate, up = gu[:, :I], gu[:, I:]
    return product(mats[-1], gelu_tanh(gate) * up)


def expert_ffn(mats, x: torch.Tensor, I: int) -> torch.Tensor:
    """One expert on its rows x [n, d], `mats` its matrices (ExpertMatrix or tensors)."""
    return _gated_ffn(lambda m, rows: linear(rows, m), mats, x, I)


def grouped_expert_ffn(banks, x: torch.Tensor, experts: torch.Tensor, I: int) -> torch.Tensor:
    """`expert_ffn` for P pairs at once: row p of x [P, d] float32 through expert experts[p] of
    `banks` (ExpertBanks), one grouped product a bank."""
    return _gated_ffn(lambda bank, rows: bank.grouped(rows, experts), banks, x, I)


def _dense(model, i: int, r: torch.Tensor) -> torch.Tensor:
    """The block's dense branch h1 on r's device."""
    w, b, eps = model.w, f"blk.{i}.", model.cfg.rms_eps
    return rms_norm(gated_mlp(rms_norm(r, w[b + "ffn_norm.weight"], eps), w, b), w[b + "post_ffw_norm_1.weight"], eps)


def crossing_bytes(d: int, k: int, T: int = 1) -> tuple[int, int]:
    """(device->host, host->device) bytes a host-experts layer moves for T rows."""
    return int(T * d * 4 + 2 * T * k * 4), int(T * d * 4)



def _cached_moe_ffn(model, i: int, r: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, cache) -> torch.Tensor:
    """host_moe_ffn with a hot-expert cache (models/expert_cache.py). The residual, ids and
    weights cross as without a cache; after the layer's one wait the host splits the picks: those
    in the layer's device slots are enqueued on the device (the dense branch is already there),
    the misses, each row's compacted and padded with a weight-0 repeat of one of them, go through
    the CPU graph; the two partial sums are added before the post norm. Misses are copied in
    after the block."""
    cfg, w, b, eps = model.cfg, model.w, f"blk.{i}.", model.cfg.rms_eps
    T, d = r.shape
    st, copied = _send(model, r, ids, wts)
    h1 = _dense(model, i, r)
    if copied is not None:
        copied.synchronize()  # the layer's one wait: the host now knows the picks
    hit, slot = cache.split(i, st.ids)
    h2 = torch.zeros(T, d, device=r.device, dtype=torch.float32)
    if bool(hit.any()):  # the device's share, enqueued before the CPU starts its own
        z = rms_norm(r, w[b + "pre_ffw_norm_2.weight"], eps).float()
        scale = w.get(b + "ffn_down_exps.scale")
        rows, cols = hit.nonzero(as_tuple=True)  # the P hit pairs, on the host: two copies over
        rows_d, slots_d, ids_d = torch.stack([rows, slot[rows, cols], st.ids[rows, cols].long()]).to(
            r.device, non_blocking=True)
        k_w = st.wts[rows, cols].to(r.device, non_blocking=True)
        if scale is not None:
            k_w = k_w * scale.float()[ids_d]
        y = grouped_expert_ffn(cache.layers[i].banks, z[rows_d], slots_d, cfg.expert_ffn_width)
        h2.index_add_(0, rows_d, y * k_w[:, None])
    miss = ~hit
    kk = int(miss.sum(-1).max())
    t0, back = time.perf_counter(), 0
    if kk:  # the CPU's share, on the host copies
        order = torch.argsort(miss.to(torch.int8), dim=-1, descending=True, stable=True)[:, :kk]
        taken = miss.gather(1, order)
        m_ids, m_wts = st.ids.gather(1, order), st.wts.gather(1, order) * taken
        pad = torch.where(miss.any(-1, keepdim=True), m_ids[:, :1], st.ids[miss][:1].reshape(1, 1))
        m_ids = torch.where(taken, m_ids, pad).to(torch.int32).contiguous()  # weight-0 repeats: no new expert read
        out = _staging(model, T, d, kk).out
        out.copy_(expert_mix(w, b, st.r, m_ids, m_wts.contiguous(), eps, normed=False))
        h2 += out.to(r.device, non_blocking=r.device.type == "cuda")
        back = out.numel() * out.element_size()
    _count(model, crossing_bytes(d, cfg.n_expert_used, T)[0], back, t0)
    cache.admit(i, st.ids, hit)
    return h1 + rms_norm(h2, w[b + "post_ffw_norm_2.weight"], eps).to(r.dtype)


def layer_banks(w, b: str) -> list:
    """Layer prefix b's expert banks in product order: [gate_up, down] or [gate, up, down]."""
    names = ("gate_up",) if b + "ffn_gate_up_exps.weight" in w else ("gate", "up")
    return [w[f"{b}ffn_{n}_exps.weight"] for n in (*names, "down")]


def cache_banks(model) -> dict:
    """{layer: its host banks (`layer_banks`)} of a model's host-expert layers, for
    models.expert_cache.ExpertCache and models.expert_stream.ExpertStream."""
    return {i: layer_banks(model.w, f"blk.{i}.") for i in sorted(model.host_expert_layers)}
