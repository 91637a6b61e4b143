"""kernels.triton.fused: Triton kernels vs their torch refs vs the models.ops functions they replace.

Runs under the Triton interpreter on the CPU (TRITON_INTERPRET=1 is set before triton is imported);
`TRITON_INTERPRET=0 pytest tests/kernels/triton/test_kernels_fused.py` runs the same tests on a CUDA device, adding
bf16 inputs (the interpreter's fp32 -> bf16 cast truncates rather than rounds).
Shapes are small and odd: row lengths 40, 97, 640, 1000; head dims 40 and 64 with n_rot < hd.
"""
from triton_env import DEVICE, INTERPRET  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch

from tensor_close import assert_close
from tiny_models import TinySpec, write_tiny_gemma4

from kernels.triton import fused
from kernels.triton.fused import (
    add_rms_norm,
    add_rms_norm_ref,
    gelu_tanh_mul,
    gelu_tanh_mul_ref,
    rms_norm,
    rms_norm_ref,
    rms_norm_rope,
    rms_norm_rope_ref,
    softcap,
    softcap_ref,
)
from models import ops
from models.loader import load_model

DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
# Kernel vs ref (both fp32 math, one final rounding): fp32 differs by summation order / tanh form;
# fp16/bf16 by at most an output ulp or so.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# vs models.ops in the input dtype, which rounds intermediates (norm before rope, gelu before *).
TOL_COMMON = {torch.float32: (1e-5, 1e-5), torch.float16: (6e-3, 6e-3), torch.bfloat16: (4e-2, 4e-2)}


def _name(d) -> str:
    return str(d).removeprefix("torch.")


