"""Load-time repacking of GGUF quantized matrices into a layout made for the decode GEMV.

GGUF stores each row as a run of blocks that interleave scales and quants (Q4_K: 144 B = d, dmin,
12 B of 6-bit scales, 128 B of nibbles); Q6_K's 210-byte blocks are never 16-byte aligned and a
Q4_K nibble byte holds values 32 apart. The GEMV wants wide aligned loads and every quant of one
thread's word to pair with x values it can load as one vector. So at load the bytes are split into
planes, each row of each plane contiguous and a multiple of 4 bytes (16 for the quant planes):

  q  quants          Q4_K/Q5_K/Q6_K/Q4_0/Q5_0: the low 4 bits, 16 B per 32-value sub-block;
                     Q8_0: the 32 int8 quants of a block as they are.
  h  high bits       Q5_K/Q5_0: 4 B per sub-block (1 bit a value); Q6_K: 8 B (2 bits a value).
  s  sub-scales      Q4_K/Q5_K: the 12 GGUF scale/min bytes per block as stored; Q6_K: 16 int8.
  d  block scales    fp16: (d, dmin) pairs for Q4_K/Q5_K, d for the rest.

Nibble order (the point of the repack): in a 32-value sub-block, word u (u = 0..3, little-endian
int32) holds in nibble j (bits 4j..4j+3, j = 0..7) the quant of value 4j + u. A thread that
loads the 4 words of a sub-block (one 16-byte load) extracts nibble j of all four and multiplies
them with x[4j .. 4j+3] (one vector load).
High bits ("byte-select" order): value (u, j = 2b + p) keeps its high field in byte b of an h
word, at bit HIGH_BIT[width][u][p] of that byte (Q5: one word per sub-block, all four lanes;
Q6_K: word u // 2, two lanes each). The GEMV shifts the h word so that field lands on bit 4 of
every byte and merges it with the nibbles in one LOP3 select, (w >> 4p) & 0x0F0F0F0F | H &
0xF0F0F0F0: byte b then holds the whole 5- or 6-bit quant of j = 2b + p, one shift away from
its place in a float mantissa. Byte counts are exactly the GGUF ones.

`pack` builds the planes (plain torch, on the tensor's device, meta included); `dequantize_packed_ref`
turns them back into float32 with the exact op order of `kernels.triton.qdequant.qdequantize_ref`, so the
repack is checked bit for bit against the GGUF bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .qformats import LAYOUT, Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0

__all__ = ["HIGH_BIT", "HIGH_WORD", "PackedQuant", "dequantize_packed_ref", "pack"]

# Plane bytes per block: (q, h, s, d).
PLANE_BYTES = {
    Q4_0: (16, 0, 0, 2), Q5_0: (16, 4, 0, 2), Q8_0: (32, 0, 0, 2),
    Q4_K: (128, 0, 12, 4), Q5_K: (128, 32, 12, 4), Q6_K: (128, 64, 16, 2),
}


@dataclass(frozen=True)
class PackedQuant:
    """One matrix [n_out, n_in] in the repacked layout (module doc). Planes are uint8
    [n_out, blocks * plane bytes per block]; `h`/`s` are None for types without them."""
    ggml_type: int
    shape: tuple[int, int]
    q: torch.Tensor
    h: Optional[torch.Tensor]
    s: Optional[torch.Tensor]
    d: torch.Tensor

    @property
    def name(self) -> str:
        return LAYOUT[self.ggml_type][0]

    @property
    def planes(self) -> tuple[torch.Tensor, ...]:
        return tuple(p for p in (self.q, self.h, self.s, self.d) if p is not None)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.planes)

    @property
    def device(self) -> torch.device:
        return self.q.device

    def rows(self, ids: torch.Tensor) -> "PackedQuant":
        """The rows `ids` (a gather of every plane)."""
        ids = ids.to(self.q.device)
        pick = (lambda p: None if p is None else p.index_select(0, ids))
        return replace(self, shape=(int(ids.numel()), self.shape[1]), q=pick(self.q), h=pick(self.h),
                       s=pick(self.s), d=pick(self.d))

    def row_slice(self, r0: int, r1: int) -> "PackedQuant":
        """Rows r0..r1-1 as views."""
        cut = (lambda p: None if p is None else p[r0:r1])
        return replace(self, shape=(r1 - r0, self.shape[1]), q=cut(self.q), h=cut(self.h), s=cut(self.s),
                       d=cut(self.d))

    def to(self, device) -> "PackedQuant":
        mv = (lambda p: None if p is None else p.to(device))
        return replace(self, q=mv(self.q), h=mv(self.h), s=mv(self.s), d=mv(self.d))

    def interleave_rows(self) -> "PackedQuant":
        """Rows [gate (n/2); up (n/2)] -> (gate_0, up_0, gate_1, up_1, ...): the layout of the GEMV's
        GLU epilogue, which needs each gate row and its up row in the same program."""
        n = self.shape[0]
        assert n % 2 == 0, "interleave_rows needs an even number of rows"
        mix = (lambda p: None if p is None else torch.stack([p[:n // 2], p[n // 2:]], 1).reshape(n, -1))
        return replace(self, q=mix(self.q), h=mix(self.h), s=mix(self.s), d=mix(self.d))

    @staticmethod
    def cat(ps: list["PackedQuant"]) -> "PackedQuant":
        """Rows of matrices of one type and input width stacked (q/k/v or gate/up fused at load)."""
        t, n_in = ps[0].ggml_type, ps[0].shape[1]
        if any(p.ggml_type != t or p.shape[1] != n_in for p in ps):
            raise ValueError("PackedQuant.cat: matrices of different types or input widths")
        join = (lambda name: None if getattr(ps[0], name) is None else torch.cat([getattr(p, name) for p in ps]))
        return PackedQuant(t, (sum(p.shape[0] for p in ps), n_in), join("q"), join("h"), join("s"), join("d"))


# --- packing ------------------------------------------------------------------------------------

def _lane_order(v: torch.Tensor) -> torch.Tensor:
    """Values [..., 32] of sub-blocks in natural order -> [..., 4 (u), 8 (j)]: value 4j + u."""
    return v.reshape(*v.shape[:-1], 8, 4).transpose(-1, -2)


def _natural_order(v: torch.Tensor) -> torch.Tensor:
    """Inverse of `_lane_order`: [..., 4 (u), 8 (j)] -> [..., 32] natural order."""
    return v.transpose(-1, -2).reshape(*v.shape[:-2], 32)


def _nibble_plane(q: torch.Tensor) -> torch.Tensor:
    """4-bit quants [n, sub-blocks, 32] (natural order, uint8) -> uint8 [n, sub-blocks * 16]:
    byte b of word u holds nibbles j = 2b (low) and 2b + 1 (high) of lane u."""
    lanes = _lane_order(q)                                   # [n, S, 4, 8]
    return (lanes[..., 0::2] | (lanes[..., 1::2] << 4)).reshape(q.shape[0], -1)


# Byte-select order of the high bits (module doc): bit of value (u, j = 2b + p) inside byte b of
# h word HIGH_WORD[width][u]; HIGH_BIT + the field width never passes bit 8.
HIGH_BIT = {1: ((4, 5), (6, 7), (0, 1), (2, 3)), 2: ((4, 6), (0, 2), (4, 6), (0, 2))}
HIGH_WORD = {1: (0, 0, 0, 0), 2: (0, 0, 1, 1)}


def _high_plane(hi: torch.Tensor, width: int) -> torch.Tensor:
    """High fields [n, S, 32] (natural order, uint8 < 2**width) -> uint8 [n, S * 4 * width] in
    byte-select order: 1 (Q5) or 2 (Q6_K) little-endian words per sub-block. The fields of one byte
    occupy disjoint bits, so a uint8 sum is their OR."""
    shifts = torch.tensor(HIGH_BIT[width], dtype=torch.uint8, device=hi.device)   # [u, p]
    lanes = _lane_order(hi).reshape(*hi.shape[:-1], 4, 4, 2)         # [n, S, u, byte b, p]
    placed = lanes << shifts[:, None, :]
    words = placed.reshape(*hi.shape[:-1], width, 4 // width, 4, 2)  # [n, S, word, u in word, b, p]
    return words.sum(dim=(-3, -1), dtype=torch.uint8).reshape(hi.shape[0], -1)


def _q4k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K quant bytes [n, 128] -> 4-bit quants [n, 8, 32]: byte 32g + i holds value
    64g + i (low nibble, sub-block 2g) and 64g + 32 + i (high nibble, sub-block 2g + 1)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32)


PACK_CHUNK_VALUES = 1 << 22   # rows packed at a time: temporaries of a few x 4 MB, not of the matrix


def pack(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> PackedQuant:
    """GGUF rows uint8 [n_out, row_bytes] of a supported type -> the repacked planes (built in row
    chunks into planes allocated once, so a 262k-row vocabulary matrix needs a few MB of temporaries
    beyond its planes)."""
    t = int(ggml_type)
    if t not in LAYOUT:
        raise ValueError(f"pack: unsupported GGML type {ggml_type}")
    name, bv, bb = LAYOUT[t]
    n_out, n_in = int(shape[0]), int(shape[1])
    if n_in % bv or tuple(raw.shape) != (n_out, n_in // bv * bb) or raw.dtype != torch.uint8:
        raise ValueError(f"pack: {name} [{n_out}, {n_in}] needs uint8 rows of {n_in // bv * bb} bytes, "
                         f"got {tuple(raw.shape)} {raw.dtype}")
    chunk = max(1, PACK_CHUNK_VALUES // n_in)
    if n_out <= chunk:
        return _pack_rows(raw, t, n_out, n_in)
    nb = n_in // bv
    planes = [None if per == 0 else torch.empty((n_out, nb * per), dtype=torch.uint8, device=raw.device)
              for per in PLANE_BYTES[t]]
    for r0 in range(0, n_out, chunk):
        r1 = min(n_out, r0 + chunk)
        part = _pack_rows(raw[r0:r1], t, r1 - r0, n_in)
        for dst, src in zip(planes, (part.q, part.h, part.s, part.d)):
            if dst is not None:
                dst[r0:r1] = src
    return PackedQuant(t, (n_out, n_in), *planes)


def _pack_rows(raw: torch.Tensor, t: int, n_out: int, n_in: int) -> PackedQuant:
    _, bv, bb = LAYOUT[t]
    nb = n_in // bv
    b = raw.reshape(n_out * nb, bb)
    rows = (lambda p: p.reshape(n_out, -1).contiguous())
    h = s = None
    if t in (Q4_K, Q5_K):
        d = b[:, 0:4]                                        # d, dmin (fp16 each)
        s = b[:, 4:16]
        qoff = 16 if t == Q4_K else 48
        q = _q4k_nibbles(b[:, qoff:qoff + 128])              # [n*nb, 8, 32]
        if t == Q5_K:                                        # bit s of byte i: value 32s + i
            planes = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
            h = rows(_high_plane((b[:, None, 16:48] >> planes) & 1, 1))
        qp = _nibble_plane(q)
    elif t == Q6_K:
        n = b.shape[0]
        ql = b[:, :128].reshape(n, 2, 1, 64)
        low = torch.cat([ql & 15, ql >> 4], dim=2).reshape(n, 256)     # value 128h + 64l + i
        pairs = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[None, None, :, None]
        high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> pairs) & 3).reshape(n, 256)
        qp = _nibble_plane(low.reshape(n, 8, 32))
        h = rows(_high_plane(high.reshape(n, 8, 32), 2))
        s = b[:, 192:208]
        d = b[:, 208:210]
    elif t == Q8_0:
        d, qp = b[:, 0:2], b[:, 2:34]
    else:  # Q4_0, Q5_0: low nibbles = values 0..15, high nibbles = 16..31
        d = b[:, 0:2]
        qs = b[:, 2:18] if t == Q4_0 else b[:, 6:22]
        q = torch.cat([qs & 15, qs >> 4], dim=1).reshape(-1, 1, 32)
        qp = _nibble_plane(q)
        if t == Q5_0:                                        # bit i of the LE uint32: value i
            bits = torch.arange(8, dtype=torch.uint8, device=b.device)
            hi = ((b[:, 2:6, None] >> bits) & 1).reshape(-1, 1, 32)
            h = rows(_high_plane(hi, 1))
    return PackedQuant(t, (n_out, n_in), rows(qp), h, None if s is None else rows(s), rows(d))


# --- reference dequantization ----------------------------------------------------------------------

def _f16(p: torch.Tensor, off: int, stride: int) -> torch.Tensor:
    """fp16 fields at byte `off` of every `stride`-byte record of a plane [n, k] -> fp32 [n, k/stride, 1]."""
    rec = p.reshape(p.shape[0], -1, stride)[:, :, off:off + 2].contiguous()
    return rec.view(torch.float16).to(torch.float32)


def _unpack_nibbles(qp: torch.Tensor) -> torch.Tensor:
    """uint8 [n, S*16] nibble plane -> 4-bit quants [n, S, 32] natural order."""
    b = qp.reshape(qp.shape[0], -1, 4, 4)                    # [n, S, u, byte]
    lanes = torch.stack([b & 15, b >> 4], dim=-1).reshape(*b.shape[:3], 8)   # [n, S, u, j]
    return _natural_order(lanes)


def _unpack_high(hp: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of `_high_plane`: uint8 [n, S * 4 * width] -> high fields [n, S, 32] natural order."""
    b = hp.reshape(hp.shape[0], -1, width, 4).to(torch.int64)        # [n, S, word, byte]
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    lanes = torch.empty(*words.shape[:-1], 4, 8, dtype=torch.int64, device=hp.device)
    for u in range(4):
        for j in range(8):
            bit = 8 * (j // 2) + HIGH_BIT[width][u][j % 2]
            lanes[..., u, j] = (words[..., HIGH_WORD[width][u]] >> bit) & ((1 << width) - 1)
    return _natural_order(lanes).to(torch.uint8)


def dequantize_packed_ref(p: PackedQuant) -> torch.Tensor:
    """float32 [n_out, n_in], the same float ops in the same order as `qdequant.qdequantize_ref` on the
    GGUF bytes (so the two are bit-identical)."""
    from .qdequant import scale_min_k4_ref

    t, n_in = p.ggml_type, p.shape[1]
    n = p.q.shape[0]
    if t in (Q4_K, Q5_K):
        nb = n_in // 256
        q = _unpack_nibbles(p.q).reshape(n * nb, 8, 32)
        if t == Q5_K:
            q = q | (_unpack_high(p.h, 1).reshape(n * nb, 8, 32) << 4)
        sc, mn = scale_min_k4_ref(p.s.reshape(n * nb, 12))
        dm = _f16(p.d, 0, 4).reshape(n * nb, 1), _f16(p.d, 2, 4).reshape(n * nb, 1)
        dl = (dm[0] * sc)[:, :, None]
        ml = (dm[1] * mn)[:, :, None]
        return (dl * q.to(torch.float32) - ml).reshape(n, n_in)
    if t == Q6_K:
        nb = n_in // 256
        q = (_unpack_nibbles(p.q) | (_unpack_high(p.h, 2) << 4)).to(torch.int16) - 32   # [n, 8nb, 32]
        sc = p.s.reshape(n * nb, 16).view(torch.int8).to(torch.float32)
        dl = (_f16(p.d, 0, 2).reshape(n * nb, 1) * sc)[:, :, None]
        return (dl * q.reshape(n * nb, 16, 16).to(torch.float32)).reshape(n, n_in)
    d = _f16(p.d, 0, 2).reshape(-1, 1)                       # [n * blocks, 1]
    if t == Q8_0:
        return (p.q.reshape(-1, 32).view(torch.int8).to(torch.float32) * d).reshape(n, n_in)
    q = _unpack_nibbles(p.q).reshape(-1, 32)
    if t == Q5_0:
        q = (q | (_unpack_high(p.h, 1).reshape(-1, 32) << 4)).to(torch.int16) - 16
    else:
        q = q.to(torch.int16) - 8
    return (d * q.to(torch.float32)).reshape(n, n_in)
