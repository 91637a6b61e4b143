"""Loading a checkpoint's tensors into a model's weight dict, in the form its runtime reads
(models/runtime.py): dense tensors (the reference), models/formats/ objects otherwise.

`load_weights` dequantizes (or keeps) every tensor of a plan: float16 matrices (HalfWeight),
GGUF matrices kept quantized for the Triton kernels (QuantWeight), or on the CPU the GGUF rows
that `repack_cpu` then turns into the CPU runtime's forms (GGMLWeight on llama.cpp's kernels,
else models/cpu_quant.py's torch formats and the int8-ranked head); lookup-only tables stay in
the file's bytes, and so do MoE expert banks [E, out, in] on every runtime (ExpertBank).
`fuse_projections` stacks q/k/v and gate/up. The formats themselves, and why
each is what it is, are in models/formats/. The exact reference path (float32/float64 dense
tensors) stays what the tests compare.
"""
from __future__ import annotations

import numpy as np
import torch

from . import runtime
from .cpu_quant import cpu_weight, repackable
from .formats import ExpertBank, GGMLWeight, HalfWeight, Int4Weight, QuantWeight, Weight
from .formats import ggml as ggml_format


def weight_tensors(w) -> tuple[torch.Tensor, ...]:
    """The tensors that hold a weight's bytes, whatever its runtime form."""
    if isinstance(w, torch.Tensor):
        return (w,)
    return w.tensors if isinstance(w, Weight) else ()


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


def _expert_bank(source, name: str, shape, device) -> ExpertBank | None:
    """A 3-D GGUF tensor (MoE experts [E, out, in]) as the file's bytes (formats/experts.py), on
    every runtime; None for a source without GGUF bytes (an HF checkpoint: dense)."""
    if shape is None or len(shape) != 3 or not hasattr(source, "raw"):
        return None
    info = source.raw(name, shape)
    raw = _mapped(info) if torch.device(device).type == "cpu" else None
    if raw is None:
        raw = torch.empty(info.n_bytes, dtype=torch.uint8)  # torch's allocator: 64-byte aligned, as ggml wants
        if hasattr(info, "read"):  # a file read: no mapped pages stay resident
            info.read(out=raw.numpy())
        else:
            raw.copy_(torch.from_numpy(np.asarray(info.data).reshape(-1).view(np.uint8)))
    return ExpertBank(raw.to(device), info.ggml_type, shape)


def _mapped(info) -> torch.Tensor | None:
    """On the ggml runtime, a tensor that stays in its GGUF bytes is the file's map (gguf.py
    `TensorInfo.mapped`): loading reads nothing, the pages come in on first use and count once
    (page cache), as llama.cpp maps its files; None elsewhere (the bytes are read)."""
    if not runtime.ggml_available() or not hasattr(info, "mapped"):
        return None
    view = info.mapped()
    return None if view is None else torch.from_numpy(view)