def _rand(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# ------------------------------------------------------------------------------------ rms_norm

@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(3, 640), (7, 97), (5, 3, 40), (2, 2, 3, 64), (1000,)], ids=str)
@pytest.mark.parametrize("weighted", [True, False], ids=["w", "no_w"])
def test_rms_norm(shape, dtype, weighted):
    x = _rand(*shape, dtype=dtype, scale=3.0)
    w = _rand(shape[-1], dtype=torch.float32, seed=1) if weighted else None
    got = rms_norm(x, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    what = f"rms_norm {shape} {_name(dtype)} w={weighted}"
    assert_close(got, ref, *TOL[dtype], what + " vs ref")
    assert_close(got, ops.rms_norm(x, w, 1e-6), *TOL_COMMON[dtype], what + " vs models.ops")


def test_rms_norm_strided_heads():
    """q/k norm on [T, H, hd] views of a fused qkv output (row stride > H*hd), weight in fp16."""
    T, H, hd, extra = 5, 3, 40, 17
    y = _rand(T, H * hd + extra, dtype=torch.float16, scale=2.0)
    q = y[:, :H * hd].view(T, H, hd)
    assert not q.is_contiguous()
    w = _rand(hd, dtype=torch.float16, seed=2)
    got = rms_norm(q, w, 1e-6)
    assert got.is_contiguous()
    assert_close(got, rms_norm_ref(q, w, 1e-6), *TOL[torch.float16], "rms_norm strided heads")


# ------------------------------------------------------------------------------------ rms_norm_rope

def _cos_sin(T, n_rot, base=10000.0, zero_pairs=0):
    """models.ops's cos/sin [T, 1, n_rot/2] fp32 at odd positions; the last `zero_pairs` pairs
    do not rotate (Gemma-4 proportional RoPE: cos 1, sin 0)."""
    factors = [1.0] * (n_rot // 2 - zero_pairs) + [1e30] * zero_pairs
    inv = ops.rope_inv_freq(n_rot, base, factors)
    pos = torch.tensor([0, 3, 17, 250, 4099, 9, 1, 77])[:T].to(DEVICE)
    return ops.rope_cos_sin(pos, inv.to(DEVICE), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("T,H,hd,n_rot,zero_pairs", [
    (5, 3, 40, 40, 0),     # full rotation
    (5, 3, 40, 24, 0),     # n_rot < hd: dims 24..39 pass through
    (7, 2, 64, 64, 12),    # Gemma-4 full layers: partial rotation as cos 1 / sin 0 pairs
    (1, 4, 256, 64, 0),    # decode, hd 256
], ids=str)
@pytest.mark.parametrize("weighted", [True, False], ids=["w", "no_w"])
def test_rms_norm_rope(T, H, hd, n_rot, zero_pairs, dtype, weighted):
    x = _rand(T, H, hd, dtype=dtype, scale=2.0)
    w = _rand(hd, dtype=torch.float32, seed=3) if weighted else None
    cos, sin = _cos_sin(T, n_rot, zero_pairs=zero_pairs)
    what = f"rms_norm_rope T={T} H={H} hd={hd} n_rot={n_rot} {_name(dtype)} w={weighted}"
    got = rms_norm_rope(x, w, 1e-6, cos[:, 0], sin[:, 0])
    ref = rms_norm_rope_ref(x, w, 1e-6, cos[:, 0], sin[:, 0])
    assert_close(got, ref, *TOL[dtype], what + " vs ref")
    assert_close(rms_norm_rope(x, w, 1e-6, cos, sin), got, 0, 0, what + " [T,1,h] cos form")
    want = ops.apply_rope(ops.rms_norm(x, w, 1e-6), cos, sin).to(dtype)
    assert_close(got, want, *TOL_COMMON[dtype], what + " vs models.ops")
    if dtype == torch.float32:  # the ref is exactly models.ops's math in fp32
        assert_close(ref, want, 0, 0, what + " ref vs models.ops")


def test_rms_norm_rope_strided():
    """k as a strided view of a fused qkv output."""
    T, H, hd = 6, 2, 40
    y = _rand(T, 3 * H * hd, dtype=torch.float32, scale=2.0)
    k = y[:, H * hd:2 * H * hd].view(T, H, hd)
    w = _rand(hd, dtype=torch.float32, seed=4)
    cos, sin = _cos_sin(T, 32)
    assert_close(rms_norm_rope(k, w, 1e-6, cos, sin), rms_norm_rope_ref(k, w, 1e-6, cos, sin),
                 *TOL[torch.float32], "rms_norm_rope strided")


# ------------------------------------------------------------------------------------ gelu_tanh_mul

@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(3, 640), (7, 1000), (1, 2, 37)], ids=str)
def test_gelu_tanh_mul(shape, dtype):
    # scale 4: exercises both tanh branches (|z| < 0.2 series and the exp form) and saturation
    gate = _rand(*shape, dtype=dtype, scale=4.0, seed=5)
    up = _rand(*shape, dtype=dtype, seed=6)
    what = f"gelu_tanh_mul {shape} {_name(dtype)}"
    got = gelu_tanh_mul(gate, up)
    assert_close(got, gelu_tanh_mul_ref(gate, up), *TOL[dtype], what + " vs ref")
    want = ops.gelu_tanh(gate) * up
    assert_close(got, want, *TOL_COMMON[dtype], what + " vs models.ops")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_gelu_tanh_mul_fused_gate_up(dtype):
    """One [T, 2F] gate_up tensor: whole, and as its two chunk views (read in place)."""
    T, Fd = 5, 300
    gu = _rand(T, 2 * Fd, dtype=dtype, scale=3.0, seed=7)
    gate, up = gu.chunk(2, dim=-1)
    got = gelu_tanh_mul(gu)
    assert got.shape == (T, Fd)
    assert_close(got, gelu_tanh_mul_ref(gu), *TOL[dtype], "gelu_tanh_mul gate_up vs ref")
    assert_close(gelu_tanh_mul(gate, up), got, 0, 0, "gelu_tanh_mul chunks vs gate_up")
    assert_close(got, ops.gelu_tanh(gate) * up, *TOL_COMMON[dtype], "gelu_tanh_mul gate_up vs models.ops")


# ------------------------------------------------------------------------------------ add_rms_norm

@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(3, 640), (7, 97), (1, 1000), (2, 3, 40)], ids=str)
@pytest.mark.parametrize("variant", ["plain", "scale+next", "no_w+next_no_w", "scaled_inputs"])
def test_add_rms_norm(shape, dtype, variant):
    """h = (x·xs + rms_norm(y·ys)·w)·os·scale and n = rms_norm(h)·w_next, against the ref; fp32
    also against the models.ops composition it replaces (the reference layer code)."""
    D = shape[-1]
    x = _rand(*shape, dtype=dtype, scale=2.0, seed=11)
    y = _rand(*shape, dtype=dtype, scale=5.0, seed=12)
    w = None if variant == "no_w+next_no_w" else _rand(D, dtype=torch.float32, seed=13)
    kw = {}
    if variant == "scale+next":
        kw = dict(scale=torch.tensor([0.7], device=DEVICE), next_weight=_rand(D, dtype=torch.float32, seed=14))
    elif variant == "no_w+next_no_w":
        kw = dict(next_norm=True)
    elif variant == "scaled_inputs":
        kw = dict(x_scale=16.0, y_scale=0.03, out_scale=2 ** -0.5)
    what = f"add_rms_norm {shape} {_name(dtype)} {variant}"
    h, n = add_rms_norm(x, y, w, 1e-6, **kw)
    h_ref, n_ref = add_rms_norm_ref(x, y, w, 1e-6, **kw)
    assert h.is_contiguous() and h.shape == x.shape
    assert_close(h, h_ref, *TOL[dtype], what + " h vs ref")
    assert (n is None) == (n_ref is None) == (variant in ("plain", "scaled_inputs"))
    if n is not None:
        assert_close(n, n_ref, *TOL[dtype], what + " next norm vs ref")
        assert_close(n, rms_norm_ref(h, kw.get("next_weight"), 1e-6), *TOL[dtype], what + " next norm of h as stored")
    if dtype == torch.float32 and variant != "scaled_inputs":  # the reference layer code
        want, _ = ops.add_rms_norm(x, y, w, 1e-6, kw.get("scale"))
        assert_close(h, want, *TOL_COMMON[dtype], what + " vs models.ops")


