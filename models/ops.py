"""The layer ops of the Gemma model files (norms, RoPE, projections, the gated MLP, attention,
embedding lookups, softcap) and their kernel dispatch.

Each op is the plain-torch reference (exact math in the caller's dtype: float32 on the CPU, float64
in the exactness tests) unless `kernels.triton.launch.use_kernels` says the fused Triton kernels run where
the tensors live (CUDA; the CPU under `kernels_on_cpu()` with the interpreter; meta in a dry run).
Kernels in `kernels/` are checked against these.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .formats import is_ggml
from .runtime import Runtime


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_modules: dict = {}  # kernels module name -> the module, or None without triton (imported once)
# kernels.ggml.ops while a model on llama.cpp's CPU kernels runs a forward (`cpu_chains`), else None
_CPU_CHAINS: contextvars.ContextVar = contextvars.ContextVar("edgegem_cpu_chains", default=None)


@contextlib.contextmanager
def cpu_chains(model):
    """Inside, for a model of the ggml runtime (`model.runtime`, models/runtime.py: its matrices are
    models.formats.GGMLWeight), the ops below run their elementwise chains as ggml graphs
    (kernels/ggml/ops.py: one call where torch runs several ops, products inside where the chain
    has them) for CPU float32 tensors. Other runtimes keep the torch ops."""
    if getattr(model, "runtime", None) is not Runtime.GGML or _CPU_CHAINS.get() is not None:
        yield
        return
    from kernels.ggml import ops as ggml_ops

    token = _CPU_CHAINS.set(ggml_ops)
    try:
        yield
    finally:
        _CPU_CHAINS.reset(token)


def _chains(*ts: torch.Tensor | None):
    """kernels.ggml.ops inside `cpu_chains` when every tensor is CPU float32 with a unit last stride."""
    c = _CPU_CHAINS.get()
    if c is None:
        return None
    for t in ts:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1):
            return None
    return c


def in_cpu_chains(*ts: torch.Tensor | None) -> bool:
    """Inside `cpu_chains` with every tensor CPU float32 with a unit last stride: what a ggml graph
    of a model's rows (models/token_graph.py) takes."""
    return _chains(*ts) is not None


def _kernel_module(name: str):
    """kernels.<name> when it imports with triton, else None (checked once per module)."""
    if name not in _modules:
        import importlib

        try:
            mod = importlib.import_module(f"kernels.triton.{name}")
        except ImportError:
            mod = None
        _modules[name] = mod if mod is not None and mod.triton is not None else None
    return _modules[name]


def _fused_for(*ts: torch.Tensor | None):
    """kernels.triton.fused when every tensor given is an fp16/bf16/fp32 tensor with a unit last stride
    where the kernels run (CUDA; see kernels.triton.launch.use_kernels for the interpreter and dry runs)
    and triton imports (checked once), else None. On CUDA the fused Triton kernels make one pass
    over memory where the torch path below runs several ops with fp32 temporaries; the CPU path
    (and float64) stays the torch reference."""
    from kernels.triton.launch import use_kernels

    if ts and ts[0] is not None and ts[0].device.type == "cpu" and not _cpu_kernels_possible():
        return None  # the CPU path's common case, decided before the per-tensor checks
    if not all(t is None or (t.dtype in _FUSED_DTYPES and t.stride(-1) == 1) for t in ts) or not use_kernels(*ts):
        return None
    return _kernel_module("fused")


def _cpu_kernels_possible() -> bool:
    """Triton kernels may run on the CPU only inside kernels_on_cpu() under TRITON_INTERPRET=1."""
    from kernels.triton.launch import _state, interpreting

    return getattr(_state, "cpu_kernels", 0) > 0 and interpreting()


def kernel_path(*ts: torch.Tensor | None) -> bool:
    """True where the ops below take their fused kernels for these tensors (`_fused_for`)."""
    return _fused_for(*ts) is not None


