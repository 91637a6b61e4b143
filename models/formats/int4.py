"""Int4Weight: GGUF matrices repacked at load for torch's int4 CPU matmul (the cpu_torch runtime).

Why: CPU decode reads every weight once per token. Expanded to float16 (the old HalfWeight path)
E2B's matrices and tables took 14.6 GB of RAM for a 4.0 GB file, and torch has no kernel that
reads GGUF blocks. `torch._weight_int4pack_mm_for_cpu` (aten, shipped with every CPU build: no
compiler at install or run time) multiplies bf16 activations by 4-bit weights w = (q - 8)·s + z
with one (s, z) per group of 32 or 64 inputs. The 4-bit GGUF types map onto it with the same q
bits (the only rounding: s and z to bf16, a 2^-9 relative step):
  * Q4_K, Q4_0: w = s·q - o  ->  one plane, group 32, z = 8s - o.
The wider types fit too (`Int4Weight` holds and tests them):
  * 5/6/8-bit (Q5_0, Q5_K, Q8_0 in groups of 32; Q6_K in sub-blocks of 16): q = lo + 16·hi is
    split into two 4-bit planes laid side by side per group, [lo_g | hi_g + h0], and the input is
    expanded to [x_g | 16·x_g] (exact in bf16), so one int4 group of 2g sums both planes with the
    group's one scale: s·Σ(lo - 8)x + 16·s·Σ(hi + h0 - 8)x + 17·z·Σx = Σ(s·q - o)x for
    z = (s·(8 + 16·(8 - h0)) - o) / 17. h0 centres hi in 0..15, so z stays near zero and its bf16
    rounding small. Q6_K's sub-blocks of 16 give groups of 32 (torch has no group of 16).
  but two planes double the int4pack work, so models/cpu_quant.cpu_weight keeps those types in float16.
Bytes: Q4_K 5 bits a value (4.5 in the file); two-plane types 9 to 10.

Measured on this project's 2-core AVX2 VM (torch 2.13, one thread, best of 7, 2026-12-01;
12288x1536, the fused gate/up of an E2B layer; other agents shared the VM): decode (1 row)
float32 5.7 ms, float16 4.6 ms, int4pack 3.5 ms (two planes ~6.5), int8pack (per-row scales only:
no lossless mapping) 3.5 ms, fbgemm float16 2.9 ms; bfloat16 GEMMs have no fast path without
AVX512-BF16 (7 GFLOP/s against float32's ~58 GFLOP/s at 512 rows), int4pack at 512 rows ~30.
So: up to GEMV_ROWS rows go through int4pack; more rows (prefill) dequantize row blocks into a
reused buffer and run the float32 (bf16 where the CPU has AVX512-BF16/AMX) GEMM, never the whole
matrix per call. `rows` dequantizes only the rows asked for.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .base import BLOCK_VALUES

GEMV_ROWS = 64  # int4pack up to here; above, dequantized row blocks + GEMM (measured crossover 64-128)
_PACK_ROWS = 4096  # rows repacked per step at load (bounds the int32 temporaries)


def _affine(blocks: torch.Tensor, name: str):
    """GGUF blocks [n, bytes] -> (q uint8 [n, values] in 0..2^bits-1, s, o float32 [n, groups],
    group, bits) with value = s·q - o per group of `group` values (the types' layouts are in
    models/quant.py)."""
    from ..quant import f16_at, nibbles, bitplanes, q5_quants, scale_min_k4

    n = blocks.shape[0]
    if name == "Q4_0":  # d f16, 16 bytes of nibbles: d·(q - 8)
        d = f16_at(blocks, 0)
        return nibbles(blocks[:, 2:], 16).reshape(n, 32), d, 8 * d, 32, 4
    if name == "Q5_0":  # d f16, 5th bits, nibbles: d·(q - 16)
        d = f16_at(blocks, 0)
        return q5_quants(blocks[:, 2:6], blocks[:, 6:]).to(torch.uint8), d, 16 * d, 32, 5
    if name == "Q8_0":  # d f16, int8 q: d·q = d·(u - 128), u = q + 128
        d = f16_at(blocks, 0)
        return blocks[:, 2:] ^ 0x80, d, 128 * d, 32, 8  # the sign bit flipped: u = q + 128
    if name in ("Q4_K", "Q5_K"):  # d·sc·q - dmin·m per sub-block of 32
        sc, mn = scale_min_k4(blocks[:, 4:16])
        s, o = f16_at(blocks, 0) * sc.to(torch.float32), f16_at(blocks, 2) * mn.to(torch.float32)
        if name == "Q4_K":
            return nibbles(blocks[:, 16:], 32).reshape(n, 256), s, o, 32, 4
        ql = nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
        qh = bitplanes(blocks[:, 16:48], 32, 1).reshape(n, 8, 32)
        return (ql | (qh << 4)).reshape(n, 256), s, o, 32, 5
    if name == "Q6_K":  # d·sc·(q - 32) per sub-block of 16
        s = f16_at(blocks, 208) * blocks[:, 192:208].view(torch.int8).to(torch.float32)
        ql = nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
        qh = bitplanes(blocks[:, 128:192], 32, 2).reshape(n, 8, 32)
        return (ql | (qh << 4)).reshape(n, 256), s, 32 * s, 16, 6
    raise ValueError(f"no CPU int4 repack for {name}")


@functools.lru_cache(maxsize=None)
def pack_block_rows() -> int:
    """Rows per block of torch's packed int4 layout on this CPU ([N/bn, K, bn/2] bytes: byte (b, k, j)
    holds row b·bn + j in its low nibble and row b·bn + bn/2 + j in its high one; 32 on AVX2, 64
    on AVX512): read off a probe once, so unpacking never guesses."""
    n, k = 256, 64
    q = (torch.arange(n * k).reshape(n, k) * 7 // 3 % 16).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    for bn in (64, 32, 16, 8):
        if n % bn == 0 and torch.equal(_unpack(packed, bn, k), q) and torch.equal(_pack(q.to(torch.uint8), bn), packed):
            return bn
    raise RuntimeError("unknown int4 pack layout from torch._convert_weight_to_int4pack_for_cpu")


def _pack(q: torch.Tensor, bn: int) -> torch.Tensor:
    """uint8 values [rows, k] in 0..15 (rows a multiple of bn) -> the packed layout [rows, k/2]: what
    torch._convert_weight_to_int4pack_for_cpu makes (checked by `pack_block_rows`), in three uint8
    passes instead of its int32 input."""
    rows, k = q.shape
    q = q.view(rows // bn, 2, bn // 2, k)
    return (q[:, 0] | (q[:, 1] << 4)).transpose(1, 2).reshape(rows, k // 2)


def _unpack(packed: torch.Tensor, bn: int, k: int) -> torch.Tensor:
    """uint8 [rows, k/2] in the packed layout (rows a multiple of bn) -> int values [rows, k]."""
    p = packed.reshape(-1, k, bn // 2)
    return torch.cat([p & 15, p >> 4], dim=2).transpose(1, 2).reshape(-1, k)


@functools.lru_cache(maxsize=None)
def gemm_dtype() -> torch.dtype:
    """bfloat16 for prefill GEMMs where oneDNN has native bf16 (AVX512-BF16 or AMX), else float32
    (AVX2 has no bf16 dot product: 7 GFLOP/s against float32's ~58 on this VM)."""
    try:
        flags = open("/proc/cpuinfo").read().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return torch.float32
    fast = {"avx512_bf16", "amx_bf16"} & set(flags)
    return torch.bfloat16 if fast and torch.backends.mkldnn.is_available() else torch.float32


_buffers: dict = {}  # dtype -> the reused dequantization buffer of that dtype (prefill row blocks)


def _buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """One live buffer per dtype (the block size is the same for every matrix of a model)."""
    if dtype not in _buffers or _buffers[dtype].numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable under no_grad and inference_mode alike
            _buffers[dtype] = torch.empty(numel, dtype=dtype)
    return _buffers[dtype][:numel]


class Int4Weight:
    """A [out, in] GGUF matrix repacked for `torch._weight_int4pack_mm_for_cpu` (module doc)."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]):
        from ..quant import block_size, type_name

        self.ggml_type, self.shape = int(ggml_type), tuple(shape)
        name = type_name(self.ggml_type)
        bv, bb = block_size(self.ggml_type)
        n, k = self.shape
        self.bn = pack_block_rows()
        self.n_pad = -(-n // self.bn) * self.bn
        blocks = raw.contiguous().view(n, -1)
        self.g, self.bits = _affine(blocks[:1].reshape(-1, bb), name)[3:]
        self.k_packed = k if self.bits <= 4 else 2 * k
        self.group = self.g if self.bits <= 4 else 2 * self.g  # int4 group (32 or 64)
        self.packed = torch.empty(self.n_pad, self.k_packed // 2, dtype=torch.uint8)
        self.sz = torch.zeros(self.k_packed // self.group, self.n_pad, 2, dtype=torch.bfloat16)
        for r0 in range(0, self.n_pad, _PACK_ROWS):
            r1 = min(r0 + _PACK_ROWS, self.n_pad)
            q, s, o = _affine(blocks[r0:min(r1, n)].reshape(-1, bb), name)[:3]
            q4, s, z = self._planes(q.view(-1, k), s.view(-1, k // self.g), o.view(-1, k // self.g))
            if q4.shape[0] < r1 - r0:  # rows padded to whole pack blocks: zero weights, outputs sliced off
                q4 = F.pad(q4, (0, 0, 0, r1 - r0 - q4.shape[0]), value=8)
            self.packed[r0:r1] = _pack(q4, self.bn)
            self.sz[:, r0:r0 + s.shape[0], 0] = s.t()
            self.sz[:, r0:r0 + s.shape[0], 1] = z.t()
        if self.bits > 4:  # the input expansion [x_g | 16·x_g]
            self._x_scale = torch.tensor([1.0, 16.0], dtype=torch.bfloat16).view(1, 1, 2, 1)

    @staticmethod
    def bits_of(ggml_type: int) -> int:
        from ..quant import type_name

        return {"Q4_K": 4, "Q4_0": 4, "Q5_K": 5, "Q5_0": 5, "Q6_K": 6, "Q8_0": 8}[type_name(int(ggml_type))]

    def _planes(self, q: torch.Tensor, s: torch.Tensor, o: torch.Tensor):
        """(int4 values [rows, k_packed], s, z [rows, groups]) for value = s·q - o (module doc)."""
        if self.bits <= 4:
            return q, s, 8 * s - o
        rows, k = q.shape
        h0 = 8 - (1 << (self.bits - 5))  # centres hi (0 .. 2^(bits-4) - 1) in 0..15
        q = q.view(rows, k // self.g, self.g)
        q4 = torch.empty(rows, k // self.g, 2, self.g, dtype=torch.uint8)
        torch.bitwise_and(q, 15, out=q4[:, :, 0])
        torch.add(q >> 4, h0, out=q4[:, :, 1])
        return q4.view(rows, 2 * k), s, (s * (8 + 16 * (8 - h0)) - o) / 17

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.sz)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def _expand(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 activations [rows, k] -> the packed inputs [rows, k_packed]."""
        xb = x.to(torch.bfloat16)
        if self.bits <= 4:
            return xb
        rows, k = xb.shape
        return (xb.view(rows, k // self.g, 1, self.g) * self._x_scale).view(rows, 2 * k)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in x's dtype: int4pack up to GEMV_ROWS rows, dequantized row blocks + GEMM above."""
        n, k = self.shape
        x2 = x.reshape(-1, k)
        if x2.shape[0] > GEMV_ROWS:
            y = self._gemm(x2)
        else:
            y = torch._weight_int4pack_mm_for_cpu(self._expand(x2), self.packed, self.group, self.sz)
            y = y[:, :n] if self.n_pad != n else y
        return y.to(x.dtype).reshape(*x.shape[:-1], n)

    def _gemm(self, x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Prefill: W^T dequantized block by block into one reused buffer, one GEMM per block (a
        block of 4M values costs ~1/10 of its GEMM at 1024 rows; the matrix is never upcast whole).
        The dequantization itself is always float32: the two-plane types add 16x a plane to the
        other, and that sum in bf16 cancels to ~3% error (Q5_0). A bf16 GEMM (`gemm_dtype`) then
        rounds W, x and the output to bf16 once each (three roundings of <= 2^-9 RMS)."""
        n, k = self.shape
        dtype = gemm_dtype() if dtype is None else dtype
        xg = x.to(dtype)
        out = torch.empty(x.shape[0], n, dtype=dtype)
        step = max(self.bn, BLOCK_VALUES // self.k_packed // self.bn * self.bn)
        buf = _buffer(step * self.k_packed, torch.float32)
        low = _buffer(step * k, dtype) if dtype != torch.float32 else None
        for r0 in range(0, n, step):
            r1 = min(r0 + step, n)
            wt = self._dequant_t(r0, -(-r1 // self.bn) * self.bn, buf)  # [k, rows] float32
            if low is not None:
                wt = low[:wt.numel()].view(wt.shape).copy_(wt)
            if r1 - r0 == n and wt.shape[1] == n:
                torch.mm(xg, wt, out=out)
            else:
                out[:, r0:r1] = torch.mm(xg, wt[:, :r1 - r0])
        return out

    def _dequant_t(self, r0: int, r1: int, buf: torch.Tensor) -> torch.Tensor:
        """W^T for rows r0..r1 (multiples of bn) in `buf` -> [k, r1 - r0]. The packed bytes of a row
        block are already k-major ([blocks, k_packed, bn/2]) and the scales [groups, rows, 2], so
        W^T comes out with two strided copies and no transposes: low nibbles are rows j, high
        nibbles rows bn/2 + j of each block."""
        k, kp, half, rows = self.shape[1], self.k_packed, self.bn // 2, r1 - r0
        p = self.packed[r0:r1].view(-1, kp, half).transpose(0, 1)  # [kp, blocks, half] uint8
        wt = buf[:kp * rows].view(kp, rows // self.bn, 2, half)
        wt[:, :, 0].copy_(p & 15)
        wt[:, :, 1].copy_(p >> 4)
        sz = self.sz[:, r0:r1].to(buf.dtype)
        s, z = sz[..., 0].unsqueeze(1), (sz[..., 1] - 8 * sz[..., 0]).unsqueeze(1)  # [groups, 1, rows]
        wt = wt.view(kp // self.group, self.group, rows).mul_(s).add_(z)
        if self.bits <= 4:
            return wt.view(k, rows)
        planes = wt.view(k // self.g, 2, self.g, rows)
        return torch.add(planes[:, 0], planes[:, 1], alpha=16.0).view(k, rows)

    def _values(self, q4: torch.Tensor, sz: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int4 values [rows, k_packed] and their (s, z) [groups, rows, 2] -> weights [rows, k]."""
        rows, k = q4.shape[0], self.shape[1]
        s = sz[..., 0].t().float().unsqueeze(-1)
        z = sz[..., 1].t().float().unsqueeze(-1)
        w = (q4.view(rows, -1, self.group).float() - 8).mul_(s).add_(z)  # [rows, groups, group]
        if self.bits <= 4:
            w = w.view(rows, k)
            return w if out is None else out.copy_(w)
        w = w.view(rows, k // self.g, 2, self.g)
        res = torch.add(w[:, :, 0], w[:, :, 1], alpha=16.0)
        res = res.view(rows, k)
        return res if out is None else out.copy_(res)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` [len, in]: only those rows' bytes are read (embedding lookups)."""
        ids = ids.reshape(-1).long().cpu()
        half = self.bn // 2
        j = ids % self.bn
        p = self.packed.view(-1, self.k_packed, half)[ids // self.bn, :, j % half]  # [len, k_packed]
        q4 = torch.where((j >= half)[:, None], p >> 4, p & 15)
        return self._values(q4, self.sz[:, ids])

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        """The whole matrix (tests and tools; the runtime never calls it)."""
        n = self.shape[0]
        return self._values(_unpack(self.packed, self.bn, self.k_packed), self.sz)[:n].to(dtype)