def test_add_rms_norm_strided_rows_into_out():
    """x and y as column slices of wider tensors (row strides > D), h written into `out`."""
    R, D = 5, 96
    x = _rand(R, D + 7, dtype=torch.float16, seed=15)[:, :D]
    y = _rand(R, 2 * D, dtype=torch.float16, scale=3.0, seed=16)[:, D:]
    w = _rand(D, dtype=torch.float16, seed=17)
    out = torch.empty(R, D, dtype=torch.float16, device=DEVICE)
    h, n = add_rms_norm(x, y, w, 1e-6, out=out)
    assert h.data_ptr() == out.data_ptr() and n is None
    assert_close(h, add_rms_norm_ref(x, y, w, 1e-6)[0], *TOL[torch.float16], "add_rms_norm strided into out")


# ------------------------------------------------------------------------------------ softcap

@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(3, 1001), (2, 7, 33)], ids=str)
def test_softcap(shape, dtype):
    # logits from tiny (series branch of tanh) to far past the cap (saturation)
    x = _rand(*shape, dtype=dtype, scale=20.0, seed=8)
    x.view(-1)[:5] = torch.tensor([0.0, 1e-3, -0.5, 200.0, -1e4], dtype=dtype)
    what = f"softcap {shape} {_name(dtype)}"
    got = softcap(x, 30.0)
    assert_close(got, softcap_ref(x, 30.0), *TOL[dtype], what + " vs ref")
    assert_close(got, ops.softcap(x, 30.0), *TOL_COMMON[dtype], what + " vs models.ops")


def test_refs_are_models_common_in_fp32():
    """The refs are the models.ops definitions (exactly, in fp32 and fp64)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(4, 3, 40, dtype=dtype)
        w = torch.randn(40, dtype=torch.float32)
        assert torch.equal(rms_norm_ref(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
        assert torch.equal(gelu_tanh_mul_ref(x, x.flip(0)), ops.gelu_tanh(x) * x.flip(0))
        assert torch.equal(softcap_ref(x, 30.0), ops.softcap(x, 30.0))


def test_models_common_dispatch_whole_model(tmp_path, monkeypatch):
    """A tiny Gemma-4 (softcap 30, fused qkv) with models.ops's CUDA dispatch forced onto the
    interpreted kernels gives the torch path's logits, and the kernels were actually called."""
    spec = TinySpec(n_layer=4, pattern=[True, False, True, False], n_kv_shared=2, fused_qkv=True)
    path = write_tiny_gemma4(tmp_path / "tiny.gguf", spec, seed=3)
    model = load_model(path, with_tokenizer=False).model
    tokens = torch.tensor([2, 17, 99, 200, 5, 383, 64])
    want = model.forward(tokens)
    calls = {}

    class Spy:  # kernels.triton.fused, counting calls
        triton = fused.triton

        def __getattr__(self, name):
            def call(*a, **k):
                calls[name] = calls.get(name, 0) + 1
                return getattr(fused, name)(*a, **k)
            return call

    monkeypatch.setattr(ops, "_fused_for", lambda *ts: Spy())
    got = model.forward(tokens)
    assert set(calls) == {"rms_norm", "rms_norm_rope", "add_rms_norm", "gelu_tanh_mul", "softcap"}, calls
    assert_close(got, want, 2e-4, 1e-4, "tiny Gemma-4 logits, fused dispatch vs torch")
