"""GGUF reader: metadata and memory-mapped tensor views, with one-line typed errors.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 KV count,
the KV pairs, the tensor infos (name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset),
padding to `general.alignment` (default 32), then the tensor data.

The header walk is our own rather than `gguf.GGUFReader`: the reader trusts the counts it reads
(an array header claiming 2**60 elements makes it loop for ever on empty reads past EOF) and builds
one numpy object per string (seconds for a 262144-token vocab). Here every count and length is
checked against the bytes left before anything is allocated, so a hostile or truncated file fails
in microseconds with a message naming the file. The `gguf` package still supplies the type enums
and block sizes, and the test suite checks our reading against `gguf.GGUFReader` on real files.
"""
from __future__ import annotations

import itertools
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS


def _printable(text: str, limit: int = 160) -> str:
    """Names read from a hostile file may hold newlines or escapes, or run to megabytes: show them
    escaped and cut so an error stays one readable line."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


class GGUFError(ValueError):
    """A problem with a GGUF file. `str(err)` is one line: `<file>: <what> [(tensor <name>)]`."""

    def __init__(self, path: str | Path, what: str, tensor: str | None = None):
        self.path, self.what, self.tensor = str(path), what, tensor
        where = f" (tensor {_printable(tensor)})" if tensor else ""
        super().__init__(f"{_printable(Path(path).name)}: {_printable(what, 400)}{where}")


class NotGGUFError(GGUFError): ...
class TruncatedGGUFError(GGUFError): ...
class MalformedGGUFError(GGUFError): ...
class UnsupportedVersionError(GGUFError): ...
class UnsupportedArchitectureError(GGUFError): ...
class UnsupportedTensorTypeError(GGUFError): ...
class MissingTensorError(GGUFError): ...
class TensorShapeError(GGUFError): ...


class TensorShape:
    """Facts derived from `ne` (ggml order, innermost first) and `ggml_type`."""

    ne: tuple[int, ...]
    ggml_type: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne, dtype=np.int64))

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


@dataclass(frozen=True)
class TensorInfo(TensorShape):
    """One tensor of the file. `ne` is ggml order (innermost first); `shape` is torch order."""

    name: str
    ggml_type: int
    ne: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    n_bytes: int
    _file: "GGUFFile"

    @property
    def data(self) -> np.ndarray:
        """Raw bytes as a read-only uint8 view of the memory map (no copy)."""
        return self._file._mm[self.offset:self.offset + self.n_bytes]

    def mapped(self) -> Optional[np.ndarray]:
        """The raw bytes as a copy-on-write map of the file (writable, never written): no copy and
        no read now; a page comes in from the page cache on first use and counts once, shared with
        every process mapping the file (llama.cpp's default). None where they do not sit at ggml's
        32-byte alignment (a file with a smaller general.alignment: read them instead)."""
        view = self._file.cow_map()[self.offset:self.offset + self.n_bytes]
        return view if view.ctypes.data % 32 == 0 else None

    def read(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The raw bytes copied by a file read, not through the memory map: a weight repacked at load
        (models/cpu_quant.py) then leaves no mapped file pages behind in the process's RSS. `out`:
        a uint8 [n_bytes] buffer to read into (an aligned one: an expert bank ggml reads in place)."""
        out = np.empty(self.n_bytes, dtype=np.uint8) if out is None else out
        with open(self._file.path, "rb") as f:
            f.seek(self.offset)
            if f.readinto(memoryview(out)) != self.n_bytes:
                raise TruncatedGGUFError(self._file.path, "tensor data ends early", self.name)
        return out


_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


class _Cursor:
    """Bounds-checked reads over the memory map; every length is checked before use.

    Reads go through a memoryview with `struct.unpack_from` (about 1 µs a string: a 262144-token
    vocab with 514906 merges parses in well under a second).
    """

    def __init__(self, mm: np.ndarray, path: Path):
        self.mv, self.path, self.pos, self.size = memoryview(mm), path, 0, len(mm)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise TruncatedGGUFError(
                self.path, f"truncated: {what} needs {n} bytes at offset {self.pos}, file has {self.size}")

    def take(self, n: int, what: str) -> memoryview:
        self.need(n, what)
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.mv, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        return str(self.take(n, what), "utf-8", errors="replace")

    def strings(self, count: int, key: str) -> list[str]:
        """`count` consecutive GGUF strings (the hot loop for vocabularies and merges)."""
        mv, size, pos, out = self.mv, self.size, self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{key}[{i}]")
            n = unpack(mv, pos)[0]
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.need(n, f"{key}[{i}]")
            out.append(str(mv[pos:pos + n], "utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], f"value of {key}")
        if vtype == GGUFValueType.STRING:
            return self.string(f"value of {key}")
        if vtype != GGUFValueType.ARRAY:
            raise MalformedGGUFError(self.path, f"unknown value type {vtype} for key {key}")
        itype = self.scalar("<I", f"array type of {key}")
        count = self.scalar("<Q", f"array length of {key}")
        if itype in _SCALARS:
            item = struct.calcsize(_SCALARS[itype])
            raw = self.take(count * item, f"array {key}[{count}]")  # checked before any allocation
            arr = np.frombuffer(raw, dtype=np.dtype(_SCALARS[itype])).copy()
            return arr.astype(bool) if itype == GGUFValueType.BOOL else arr
        if itype == GGUFValueType.STRING:
            self.need(count * 8, f"array {key}[{count}] of strings")  # each string has a u64 length
            return self.strings(count, key)
        if itype == GGUFValueType.ARRAY and depth < 2:
            self.need(count * 12, f"array {key}[{count}] of arrays")
            return [self.value(GGUFValueType.ARRAY, key, depth + 1) for _ in range(count)]
        raise MalformedGGUFError(self.path, f"unknown array element type {itype} for key {key}")


class TensorTable:
    """Metadata and tensor-table access shared by GGUF files and in-memory layouts that look like
    one (models/synthetic.py). Needs `path`, `metadata` (dict) and `tensors` (name -> info)."""

    path: Path
    metadata: dict
    tensors: dict

    # --- metadata access -------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise MalformedGGUFError(self.path, "missing general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def check_architecture(self, supported: tuple[str, ...]) -> str:
        arch = self.architecture
        if arch not in supported:
            raise UnsupportedArchitectureError(
                self.path, f"unsupported architecture '{arch}' (supported: {', '.join(supported)})")
        return arch

    # --- tensors ---------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator["TensorInfo"]:
        return iter(self.tensors.values())

    def tensor(self, name: str) -> "TensorInfo":
        try:
            return self.tensors[name]
        except KeyError:
            raise MissingTensorError(self.path, "missing tensor", name) from None



class GGUFFile(TensorTable):
    """An opened GGUF file: `metadata` (dict), `tensors` (name -> TensorInfo), memory-mapped.

    Metadata values are Python scalars, `str`, numpy arrays (numeric arrays) or `list[str]`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except FileNotFoundError:
            raise GGUFError(self.path, "no such file") from None
        except ValueError:  # numpy refuses to map an empty file
            raise NotGGUFError(self.path, "not a GGUF file (empty)") from None
        except OSError as e:
            raise GGUFError(self.path, f"cannot open: {e.strerror or e}") from None
        self._cow: Optional[np.memmap] = None
        cur = _Cursor(self._mm, self.path)
        if len(self._mm) < 4 or bytes(self._mm[:4]) != GGUF_MAGIC:
            raise NotGGUFError(self.path, "not a GGUF file (bad magic)")
        cur.pos = 4
        self.version = cur.scalar("<I", "version")
        if self.version not in SUPPORTED_VERSIONS:
            if self.version & 0xFFFF == 0:
                raise UnsupportedVersionError(self.path, "big-endian GGUF files are not supported")
            raise UnsupportedVersionError(
                self.path, f"unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.scalar("<Q", "tensor count")
        n_kv = cur.scalar("<Q", "metadata count")
        # Smallest possible entries: KV = 8 (key len) + 4 (type) + 1; tensor info = 8 + 4 + 4 + 8.
        if n_kv * 13 > cur.size - cur.pos:
            raise MalformedGGUFError(self.path, f"metadata count {n_kv} exceeds what the file can hold")
        if n_tensors * 24 > cur.size - cur.pos:
            raise MalformedGGUFError(self.path, f"tensor count {n_tensors} exceeds what the file can hold")

        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            vtype = cur.scalar("<I", f"type of {key}")
            if key in self.metadata:
                raise MalformedGGUFError(self.path, f"duplicate metadata key {key}")
            self.metadata[key] = cur.value(vtype, key)

        align = self.metadata.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise MalformedGGUFError(self.path, f"invalid general.alignment {align!r}")

        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        data_start = -(-cur.pos // align) * align
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        spans = []
        for name, ne, gtype, rel in infos:
            if name in self.tensors:
                raise MalformedGGUFError(self.path, "duplicate tensor", name)
            if rel % align:
                raise MalformedGGUFError(self.path, f"tensor offset {rel} not aligned to {align}", name)
            blck, tsize = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
            if ne[0] % blck:
                raise MalformedGGUFError(
                    self.path, f"row of {ne[0]} values is not a multiple of the {blck}-value block", name)
            n_bytes = int(np.prod(ne, dtype=object)) // blck * tsize
            start = data_start + rel
            if start + n_bytes > len(self._mm):
                raise TruncatedGGUFError(
                    self.path, f"truncated: tensor data ends at {start + n_bytes}, file has {len(self._mm)}", name)
            self.tensors[name] = TensorInfo(name, gtype, ne, start, n_bytes, self)
            spans.append((start, start + n_bytes, name))
        spans.sort()   # one sort, then neighbours only: n_bytes > 0, so any overlap shows between neighbours
        for (_, end0, name0), (start1, _, name1) in itertools.pairwise(spans):
            if start1 < end0:
                raise MalformedGGUFError(self.path, f"tensor data overlaps tensor {name0}", name1)

    def _tensor_info(self, cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string("tensor name")
        n_dims = cur.scalar("<I", f"dims of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise MalformedGGUFError(self.path, f"tensor has {n_dims} dimensions (1..{MAX_DIMS})", name)
        ne = tuple(int(cur.scalar("<Q", f"shape of {name}")) for _ in range(n_dims))
        if any(n <= 0 for n in ne) or int(np.prod(ne, dtype=object)) >= 2**62:
            raise MalformedGGUFError(self.path, f"invalid shape {list(ne)}", name)
        gtype = cur.scalar("<I", f"type of {name}")
        try:
            GGMLQuantizationType(gtype)
        except ValueError:
            raise UnsupportedTensorTypeError(self.path, f"unknown tensor type {gtype}", name) from None
        rel = cur.scalar("<Q", f"offset of {name}")
        return name, ne, gtype, rel

    def cow_map(self) -> np.memmap:
        """The whole file mapped copy-on-write (made on first use): `TensorInfo.mapped`."""
        if self._cow is None:
            self._cow = np.memmap(self.path, dtype=np.uint8, mode="c")
            start = self._cow.ctypes.data
            _COW_RANGES[id(self)] = (start, start + self._cow.nbytes)
            weakref.finalize(self, _COW_RANGES.pop, id(self), None)
        return self._cow

    def raw(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        """The tensor's info after checking its torch-order shape (when given) and type support."""
        from .quant import SUPPORTED_TYPES

        info = self.tensor(name)
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise TensorShapeError(
                self.path, f"shape {list(info.shape)} where {list(shape)} was expected", name)
        if info.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedTensorTypeError(
                self.path, f"unsupported tensor type {info.type_name}", name)
        return info

    def load(self, name: str, shape: tuple[int, ...] | None = None, dtype=None):
        """Dequantize a tensor to a dense torch tensor (float32 unless `dtype`)."""
        import torch

        from .quant import dequantize

        info = self.raw(name, shape)
        return dequantize(info.data, info.ggml_type, info.shape, dtype=dtype or torch.float32)


_COW_RANGES: dict[int, tuple[int, int]] = {}  # id(GGUFFile) -> its cow_map's [start, end) addresses


def in_cow_map(ptr: int, n_bytes: int) -> bool:
    """Whether [ptr, ptr + n_bytes) lies inside a live GGUF copy-on-write map (`GGUFFile.cow_map`)."""
    return any(start <= ptr and ptr + n_bytes <= end for start, end in list(_COW_RANGES.values()))
