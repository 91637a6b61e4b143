"""Fused elementwise / row-wise ops of the Gemma layers: RMSNorm, RMSNorm + NeoX RoPE (q/k norm),
gelu_tanh(gate) * up, and logit softcapping.

Each op is one pass over memory instead of the several torch ops (and fp32 temporaries) of the
reference path in ``models/ops.py``; all math is fp32, the output is in the input's dtype:
- ``rms_norm``: reads x once, writes y once (2 x R x D elements) plus the [D] weight.
- ``rms_norm_rope``: the q/k norm and RoPE of one head row in one program; the rotation partner
  (dim j +- n_rot/2) is re-read from memory (the same row, an L1 hit) rather than permuted in
  registers.  Reads x and cos/sin [T, n_rot/2] once, writes once; the torch path does norm, cast,
  3 slices, 4 multiplies, 2 adds and a cat.
- ``gelu_tanh_mul``: reads gate and up (possibly the two halves of one [T, 2F] gate_up tensor, by
  row stride, no copy), writes [T, F] once.
- ``softcap``: cap * tanh(x / cap) over the logits, one read and one write.
- ``add_rms_norm``: the residual update h = (x + rms_norm(y) [* w]) [* scale] and, for the op that
  reads h next, rms_norm(h) [* w_next] in the same pass: reads x and y once, writes h and the
  normed copy once (the torch path: norm, cast, add, cast, multiply, then the next layer's norm).
  Gemma-4 runs it three times a layer (after attention, after the MLP, after the PLE injection,
  the last one with the layer scale and the next layer's attention norm).

tanh is computed here from ``exp`` (``_tanh``): the interpreter does not run libdevice calls, and
one formula everywhere keeps the GPU and interpreted results the same up to rounding.

Block sizes are untuned guesses (no GPU was available when this was written; the kernels have run
only under TRITON_INTERPRET=1).  Under the interpreter, which pays per program rather than per
element, the blocks are made wide so the tests run fast.

The ``*_ref`` functions are the plain-torch definitions (fp32 math, cast back; float64 inputs stay
float64).  ``rms_norm_rope_ref`` keeps the normalised row in fp32 between the norm and the rotation
(the fused semantics), where ``apply_rope(rms_norm(x))`` in models.ops rounds it to x's dtype
first: the two are identical for fp32 inputs and differ by one rounding for fp16/bf16.
Triton is optional: without it this module imports and the refs work; the launchers raise.
"""
import torch
import torch.nn.functional as F

from .launch import interpreting

try:  # CPU-only installs have no triton: the refs below still work.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["add_rms_norm", "add_rms_norm_ref", "gelu_tanh_mul", "gelu_tanh_mul_ref", "rms_norm", "rms_norm_ref", "rms_norm_rope",
           "rms_norm_rope_ref", "softcap", "softcap_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SQRT_2_OVER_PI = 0.7978845608028654


def _elems() -> int:
    """Elements per program (rows x padded row length for the norms).  GPU: ~4096 fp32 values keeps
    a row block in registers with 4-8 warps; interpreter: wide blocks, few programs."""
    return 1 << 16 if interpreting() else 4096


# ------------------------------------------------------------------------------------ kernels

