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
_fused_module: list = []  # [kernels.fused or None], filled on first use


def _fused_for(*ts: torch.Tensor | None):
    """kernels.fused when every tensor given is an fp16/bf16/fp32 tensor with a unit last stride
    where the kernels run (CUDA; see kernels.launch.use_kernels for the interpreter and dry runs)
    and triton imports (checked once), else None. On CUDA the fused Triton kernels make one pass
    over memory where the torch path below runs several ops with fp32 temporaries; the CPU path
    (and float64) stays the torch reference."""
    from kernels.launch import use_kernels

    if not all(t is None or (t.dtype in _FUSED_DTYPES and t.stride(-1) == 1) for t in ts) or not use_kernels(*ts):
        return None
    if not _fused_module:
        try:
            from kernels import fused
        except ImportError:
            fused = None
        _fused_module.append(fused if fused is not None and fused.triton is not None else None)
    return _fused_module[0]


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


def qkv_projection(x: torch.Tensor, w: dict, b: str, n_q: int, n_kv: int):
    """q [.., n_q], k [.., n_kv], v [.., n_kv] or None (no attn_v: V = K) for layer prefix `b`,
    from separate attn_q/k/v weights or one fused `attn_qkv` (rows Q, K[, V])."""
    fused = w.get(b + "attn_qkv.weight")
    if fused is not None:
        y = linear(x, fused)
        if y.shape[-1] == n_q + 2 * n_kv:
            return y.split([n_q, n_kv, n_kv], dim=-1)
        q, k = y.split([n_q, n_kv], dim=-1)
        return q, k, None
    v = linear(x, w[b + "attn_v.weight"]) if b + "attn_v.weight" in w else None
    return linear(x, w[b + "attn_q.weight"]), linear(x, w[b + "attn_k.weight"]), v


def gated_mlp(m: torch.Tensor, w: dict, b: str) -> torch.Tensor:
    """down(gelu_tanh(gate m) * up m) for layer prefix `b` (gate/up possibly fused)."""
    fused = w.get(b + "ffn_gate_up.weight")
    if fused is not None:
        gate, up = linear(m, fused).chunk(2, dim=-1)
    else:
        gate, up = linear(m, w[b + "ffn_gate.weight"]), linear(m, w[b + "ffn_up.weight"])
    kern = _fused_for(gate, up)
    # CUDA: gelu_tanh(gate) * up in one Triton pass, reading the gate_up halves in place.
    act = kern.gelu_tanh_mul(gate, up) if kern is not None else gelu_tanh(gate) * up
    return linear(act, w[b + "ffn_down.weight"])


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


def attend(cache, layer: int, source: int, q: torch.Tensor, pos: torch.Tensor, window: Optional[int],
           scale: float) -> torch.Tensor:
    """Attention of `layer` over the K/V of `source` (its KV source layer): a cache with its own
    `attend` (the engine's pooled KV, possibly a Triton backend) resolves the slab itself from the
    same `kv_shared_layers` list; a plain cache is read at `source`."""
    if hasattr(cache, "attend"):
        return cache.attend(layer, q, pos, window, scale)
    ks, vs, kpos = cache.read(source)
    return attention(q, ks, vs, pos, kpos, window, scale)


def softcap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    if not cap:
        return x
    fused = _fused_for(x)
    if fused is not None:  # CUDA: one Triton pass over the [T, vocab] logits
        return fused.softcap(x, cap)
    return torch.tanh(x / cap) * cap
