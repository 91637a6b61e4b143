"""One decode query's attention on llama.cpp's CPU kernel: ggml's `flash_attn_ext` over a window
of a KV slab, read in place.

Why: a CPU decode step's attention as torch ops is ~10 ops a layer (scores, scale, softmax, the
V product per slot run): ~0.2-0.4 ms a layer of dispatch on this VM's 2 cores, 7 ms of the demo
model's 26 ms step. ggml's flash attention is one node: one pass over K and V per head with an
online softmax (split over the keys between the threads from 512 keys on), the kernel
llama.cpp's own decode runs.

The keys are a window [lo, lo + S) of the slab's slots and a float16 mask row (0: this query sees
the slot, -inf: not; ggml skips a -inf slot without reading it), so a sequence's slots need not
be consecutive or in position order (attention sums over keys; their positions are already in
RoPE). S is rounded up to a multiple of `BUCKET`, so one graph serves 64 steps of a growing
sequence (graphs are kept per layout: `kernels/ggml/ops.cached_graph`).

Numerics: float32 scores, online softmax and V accumulation for float32 K/V (ggml's float16 V
path accumulates in float16: callers keep float32 pools on the CPU); expf where torch's softmax
uses its own exp: ~1e-6 relative against `decode_attention_ref`.
"""
from __future__ import annotations

import torch

from .graph import Graph, layout
from .ops import cached_graph

BUCKET = 64  # keys: windows are rounded up to this (one graph per bucket)
_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [1, n_h, hd] float32 (unit last stride), k, v [S, n_kv, hd] float32/16 or bfloat16 views
    of a slab (unit last stride; n_h a multiple of n_kv), mask float16 [1, S] contiguous (0 or
    -inf), or [2, S] with its second row all -inf (the query then goes in twice: ggml's two-row
    path, one pass over the keys a head whatever their layout: engine/kv/canonical.py) -> [1, n_h * hd]
    float32: softmax(q k^T * scale + mask) v per head, head h reading KV head h // (n_h / n_kv)."""
    n_h, hd = q.shape[1], q.shape[2]
    S, n_kv = k.shape[0], k.shape[1]
    if (q.dim() != 3 or q.shape[0] != 1 or k.dim() != 3 or k.shape != v.shape or k.shape[2] != hd
            or n_h % n_kv or mask.dim() != 2 or mask.shape[0] not in (1, 2) or mask.shape[1] != S):
        raise ValueError(f"ggml decode_attention: q [1, n_h, hd], k = v [S, n_kv, hd], mask [1|2, S]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, mask {tuple(mask.shape)}")
    if (q.dtype != torch.float32 or k.dtype not in _KV_DTYPES or v.dtype != k.dtype or mask.dtype != torch.float16
            or not mask.is_contiguous() or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
            or q.device.type != "cpu" or k.device.type != "cpu"):
        raise ValueError(f"ggml decode_attention: CPU q float32, k/v {[str(d) for d in _KV_DTYPES]} with unit last "
                         f"strides and a contiguous float16 mask; got {q.dtype}, {k.dtype}/{v.dtype}, {mask.dtype}")
    rows = mask.shape[0]
    if rows == 2:
        q = q.expand(2, n_h, hd).contiguous()
    qh, kh, vh = q.permute(1, 0, 2), k.permute(1, 0, 2), v.permute(1, 0, 2)  # ggml [hd, rows|S, heads]

    def build(big):
        g = Graph(8, big)
        node = g.flash_attn_ext(g.input(qh), g.input(kh), g.input(vh), g.input(mask), float(scale), 0.0, 0.0)
        g.output(node)
        return g.finish()

    out = torch.empty(rows, n_h * hd)
    cached_graph(("flash", layout(qh), layout(kh), layout(vh), S, float(scale)), build).run([qh, kh, vh, mask], [out])
    return out[:1]


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`decode_attention` in torch (float64 inside, float32 out)."""
    n_h, hd = q.shape[1], q.shape[2]
    n_kv = k.shape[1]
    qg = q[0].double().reshape(n_kv, n_h // n_kv, hd)                     # [n_kv, group, hd]
    s = torch.matmul(qg, k.double().permute(1, 2, 0)) * scale + mask.double()  # [n_kv, group, S]
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.double().permute(1, 0, 2)).reshape(1, n_h * hd).float()
