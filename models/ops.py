"""The layer ops of the Gemma model files (norms, RoPE, projections, the gated MLP, attention,
embedding lookups, softcap) and their kernel dispatch.

Each op is the plain-torch reference (exact math in the caller's dtype: float32 on the CPU, float64
in the exactness tests) unless `kernels.launch.use_kernels` says the fused Triton kernels run where
the tensors live (CUDA; the CPU under `kernels_on_cpu()` with the interpreter; meta in a dry run).
Kernels in `kernels/` are checked against these.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_modules: dict = {}  # kernels module name -> the module, or None without triton (imported once)


def _kernel_module(name: str):
    """kernels.<name> when it imports with triton, else None (checked once per module)."""
    if name not in _modules:
        import importlib

        try:
            mod = importlib.import_module(f"kernels.{name}")
        except ImportError:
            mod = None
        _modules[name] = mod if mod is not None and mod.triton is not None else None
    return _modules[name]


def _fused_for(*ts: torch.Tensor | None):
    """kernels.fused when every tensor given is an fp16/bf16/fp32 tensor with a unit last stride
    where the kernels run (CUDA; see kernels.launch.use_kernels for the interpreter and dry runs)
    and triton imports (checked once), else None. On CUDA the fused Triton kernels make one pass
    over memory where the torch path below runs several ops with fp32 temporaries; the CPU path
    (and float64) stays the torch reference."""
    from kernels.launch import use_kernels

    if not all(t is None or (t.dtype in _FUSED_DTYPES and t.stride(-1) == 1) for t in ts) or not use_kernels(*ts):
        return None
    return _kernel_module("fused")


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
    if fused is not None:  # CUDA: one Triton pass (kernels/fused.py), same fp32 math
        return fused.rms_norm(x, weight, eps)
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
    """gelu_tanh(gate) * up; on the kernel path one Triton pass (kernels/fused.gelu_tanh_mul) that
    reads gate and up in place (the halves of a fused gate_up output, or a strided PLE slice)."""
    kern = _fused_for(gate, up)
    return kern.gelu_tanh_mul(gate, up) if kern is not None else gelu_tanh(gate) * up


def gated_mlp(m: torch.Tensor, w: dict, b: str) -> torch.Tensor:
    """down(gelu_tanh(gate m) * up m) for layer prefix `b` (gate/up possibly fused; a quantized
    gate/up with interleaved rows does gate, up and the activation in one GEMV, `glu`)."""
    fused = w.get(b + "ffn_gate_up.weight")
    if getattr(fused, "interleaved", False):
        return linear(fused.glu(m), w[b + "ffn_down.weight"])
    if fused is not None:
        gate, up = linear(m, fused).chunk(2, dim=-1)
    else:
        gate, up = linear(m, w[b + "ffn_gate.weight"]), linear(m, w[b + "ffn_up.weight"])
    return linear(gelu_mul(gate, up), w[b + "ffn_down.weight"])


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                 scale: Optional[torch.Tensor] = None, next_weight: Optional[torch.Tensor] = None):
    """The residual update (x + rms_norm(y) [* weight]) [* scale] -> (h, n): on the kernel path one
    Triton pass (kernels/fused.add_rms_norm) that also returns n = rms_norm(h) * next_weight for
    the op reading h next (the next layer's attention norm, or the final norm); the reference
    returns n = None (the next op norms h itself, as it always did). scale: a one-element tensor
    (Gemma-4's layer_output_scale), read in the kernel."""
    fused = _fused_for(x, y, weight, next_weight)
    if fused is not None:
        return fused.add_rms_norm(x, y, weight, eps, scale, next_weight)
    h = x + rms_norm(y, weight, eps)
    if scale is not None:
        h = h * scale.to(h.dtype)
    return h, None


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
    Kernel path: one Triton launch (kernels/qkv.py), storing straight into the slabs when the cache
    offers them (`cache.slab_target(layer)`, the engine's pools with the triton backend)."""
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
    `.ggml_type`, `.shape`; or a repacked tied head, whose `.rows` dequantizes on its device), dequantized on `device` by the Triton kernel (kernels.qmatmul.qdequantize)
    -> [len(ids), D] in `dtype` each. Host tables (`--embed-weights host`) send their raw rows, not
    dequantized ones: a 2048-token prefill moves 2048 x 7350 bytes of E2B's Q6_K per-layer table
    instead of 2048 x 8960 fp32 values, in one pinned non-blocking copy for all the tables, and the
    host no longer dequantizes (~133 ms per 2048 rows on 2 cores)."""
    from kernels.qmatmul import qdequantize

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
    CUDA: one Triton pass (kernels/fused.rms_norm_rope: fp32 math and fp32 angles, one read and one
    write of x instead of ~8 elementwise kernels); elsewhere the reference composition."""
    fused = _fused_for(x, weight)
    if fused is not None and cos.shape[-1] > 0:
        return fused.rms_norm_rope(x, weight, eps, cos.float(), sin.float())
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor, window: Optional[int], scale: float) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention.

    q: [T, n_h, hd]; k, v: [S, n_kv, hd]; q_pos: [T]; k_pos: [S] absolute positions.
    Key j is visible to query i iff k_pos[j] <= q_pos[i] and (no window or q_pos[i] - k_pos[j] < window):
    a window of W keys includes the query's own position (llama.cpp `is_masked_swa`).
    Returns [T, n_h * hd].
    """
    T, n_h, hd = q.shape
    n_kv = k.shape[1]
    if T == 1 and q.device.type == "cpu":  # a decode step: no SDPA mask broadcast (E2B, 2 threads,
        # a full layer at 1024 keys: 380 us against SDPA's 575; the time is reading K and V once)
        return decode_attention_parts(q, [k], [v], q_pos, [k_pos], window, scale)
    diff = q_pos[:, None].to(k_pos.device) - k_pos[None, :]  # [T, S]
    mask = diff >= 0
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


def attend(cache, layer: int, source: int, q: torch.Tensor, pos: torch.Tensor, window: Optional[int],
           scale: float) -> torch.Tensor:
    """Attention of `layer` over the K/V of `source` (its KV source layer): a cache with its own
    `attend` (the engine's pooled KV, possibly a Triton backend) resolves the slab itself from the
    same `kv_shared_layers` list; a plain cache is read at `source`."""
    if hasattr(cache, "attend"):
        return cache.attend(layer, q, pos, window, scale)
    ks, vs, kpos = cache.read(source)
    return attention(q, ks, vs, pos, kpos, window, scale)


def head_logits(y: torch.Tensor, w, cap: Optional[float]) -> torch.Tensor:
    """float32 logits cap * tanh(y W^T / cap) of normed rows y [R, d] (the LM head, then the final
    softcap), whatever y's dtype. On the kernel path the quantized head's GEMV writes float32 and
    the softcap reads it: bf16 logits are 0.125 apart between 16 and 32, which made greedy ties
    and moved probabilities by 6-13% against llama.cpp and the CPU path (issue 21 item 1). A dense
    or CPU head computes in y's dtype (float32 on the CPU) and is widened after."""
    packed = None if isinstance(w, torch.Tensor) else getattr(w, "packed", None)
    if packed is not None:
        from kernels.qmatmul import qmatmul

        logits = qmatmul(y, packed, out_dtype=torch.float32)
    else:
        logits = linear(y, w).float()
    return softcap(logits, cap)


def softcap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    if not cap:
        return x
    fused = _fused_for(x)
    if fused is not None:  # CUDA: one Triton pass over the [T, vocab] logits
        return fused.softcap(x, cap)
    return torch.tanh(x / cap) * cap