def release_mapped(*tensors: torch.Tensor) -> None:
    """Drop the mapped file pages under `tensors` (views of a GGUF's copy-on-write map, `_mapped`,
    never written) from this process once their bytes were copied elsewhere (a fused matrix):
    without it the file's pages count in the RSS beside the copy (31B: its q/k/v and gate/up,
    ~6 GB twice). Whole pages inside each tensor only; a later read faults them in again from the
    file, so nothing is lost. Linux madvise(MADV_DONTNEED); elsewhere, or for other memory, nothing."""
    import ctypes
    import mmap
    import sys

    from .gguf import in_cow_map

    if not sys.platform.startswith("linux"):
        return
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None)  # a failed madvise leaves the pages resident: nothing lost
    for t in tensors:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        if not in_cow_map(start, end - start):
            continue
        lo, hi = -(-start // page) * page, end // page * page
        if hi > lo:
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


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
    if not (repackable(info.ggml_type, shape)
            or (runtime.ggml_available() and ggml_format.takes(info.ggml_type, shape))):
        return None
    if mapped:
        import warnings

        with warnings.catch_warnings():  # a read-only map: the tables are only ever read
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(info.data)
    else:  # to be repacked by the torch formats (a copy), or kept as the file's bytes by ggml (the map)
        data = _mapped(info) if ggml_format.takes(info.ggml_type, shape) else None
        if data is None:
            data = torch.from_numpy(info.read() if hasattr(info, "read") else info.data.copy())
    raw = data.view(shape[0], row_bytes(info.ggml_type, shape[1]))
    w = QuantWeight(raw, info.ggml_type, shape, lookup=True)
    if mapped and hasattr(info, "_file"):  # rows are read with pread; the map only describes the bytes
        from .row_reader import RowReader

        w.reader = RowReader(info._file.path, info.offset, shape[0], raw.shape[1])
    return w


def repack_cpu(weights: dict, tables: frozenset) -> None:
    """Every GGUF-row matrix of `weights` (after `fuse_projections`) but the lookup `tables` takes
    its CPU runtime form, one at a time: with llama.cpp's kernels (the ggml runtime) the GGUF
    bytes themselves, multiplied by ggml (the tied head too: exact logits); without them
    models/cpu_quant.cpu_weight's torch formats and the int8-ranked head (the GGUF copy is dropped
    as each is repacked)."""
    from kernels import ggml
    from kernels.ggml import pages

    to_ggml = set(_ggml_matrices(weights, tables)) if runtime.ggml_available() else set()
    repacked = sum(weights[n].raw.numel() for n in to_ggml  # what the repacked copies would take
                   if ggml.repacks(weights[n].ggml_type, weights[n].shape[0]))
    copies = bool(to_ggml) and ggml_format.keeps_repacked_copies(repacked)
    n_bytes = sum(weights[n].raw.numel() for n in to_ggml)
    arena = pages.Arena() if n_bytes and ggml_format.keeps_huge_pages(n_bytes) else None
    for name in list(weights):
        w = weights[name]
        if name in to_ggml:
            raw = w.raw
            if arena is not None:  # the file's pages (or a fused copy) go once the bytes moved
                raw = arena.copy(raw).view(raw.shape)
                release_mapped(w.raw)
            weights[name] = GGMLWeight(raw, w.ggml_type, w.shape, repacked_copy=copies)
            del w, raw
        elif isinstance(w, QuantWeight) and w.packed is None and name not in tables:
            weights[name] = None
            q = _int8_head(w, weights.get("token_embd.host")) if name == "token_embd.weight" else None
            if q is None:
                q = cpu_weight(w.raw, w.ggml_type, w.shape)
            weights[name] = HalfWeight(q) if isinstance(q, torch.Tensor) else q
            del w, q


def _ggml_matrices(weights: dict, tables: frozenset) -> list[str]:
    """Names of the GGUF-row matrices `repack_cpu` hands to ggml on the ggml runtime."""
    return [n for n, w in weights.items() if isinstance(w, QuantWeight) and w.packed is None and n not in tables
            and ggml_format.takes(w.ggml_type, w.shape)]


def _int8_head(w: "QuantWeight", table) -> object | None:
    """The tied head of a 5- to 8-bit type as models.formats.int8_head.Int8Head (int8 ranking, its
    top rows exact from the lookup table's file rows), when fbgemm is there; else None (float16)."""
    from .formats import int8_head
    from .quant import dequantize

    if table is None or Int4Weight.bits_of(w.ggml_type) <= 4 or not int8_head.available():
        return None
    k = w.shape[1]
    return int8_head.Int8Head(lambda r0, r1: dequantize(w.raw[r0:r1], w.ggml_type, (r1 - r0, k)), table.rows, w.shape)


HOST_TABLES = ("token_embd.weight", "per_layer_token_embd.weight")


def lookup_table(source, name: str, shape, weight_dtype: torch.dtype = torch.float16):
    """A table only gathered from, in host memory as the CPU runtime keeps one (`load_weights` with
    `cpu_quant`): GGUF rows read from the file on demand where its type allows, else `weight_dtype`
    rows (HalfWeight for float16). The layers a model keeps on the CPU beside a GPU embed with it."""
    q = _gguf_rows(source, name, shape, mapped=True)
    if q is not None:
        return q
    t = source.load(name, shape, dtype=weight_dtype)
    return HalfWeight(t) if weight_dtype == torch.float16 else t


def file_bytes(source, name: str) -> int:
    """Bytes of tensor `name` as stored (GGUF: its quantized blocks), 0 when the source cannot say."""
    tensors = getattr(source, "tensors", None)
    t = tensors.get(name) if isinstance(tensors, dict) else None
    return int(getattr(t, "n_bytes", 0) or 0)


def check_host_tensors(host_tensors, plan) -> None:
    """Expert banks kept in host memory beside a GPU (whole layers are the model file's to split
    off first: models/host_layers.py): anything else is refused in one line."""
    other = sorted(n for n in host_tensors if "_exps." not in n or not n.endswith(".weight"))
    if other:
        raise ValueError(f"{other[0]}{f' and {len(other) - 1} more' if len(other) > 1 else ''}: only MoE expert banks "
                         "and whole layers can stay in host RAM beside a GPU (parts of a layer do not run there)")
    missing = sorted(set(host_tensors) - set(plan))
    if missing:
        raise ValueError(f"{missing[0]}: no such expert bank in this model")
    # a layer's experts run on one side: gate/up on the GPU and down on the host would cross the
    # [T, k, I] activations instead of the [T, d] rows
    layers = {n.split(".")[1] for n in host_tensors}
    left = sorted(n for n in plan if "_exps." in n and n.endswith(".weight") and n.split(".")[1] in layers
                  and n not in host_tensors)
    if left:
        raise ValueError(f"{left[0]}: a layer's expert banks stay in host RAM together (the others of "
                         f"blk.{left[0].split('.')[1]} are placed there)")


def progress_parts(progress, source, plans: list) -> list:
    """One `load_weights` progress callback per plan (name -> shape), reporting on one bar over
    all of them (a model loaded in parts: the layers on the CPU beside a GPU, the rest)."""
    if progress is None:
        return [None] * len(plans)
    counts = [len(p) for p in plans]
    sizes = [sum(file_bytes(source, name) for name in p) for p in plans]

    def part(j):
        def report(done, total, bytes_done, bytes_total):
            progress(sum(counts[:j]) + done, sum(counts), sum(sizes[:j]) + bytes_done, sum(sizes))
        return report

    return [part(j) for j in range(len(plans))]


def load_weights(source, plan: dict, dtype: torch.dtype = torch.float32, device="cpu",
                 weight_dtype: torch.dtype | None = None, quantized: bool = False,
                 host_embeddings: bool = False, progress=None, cpu_quant: bool = False,
                 host_tensors: frozenset = frozenset()) -> dict:
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
    becomes models.formats.int8_head.Int8Head, the rest `weight_dtype`. `host_tensors`: expert banks
    kept in host memory beside a GPU (the memory plan's placement, engine/placement.py), the
    mapped file's bytes as on the CPU runtime, computed there (models/host_experts.py)."""
    out = {}
    check_host_tensors(host_tensors, plan)
    # Tables only ever gathered from: the PLE table, and the token table when the head is untied.
    lookup_only = frozenset(["per_layer_token_embd.weight"] + (
        ["token_embd.weight"] if "output.weight" in plan else []))
    sizes = [file_bytes(source, name) for name in plan]
    total, done = sum(sizes), 0

    def one(name, shape, where, lookup=False):
        bank = _expert_bank(source, name, shape, where)
        if bank is not None:
            return bank
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
            out[name] = one(name, shape, "cpu" if on_host or name in host_tensors else device, lookup=lookup)
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
                release_mapped(*(w.raw for w in ws))
            elif fused == "ffn_gate_up.weight":  # gate/up interleaved: the GEMV's GLU epilogue
                weights[b + fused] = QuantWeight.cat(ws).interleave()
            else:
                weights[b + fused] = QuantWeight.cat(ws)