def rope_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the cos/sin tables x's layer wants: fp32 on the kernel path (the fused kernels
    rotate in fp32, and one table per step serves every layer without a cast), x's otherwise."""
    return torch.float32 if kernel_path(x) else x.dtype


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-1/2 [* weight] over the last dim; float32 at least, cast back."""
    fused = _fused_for(x, weight)
    if fused is not None:  # CUDA: one Triton pass (kernels/triton/fused.py), same fp32 math
        return fused.rms_norm(x, weight, eps)
    chains = _chains(x, weight)
    if chains is not None:  # CPU on llama.cpp's kernels: one ggml graph
        return chains.rms_norm(x, weight, eps)
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    w = None if weight is None else weight.to(xf.dtype)
    # F.rms_norm is one op (the composite form is 5, ~30 us each on a small CPU) and equals it
    # exactly in float32 and float64.
    return F.rms_norm(xf, (xf.shape[-1],), w, eps).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """y = x W^T for a dense [out, in] tensor, or a weight object exposing `.linear(x)`
    (quantized weights on the CUDA path)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return w.linear(x)


def linear_gelu_mul(x: torch.Tensor, w, e: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x W^T) * e (Gemma-4's per-layer-input gate): a quantized W on the kernel path does
    it in the GEMV's epilogue (one launch); elsewhere linear, then gelu_mul."""
    if not isinstance(w, torch.Tensor) and getattr(w, "packed", None) is not None and kernel_path(x, e):
        return w.linear(x, gelu_mul=e)
    chains = _chains(x, e) if x.dim() == 2 and e.dim() == 2 else None
    if chains is not None and is_ggml(w):  # CPU on llama.cpp's kernels: product + GELU·mul
        return chains.linear_gelu_mul(x, w.matrix_for(x.shape[0]), e)
    return gelu_mul(linear(x, w), e)


def qkv_projection(x: torch.Tensor, w: dict, b: str, n_q: int, n_kv: int):
    """q [.., n_q], k [.., n_kv], v [.., n_kv] or None (no attn_v: V = K) for layer prefix `b`,
    from separate attn_q/k/v weights or one fused `attn_qkv` (rows Q, K[, V]; when it holds Q and
    K only, a separate attn_v, e.g. of another quantization type, is still V)."""
    fused = w.get(b + "attn_qkv.weight")
    v = linear(x, w[b + "attn_v.weight"]) if b + "attn_v.weight" in w else None
    if fused is not None:
        y = linear(x, fused)
        if y.shape[-1] == n_q + 2 * n_kv:
            return y.split([n_q, n_kv, n_kv], dim=-1)
        q, k = y.split([n_q, n_kv], dim=-1)
        return q, k, v
    return linear(x, w[b + "attn_q.weight"]), linear(x, w[b + "attn_k.weight"]), v


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up; on the kernel path one Triton pass (kernels/triton/fused.gelu_tanh_mul) that
    reads gate and up in place (the halves of a fused gate_up output, or a strided PLE slice)."""
    kern = _fused_for(gate, up)
    if kern is not None:
        return kern.gelu_tanh_mul(gate, up)
    chains = _chains(gate, up)
    return chains.gelu_mul(gate, up) if chains is not None else gelu_tanh(gate) * up


def gated_mlp(m: torch.Tensor, w: dict, b: str) -> torch.Tensor:
    """down(gelu_tanh(gate m) * up m) for layer prefix `b` (gate/up possibly fused; a quantized
    gate/up with interleaved rows does gate, up and the activation in one GEMV, `glu`)."""
    fused = w.get(b + "ffn_gate_up.weight")
    if getattr(fused, "interleaved", False):
        return linear(fused.glu(m), w[b + "ffn_down.weight"])
    down = w[b + "ffn_down.weight"]
    chains = _chains(m) if m.dim() == 2 and is_ggml(down) else None
    if chains is not None:  # CPU on llama.cpp's kernels: gate/up, GEGLU and down in one ggml graph
        rows = m.shape[0]
        if is_ggml(fused):
            return chains.gated_mlp(m, fused.matrix_for(rows), down.matrix_for(rows))
        gate, up = w.get(b + "ffn_gate.weight"), w.get(b + "ffn_up.weight")
        if fused is None and is_ggml(gate, up):
            return chains.gated_mlp(m, None, down.matrix_for(rows), gate.matrix_for(rows), up.matrix_for(rows))
    if fused is not None:
        gate, up = linear(m, fused).chunk(2, dim=-1)
    else:
        gate, up = linear(m, w[b + "ffn_gate.weight"]), linear(m, w[b + "ffn_up.weight"])
    return linear(gelu_mul(gate, up), w[b + "ffn_down.weight"])


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                 scale: Optional[torch.Tensor] = None, next_weight: Optional[torch.Tensor] = None):
    """The residual update (x + rms_norm(y) [* weight]) [* scale] -> (h, n): on the kernel path one
    Triton pass (kernels/triton/fused.add_rms_norm) that also returns n = rms_norm(h) * next_weight for
    the op reading h next (the next layer's attention norm, or the final norm); the reference
    returns n = None (the next op norms h itself, as it always did). scale: a one-element tensor
    (Gemma-4's layer_output_scale), read in the kernel."""
    fused = _fused_for(x, y, weight, next_weight)
    if fused is not None:
        return fused.add_rms_norm(x, y, weight, eps, scale, next_weight)
    chains = _chains(x, y, weight, next_weight)
    if chains is not None and (scale is None or scale.dtype == torch.float32):
        return chains.add_rms_norm(x, y, weight, eps, scale, next_weight)
    h = x + rms_norm(y, weight, eps)
    if scale is not None:
        h = h * scale.to(h.dtype)
    return h, None


def attn_residual(x: torch.Tensor, o: torch.Tensor, w_o, post_weight: torch.Tensor, eps: float,
                  next_weight: Optional[torch.Tensor] = None):
    """After attention: (h, n) = add_rms_norm(x, o W_o^T, post_weight, next_weight=...): the output
    projection and the residual update; on the CPU with llama.cpp's kernels one ggml graph
    (kernels/ggml/ops.attn_residual), n always given there."""
    chains = _chains(x, o, post_weight, next_weight) if x.dim() == 2 and o.dim() == 2 else None
    if chains is not None and is_ggml(w_o):
        return chains.attn_residual(x, o, w_o.matrix_for(x.shape[0]), post_weight, eps, next_weight)
    return add_rms_norm(x, linear(o, w_o), post_weight, eps, next_weight=next_weight)


def ffn_residual(x: torch.Tensor, m: torch.Tensor, w: dict, b: str, eps: float, pl: Optional[torch.Tensor] = None,
                 scale: Optional[torch.Tensor] = None, next_weight: Optional[torch.Tensor] = None):
    """The rest of a dense layer after the MLP's pre-norm m: f = gated_mlp(m); x += rms_norm(f) *
    post_ffw_norm; with `pl` (Gemma-4's per-layer input [T, P]) x += rms_norm(proj(gelu(x
    inp_gate^T) * pl)) * post_norm; x *= scale -> (x, rms_norm(x) * next_weight or None). On the
    CPU with llama.cpp's kernels one ggml graph (kernels/ggml/ops.ffn_residual)."""
    chains = _chains(x, m, pl, next_weight) if x.dim() == 2 and m.dim() == 2 else None
    down = w[b + "ffn_down.weight"]
    if chains is not None and is_ggml(down):
        rows = x.shape[0]
        mats = [w.get(b + n) for n in ("ffn_gate_up.weight", "ffn_gate.weight", "ffn_up.weight")]
        ple = None
        if pl is not None:
            gate, proj = w[b + "inp_gate.weight"], w[b + "proj.weight"]
            if is_ggml(gate, proj):
                ple = (gate.matrix_for(rows), pl, proj.matrix_for(rows), w[b + "post_norm.weight"])
        ok = (mats[0] is None or is_ggml(mats[0])) and (pl is None or ple is not None) and (
            mats[0] is not None or is_ggml(*mats[1:]))
        if ok:
            gu, g, u = (None if t is None else t.matrix_for(rows) for t in mats)
            return chains.ffn_residual(x, m, gu, g, u, down.matrix_for(rows), w[b + "post_ffw_norm.weight"], eps,
                                       ple, scale, next_weight)
    f = gated_mlp(m, w, b)
    if pl is None:
        return add_rms_norm(x, f, w[b + "post_ffw_norm.weight"], eps, scale, next_weight)
    x, _ = add_rms_norm(x, f, w[b + "post_ffw_norm.weight"], eps)  # PLE injection: the gate reads the post-MLP residual
    g = linear_gelu_mul(x, w[b + "inp_gate.weight"], pl)
    return add_rms_norm(x, linear(g, w[b + "proj.weight"]), w[b + "post_norm.weight"], eps, scale, next_weight)


def attention_prologue(a: torch.Tensor, w: dict, b: str, n_head: int, n_kv: int, head_dim: int, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, cache, layer: int, pos: torch.Tensor,
                       has_kv: bool = True, v_norm: bool = True) -> torch.Tensor:
    """A layer's projections and attention prologue -> q [T, n_head, hd]: q (and, for a KV-owning
    layer, k and v, written to `cache`) from the normed residual a [T, d]; q, k RMSNorm + RoPE, v
    weightless RMSNorm (`v_norm`; Gemma 3 keeps v raw; no attn_v: V = raw K). A KV-shared layer
    (`has_kv` False) projects q only. On the CPU with llama.cpp's kernels one ggml graph
    (kernels/ggml/ops.attention_prologue); elsewhere the projections, then norm_rope_store (one
    Triton launch on CUDA) or norm_rope."""
    T, shared = a.shape[0], not has_kv
    qkv = w.get(b + "attn_q.weight") if shared else w.get(b + "attn_qkv.weight")
    chains = _chains(a, cos, sin) if a.dim() == 2 and cos.shape[-1] > 0 else None
    if chains is not None and is_ggml(qkv) and (shared or qkv.shape[0] > n_head * head_dim):
        v_m = w.get(b + "attn_v.weight")
        if v_m is None or is_ggml(v_m):
            q, k, v = chains.attention_prologue(
                a, qkv.matrix_for(T), None if v_m is None else v_m.matrix_for(T), n_head, n_kv, head_dim,
                w[b + "attn_q_norm.weight"], None if shared else w[b + "attn_k_norm.weight"], eps, cos, sin, v_norm)
            if not shared:
                cache.write(layer, pos, k, v)
            return q
    if shared:
        return norm_rope(linear(a, w[b + "attn_q.weight"]).reshape(T, n_head, head_dim), w[b + "attn_q_norm.weight"],
                         eps, cos, sin)
    q, k_raw, v_raw = qkv_projection(a, w, b, n_head * head_dim, n_kv * head_dim)
    q, k_raw = q.reshape(T, n_head, head_dim), k_raw.reshape(T, n_kv, head_dim)
    v_raw = None if v_raw is None else v_raw.reshape(T, n_kv, head_dim)  # no attn_v: V = raw K
    if v_norm:
        return norm_rope_store(q, k_raw, v_raw, w[b + "attn_q_norm.weight"], w[b + "attn_k_norm.weight"], eps,
                               cos, sin, cache, layer, pos)
    q = norm_rope(q, w[b + "attn_q_norm.weight"], eps, cos, sin)
    cache.write(layer, pos, norm_rope(k_raw, w[b + "attn_k_norm.weight"], eps, cos, sin), v_raw)
    return q


def scaled_add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                        x_scale: float, y_scale: float, out_scale: float,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(x * x_scale + rms_norm(y * y_scale) [* weight]) * out_scale (Gemma-4's per-layer inputs:
    tok·√P + rms_norm(ctx·d^-1/2), times 2^-1/2), into `out` when given; one Triton pass on the
    kernel path."""
    fused = _fused_for(x, y, weight, out)
    if fused is not None:
        return fused.add_rms_norm(x, y, weight, eps, x_scale=x_scale, y_scale=y_scale, out_scale=out_scale,
                                  out=out)[0]
    h = (x * x_scale + rms_norm(y * y_scale, weight, eps)) * out_scale
    return h if out is None else out.copy_(h)


def norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor], q_weight: torch.Tensor,
                    k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, cache,
                    layer: int, pos: torch.Tensor) -> torch.Tensor:
    """The attention prologue of a KV-owning layer: q, k rms_norm + RoPE, v weightless rms_norm
    (v None: the raw k), K/V written to `cache` for `layer` at `pos`; returns q.
    q [T, n_h, hd], k, v [T, n_kv, hd]; cos, sin [T, 1, n_rot/2] (fp32 on the kernel path).
    Kernel path: one Triton launch (kernels/triton/qkv.py), storing straight into the slabs when the cache
    offers them (`cache.slab_target(layer)`, the engine's pools with the triton backend)."""
    chains = _chains(q, k, v, q_weight, k_weight, cos, sin)
    if chains is not None and cos.shape[-1] > 0:  # CPU on llama.cpp's kernels: one ggml graph
        q, k, v = chains.qkv_norm_rope(q, k, v, q_weight, k_weight, eps, cos, sin)
        cache.write(layer, pos, k, v)
        return q
    qkv = _kernel_module("qkv") if _fused_for(q, k, v, q_weight, k_weight) is not None else None
    if qkv is None or cos.dtype != torch.float32 or cos.shape[-1] == 0:
        q = norm_rope(q, q_weight, eps, cos, sin)
        k_normed = norm_rope(k, k_weight, eps, cos, sin)
        cache.write(layer, pos, k_normed, rms_norm(k if v is None else v, None, eps))
        return q
    target = cache.slab_target(layer) if hasattr(cache, "slab_target") else None
    if target is None:
        q, k, v = qkv.qkv_norm_rope_store(q, k, v, q_weight, k_weight, eps, cos, sin)
        cache.write(layer, pos, k, v)
        return q
    return qkv.qkv_norm_rope_store(q, k, v, q_weight, k_weight, eps, cos, sin, target.k, target.v,
                                   target.slots, target.k_scale, target.v_scale)[0]


def embedding_rows(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a [V, D] table: a dense tensor or an object with `.rows(ids)` (host tables)."""
    if isinstance(table, torch.Tensor):
        return table.index_select(0, ids.to(table.device))
    return table.rows(ids)


def rows_to_device(rows: torch.Tensor, device: torch.device, dtype) -> torch.Tensor:
    """Gathered embedding rows from host tables (`--embed-weights host`) to the device: through
    pinned memory, so the copy is asynchronous and overlaps the host's next work."""
    if rows.device.type == "cpu" and device.type == "cuda":
        return rows.pin_memory().to(device, non_blocking=True).to(dtype)
    return rows.to(device, dtype)


def quant_rows_to_device(tables: Sequence, ids: torch.Tensor, device: torch.device, dtype) -> list:
    """Rows `ids` of quantized embedding tables (QuantWeight: GGUF rows `.raw` [V, row_bytes] uint8,
    `.ggml_type`, `.shape`; or a repacked tied head, whose `.rows` dequantizes on its device), dequantized on `device` by the Triton kernel (kernels.triton.qmatmul.qdequantize)
    -> [len(ids), D] in `dtype` each. Host tables (`--embed-weights host`) send their raw rows, not
    dequantized ones: a 2048-token prefill moves 2048 x 7350 bytes of E2B's Q6_K per-layer table
    instead of 2048 x 8960 fp32 values, in one pinned non-blocking copy for all the tables, and the
    host no longer dequantizes (~133 ms per 2048 rows on 2 cores)."""
    from kernels.triton.qmatmul import qdequantize

    if any(t.raw is None for t in tables):  # a repacked table (a tied head on the device): rows from its planes
        return [t.rows(ids.to(t.device)).to(device, dtype) if t.raw is None else
                quant_rows_to_device([t], ids, device, dtype)[0] for t in tables]
    raws = [t.raw_rows(ids) if hasattr(t, "raw_rows") else t.raw.index_select(0, ids.to(t.raw.device))
            for t in tables]
    remote = [i for i, r in enumerate(raws) if r.device != device]
    if remote:  # one copy: the tables' rows back to back (each part stays contiguous)
        flat = torch.cat([raws[i].reshape(-1) for i in remote]) if len(remote) > 1 else raws[remote[0]].reshape(-1)
        if flat.device.type == "cpu" and device.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)
        start = 0
        for i in remote:
            n = raws[i].numel()
            raws[i] = flat[start:start + n].view(raws[i].shape)
            start += n
    return [qdequantize(r, t.ggml_type, r.shape[0], t.shape[1], dtype) for r, t in zip(raws, tables)]


def quantized_table(table) -> bool:
    """A table `quant_rows_to_device` can read: a QuantWeight (GGUF rows the kernels dequantize)."""
    return hasattr(table, "raw") and hasattr(table, "ggml_type") and not isinstance(table, torch.Tensor)


def rope_inv_freq(n_rot: int, base: float, freq_factors: Optional[Sequence[float]] = None,
                  dtype=torch.float64) -> torch.Tensor:
    """Inverse frequencies for NeoX RoPE over `n_rot` dims: base^(-2j/n_rot) / factor[j], j < n_rot/2.

    A factor >= 1e29 (Gemma 4's proportional RoPE marks non-rotating pairs with 1e30) means no
    rotation: inv_freq 0 exactly, rather than dividing by 1e30.
    """
    j = torch.arange(n_rot // 2, dtype=torch.float64)
    inv = base ** (-2.0 * j / n_rot)
    if freq_factors is not None:
        f = torch.tensor(list(freq_factors)[: n_rot // 2], dtype=torch.float64)
        inv = torch.where(f >= 1e29, torch.zeros_like(inv), inv / f)
    return inv.to(dtype)


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, dtype, pos_scale: float = 1.0):
    """cos, sin [T, 1, n_rot/2] of NeoX RoPE angles pos·inv_freq (float64 angles, cast to dtype)."""
    ang = (pos.to(torch.float64) * pos_scale)[:, None] * inv_freq.to(torch.float64)[None, :]
    return ang.cos().to(dtype)[:, None, :], ang.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (half-split) RoPE. x: [T, n_heads, hd]; cos, sin: [T, 1, n_rot/2].

    Dim j pairs with j + n_rot/2; dims >= n_rot pass through.
    """
    n_half = cos.shape[-1]
    x1, x2, rest = x[..., :n_half], x[..., n_half:2 * n_half], x[..., 2 * n_half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The q/k path: rms_norm over the head dim, then NeoX RoPE. x [T, H, hd]; cos, sin [T, 1, n_rot/2].
    CUDA: one Triton pass (kernels/triton/fused.rms_norm_rope: fp32 math and fp32 angles, one read and one
    write of x instead of ~8 elementwise kernels); elsewhere the reference composition."""
    fused = _fused_for(x, weight)
    if fused is not None and cos.shape[-1] > 0:
        return fused.rms_norm_rope(x, weight, eps, cos.float(), sin.float())
    chains = _chains(x, weight, cos, sin)
    if chains is not None and cos.shape[-1] > 0:
        return chains.qkv_norm_rope(x, None, None, weight, None, eps, cos, sin)[0]
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor, window: Optional[int], scale: float,
              last_key: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention.

    q: [T, n_h, hd]; k, v: [S, n_kv, hd]; q_pos: [T]; k_pos: [S] absolute positions.
    Key j is visible to query i iff k_pos[j] <= q_pos[i] and (no window or q_pos[i] - k_pos[j] < window):
    a window of W keys includes the query's own position (llama.cpp `is_masked_swa`).
    `last_key` [T]: the last position each query sees instead of its own (an image token on the
    sliding layers of 26B/31B sees the rest of its image: models/image_attention.py).
    Returns [T, n_h * hd].
    """
    T, n_h, hd = q.shape
    n_kv = k.shape[1]
    if T == 1 and q.device.type == "cpu":  # a decode step: no SDPA mask broadcast (E2B, 2 threads,
        # a full layer at 1024 keys: 380 us against SDPA's 575; the time is reading K and V once).
        # One row's last_key is its own position (an image run of one row ends there).
        return decode_attention_parts(q, [k], [v], q_pos, [k_pos], window, scale)
    diff = q_pos[:, None].to(k_pos.device) - k_pos[None, :]  # [T, S]
    mask = diff >= 0 if last_key is None else k_pos[None, :] <= last_key[:, None].to(k_pos.device)
    if window is not None:
        mask &= diff < window
    group = n_h // n_kv
    # Fold each KV head's query group into the query axis rather than copying K/V per query head:
    # q [n_kv, group*T, hd] against k, v [n_kv, S, hd]; head h = kv*group + j reads KV head h // group.
    qg = q.reshape(T, n_kv, group, hd).permute(1, 2, 0, 3).reshape(n_kv, group * T, hd)
    o = F.scaled_dot_product_attention(qg, k.permute(1, 0, 2), v.permute(1, 0, 2),
                                       attn_mask=mask.repeat(group, 1), scale=scale)
    return o.reshape(n_kv, group, T, hd).permute(2, 0, 1, 3).reshape(T, n_h * hd)


def decode_attention_parts(q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                           q_pos: torch.Tensor, k_pos: Sequence[torch.Tensor], window: Optional[int],
                           scale: float) -> torch.Tensor:
    """`attention` for one query q [1, n_h, hd] over keys held in several parts (ks[i], vs[i]
    [S_i, n_kv, hd] at positions k_pos[i] [S_i]): views of a pool's consecutive slot runs, so
    the engine need not gather a sequence's K/V into one tensor every step. The scores of all
    parts share one softmax; each part's V is read in place."""
    n_h, hd = q.shape[1], q.shape[2]
    n_kv = ks[0].shape[1]
    qg = q[0].reshape(n_kv, n_h // n_kv, hd)                                   # [n_kv, group, hd]
    s = torch.cat([torch.matmul(qg, k.permute(1, 2, 0)) for k in ks], dim=-1) if len(ks) > 1 else \
        torch.matmul(qg, ks[0].permute(1, 2, 0))                               # [n_kv, group, S]
    s.mul_(scale)
    kp = torch.cat(list(k_pos)) if len(k_pos) > 1 else k_pos[0]
    diff = q_pos[0].to(kp.device) - kp                                          # [S]
    hidden = diff < 0
    if window is not None:
        hidden |= diff >= window
    p = torch.softmax(s.masked_fill_(hidden, float("-inf")), dim=-1)
    o, start = None, 0
    for v in vs:
        part = torch.matmul(p[..., start:start + v.shape[0]], v.permute(1, 0, 2))  # [n_kv, group, hd]
        o = part if o is None else o.add_(part)
        start += v.shape[0]
    return o.reshape(1, n_h * hd)


def decode_attention(q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """One query q [1, n_h, hd] over keys that are all visible to it (the caller sliced each part,
    ks[i], vs[i] [S_i, n_kv, hd], to the window: no mask), the parts sharing one softmax. One KV
    head (E2B/E4B): plain 2-D products on the [S, hd] slab views. ~3 ops a part where the masked
    form takes ~12 (E2B, a sliding layer at 256 keys: 47 against 79 us, one thread)."""
    n_h, hd = q.shape[1], q.shape[2]
    n_kv = ks[0].shape[1]
    if n_kv == 1:
        qg = q[0]                                                                   # [n_h, hd]
        s = torch.cat([torch.mm(qg, k[:, 0].t()) for k in ks], dim=-1) if len(ks) > 1 else torch.mm(qg, ks[0][:, 0].t())
    else:
        qg = q[0].reshape(n_kv, n_h // n_kv, hd)                                    # [n_kv, group, hd]
        s = torch.cat([torch.matmul(qg, k.permute(1, 2, 0)) for k in ks], dim=-1) if len(ks) > 1 else \
            torch.matmul(qg, ks[0].permute(1, 2, 0))                                # [n_kv, group, S]
    if scale != 1.0:
        s.mul_(scale)
    p = torch.softmax(s, dim=-1)
    o, start = None, 0
    for v in vs:
        pv = p[..., start:start + v.shape[0]]
        part = torch.mm(pv, v[:, 0]) if n_kv == 1 else torch.matmul(pv, v.permute(1, 0, 2))
        o = part if o is None else o.add_(part)
        start += v.shape[0]
    return o.reshape(1, n_h * hd)


def attend(cache, layer: int, source: int, q: torch.Tensor, pos: torch.Tensor, window: Optional[int],
           scale: float, last_key: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of `layer` over the K/V of `source` (its KV source layer): a cache with its own
    `attend` (the engine's pooled KV, possibly a Triton backend) resolves the slab itself from the
    same `kv_shared_layers` list; a plain cache is read at `source`. `last_key`: see `attention`."""
    if hasattr(cache, "attend"):
        if last_key is None:  # the caches that never see images keep their signature
            return cache.attend(layer, q, pos, window, scale)
        return cache.attend(layer, q, pos, window, scale, last_key=last_key)
    ks, vs, kpos = cache.read(source)
    return attention(q, ks, vs, pos, kpos, window, scale, last_key)


def head_logits(y: torch.Tensor, w, cap: Optional[float]) -> torch.Tensor:
    """float32 logits cap * tanh(y W^T / cap) of normed rows y [R, d] (the LM head, then the final
    softcap), whatever y's dtype. On the kernel path the quantized head's GEMV writes float32 and
    the softcap reads it: bf16 logits are 0.125 apart between 16 and 32, which made greedy ties
    and moved probabilities by 6-13% against llama.cpp and the CPU path (issue 21 item 1). A dense
    or CPU head computes in y's dtype (float32 on the CPU) and is widened after; a float64 model
    (the oracle runs) keeps float64. Only a `kernels.triton.qpack.PackedQuant` takes the kernel: the CPU
    heads keep other things under `packed` (fbgemm's prepacked chunks)."""
    from kernels.triton.qpack import PackedQuant

    packed = None if isinstance(w, torch.Tensor) else getattr(w, "packed", None)
    if isinstance(packed, PackedQuant):
        from kernels.triton.qmatmul import qmatmul

        logits = qmatmul(y, packed, out_dtype=torch.float32)
    else:
        logits = linear(y, w)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
    return softcap(logits, cap)


def softcap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    if not cap:
        return x
    fused = _fused_for(x)
    if fused is not None:  # CUDA: one Triton pass over the [T, vocab] logits
        return fused.softcap(x, cap)
    return torch.tanh(x / cap) * cap
