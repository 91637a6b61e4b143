"""The CPU fused chains: the models' elementwise chains (the ones the CUDA path fuses into Triton
kernels) as one ggml graph each, run by llama.cpp's own CPU ops, with matrix products inside the
graph where the chain has them.

Why: a decode step on the CPU is ~35 layers x ~40 small ops; as torch ops each costs ~4-6 us of
dispatch on this VM (E2B: ~30 ms of a ~75 ms step besides the products), as nodes of one ggml
graph ~0.3 us. Each function below builds its graph once per layout (kernels/ggml/graph.py,
cached) and runs it over the caller's tensors in place.

Numerics: llama.cpp's. RMSNorm accumulates in double; GELU is ggml's f16 table (`GGML_GELU_FP16`:
the input rounded to f16, the table's f16 value; ~3e-4 relative to tanh-GELU), as llama.cpp
computes it on the CPU; RoPE takes the caller's cos/sin tables (float64 angles, so long contexts
keep the reference's angles, not ggml's float32 ones). Every function has its `_ref` in torch
(GELU there is the table too, `gelu_ref`), which the tests compare against on odd shapes; the
models' own torch path (models/ops.py) keeps the exact GELU.

All tensors float32 on the CPU with a unit last stride; inputs may be strided views (q, k, v
slices of one projection output).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .graph import Graph, layout
from .lib import Matrix

_graphs: dict = {}
_MAX_GRAPHS = 512  # layouts x weights of the decode-sized graphs
CACHED_ROWS = 16  # graphs of up to this many rows are kept (decode, verify); bigger ones are built per run


def cached_graph(key, build, rows: int = 1):
    """The graph for `key`, built once. Rows beyond CACHED_ROWS (a prefill chunk): built for this
    run only, its intermediates in the shared allocator's buffer (kernels/ggml/graph.py): building
    costs ~0.1 ms against the chunk's milliseconds, and a kept graph per layer and chunk length
    would hold its own buffer (E2B: ~50 MB a layer at 512 rows)."""
    if rows > CACHED_ROWS:
        return build(True)
    g = _graphs.get(key)
    if g is None:
        if len(_graphs) >= _MAX_GRAPHS:
            for k in list(_graphs)[: _MAX_GRAPHS // 4]:  # oldest first (dicts keep insertion order)
                del _graphs[k]
        g = _graphs[key] = build(False)
    return g


def check_cpu_float32(*ts: Optional[torch.Tensor]) -> None:
    """What every graph here takes: CPU float32 tensors with a unit last stride (None skipped), or a ValueError."""
    for t in ts:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1):
            raise ValueError(f"ggml_ops: CPU float32 tensors with a unit last stride, got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()} on {t.device}")


def norm_nodes(g: Graph, x: int, w: Optional[int], eps: float) -> int:
    """RMSNorm of node x, times the weight node w (None: no weight)."""
    y = g.rms_norm(x, eps)
    return y if w is None else g.mul(y, w)


_scalars: dict = {}  # id of a one-element weight tensor -> (the tensor, its float value)


def scalar(t: Optional[torch.Tensor]) -> Optional[float]:
    """The value of a one-element weight (Gemma-4's layer_output_scale), read once: it is baked into
    the graphs as ggml_scale (a broadcast ggml_mul by a [1] tensor costs 6 us a row)."""
    if t is None:
        return None
    hit = _scalars.get(id(t))
    if hit is None or hit[0] is not t:
        hit = _scalars[id(t)] = (t, float(t.reshape(-1)[0]))
    return hit[1]


# --- GGUF rows ------------------------------------------------------------------------------
def dequantize_rows(raw: torch.Tensor, ggml_type: int, n_values: int) -> torch.Tensor:
    """uint8 [n, row bytes] GGUF rows of `ggml_type` -> float32 [n, n_values] by ggml's own
    dequantization (bit-exact with gguf-py's and models/quant.py's; one pass where the torch
    dequantizer runs ~20 ops: 0.2 ms for an E2B Q6_K embedding row against ~10 us)."""
    n = raw.shape[0]
    raw = raw.contiguous()

    def build(big):
        g = Graph(4, big)
        g.output(g.cast(g.raw_input(ggml_type, n_values, n), 0))
        return g.finish()

    out = torch.empty(n, n_values)
    if n:
        cached_graph(("rows", int(ggml_type), n_values, n), build, n).run([raw], [out])
    return out


# --- RMSNorm and the residual update ---------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """rms_norm(x) [* weight] over the last dim."""
    check_cpu_float32(x, weight)

    def build(big):
        g = Graph(8, big)
        g.output(norm_nodes(g, g.input(x), None if weight is None else g.input(weight), eps))
        return g.finish()

    out = torch.empty(x.shape)
    cached_graph(("rms", layout(x), weight is None, eps), build, x.numel() // max(1, x.shape[-1])).run(
        [x] + ([] if weight is None else [weight]), [out])
    return out


def rms_norm_ref(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                 scale: Optional[torch.Tensor] = None, next_weight: Optional[torch.Tensor] = None):
    """h = (x + rms_norm(y) [* weight]) [* scale]; n = rms_norm(h) * next_weight (None without
    next_weight) -> (h, n). scale: a one-element tensor."""
    check_cpu_float32(x, y, weight, next_weight)
    inputs = [t for t in (x, y, weight, next_weight) if t is not None]
    s = scalar(scale)

    def build(big):
        g = Graph(16, big)
        gx, gy = g.input(x), g.input(y)
        gw = g.input(weight) if weight is not None else None
        gn = g.input(next_weight) if next_weight is not None else None
        h = g.add(gx, norm_nodes(g, gy, gw, eps))
        if s is not None:
            h = g.scale(h, s)
        g.output(h)
        if gn is not None:
            g.output(norm_nodes(g, h, gn, eps))
        return g.finish()

    key = ("add_rms", layout(x), layout(y), weight is None, s, next_weight is None, eps)
    h = torch.empty(x.shape)
    n = torch.empty(x.shape) if next_weight is not None else None
    cached_graph(key, build, x.numel() // max(1, x.shape[-1])).run(inputs, [h] if n is None else [h, n])
    return h, n


def add_rms_norm_ref(x, y, weight, eps, scale=None, next_weight=None):
    h = x + rms_norm_ref(y, weight, eps)
    if scale is not None:
        h = h * scale
    return h, None if next_weight is None else rms_norm_ref(h, next_weight, eps)


# --- q/k/v: RMSNorm + NeoX RoPE ----------------------------------------------------------------
def rope_nodes(g: Graph, x: int, hd: int, heads: int, rows: int, cos: int, sin: int, n_half: int) -> int:
    """NeoX RoPE of a contiguous [rows, heads, hd] node x by cos/sin [rows, 1, n_half] nodes: pairs
    (j, j + n_half), dims >= 2·n_half pass through."""
    nb = [4, 4 * hd, 4 * hd * heads]
    x1 = g.view(x, [n_half, heads, rows], nb, 0)
    x2 = g.view(x, [n_half, heads, rows], nb, 4 * n_half)
    y = g.concat(g.sub(g.mul(x1, cos), g.mul(x2, sin)), g.add(g.mul(x2, cos), g.mul(x1, sin)), 0)
    if 2 * n_half < hd:
        y = g.concat(y, g.view(x, [hd - 2 * n_half, heads, rows], nb, 8 * n_half), 0)
    return y


def qkv_norm_rope(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], q_weight: torch.Tensor,
                  k_weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """The attention prologue: q, k RMSNorm (their weights) + RoPE; v weightless RMSNorm (v None:
    of the raw k). q [T, H, hd], k, v [T, Hk, hd] (views allowed); cos, sin [T, 1, n_half].
    k None (a KV-shared layer): only q. -> (q, k, v) new contiguous tensors (k, v None without k)."""
    check_cpu_float32(q, k, v, q_weight, k_weight, cos, sin)
    T, H, hd = q.shape
    n_half = cos.shape[-1]
    cos3, sin3 = cos.reshape(T, 1, n_half), sin.reshape(T, 1, n_half)
    ins = [q, q_weight, cos3, sin3] + ([k, k_weight] if k is not None else []) + ([v] if v is not None else [])

    def build(big):
        g = Graph(64, big)
        gq, gqw, gc, gs = (g.input(t) for t in ins[:4])
        g.output(rope_nodes(g, norm_nodes(g, gq, gqw, eps), hd, H, T, gc, gs, n_half))
        if k is not None:
            gk, gkw = g.input(k), g.input(k_weight)
            Hk = k.shape[1]
            g.output(rope_nodes(g, norm_nodes(g, gk, gkw, eps), hd, Hk, T, gc, gs, n_half))
            g.output(norm_nodes(g, g.input(v) if v is not None else gk, None, eps))
        return g.finish()

    key = ("qkv", layout(q), layout(k), layout(v), layout(cos3), eps)
    qo = torch.empty(q.shape)
    if k is None:
        cached_graph(key, build, T).run(ins, [qo])
        return qo, None, None
    ko, vo = torch.empty(k.shape), torch.empty(k.shape)
    cached_graph(key, build, T).run(ins, [qo, ko, vo])
    return qo, ko, vo


def rope_ref(x, cos, sin):
    n = cos.shape[-1]
    x1, x2, rest = x[..., :n], x[..., n:2 * n], x[..., 2 * n:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def qkv_norm_rope_ref(q, k, v, q_weight, k_weight, eps, cos, sin):
    qo = rope_ref(rms_norm_ref(q, q_weight, eps), cos, sin)
    if k is None:
        return qo, None, None
    return qo, rope_ref(rms_norm_ref(k, k_weight, eps), cos, sin), rms_norm_ref(k if v is None else v, None, eps)


# --- GELU chains -----------------------------------------------------------------------------
def gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU (GGML_GELU_FP16): 0 below -10, x above 10, else the f16 table at f16(x)."""
    y = F.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up (views allowed: the halves of one gate/up product)."""
    check_cpu_float32(gate, up)

    def build(big):
        g = Graph(8, big)
        g.output(g.mul(g.gelu(g.cont(g.input(gate))), g.input(up)))
        return g.finish()

    out = torch.empty(gate.shape)
    cached_graph(("gelu_mul", layout(gate), layout(up)), build, gate.numel() // max(1, gate.shape[-1])).run(
        [gate, up], [out])
    return out


def gelu_mul_ref(gate, up):
    return gelu_ref(gate) * up


def linear_gelu_mul(x: torch.Tensor, w: Matrix, e: torch.Tensor) -> torch.Tensor:
    """gelu(x W^T) * e: Gemma-4's per-layer-input gate, x [T, in], e [T, out] (a view allowed)."""
    check_cpu_float32(x, e)

    def build(big):
        g = Graph(8, big)
        g.output(g.mul(g.gelu(g.mul_mat(g.matrix(w), g.input(x))), g.input(e)))
        return g.finish()

    out = torch.empty(x.shape[0], w.shape[0])
    cached_graph(("lin_gelu_mul", id(w), layout(x), layout(e)), build, x.shape[0]).run([x, e], [out])
    return out


def mlp_nodes(g: Graph, gm: int, gate_up: Optional[Matrix], down: Matrix, gate: Optional[Matrix] = None,
              up: Optional[Matrix] = None) -> int:
    """The nodes of `gated_mlp` on node gm [d, T] -> [d_out, T]."""
    if gate_up is not None:
        act = g.geglu(g.mul_mat(g.matrix(gate_up), gm))
    else:
        act = g.mul(g.gelu(g.mul_mat(g.matrix(gate), gm)), g.mul_mat(g.matrix(up), gm))
    return g.mul_mat(g.matrix(down), act)


def gated_mlp(m: torch.Tensor, gate_up: Matrix, down: Matrix, gate: Optional[Matrix] = None,
              up: Optional[Matrix] = None) -> torch.Tensor:
    """down(gelu(m G^T) * (m U^T)) for m [T, d]: one stacked [gate; up] matrix (`gate_up`, its
    product's halves fed to ggml's GEGLU), or separate `gate` and `up` (gate_up None)."""
    check_cpu_float32(m)

    def build(big):
        g = Graph(16, big)
        g.output(mlp_nodes(g, g.input(m), gate_up, down, gate, up))
        return g.finish()

    key = ("mlp", id(gate_up), id(gate), id(up), id(down), layout(m))
    out = torch.empty(m.shape[0], down.shape[0])
    cached_graph(key, build, m.shape[0]).run([m], [out])
    return out


# --- whole stretches of a decoder layer ---------------------------------------------------------
def raw_v(g: Graph, y: int, a: int, v_matrix: Optional[Matrix], width: int, n_head: int, n_kv: int,
          head_dim: int, T: int) -> int:
    """The un-normed V view [hd, n_kv, T] of a layer: its own product a V^T (`v_matrix`, another
    quantization type), the rows after Q and K of the stacked product y [T, width], or (no V
    projection) the raw K rows."""
    nq, nk = n_head * head_dim, n_kv * head_dim
    if v_matrix is not None:
        return g.view(g.mul_mat(g.matrix(v_matrix), a), [head_dim, n_kv, T], [4, 4 * head_dim, 4 * nk], 0)
    nb = [4, 4 * head_dim, 4 * width]
    return g.view(y, [head_dim, n_kv, T], nb, 4 * (nq + nk) if width >= nq + 2 * nk else 4 * nq)


def attention_prologue(a: torch.Tensor, qkv: Matrix, v_matrix: Optional[Matrix], n_head: int, n_kv: int,
                       head_dim: int, q_weight: torch.Tensor, k_weight: Optional[torch.Tensor], eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, v_norm: bool = True):
    """The projections and the q/k(/v) prologue of a layer in one graph. a [T, d] (the normed
    residual); `qkv` the stacked rows Q, K[, V] (or only Q: a KV-shared layer, k_weight None),
    `v_matrix` a separate V (another quantization type), neither: V = the raw K. q, k RMSNorm +
    RoPE, v RMSNorm without weight (`v_norm`; Gemma 3: v raw). -> (q [T, H, hd], k, v [T, Hk, hd])
    contiguous (k, v None for a KV-shared layer)."""
    check_cpu_float32(a, q_weight, k_weight, cos, sin)
    T = a.shape[0]
    n_half = cos.shape[-1]
    cos3, sin3 = cos.reshape(T, 1, n_half), sin.reshape(T, 1, n_half)
    shared = k_weight is None
    ins = [a, q_weight, cos3, sin3] + ([] if shared else [k_weight])
    nq = n_head * head_dim

    def build(big):
        g = Graph(96, big)
        ga, gqw, gc, gs = (g.input(t) for t in ins[:4])
        y = g.mul_mat(g.matrix(qkv), ga)  # [T, rows of qkv]
        width = qkv.shape[0]
        nb = [4, 4 * head_dim, 4 * width]
        q = g.view(y, [head_dim, n_head, T], nb, 0)
        g.output(rope_nodes(g, norm_nodes(g, q, gqw, eps), head_dim, n_head, T, gc, gs, n_half))
        if not shared:
            gkw = g.input(k_weight)
            k = g.view(y, [head_dim, n_kv, T], nb, 4 * nq)
            g.output(rope_nodes(g, norm_nodes(g, k, gkw, eps), head_dim, n_kv, T, gc, gs, n_half))
            v = raw_v(g, y, ga, v_matrix, width, n_head, n_kv, head_dim, T)
            g.output(norm_nodes(g, v, None, eps) if v_norm else g.cont(v))
        return g.finish()

    key = ("prologue", id(qkv), id(v_matrix), layout(a), layout(cos3), n_head, n_kv, head_dim, shared, v_norm, eps)
    qo = torch.empty(T, n_head, head_dim)
    if shared:
        cached_graph(key, build, T).run(ins, [qo])
        return qo, None, None
    ko, vo = torch.empty(T, n_kv, head_dim), torch.empty(T, n_kv, head_dim)
    cached_graph(key, build, T).run(ins, [qo, ko, vo])
    return qo, ko, vo


def attn_residual(x: torch.Tensor, o: torch.Tensor, w_o: Matrix, post_weight: torch.Tensor, eps: float,
                  next_weight: Optional[torch.Tensor]):
    """After attention: h = x + rms_norm(o W_o^T) * post_weight; n = rms_norm(h) * next_weight
    (the MLP's pre-norm) -> (h, n)."""
    check_cpu_float32(x, o, post_weight, next_weight)
    ins = [x, o, post_weight] + ([] if next_weight is None else [next_weight])

    def build(big):
        g = Graph(16, big)
        gx, go, gw = (g.input(t) for t in ins[:3])
        h = g.add(gx, norm_nodes(g, g.mul_mat(g.matrix(w_o), go), gw, eps))
        g.output(h)
        if next_weight is not None:
            g.output(norm_nodes(g, h, g.input(next_weight), eps))
        return g.finish()

    h = torch.empty(x.shape)
    n = None if next_weight is None else torch.empty(x.shape)
    cached_graph(("attn_res", id(w_o), layout(x), layout(o), next_weight is None, eps), build, x.shape[0]).run(
        ins, [h] if n is None else [h, n])
    return h, n


def ffn_residual(x: torch.Tensor, m: torch.Tensor, gate_up: Optional[Matrix], gate: Optional[Matrix],
                 up: Optional[Matrix], down: Matrix, post_weight: torch.Tensor, eps: float,
                 ple: Optional[tuple] = None, scale: Optional[torch.Tensor] = None,
                 next_weight: Optional[torch.Tensor] = None):
    """The rest of a layer in one graph: f = down(gelu(m G^T) * (m U^T)); x1 = x + rms_norm(f) *
    post_weight; with `ple` = (inp_gate Matrix, pl [T, P], proj Matrix, post_norm weight) (Gemma-4's
    per-layer input) x2 = x1 + rms_norm(proj(gelu(x1 inp_gate^T) * pl)) * post_norm, else x2 = x1;
    h = x2 [* scale]; n = rms_norm(h) * next_weight (the next layer's attention norm or the final
    norm) -> (h, n)."""
    inp_gate, pl, proj, post_norm = ple if ple is not None else (None, None, None, None)
    check_cpu_float32(x, m, post_weight, pl, post_norm, next_weight)
    s = scalar(scale)
    ins = [t for t in (x, m, post_weight, pl, post_norm, next_weight) if t is not None]

    def build(big):
        g = Graph(48, big)
        it = iter(ins)
        gx, gm, gpw = next(it), next(it), next(it)
        gx, gm, gpw = g.input(gx), g.input(gm), g.input(gpw)
        if gate_up is not None:
            act = g.geglu(g.mul_mat(g.matrix(gate_up), gm))
        else:
            act = g.mul(g.gelu(g.mul_mat(g.matrix(gate), gm)), g.mul_mat(g.matrix(up), gm))
        h = g.add(gx, norm_nodes(g, g.mul_mat(g.matrix(down), act), gpw, eps))
        if ple is not None:
            gpl, gpn = g.input(next(it)), g.input(next(it))
            e = g.mul(g.gelu(g.mul_mat(g.matrix(inp_gate), h)), gpl)
            h = g.add(h, norm_nodes(g, g.mul_mat(g.matrix(proj), e), gpn, eps))
        if s is not None:
            h = g.scale(h, s)
        g.output(h)
        if next_weight is not None:
            g.output(norm_nodes(g, h, g.input(next(it)), eps))
        return g.finish()

    key = ("ffn_res", id(gate_up), id(gate), id(up), id(down), id(inp_gate), id(proj), layout(x), layout(m),
           layout(pl), s, next_weight is None, eps)
    h = torch.empty(x.shape)
    n = None if next_weight is None else torch.empty(x.shape)
    cached_graph(key, build, x.shape[0]).run(ins, [h] if n is None else [h, n])
    return h, n

