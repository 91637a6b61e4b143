"""CPU runtime weight formats, used through `.linear(x)` and `.rows(ids)`.

Why: CPU decode is memory-bound (every weight read once per token). GGUF matrices of the types
Gemma files use are repacked at load into torch's int4 CPU layout (models/cpu_quant.py: about the
file's bytes, bf16 scales), and the lookup tables stay in the file's bytes. What remains dense
(F16/BF16/F32 matrices, safetensors checkpoints) is HalfWeight: float16, a torch float16 GEMV up to
GEMV_ROWS rows (inputs rounded to float16, float32 accumulation, ~5e-4 relative error); larger
batches (prefill) upcast row blocks into a reused float32 buffer for the float32 GEMM (float16
GEMMs are 5x slower than float32 on AVX2), never the whole matrix per call. A float16 output out
of range is inf: the model's per-step check (models/decoder.py, FiniteWatch) reports it with the
layer, rather than each matmul checking and recomputing in float32 (that check once turned a
model whose activations went non-finite into a silent 10x slower path).
The exact reference path (float32/float64 dense tensors) stays what the tests compare.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import cpu_ggml
from .cpu_ggml import GGMLWeight
from .cpu_quant import BLOCK_VALUES, Int4Weight, cpu_weight, repackable

GEMV_ROWS = 16
_upcast: dict = {}  # numel -> the reused float32 buffer of HalfWeight's prefill blocks


class HalfWeight:
    """A [out, in] matrix kept in float16; `.linear(x)` and `.rows(ids)` return x's dtype."""

    def __init__(self, w: torch.Tensor):
        self.w = w.to(torch.float16).contiguous()
        self.shape = tuple(self.w.shape)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= GEMV_ROWS or self.w.dim() != 2:
            return F.linear(x.to(torch.float16), self.w).to(x.dtype)
        n, k = self.shape
        step = max(1, min(n, BLOCK_VALUES // k))
        if step * k not in _upcast:
            _upcast.clear()
            with torch.inference_mode(False):  # writable under no_grad and inference_mode alike
                _upcast[step * k] = torch.empty(step * k, dtype=torch.float32)
        buf, x2 = _upcast[step * k], x.reshape(-1, k).float()
        out = torch.empty(x2.shape[0], n, dtype=torch.float32)
        for r0 in range(0, n, step):
            r1 = min(r0 + step, n)
            w = buf[:(r1 - r0) * k].view(r1 - r0, k).copy_(self.w[r0:r1])
            out[:, r0:r1] = torch.mm(x2, w.t())
        return out.to(x.dtype).reshape(*x.shape[:-1], n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.index_select(0, ids.to(self.w.device)).float()

    def __getitem__(self, idx) -> "HalfWeight":
        """Expert slices of 3-D MoE weights [E, out, in] stay in float16."""
        return HalfWeight(self.w[idx])

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        return self.w.to(dtype)


class QuantWeight:
    """A matrix kept quantized on its device.

    Matrices that are multiplied hold the repacked planes (`packed`, kernels/qpack.py: GGUF bytes
    regrouped for wide GEMV loads, the same byte count); `.linear(x)` runs `kernels.qmatmul`, which
    reads each weight byte once per call. Embedding tables that are only looked up (`lookup=True`:
    the host tables of `--embed-weights host`) keep the GGUF bytes (`raw`), so a gather moves
    whole GGUF rows. `.rows(ids)` dequantizes only the requested rows from either form."""

    TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"})  # what qmatmul handles

    def __init__(self, raw: Optional[torch.Tensor], ggml_type: int, shape: tuple[int, int], lookup: bool = False,
                 packed=None):
        from kernels.triton.qpack import pack

        self.ggml_type, self.shape = int(ggml_type), tuple(shape)
        self.interleaved = False  # rows (gate_0, up_0, gate_1, ...): multiplied through `glu`
        self.reader = None  # a models.row_reader.RowReader: lookup rows read from the file, not the map
        if packed is not None:
            self.raw, self.packed = None, packed
        elif lookup:
            self.raw, self.packed = raw.contiguous(), None
        else:
            self.raw, self.packed = None, pack(raw.contiguous(), self.ggml_type, self.shape)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the bytes (the planes, or the GGUF rows of a lookup table)."""
        return (self.raw,) if self.packed is None else self.packed.planes

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def linear(self, x: torch.Tensor, gelu_mul: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x W^T; with `gelu_mul` (same leading shape, n_out wide) gelu_tanh(x W^T) * gelu_mul, the
        epilogue fused into the GEMV."""
        from kernels.triton.qmatmul import qmatmul

        if self.packed is None:
            raise ValueError(f"QuantWeight {self.shape}: a lookup table cannot be multiplied")
        return qmatmul(x, self.packed, gelu_mul=gelu_mul)

    def glu(self, x: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(x G^T) * (x U^T) [..., n_out / 2] for an interleaved gate/up matrix (`interleave`):
        the GEMV's GLU epilogue, one launch for Gemma's gate, up and activation."""
        from kernels.triton.qmatmul import qmatmul

        if not self.interleaved:
            raise ValueError(f"QuantWeight {self.shape}: glu needs interleaved gate/up rows")
        return qmatmul(x, self.packed, glu=True)

    def interleave(self) -> "QuantWeight":
        """A stacked [gate; up] matrix with its rows interleaved for `glu`."""
        w = QuantWeight(None, self.ggml_type, self.shape, packed=self.packed.interleave_rows())
        w.interleaved = True
        return w

    @classmethod
    def cat(cls, ws: list["QuantWeight"]) -> "QuantWeight":
        """The rows of several matrices of one type and input width stacked into one (q/k/v or
        gate/up fused at load: one GEMV launch instead of several)."""
        from kernels.triton.qpack import PackedQuant

        t, n_in = ws[0].ggml_type, ws[0].shape[1]
        if any(w.ggml_type != t or w.shape[1] != n_in or w.packed is None for w in ws):
            raise ValueError("QuantWeight.cat: matrices of different types or input widths, or lookup tables")
        p = PackedQuant.cat([w.packed for w in ws])
        return cls(None, t, p.shape, packed=p)

    def raw_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The GGUF bytes of rows `ids` [n, row_bytes] of a lookup table (read from the file when it
        has a reader: no mapped page joins the resident set)."""
        if self.reader is not None:
            return self.reader.rows(ids)
        return self.raw.index_select(0, ids.to(self.raw.device))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` [n, n_in] (on the table's device)."""
        if self.packed is None:
            from .quant import dequantize

            sel = self.raw_rows(ids.reshape(-1))
            if sel.device.type == "cpu" and cpu_ggml.enabled():  # ggml's dequantization: bit-exact, one pass
                from kernels.ggml.ops import dequantize_rows

                return dequantize_rows(sel, self.ggml_type, self.shape[1])
            return dequantize(sel, self.ggml_type, (sel.shape[0], self.shape[1]))
        from kernels.triton.launch import use_kernels
        from kernels.triton.qpack import dequantize_packed_ref

        picked = self.packed.rows(ids)
        if use_kernels(picked.q):
            from kernels.triton.qmatmul import qdequantize_packed

            return qdequantize_packed(picked, torch.float32)
        return dequantize_packed_ref(picked)


def weight_tensors(w) -> tuple[torch.Tensor, ...]:
    """The tensors that hold a weight's bytes, whatever its runtime form."""
    if isinstance(w, QuantWeight):
        return w.tensors
    if isinstance(w, HalfWeight):
        return (w.w,)
    if isinstance(w, (Int4Weight, GGMLWeight)):
        return w.tensors
    return (w,) if isinstance(w, torch.Tensor) else ()


def _quant_weight(source, name: str, shape, device, lookup: bool = False) -> QuantWeight | None:
    """A 2-D GGUF matrix of a type the kernels read, repacked (or, `lookup`, its GGUF bytes for
    row gathers), else None (dense it is)."""
    from .quant import row_bytes, type_name

    if shape is None or len(shape) != 2 or not hasattr(source, "raw"):
        return None
    info = source.raw(name, shape)
    if type_name(info.ggml_type) not in QuantWeight.TYPES:
        return None
    raw = torch.from_numpy(info.data.copy()).reshape(shape[0], row_bytes(info.ggml_type, shape[1]))
    return QuantWeight(raw.to(device), info.ggml_type, shape, lookup=lookup)


def _gguf_rows(source, name: str, shape, mapped: bool) -> QuantWeight | None:
    """A 2-D GGUF matrix of a type Int4Weight repacks, as GGUF rows (QuantWeight lookup form), else
    None. `mapped`: a lookup table whose rows are read from the file on demand (a RowReader:
    pread, so only the rows looked up are copied and no mapped page joins the RSS; the map
    only describes the bytes); otherwise copied by a file
    read, to be repacked (`repack_cpu`)."""
    from .quant import row_bytes

    if shape is None or len(shape) != 2 or not hasattr(source, "raw"):
        return None
    info = source.raw(name, shape)
    if not (repackable(info.ggml_type, shape) or (cpu_ggml.enabled() and cpu_ggml.takes(info.ggml_type, shape))):
        return None
    if mapped:
        import warnings

        with warnings.catch_warnings():  # a read-only map: the tables are only ever read
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(info.data)
    else:
        data = torch.from_numpy(info.read() if hasattr(info, "read") else info.data.copy())
    raw = data.view(shape[0], row_bytes(info.ggml_type, shape[1]))
    w = QuantWeight(raw, info.ggml_type, shape, lookup=True)
    if mapped and hasattr(info, "_file"):  # rows are read with pread; the map only describes the bytes
        from .row_reader import RowReader

        w.reader = RowReader(info._file.path, info.offset, shape[0], raw.shape[1])
    return w


def repack_cpu(weights: dict, tables: frozenset) -> None:
    """Every GGUF-row matrix of `weights` (after `fuse_projections`) but the lookup `tables` takes
    its CPU runtime form, one at a time: with llama.cpp's kernels (models/cpu_ggml.py) the GGUF
    bytes themselves, multiplied by ggml (the tied head too: exact logits); without them
    models/cpu_quant.cpu_weight's torch formats and the int8-ranked head (the GGUF copy is dropped
    as each is repacked)."""
    ggml = cpu_ggml.enabled()
    for name in list(weights):
        w = weights[name]
        if isinstance(w, QuantWeight) and w.packed is None and name not in tables:
            weights[name] = None
            if ggml and cpu_ggml.takes(w.ggml_type, w.shape):
                weights[name] = GGMLWeight(w.raw, w.ggml_type, w.shape)
                del w
                continue
            q = _int8_head(w, weights.get("token_embd.host")) if name == "token_embd.weight" else None
            if q is None:
                q = cpu_weight(w.raw, w.ggml_type, w.shape)
            weights[name] = HalfWeight(q) if isinstance(q, torch.Tensor) else q
            del w, q


def _int8_head(w: "QuantWeight", table) -> object | None:
    """The tied head of a 5- to 8-bit type as models.cpu_head.Int8Head (int8 ranking, its top rows
    exact from the lookup table's file rows), when fbgemm is there; else None (float16)."""
    from . import cpu_head
    from .quant import dequantize

    if table is None or Int4Weight.bits_of(w.ggml_type) <= 4 or not cpu_head.available():
        return None
    k = w.shape[1]
    return cpu_head.Int8Head(lambda r0, r1: dequantize(w.raw[r0:r1], w.ggml_type, (r1 - r0, k)), table.rows, w.shape)


HOST_TABLES = ("token_embd.weight", "per_layer_token_embd.weight")


def _file_bytes(source, name: str) -> int:
    """Bytes of tensor `name` as stored (GGUF: its quantized blocks), 0 when the source cannot say."""
    tensors = getattr(source, "tensors", None)
    t = tensors.get(name) if isinstance(tensors, dict) else None
    return int(getattr(t, "n_bytes", 0) or 0)


def load_weights(source, plan: dict, dtype: torch.dtype = torch.float32, device="cpu",
                 weight_dtype: torch.dtype | None = None, quantized: bool = False,
                 host_embeddings: bool = False, progress=None, cpu_quant: bool = False) -> dict:
    """Dequantize every tensor of `plan` (name -> expected torch shape) from a GGUFFile or
    HFCheckpoint. Matrices go to `weight_dtype` (float16: HalfWeight) when given, the rest to
    `dtype`; norms and scales are never rounded below float32. `quantized`: matrices of the types
    the Triton kernels read stay in their GGUF bytes (QuantWeight). `host_embeddings`
    (`--embed-weights host`): the embedding lookup tables stay in host memory and only the rows of
    the current tokens go to the device; a tied LM head keeps its device copy ("token_embd.host"
    is then the lookup copy). `progress(done, total, bytes_done, bytes_total)` is called after
    each tensor (bytes as stored in the file: what a loading bar should count). `cpu_quant` (the
    CPU runtime format): matrices of the types Int4Weight reads are repacked for torch's int4 CPU
    matmul, lookup-only tables stay in the file (rows read by pread), a tied 5- to 8-bit head
    becomes models.cpu_head.Int8Head, the rest `weight_dtype`."""
    out = {}
    # Tables only ever gathered from: the PLE table, and the token table when the head is untied.
    lookup_only = frozenset(["per_layer_token_embd.weight"] + (
        ["token_embd.weight"] if "output.weight" in plan else []))
    sizes = [_file_bytes(source, name) for name in plan]
    total, done = sum(sizes), 0

    def one(name, shape, where, lookup=False):
        if cpu_quant:
            q = _gguf_rows(source, name, shape, mapped=lookup)
            if q is not None:
                return q
        if quantized:
            q = _quant_weight(source, name, shape, where, lookup)
            if q is not None:
                return q
        matrix = shape is not None and len(shape) >= 2
        t = source.load(name, shape, dtype=weight_dtype if matrix and weight_dtype else dtype).to(where)
        return HalfWeight(t) if matrix and weight_dtype == torch.float16 else t

    host = host_embeddings and torch.device(device).type != "cpu"
    for i, (name, shape) in enumerate(plan.items()):
        if cpu_quant and name == "token_embd.weight" and name not in lookup_only:
            # the tied head: repacked for the matmul; lookups read the file's rows (pread)
            out[name] = one(name, shape, "cpu")
            out["token_embd.host"] = one(name, shape, "cpu", lookup=True)
            if not isinstance(out[name], QuantWeight):
                del out["token_embd.host"]
        elif host and name == "per_layer_token_embd.weight":
            out[name] = one(name, shape, "cpu", lookup=True)
        elif host and name == "token_embd.weight" and "output.weight" not in plan:
            out[name] = one(name, shape, device)  # the tied LM head
            out["token_embd.host"] = one(name, shape, "cpu", lookup=True)
        else:
            on_host = host and name in HOST_TABLES
            # tables that are only gathered (the PLE table, an untied token table) keep GGUF rows
            lookup = on_host or name == "per_layer_token_embd.weight" or (
                name == "token_embd.weight" and "output.weight" in plan)
            out[name] = one(name, shape, "cpu" if on_host else device, lookup=lookup)
        if progress is not None:
            done += sizes[i]
            progress(i + 1, len(plan), done, total)
    if weight_dtype == torch.float16 or quantized or cpu_quant:
        fuse_projections(out)
    if cpu_quant:
        repack_cpu(out, lookup_only | {"token_embd.host"})
    return out


# Projections that read the same input, fused into one matrix in the runtime format: a decode step
# then makes 4 matmul calls a layer instead of 7 (each call costs ~30 us of overhead on a small CPU,
# as much as the GEMV itself at these sizes; on CUDA each is a kernel launch). Rows are stacked in
# order; the model splits by shape.
FUSIONS = (("attn_qkv.weight", ("attn_q.weight", "attn_k.weight", "attn_v.weight")),
           ("ffn_gate_up.weight", ("ffn_gate.weight", "ffn_up.weight")))


def _fusable(ws: list) -> bool:
    """Matrices one fused matrix can hold: all HalfWeight, or all QuantWeight of one GGML type (the
    quantized GEMV reads one format per launch)."""
    if all(isinstance(w, HalfWeight) for w in ws):
        return True
    return all(isinstance(w, QuantWeight) for w in ws) and len({w.ggml_type for w in ws}) == 1 and \
        len({w.packed is None for w in ws}) == 1


def fuse_projections(weights: dict) -> None:
    """Stack q/k(/v) and gate/up of every layer (FUSIONS) in place. Quantized matrices are stacked
    as far as they share a type: Q4_K_M files keep some attn_v in Q6_K beside Q4_K q and k, so
    those layers get a q+k `attn_qkv` and keep their `attn_v` (ops.qkv_projection reads both)."""
    layers = {name.split(".")[1] for name in weights if name.startswith("blk.")}
    for i in layers:
        b = f"blk.{i}."
        for fused, parts in FUSIONS:
            names = [b + p for p in parts if b + p in weights]
            # q+k(+v) or gate+up; a KV-shared layer's lone q stays as it is.
            if len(names) < 2 or names[:2] != [b + parts[0], b + parts[1]]:
                continue
            while len(names) >= 2 and not _fusable([weights[n] for n in names]):
                names.pop()  # drop the trailing matrix of another type (attn_v)
            if len(names) < 2:
                continue
            ws = [weights.pop(n) for n in names]
            if isinstance(ws[0], HalfWeight):
                weights[b + fused] = HalfWeight(torch.cat([w.w for w in ws]))
            elif ws[0].packed is None:  # GGUF rows, before the CPU repack: stacked as they are
                rows = sum(w.shape[0] for w in ws)
                weights[b + fused] = QuantWeight(torch.cat([w.raw for w in ws]), ws[0].ggml_type,
                                                 (rows, ws[0].shape[1]), lookup=True)
            elif fused == "ffn_gate_up.weight":  # gate/up interleaved: the GEMV's GLU epilogue
                weights[b + fused] = QuantWeight.cat(ws).interleave()
            else:
                weights[b + fused] = QuantWeight.cat(ws)
