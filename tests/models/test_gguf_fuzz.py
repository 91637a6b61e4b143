"""Hostile GGUF files: every malformed header opens cleanly or fails with one typed line, fast.

Small valid files are written with the `gguf` writer, walked once to record where every field
lies (magic, counts, each key/string length, value and array types, array counts, tensor dims,
types and offsets, padding, data), and then mutated field by field with hypothesis (derandomized,
so a run is reproducible). A case passes when `models.loader.open_gguf` (the reader plus the
architecture check) either opens the file (the mutation was harmless; the opened table is then
checked: data aligned, inside the file, no two tensors sharing bytes) or raises a `GGUFError` whose
message is one line naming the file, in under a second; max RSS may grow by less than 200 MB.
Mutations that can never be harmless (bad magic, misaligned or overlapping tensors, lengths past
EOF, ...) must fail. The same is run through the `edgegem info` path (`engine.api.describe`, which
also builds the model config) on a tiny Gemma-4, and a few bad files through `app.cli.main` itself.
Metadata values of the wrong GGUF type still escape the config as TypeError/OverflowError: that
test is a strict xfail until models/metadata.py reads metadata with typed accessors.
"""
from __future__ import annotations

import itertools
import resource
import struct
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.gguf import GGUFError, GGUFFile
from models.loader import open_gguf

U32, U64 = 2**32 - 1, 2**64 - 1
KNOWN_TENSOR_TYPES = frozenset(int(t) for t in GGMLQuantizationType)
_SCALAR_FMT = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
               GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
               GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
               GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
MAX_CASE_S = 2.0  # a hang guard, not a benchmark: one case took 1.09 s on a loaded 2-core CI run
_slowest = [0.0]   # seconds of the slowest case so far (for the summary line)
MAX_GROWTH_MB = 200


def _settings(n: int):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


# --- valid files and the map of their fields ------------------------------------------------------

@dataclass(frozen=True)
class Field:
    kind: str        # "magic", "n_kv", "key_len", "value_type", "array_count", "dim", "tensor_offset", ...
    offset: int
    size: int
    fmt: str | None  # struct format of a numeric field


@dataclass(frozen=True)
class Tensor:
    name: str
    rel: int         # offset relative to the data section
    n_bytes: int
    fields: dict     # "name_len", "n_dims", "dims" (list), "tensor_type", "tensor_offset" -> Field


@dataclass(frozen=True)
class Layout:
    data: bytes
    fields: list[Field]
    tensors: list[Tensor]
    kv_spans: dict   # key -> (offset of its value type, end of its value)
    header_end: int  # end of the last tensor info
    data_start: int
    align: int

    def of(self, *kinds: str) -> list[Field]:
        return [f for f in self.fields if f.kind in kinds]


