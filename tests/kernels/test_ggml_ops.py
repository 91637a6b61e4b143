"""The CPU fused chains (kernels/ggml/ops.py) against their torch references, on odd shapes and
strided inputs (q/k/v slices of one projection, the halves of a gate/up product, a per-layer
input slice), every variant a model takes.

Matrices are F32 here, so ggml's products are exact float32 dot products (no activation
quantization) and the chains are checked to float32 rounding: 2e-6 relative (float32 sums in
another order; RMSNorm accumulates in double in ggml). GELU is ggml's f16 table on both sides
(`gelu_ref`). One quantized case checks that the chains run on the matrix a GGMLWeight picks.
"""
from __future__ import annotations

import pytest
import torch

from kernels import ggml

pytestmark = pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")

from kernels.ggml import ops as go  # noqa: E402

TOL = 2e-6
EPS = 1e-6


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _f32(n: int, k: int, seed: int):
    """A float32 GGUF matrix [n, k] (ggml type 0) and its values."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5
    return ggml.Matrix(w.view(torch.uint8).reshape(n, -1), 0, (n, k)), w


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T,d", [(1, 96), (5, 200), (3, 1)])
def test_rms_norm_and_residual_updates(T, d):
    x, y, w, nw = _x(T, d), _x(T, d, seed=1) * 3, _x(d, seed=2), _x(d, seed=3)
    assert _rel(go.rms_norm(x, w, EPS), go.rms_norm_ref(x, w, EPS)) < TOL
    assert _rel(go.rms_norm(x, None, EPS), go.rms_norm_ref(x, None, EPS)) < TOL
    scale = torch.tensor([0.37])
    for s in (None, scale):
        for n in (None, nw):
            h, m = go.add_rms_norm(x, y, w, EPS, s, n)
            rh, rm = go.add_rms_norm_ref(x, y, w, EPS, s, n)
            assert _rel(h, rh) < TOL and (m is None) == (n is None)
            if n is not None:
                assert _rel(m, rm) < TOL


@pytest.mark.parametrize("H,Hk,hd,n_half", [(3, 1, 16, 8), (4, 2, 24, 6), (2, 2, 8, 4)])
def test_qkv_norm_rope_on_slices_of_one_projection(H, Hk, hd, n_half):
    """q, k, v as views into one [T, (H + 2 Hk) hd] projection output; partial rotary (n_half <
    hd/2: the tail passes through); no v (V = raw K); a KV-shared layer (q only)."""
    T = 5
    y = _x(T, (H + 2 * Hk) * hd, seed=4)
    q = y[:, :H * hd].view(T, H, hd)
    k = y[:, H * hd:(H + Hk) * hd].view(T, Hk, hd)
    v = y[:, (H + Hk) * hd:].view(T, Hk, hd)
    qw, kw = _x(hd, seed=5), _x(hd, seed=6)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * torch.rand(n_half, dtype=torch.float64)[None, :] * 3
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    for vv in (v, None):
        got = go.qkv_norm_rope(q, k, vv, qw, kw, EPS, cos, sin)
        want = go.qkv_norm_rope_ref(q, k, vv, qw, kw, EPS, cos, sin)
        assert all(_rel(a, b) < TOL for a, b in zip(got, want))
    qo, ko, vo = go.qkv_norm_rope(q, None, None, qw, None, EPS, cos, sin)
    assert ko is None and vo is None and _rel(qo, go.qkv_norm_rope_ref(q, None, None, qw, None, EPS, cos, sin)[0]) < TOL


def test_gelu_chains():
    T, d, n = 3, 64, 40
    gu = _x(T, 2 * n, seed=7) * 4
    gate, up = gu[:, :n], gu[:, n:]
    assert _rel(go.gelu_mul(gate, up), go.gelu_mul_ref(gate, up)) < TOL
    m, w = _f32(n, d, 8)
    x, e = _x(T, d, seed=9), _x(T, 7, n, seed=10)[:, 3]  # e: a strided per-layer slice
    assert _rel(go.linear_gelu_mul(x, m, e), go.gelu_ref(x @ w.t()) * e) < TOL
    assert go.gelu_ref(torch.tensor([-11.0, 11.0, 0.0])).tolist() == [0.0, 11.0, 0.0]


def _mlp_ref(m, wg, wu, wd):
    return go.gelu_ref(m @ wg.t()) * (m @ wu.t()) @ wd.t()


def test_gated_mlp_stacked_and_separate():
    T, d, n = 4, 48, 72
    gate, wg = _f32(n, d, 11)
    up, wu = _f32(n, d, 12)
    down, wd = _f32(d, n, 13)
    gate_up = ggml.Matrix(torch.cat([wg, wu]).view(torch.uint8).reshape(2 * n, -1), 0, (2 * n, d))
    m = _x(T, d, seed=14) * 2
    want = _mlp_ref(m, wg, wu, wd)
    assert _rel(go.gated_mlp(m, gate_up, down), want) < TOL
    assert _rel(go.gated_mlp(m, None, down, gate, up), want) < TOL


@pytest.mark.parametrize("variant", ["qkv", "qk+v", "no-v", "shared", "raw-v"])
def test_attention_prologue(variant):
    T, d, H, Hk, hd, n_half = 3, 64, 4, 2, 16, 8
    wq, wk, wv = (_x(H * hd, d, seed=15), _x(Hk * hd, d, seed=16), _x(Hk * hd, d, seed=17))
    rows = {"qkv": [wq, wk, wv], "qk+v": [wq, wk], "no-v": [wq, wk], "shared": [wq], "raw-v": [wq, wk, wv]}[variant]
    stacked = torch.cat(rows) * d ** -0.5
    qkv = ggml.Matrix(stacked.contiguous().view(torch.uint8).reshape(stacked.shape[0], -1), 0, tuple(stacked.shape))
    v_m = None
    if variant == "qk+v":
        wv2 = (wv * d ** -0.5).contiguous()
        v_m = ggml.Matrix(wv2.view(torch.uint8).reshape(wv2.shape[0], -1), 0, tuple(wv2.shape))
    a = _x(T, d, seed=18)
    qw, kw = _x(hd, seed=19), _x(hd, seed=20)
    ang = torch.rand(T, n_half, dtype=torch.float64, generator=torch.Generator().manual_seed(21)) * 9
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    shared = variant == "shared"
    q, k, v = go.attention_prologue(a, qkv, v_m, H, Hk, hd, qw, None if shared else kw, EPS, cos, sin,
                                    v_norm=variant != "raw-v")
    y = a @ (torch.cat([wq, wk, wv]) * d ** -0.5).t()
    q_raw, k_raw, v_raw = y[:, :H * hd].view(T, H, hd), y[:, H * hd:(H + Hk) * hd].view(T, Hk, hd), \
        y[:, (H + Hk) * hd:].view(T, Hk, hd)
    assert _rel(q, go.rope_ref(go.rms_norm_ref(q_raw, qw, EPS), cos, sin)) < TOL
    if shared:
        assert k is None and v is None
        return
    assert _rel(k, go.rope_ref(go.rms_norm_ref(k_raw, kw, EPS), cos, sin)) < TOL
    v_src = k_raw if variant == "no-v" else v_raw
    assert _rel(v, v_raw if variant == "raw-v" else go.rms_norm_ref(v_src, None, EPS)) < TOL


@pytest.mark.parametrize("ple", [False, True])
@pytest.mark.parametrize("scale", [False, True])
def test_attn_and_ffn_residual(ple, scale):
    T, d, n, P, hd_all = 2, 40, 56, 24, 32
    x, o = _x(T, d, seed=22), _x(T, hd_all, seed=23)
    w_o, wo = _f32(d, hd_all, 24)
    post, ffn_norm, post_ffw, post_norm, nxt = (_x(d, seed=s) for s in (25, 26, 27, 28, 29))
    h, m = go.attn_residual(x, o, w_o, post, EPS, ffn_norm)
    rh, rm = go.add_rms_norm_ref(x, o @ wo.t(), post, EPS, None, ffn_norm)
    assert _rel(h, rh) < TOL and _rel(m, rm) < TOL
    gu, wgu = _f32(2 * n, d, 30)
    down, wd = _f32(d, n, 31)
    inp_gate, wig = _f32(P, d, 32)
    proj, wp = _f32(d, P, 33)
    pl = _x(T, 5, P, seed=34)[:, 2]
    s = torch.tensor([0.61]) if scale else None
    got = go.ffn_residual(h, m, gu, None, None, down, post_ffw, EPS,
                          (inp_gate, pl, proj, post_norm) if ple else None, s, nxt)
    f = go.gelu_ref(m @ wgu[:n].t()) * (m @ wgu[n:].t()) @ wd.t()
    r, _ = go.add_rms_norm_ref(h, f, post_ffw, EPS)
    if ple:
        r, _ = go.add_rms_norm_ref(r, (go.gelu_ref(r @ wig.t()) * pl) @ wp.t(), post_norm, EPS)
    if scale:
        r = r * s
    assert _rel(got[0], r) < TOL and _rel(got[1], go.rms_norm_ref(r, nxt, EPS)) < TOL


def test_graphs_are_built_once_per_layout():
    x, y, w = _x(1, 32), _x(1, 32, seed=1), _x(32, seed=2)
    go.add_rms_norm(x, y, w, EPS)
    n = len(go._graphs)
    for seed in range(5):  # other values, same layout: the same graph
        go.add_rms_norm(_x(1, 32, seed=seed), _x(1, 32, seed=seed + 9), _x(32, seed=seed + 3), EPS)
    assert len(go._graphs) == n
    go.add_rms_norm(_x(2, 32), _x(2, 32), w, EPS)  # another row count: one more
    assert len(go._graphs) == n + 1


def test_chains_reject_what_they_cannot_read():
    with pytest.raises(ValueError, match="unit last stride"):
        go.rms_norm(_x(4, 8).t(), None, EPS)
    with pytest.raises(ValueError, match="float32"):
        go.rms_norm(_x(4, 8).double(), None, EPS)


def test_prefill_sized_chains_share_one_buffer_and_stay_correct():
    """Beyond CACHED_ROWS rows a chain is built for its run, its intermediates in the one shared
    allocator (kernels/ggml/graph.shared_allocator): nothing is kept, and chains of different
    sizes in turn (the buffer reused, grown) each give the reference."""
    T1, T2, d, n = go.CACHED_ROWS + 3, go.CACHED_ROWS + 40, 48, 64
    gu, wgu = _f32(2 * n, d, 40)
    down, wd = _f32(d, n, 41)
    post, nxt = _x(d, seed=42), _x(d, seed=43)
    tol = 2.5 * d * 2.0 ** -24  # multi-row products sum in blocks: k·2^-24 per product, chained (x2.5)
    before = len(go._graphs)
    for T in (T1, T2, T1, T2):
        x, m = _x(T, d, seed=T), _x(T, d, seed=T + 1)
        h, nn = go.ffn_residual(x, m, gu, None, None, down, post, EPS, None, None, nxt)
        f = go.gelu_ref(m @ wgu[:n].t()) * (m @ wgu[n:].t()) @ wd.t()
        r, rn = go.add_rms_norm_ref(x, f, post, EPS, None, nxt)
        assert _rel(h, r) < tol and _rel(nn, rn) < tol
        y = _x(T, d, seed=T + 2)
        assert _rel(go.add_rms_norm(x, y, post, EPS)[0], go.add_rms_norm_ref(x, y, post, EPS)[0]) < TOL
    assert len(go._graphs) == before