if triton is not None:

    @triton.jit
    def _tanh(z):
        """fp32 tanh: odd Taylor series to z^9 for |z| < 0.2 (relative error < 1e-9 there), else
        (1 - e) / (1 + e) with e = exp(-2|z|) (cancellation costs at most ~2 ulp above 0.2)."""
        a = tl.abs(z)
        z2 = z * z
        small = z * (1.0 + z2 * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0 + z2 * (62.0 / 2835.0)))))
        e = tl.exp(-2.0 * a)
        big = (1.0 - e) / (1.0 + e)
        big = tl.where(z < 0, -big, big)
        return tl.where(a < 0.2, small, big)

    @triton.jit
    def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, R, H, sx0, sx1, sc0, eps,
                              D: tl.constexpr, HALF: tl.constexpr, HAS_W: tl.constexpr,
                              ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rows r = t*H + h of x [T, H, D] (strides sx0, sx1, 1) -> out [R, D] contiguous.
        ROPE: dims j < HALF pair with j + HALF (cos/sin [T, HALF], row stride sc0); j >= 2*HALF pass."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < R
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        t = (rows // H).to(tl.int64)
        base = t * sx0 + (rows % H).to(tl.int64) * sx1
        x = tl.load(x_ptr + base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * rstd[:, None]
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            y = y * w[None, :]
        if ROPE:
            first = cols < HALF
            rot = cols < 2 * HALF
            pcols = tl.where(first, cols + HALF, cols - HALF)
            pmask = rmask[:, None] & rot[None, :]
            xp = tl.load(x_ptr + base[:, None] + pcols[None, :], mask=pmask, other=0.0).to(tl.float32)
            yp = xp * rstd[:, None]
            if HAS_W:
                wp = tl.load(w_ptr + pcols, mask=rot, other=0.0).to(tl.float32)
                yp = yp * wp[None, :]
            j = tl.where(first, cols, cols - HALF)
            cs_off = t[:, None] * sc0 + j[None, :]
            c = tl.load(cos_ptr + cs_off, mask=pmask, other=1.0)
            s = tl.load(sin_ptr + cs_off, mask=pmask, other=0.0)
            # j < HALF: y1 cos - y2 sin; HALF <= j < 2*HALF: y2 cos + y1 sin; else y.
            rotated = tl.where(first[None, :], y * c - yp * s, y * c + yp * s)
            y = tl.where(rot[None, :], rotated, y)
        out_off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_tanh_mul_kernel(g_ptr, u_ptr, out_ptr, R, sg, su, F_: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
        """out[r, f] = gelu_tanh(gate[r, f]) * up[r, f]; gate/up row strides sg/su, out [R, F_]."""
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (rows < R)[:, None] & (cols < F_)[None, :]
        g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows[:, None] * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        y = 0.5 * g * (1.0 + _tanh(inner)) * u
        tl.store(out_ptr + rows[:, None] * F_ + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _softcap_kernel(x_ptr, out_ptr, N, cap, BLOCK: tl.constexpr):
        """out = cap * tanh(x / cap) over N contiguous elements."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _tanh(x / cap) * cap
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, scale_ptr, nw_ptr, h_ptr, n_ptr, R, sx, sy,
                             eps, x_scale, y_scale, out_scale, D: tl.constexpr, HAS_W: tl.constexpr,
                             HAS_SCALE: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_NW: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """h = (x * x_scale + rms_norm(y * y_scale) [* w]) * out_scale [* scale[0]] per row
        (x, y row strides sx, sy; h [R, D] contiguous); HAS_NEXT: n = rms_norm(h as stored) [* nw]."""
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        mask = (rows < R)[:, None] & cmask[None, :]
        y = tl.load(y_ptr + rows[:, None] * sy + cols[None, :], mask=mask, other=0.0).to(tl.float32) * y_scale
        ny = y * (1.0 / tl.sqrt(tl.sum(y * y, axis=1) / D + eps))[:, None]
        if HAS_W:
            ny = ny * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = (x * x_scale + ny) * out_scale
        if HAS_SCALE:
            h = h * tl.load(scale_ptr).to(tl.float32)
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * D + cols[None, :], h, mask=mask)
        if HAS_NEXT:
            hf = h.to(tl.float32)
            n = hf * (1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / D + eps))[:, None]
            if HAS_NW:
                n = n * tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            tl.store(n_ptr + rows[:, None] * D + cols[None, :], n.to(n_ptr.dtype.element_ty), mask=mask)

# ------------------------------------------------------------------------------------ launchers

def _need_triton(fn: str) -> None:
    if triton is None:
        raise RuntimeError(f"{fn}: triton is not installed; use {fn}_ref")


def _as_rows3(x: torch.Tensor, fn: str) -> torch.Tensor:
    """x [..., D] -> a [T, H, D] view (unit last stride) whose rows t*H + h are x's rows in order."""
    assert x.dim() >= 1 and x.shape[-1] > 0, f"{fn}: x {tuple(x.shape)}"
    assert x.stride(-1) == 1 or x.shape[-1] == 1, f"{fn}: x's last dim must be contiguous, strides {x.stride()}"
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() > 3:
        x = x.flatten(0, -3)  # a view when the leading dims collapse, else a copy
    return x


def _norm_launch(x, weight, eps, cos, sin, fn):
    _need_triton(fn)
    assert x.dtype in _DTYPES, f"{fn}: x dtype {x.dtype}"
    D = x.shape[-1]
    if weight is not None:
        assert weight.shape == (D,) and weight.is_contiguous(), f"{fn}: weight {tuple(weight.shape)}, D={D}"
        assert weight.device == x.device and weight.dtype in _DTYPES, f"{fn}: weight {weight.dtype} {weight.device}"
    x3 = _as_rows3(x, fn)
    T, H, _ = x3.shape
    R = T * H
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if R == 0:
        return out
    half = 0
    if cos is not None:
        half = cos.shape[-1]
        assert cos.shape == sin.shape == (T, half), f"{fn}: cos {tuple(cos.shape)} sin {tuple(sin.shape)}, T={T}"
        assert cos.dtype == sin.dtype == torch.float32, f"{fn}: cos/sin must be fp32, got {cos.dtype}/{sin.dtype}"
        assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0), \
            f"{fn}: cos/sin strides {cos.stride()} {sin.stride()}"
        assert cos.device == x.device and sin.device == x.device, f"{fn}: cos/sin on {cos.device}, x on {x.device}"
        assert 2 * half <= D, f"{fn}: n_rot = {2 * half} > head dim {D}"
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(_elems() // block_d, triton.next_power_of_2(R)))
    warps = 4 if block_d <= 1024 else (8 if block_d <= 4096 else 16)
    _rms_norm_rope_kernel[(triton.cdiv(R, block_r),)](
        x3, weight if weight is not None else x3, cos if cos is not None else x3,
        sin if sin is not None else x3, out, R, H, x3.stride(0), x3.stride(1),
        cos.stride(0) if cos is not None else 0, float(eps),
        D=D, HALF=half, HAS_W=weight is not None, ROPE=cos is not None and half > 0,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps)
    return out


def rms_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """x [..., D] (fp16/bf16/fp32, unit last stride) * rsqrt(mean(x^2) + eps) [* weight [D]] over
    the last dim, fp32 math, output contiguous in x's dtype.  weight None: weightless (Gemma-4's V
    norm).  x [T, H, hd] with weight [hd] is the per-head q/k norm (any T and H strides)."""
    return _norm_launch(x, weight, eps, None, None, "rms_norm")


def rms_norm_rope(x: torch.Tensor, weight, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rms_norm over hd, then NeoX RoPE: x [T, H, hd]; cos, sin fp32 [T, n_rot/2] (or [T, 1, n_rot/2]
    as models.ops.rope_cos_sin returns them).  Dim j < n_rot/2 pairs with j + n_rot/2; dims
    >= n_rot pass through normalised only.  Output [T, H, hd] contiguous in x's dtype."""
    assert x.dim() == 3, f"rms_norm_rope: x must be [T, H, hd], got {tuple(x.shape)}"
    if cos.dim() == 3:
        assert cos.shape[1] == 1 and sin.shape[1] == 1, f"rms_norm_rope: cos {tuple(cos.shape)}"
        cos, sin = cos[:, 0], sin[:, 0]
    return _norm_launch(x, weight, eps, cos, sin, "rms_norm_rope")


def gelu_tanh_mul(gate: torch.Tensor, up=None) -> torch.Tensor:
    """gelu_tanh(gate) * up, fp32 math, output [..., F] contiguous in gate's dtype.

    gate, up [..., F] with unit last stride (row strides free: the two halves of a [T, 2F] tensor
    are read in place); or up None and gate the fused gate_up [..., 2F] (gate first)."""
    _need_triton("gelu_tanh_mul")
    if up is None:
        assert gate.shape[-1] % 2 == 0, f"gelu_tanh_mul: gate_up last dim {gate.shape[-1]} is odd"
        gate, up = gate.chunk(2, dim=-1)
    assert gate.shape == up.shape, f"gelu_tanh_mul: gate {tuple(gate.shape)} up {tuple(up.shape)}"
    assert gate.dtype in _DTYPES and up.dtype == gate.dtype, f"gelu_tanh_mul: dtypes {gate.dtype} {up.dtype}"
    assert gate.device == up.device, f"gelu_tanh_mul: devices {gate.device} {up.device}"
    Fd = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    g2 = _as_rows3(gate, "gelu_tanh_mul").flatten(0, 1)
    u2 = _as_rows3(up, "gelu_tanh_mul").flatten(0, 1)
    R = g2.shape[0]
    if R == 0 or Fd == 0:
        return out
    block_f = min(triton.next_power_of_2(Fd), 1024 if interpreting() else 2048)
    block_r = max(1, min(_elems() // block_f, triton.next_power_of_2(R)))
    _gelu_tanh_mul_kernel[(triton.cdiv(R, block_r), triton.cdiv(Fd, block_f))](
        g2, u2, out, R, g2.stride(0), u2.stride(0), F_=Fd, BLOCK_R=block_r, BLOCK_F=block_f,
        num_warps=4 if block_r * block_f <= 2048 else 8)
    return out


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (cap > 0), fp32 math, output contiguous in x's dtype."""
    _need_triton("softcap")
    assert x.dtype in _DTYPES, f"softcap: x dtype {x.dtype}"
    assert cap and cap > 0, f"softcap: cap {cap}"
    x = x.contiguous()
    out = torch.empty_like(x)
    N = x.numel()
    if N == 0:
        return out
    block = min(_elems(), triton.next_power_of_2(N))
    _softcap_kernel[(triton.cdiv(N, block),)](x, out, N, float(cap), BLOCK=block, num_warps=4)
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight, eps: float, scale=None, next_weight=None,
                 next_norm: bool = False, x_scale: float = 1.0, y_scale: float = 1.0, out_scale: float = 1.0,
                 out=None):
    """h = (x * x_scale + rms_norm(y * y_scale) [* weight]) * out_scale [* scale] and, when
    `next_norm` (or a `next_weight` is given), n = rms_norm(h) [* next_weight]: (h, n or None).

    x, y [..., D] of one dtype (fp16/bf16/fp32, unit last stride, any row strides); weight,
    next_weight [D] or None; scale None or a one-element tensor on the device (Gemma-4's
    layer_output_scale, read in the kernel: no host sync, no cast op). fp32 math; h is rounded to
    x's dtype once and n is the norm of h as stored. Outputs are contiguous in x's shape, h in
    `out` when given (contiguous, x's shape and dtype)."""
    _need_triton("add_rms_norm")
    D = x.shape[-1]
    assert y.shape == x.shape, f"add_rms_norm: x {tuple(x.shape)} y {tuple(y.shape)}"
    assert x.dtype in _DTYPES and y.dtype == x.dtype, f"add_rms_norm: dtypes {x.dtype} {y.dtype}"
    assert x.device == y.device, f"add_rms_norm: devices {x.device} {y.device}"
    for w in (weight, next_weight):
        assert w is None or (w.shape == (D,) and w.is_contiguous() and w.device == x.device
                             and w.dtype in _DTYPES), f"add_rms_norm: weight {w.shape} {w.dtype}, D={D}"
    if scale is not None:
        assert scale.numel() == 1 and scale.device == x.device and scale.dtype in _DTYPES, \
            f"add_rms_norm: scale {tuple(scale.shape)} {scale.dtype} {scale.device}"
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous() and out.device == x.device, \
        f"add_rms_norm: out {tuple(out.shape)} {out.dtype}"
    next_norm = next_norm or next_weight is not None
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if next_norm else None
    x2 = _as_rows3(x, "add_rms_norm").flatten(0, 1)
    y2 = _as_rows3(y, "add_rms_norm").flatten(0, 1)
    R = x2.shape[0]
    if R == 0:
        return out, normed
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(_elems() // block_d, triton.next_power_of_2(R)))
    # x, y, the normed y and h live in registers at once: <= 16 fp32 values of each per thread
    # (4 warps for 16 x 256 spilled on sm_80; 8 warps for a 2560-wide E4B row spilled on sm_86).
    elems = block_r * block_d
    warps = 4 if elems <= 1024 else (8 if elems <= 2048 else 16)
    _add_rms_norm_kernel[(triton.cdiv(R, block_r),)](
        x2, y2, weight if weight is not None else x2, scale if scale is not None else x2,
        next_weight if next_weight is not None else x2, out, normed if next_norm else out, R,
        x2.stride(0), y2.stride(0), float(eps), float(x_scale), float(y_scale), float(out_scale),
        D=D, HAS_W=weight is not None, HAS_SCALE=scale is not None, HAS_NEXT=next_norm,
        HAS_NW=next_weight is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps)
    return out, normed


# ------------------------------------------------------------------------------------ references

def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def rms_norm_ref(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    xf = _f32(x)
    w = None if weight is None else weight.to(xf.dtype)
    return F.rms_norm(xf, (xf.shape[-1],), w, eps).to(x.dtype)


def rms_norm_rope_ref(x: torch.Tensor, weight, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = _f32(x)
    w = None if weight is None else weight.to(xf.dtype)
    y = F.rms_norm(xf, (xf.shape[-1],), w, eps)
    if cos.dim() == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]
    c, s = cos.to(y.dtype), sin.to(y.dtype)
    h = c.shape[-1]
    y1, y2, rest = y[..., :h], y[..., h:2 * h], y[..., 2 * h:]
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s, rest], dim=-1).to(x.dtype)


def gelu_tanh_mul_ref(gate: torch.Tensor, up=None) -> torch.Tensor:
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return (F.gelu(_f32(gate), approximate="tanh") * _f32(up)).to(gate.dtype)


def softcap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    return (torch.tanh(_f32(x) / cap) * cap).to(x.dtype)


def add_rms_norm_ref(x, y, weight, eps, scale=None, next_weight=None, next_norm=False, x_scale=1.0,
                     y_scale=1.0, out_scale=1.0, out=None):
    xf, yf = _f32(x), _f32(y)
    w = None if weight is None else weight.to(yf.dtype)
    h = (xf * x_scale + F.rms_norm(yf * y_scale, (yf.shape[-1],), w, eps)) * out_scale
    if scale is not None:
        h = h * scale.reshape(()).to(h.dtype)
    h = h.to(x.dtype)
    if out is not None:
        h = out.copy_(h)
    n = rms_norm_ref(h, next_weight, eps) if next_norm or next_weight is not None else None
    return h, n