def walk(data: bytes) -> Layout:
    """Record every field of a valid GGUF (the test's own walk, independent of models/gguf.py)."""
    fields: list[Field] = []
    pos = 0

    def num(kind: str, fmt: str) -> int | float:
        nonlocal pos
        f = Field(kind, pos, struct.calcsize(fmt), fmt)
        fields.append(f)
        pos += f.size
        return struct.unpack_from(fmt, data, f.offset)[0]

    def string(kind: str) -> str:
        nonlocal pos
        n = num(kind + "_len", "<Q")
        fields.append(Field(kind, pos, n, None))
        pos += n
        return data[pos - n:pos].decode()

    def value(vtype: int):
        if vtype in _SCALAR_FMT:
            return num("scalar", _SCALAR_FMT[vtype])
        if vtype == GGUFValueType.STRING:
            return string("str")
        assert vtype == GGUFValueType.ARRAY
        itype, count = num("array_type", "<I"), num("array_count", "<Q")
        return [value(itype) for _ in range(count)]

    assert data[:4] == b"GGUF"
    fields.append(Field("magic", 0, 4, None))
    pos = 4
    num("version", "<I")
    n_tensors, n_kv = num("n_tensors", "<Q"), num("n_kv", "<Q")
    kv_spans, meta = {}, {}
    for _ in range(n_kv):
        key = string("key")
        start = pos
        meta[key] = value(num("value_type", "<I"))
        kv_spans[key] = (start, pos)
    align = meta.get("general.alignment", 32)
    infos = []
    for _ in range(n_tensors):
        first = len(fields)
        name = string("name")
        n_dims = num("n_dims", "<I")
        ne = [num("dim", "<Q") for _ in range(n_dims)]
        gtype, rel = num("tensor_type", "<I"), num("tensor_offset", "<Q")
        fs = fields[first:]
        by = {"name_len": fs[0], "n_dims": fs[2], "dims": fs[3:3 + n_dims], "tensor_type": fs[-2],
              "tensor_offset": fs[-1]}
        blck, tsize = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
        infos.append(Tensor(name, rel, int(np.prod(ne)) // blck * tsize, by))
    header_end = pos
    data_start = -(-pos // align) * align
    fields.append(Field("padding", header_end, data_start - header_end, None))
    fields.append(Field("data", data_start, len(data) - data_start, None))
    return Layout(data, fields, infos, kv_spans, header_end, data_start, align)


def _finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_small_gguf(path: Path) -> Path:
    """Every value type, a nested array, and five tensors of four ggml types (F32, F16, Q8_0, Q4_K)."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch="gemma4")
    w.add_custom_alignment(32)
    w.add_string("general.name", "fuzz")
    w.add_uint8("t.u8", 7); w.add_int8("t.i8", -7); w.add_uint16("t.u16", 700); w.add_int16("t.i16", -700)
    w.add_uint32("t.u32", 70000); w.add_int32("t.i32", -70000); w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -2**40); w.add_float32("t.f32", 1.5); w.add_float64("t.f64", -2.25)
    w.add_bool("t.bool", True)
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.f32s", [0.5, 1.5, 2.5, 3.5])
    w.add_array("t.strs", ["<pad>", "a", "▁b", "ü"])
    w.add_array("t.nest", [[1, 2], [3, 4, 5]])
    w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("c.weight", rng.integers(0, 255, size=(2, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("d.weight", rng.integers(0, 255, size=(1, 144), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q4_K)
    w.add_tensor("e.weight", rng.standard_normal(3).astype(np.float32))
    _finish(w)
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Layout:
    path = write_small_gguf(tmp_path_factory.mktemp("fuzz") / "small.gguf")
    lay = walk(path.read_bytes())
    f = GGUFFile(path)   # the base opens, and our reader agrees with the walk
    assert [(t.name, t.offset, t.n_bytes) for t in f] == \
        [(t.name, lay.data_start + t.rel, t.n_bytes) for t in lay.tensors]
    assert f.data_offset == lay.data_start
    return lay


# --- mutations: (file bytes, must_fail) -------------------------------------------------------------

def put(data: bytes, f: Field, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(f.fmt, b, f.offset, value)
    return bytes(b)


def _left(lay: Layout, f: Field) -> int:
    """Bytes after a length field: a length above this runs past EOF."""
    return len(lay.data) - f.offset - f.size


def wrong_magic(lay, d):
    magic = d.draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != b"GGUF"))
    return magic + lay.data[4:], True


def wrong_version(lay, d):
    v = d.draw(st.one_of(st.sampled_from([0, 1, 4, 3 << 16, 2 << 24, U32]), st.integers(0, U32)))
    return put(lay.data, lay.of("version")[0], v), v not in (2, 3)


def huge_count(kind):
    def mutate(lay, d):
        f = lay.of(kind)[0]
        real = struct.unpack_from("<Q", lay.data, f.offset)[0]
        v = d.draw(st.one_of(st.integers(real + 1, real + 64), st.integers(2**32, U64), st.just(U64)))
        return put(lay.data, f, v), v >= 2**32
    return mutate


def string_past_eof(lay, d):
    f = d.draw(st.sampled_from(lay.of("key_len", "str_len", "name_len")))
    return put(lay.data, f, d.draw(st.integers(_left(lay, f) + 1, U64))), True


def huge_array_count(lay, d):
    f = d.draw(st.sampled_from(lay.of("array_count")))
    return put(lay.data, f, d.draw(st.integers(len(lay.data), U64))), True


def unknown_value_type(lay, d):
    f = d.draw(st.sampled_from(lay.of("value_type", "array_type")))
    return put(lay.data, f, d.draw(st.integers(max(GGUFValueType) + 1, U32))), True


def other_value_type(lay, d):
    """A known but wrong value type: the rest of the header is then read as something else."""
    f = d.draw(st.sampled_from(lay.of("value_type", "array_type")))
    return put(lay.data, f, d.draw(st.sampled_from(sorted(int(t) for t in GGUFValueType)))), False


def unknown_tensor_type(lay, d):
    f = d.draw(st.sampled_from(lay.of("tensor_type")))
    v = d.draw(st.integers(0, U32).filter(lambda t: t not in KNOWN_TENSOR_TYPES))
    return put(lay.data, f, v), True


def other_tensor_type(lay, d):
    f = d.draw(st.sampled_from(lay.of("tensor_type")))
    return put(lay.data, f, d.draw(st.sampled_from(sorted(KNOWN_TENSOR_TYPES)))), False


def bad_n_dims(lay, d):
    f = d.draw(st.sampled_from(lay.of("n_dims")))
    return put(lay.data, f, d.draw(st.one_of(st.just(0), st.integers(5, U32)))), True


def dims_overflow(lay, d):
    """One dim 0 or huge, or every dim large enough that the product passes int64."""
    t = d.draw(st.sampled_from(lay.tensors))
    dims = t.fields["dims"]
    data = lay.data
    if d.draw(st.booleans()):
        return put(data, d.draw(st.sampled_from(dims)),
                   d.draw(st.one_of(st.just(0), st.integers(2**31, U64), st.sampled_from([2**63 - 1, 2**63, U64])))), True
    for f in dims:
        data = put(data, f, d.draw(st.integers(2**16, U64)))
    return data, True


def offset_out_of_range(lay, d):
    t = d.draw(st.sampled_from(lay.tensors))
    a = lay.align
    lo = -(-(len(lay.data) - lay.data_start - t.n_bytes + 1) // a)
    rel = d.draw(st.one_of(st.integers(lo, U64 // a).map(lambda k: k * a), st.integers(len(lay.data), U64)))
    return put(lay.data, t.fields["tensor_offset"], rel), True


def misaligned(lay, d):
    t = d.draw(st.sampled_from(lay.tensors))
    rel = t.rel + d.draw(st.integers(1, lay.align - 1)) if d.draw(st.booleans()) else \
        d.draw(st.integers(0, len(lay.data)).filter(lambda r: r % lay.align))
    return put(lay.data, t.fields["tensor_offset"], rel), True


def overlapping(lay, d):
    """Tensor j moved (aligned) to start anywhere inside tensor i's bytes, or before it and into it."""
    i, j = d.draw(st.permutations(range(len(lay.tensors))).map(lambda p: p[:2]))
    ti, tj = lay.tensors[i], lay.tensors[j]
    a = lay.align
    lo = max(0, -(-(ti.rel - tj.n_bytes + 1) // a))
    hi = (ti.rel + ti.n_bytes - 1) // a
    rel = d.draw(st.integers(lo, hi)) * a
    return put(lay.data, tj.fields["tensor_offset"], rel), True


def data_past_eof(lay, d):
    end = max(lay.data_start + t.rel + t.n_bytes for t in lay.tensors)
    return lay.data[:d.draw(st.integers(lay.data_start, end - 1))], True


def truncated(lay, d):
    """Cut at a random field boundary (±2 bytes) or anywhere."""
    f = d.draw(st.sampled_from(lay.fields))
    cut = d.draw(st.one_of(st.integers(f.offset - 2, f.offset + f.size + 2), st.integers(0, len(lay.data))))
    cut = min(max(cut, 0), len(lay.data))
    end = max(lay.data_start + t.rel + t.n_bytes for t in lay.tensors)
    return lay.data[:cut], cut < end


def bad_alignment(lay, d):
    start, _ = lay.kv_spans["general.alignment"]
    f = next(x for x in lay.fields if x.offset == start + 4)
    return put(lay.data, f, d.draw(st.one_of(st.sampled_from([0, 1, 3, 8, 33, 64, 2**31]), st.integers(0, U32)))), False


def duplicate_name(lay, d):
    """A tensor renamed to another's name (all five names have the same length)."""
    i, j = d.draw(st.permutations(range(len(lay.tensors))).map(lambda p: p[:2]))
    name_i = lay.tensors[i].fields["name_len"]
    name_j = lay.tensors[j].fields["name_len"]
    n = struct.unpack_from("<Q", lay.data, name_i.offset)[0]
    b = bytearray(lay.data)
    b[name_j.offset + 8:name_j.offset + 8 + n] = lay.data[name_i.offset + 8:name_i.offset + 8 + n]
    return bytes(b), True


def bad_utf8(lay, d):
    f = d.draw(st.sampled_from([x for x in lay.of("key", "str", "name") if x.size]))
    b = bytearray(lay.data)
    b[f.offset + d.draw(st.integers(0, f.size - 1))] = d.draw(st.sampled_from([0x80, 0xC0, 0xFF, 0xFE, 0x00]))
    return bytes(b), False


def byte_flips(lay, d):
    """1-8 random bytes xored, mostly inside the header (flips in tensor data are harmless)."""
    b = bytearray(lay.data)
    for _ in range(d.draw(st.integers(1, 8))):
        at = d.draw(st.one_of(st.integers(0, lay.data_start - 1), st.integers(0, len(b) - 1)))
        b[at] ^= d.draw(st.integers(1, 255))
    return bytes(b), False


MUTATIONS = {
    "wrong magic": (wrong_magic, 100), "wrong version": (wrong_version, 100),
    "huge tensor count": (huge_count("n_tensors"), 120), "huge KV count": (huge_count("n_kv"), 120),
    "string past EOF": (string_past_eof, 150), "huge array count": (huge_array_count, 100),
    "unknown value type": (unknown_value_type, 100), "other value type": (other_value_type, 150),
    "unknown tensor type": (unknown_tensor_type, 100), "other tensor type": (other_tensor_type, 100),
    "n_dims out of range": (bad_n_dims, 100), "dims overflow": (dims_overflow, 150),
    "offset out of range": (offset_out_of_range, 100), "misaligned offset": (misaligned, 120),
    "overlapping tensors": (overlapping, 150), "data past EOF": (data_past_eof, 80),
    "truncated": (truncated, 150), "bad alignment": (bad_alignment, 80),
    "duplicate tensor": (duplicate_name, 20), "bad utf-8": (bad_utf8, 60),
    "byte flips": (byte_flips, 300),
}


# --- running a case ---------------------------------------------------------------------------------

def open_case(path: Path, data: bytes) -> str:
    """Write and open one case; returns "opened" or the error class. Anything else propagates."""
    path.unlink(missing_ok=True)   # a fresh inode: earlier memory maps never see the new bytes
    path.write_bytes(data)
    t0 = time.perf_counter()
    try:
        f = open_gguf(path)   # the reader plus the architecture check
    except GGUFError as e:
        outcome = type(e).__name__
        msg = str(e)
        assert "\n" not in msg and msg.startswith(f"{path.name}: "), repr(msg)
    else:
        outcome = "opened"
        spans = sorted((t.offset, t.offset + t.n_bytes) for t in f)
        assert all((s - f.data_offset) % f.get("general.alignment", 32) == 0 and e <= len(data) for s, e in spans)
        assert all(e0 <= s1 for (_, e0), (s1, _) in itertools.pairwise(spans)), spans
        assert all(len(t.data) == t.n_bytes for t in f)
        del f
    dt = time.perf_counter() - t0
    assert dt < MAX_CASE_S, f"{dt:.2f} s"
    _slowest[0] = max(_slowest[0], dt)
    return outcome


def _summary(title: str, counts: Counter, outcomes: Counter) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in counts.items())
    results = ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items()))
    return (f"{title}: {sum(counts.values())} cases ({kinds}), 0 crashes; outcomes: {results}; "
            f"slowest case {_slowest[0] * 1e3:.1f} ms")


def run_mutations(lay: Layout, mutations: dict, open_fn, path: Path) -> tuple[Counter, Counter]:
    """Every mutation kind, `n` derandomized hypothesis cases each; returns counts per kind and outcome."""
    counts, outcomes = Counter(), Counter()
    for kind, (mutate, n) in mutations.items():
        _run_kind(lay, kind, mutate, n, open_fn, path, counts, outcomes)
    return counts, outcomes


def _run_kind(lay, kind, mutate, n, open_fn, path, counts, outcomes) -> None:
    @_settings(n)
    @given(st.data())
    def case(d):
        data, must_fail = mutate(lay, d)
        outcome = open_fn(path, data)
        assert not (must_fail and outcome in ("opened", "described")), f"{kind}: {outcome} a file that must fail"
        counts[kind] += 1
        outcomes[outcome] += 1
    case()


def test_gguf_header_fuzz(small, tmp_path, capsys):
    path = tmp_path / "case.gguf"
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counts, outcomes = run_mutations(small, MUTATIONS, open_case, path)
    # Truncation at every boundary of every field, and one byte either side.
    cuts = sorted({c for f in small.fields for b in (f.offset, f.offset + f.size) for c in (b - 1, b, b + 1)
                   if 0 <= c < len(small.data)})
    end = max(small.data_start + t.rel + t.n_bytes for t in small.tensors)
    for cut in cuts:
        outcome = open_case(path, small.data[:cut])
        assert cut >= end or outcome != "opened", f"opened a file cut at {cut}"
        counts["cut at every boundary"] += 1
        outcomes[outcome] += 1
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    with capsys.disabled():
        print("\n" + _summary("gguf fuzz", counts, outcomes) + f"; max RSS grew {growth_mb:.0f} MB")
    assert sum(counts.values()) >= 2000
    assert outcomes["NotGGUFError"] >= 100 and outcomes["UnsupportedVersionError"] >= 90
    assert growth_mb < MAX_GROWTH_MB


# --- the `edgegem info` path: GGUF reader, architecture check, model config -----------------------

def _enc_str(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(b)) + b


_INTS = {GGUFValueType.UINT8: (0, 255), GGUFValueType.INT8: (-128, 127), GGUFValueType.UINT16: (0, 2**16 - 1),
         GGUFValueType.INT16: (-2**15, 2**15 - 1), GGUFValueType.UINT32: (0, U32),
         GGUFValueType.INT32: (-2**31, 2**31 - 1), GGUFValueType.UINT64: (0, U64),
         GGUFValueType.INT64: (-2**63, 2**63 - 1)}


@st.composite
def typed_values(draw, depth: int = 0) -> tuple[int, bytes]:
    """(value type, encoded value) of any GGUF type, with edge values (0, -1, huge, nan, inf, "")."""
    vtype = draw(st.sampled_from(sorted(int(t) for t in GGUFValueType) if depth < 2 else
                                 sorted(int(t) for t in GGUFValueType if t != GGUFValueType.ARRAY)))
    if vtype in _INTS:
        lo, hi = _INTS[vtype]
        v = draw(st.one_of(st.sampled_from([0, 1, 2, lo, hi]), st.integers(lo, hi), st.integers(0, 64)))
        return vtype, struct.pack(_SCALAR_FMT[vtype], v)
    if vtype == GGUFValueType.FLOAT32:
        return vtype, struct.pack("<f", draw(st.floats(width=32)))
    if vtype == GGUFValueType.FLOAT64:
        return vtype, struct.pack("<d", draw(st.floats()))
    if vtype == GGUFValueType.BOOL:
        return vtype, struct.pack("<?", draw(st.booleans()))
    if vtype == GGUFValueType.STRING:
        return vtype, _enc_str(draw(st.one_of(st.text(max_size=12), st.sampled_from(["", "gemma4", "gemma3", "8"]))))
    items = draw(st.lists(typed_values(depth + 1), max_size=10))
    itype = items[0][0] if items else draw(st.sampled_from(sorted(_SCALAR_FMT)))
    items = [p for t, p in items if t == itype]   # an inner array's payload carries its own header
    return vtype, struct.pack("<IQ", itype, len(items)) + b"".join(items)


def splice_value(lay: Layout, key: str, vtype: int, payload: bytes | None) -> bytes:
    """The file with `key`'s value replaced (or the KV dropped when `payload` is None), re-padded so
    the tensor data keeps its place relative to the data section."""
    start, end = lay.kv_spans[key]
    data = lay.data
    if payload is None:
        key_start = start - 8 - len(key.encode())
        n_kv = struct.unpack_from("<Q", data, 16)[0]
        header = put(data[:key_start], lay.of("n_kv")[0], n_kv - 1) + data[end:lay.header_end]
    else:
        header = data[:start] + struct.pack("<I", vtype) + payload + data[end:lay.header_end]
    pad = -len(header) % lay.align
    return header + b"\0" * pad + data[lay.data_start:]


def tiny_gemma4(path: Path) -> Path:
    import sys
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from tiny_models import TinySpec, write_tiny_gemma4
    spec = TinySpec(n_layer=4, pattern=[True, False, True, False], d_model=16, n_vocab=300, hd_sliding=8,
                    hd_full=16, sliding_window=4, ffn=32, n_kv_shared=2, ple_width=4)
    return write_tiny_gemma4(path, spec)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Layout:
    return walk(tiny_gemma4(tmp_path_factory.mktemp("fuzz") / "tiny.gguf").read_bytes())


def retyped_value(lay, d):
    key = d.draw(st.sampled_from(sorted(lay.kv_spans)))
    return splice_value(lay, key, *d.draw(typed_values())), False


def dropped_key(lay, d):
    return splice_value(lay, d.draw(st.sampled_from(sorted(lay.kv_spans))), 0, None), False


def scalar_value(lay, d):
    """A numeric config value set to an edge: 0, 1, negative, huge, nan."""
    f = d.draw(st.sampled_from(lay.of("scalar")[:40]))   # the model keys; not the tokenizer arrays
    if f.fmt in ("<f", "<d"):
        v = d.draw(st.floats(width=32 if f.fmt == "<f" else 64))
    elif f.fmt == "<?":
        v = d.draw(st.booleans())
    else:
        lo, hi = (0, 2**(8 * f.size) - 1) if f.fmt.isupper() or f.fmt == "<B" else \
            (-2**(8 * f.size - 1), 2**(8 * f.size - 1) - 1)
        v = d.draw(st.one_of(st.sampled_from([lo, hi, 0, 1, 2, 3]), st.integers(lo, hi)))
    return put(lay.data, f, v), False


def tensor_dims(lay, d):
    """A tensor's dims set to other small values (the config reads token_embd's rows, rope_freqs)."""
    t = d.draw(st.sampled_from(lay.tensors))
    data = lay.data
    for f in t.fields["dims"]:
        data = put(data, f, d.draw(st.integers(1, 600)))
    return data, False


LOADER_MUTATIONS = {
    "dropped key": (dropped_key, 40), "edge scalar": (scalar_value, 200), "tensor dims": (tensor_dims, 80),
    "other tensor type": (other_tensor_type, 40), "byte flips": (byte_flips, 200),
    "truncated": (truncated, 60), "overlapping tensors": (overlapping, 30), "misaligned offset": (misaligned, 30),
}


def describe_case(path: Path, data: bytes) -> str:
    """Open `data` the way `edgegem info FILE` does; "described" or the one-line typed error."""
    from engine import api
    from models.metadata import ConfigError

    path.unlink(missing_ok=True)
    path.write_bytes(data)
    t0 = time.perf_counter()
    try:
        api.describe(api.open_layout(str(path)))
        outcome = "described"
    except (GGUFError, ConfigError) as e:
        outcome = type(e).__name__
        assert "\n" not in str(e), repr(str(e))
    dt = time.perf_counter() - t0
    assert dt < MAX_CASE_S, f"{dt:.2f} s"
    _slowest[0] = max(_slowest[0], dt)
    return outcome


def test_info_path_fuzz(tiny, tmp_path, capsys):
    path = tmp_path / "case.gguf"
    assert describe_case(path, tiny.data) == "described"
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counts, outcomes = run_mutations(tiny, LOADER_MUTATIONS, describe_case, path)
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    with capsys.disabled():
        print("\n" + _summary("gguf info-path fuzz", counts, outcomes) + f"; max RSS grew {growth_mb:.0f} MB")
    assert sum(counts.values()) >= 600
    assert growth_mb < MAX_GROWTH_MB


def test_info_path_wrong_typed_metadata(tiny, tmp_path, capsys):
    """Each metadata value of the tiny Gemma-4 replaced by a value of another type (or an edge value)."""
    path = tmp_path / "case.gguf"
    untyped: Counter = Counter()
    n = 0

    @_settings(250)
    @given(st.sampled_from(sorted(tiny.kv_spans)), typed_values())
    def case(key, value):
        nonlocal n
        n += 1
        try:
            describe_case(path, splice_value(tiny, key, *value))
        except (TypeError, OverflowError, ValueError) as e:   # not GGUFError/ConfigError: untyped
            untyped[f"{key}: {type(e).__name__}"] += 1
    case()
    with capsys.disabled():
        print(f"\ngguf wrong-typed metadata: {n} cases, {sum(untyped.values())} untyped errors: "
              + ", ".join(f"{k} x{c}" for k, c in sorted(untyped.items())))
    assert not untyped, f"{len(untyped)} key/exception pairs escape untyped: {sorted(untyped)}"


def _escape_key_with_bad_type(lay: Layout, key_len: Field) -> bytes:
    """A key starting with a newline and a terminal escape, whose value type is unknown: the error
    names the key, so the message must escape it."""
    at = key_len.offset + 8
    data = lay.data[:at] + b"\n\x1b[J" + lay.data[at + 4:]
    return put(data, lay.fields[lay.fields.index(key_len) + 2], 99)


@pytest.mark.parametrize("kind", ["wrong magic", "truncated header", "huge KV count", "string past EOF",
                                  "misaligned offset", "overlapping tensors", "control chars in key",
                                  "missing config key"])
def test_cli_info_bad_file_one_line(tiny, tmp_path, capsys, kind):
    """`edgegem info FILE` on a hostile file: exit code 2, one line on stderr naming the file."""
    from app import cli

    first, second = tiny.tensors[0], tiny.tensors[1]
    key_len = tiny.of("key_len")[3]
    data = {
        "wrong magic": b"GGUG" + tiny.data[4:],
        "truncated header": tiny.data[:tiny.header_end // 2],
        "huge KV count": put(tiny.data, tiny.of("n_kv")[0], U64),
        "string past EOF": put(tiny.data, key_len, 2**40),
        "misaligned offset": put(tiny.data, second.fields["tensor_offset"], second.rel + 4),
        "overlapping tensors": put(tiny.data, second.fields["tensor_offset"], first.rel),
        "control chars in key": _escape_key_with_bad_type(tiny, key_len),
        "missing config key": splice_value(tiny, "gemma4.block_count", 0, None),
    }[kind]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    assert cli.main(["info", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("edgegem: error: "), err
    assert "bad.gguf" in err and "\x1b" not in err and "Traceback" not in err, err
