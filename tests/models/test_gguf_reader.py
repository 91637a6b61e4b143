"""The GGUF reader: same contents as `gguf.GGUFReader` on good files, one-line errors on bad ones."""
from __future__ import annotations

import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from models.gguf import (GGUFError, GGUFFile, MalformedGGUFError, MissingTensorError, NotGGUFError,
                         TensorShapeError, TruncatedGGUFError, UnsupportedArchitectureError,
                         UnsupportedTensorTypeError, UnsupportedVersionError)
from models.loader import open_gguf


@pytest.fixture()
def small_gguf(tmp_path):
    path = tmp_path / "small.gguf"
    w = GGUFWriter(str(path), arch="gemma4")
    w.add_uint32("gemma4.block_count", 3)
    w.add_float32("gemma4.rope.freq_base", 1e6)
    w.add_array("gemma4.attention.sliding_window_pattern", [True, True, False])
    w.add_array("tokenizer.ggml.tokens", ["<pad>", "a", "▁b", "ü"])
    w.add_array("gemma4.feed_forward_length", [7, 8, 9])
    w.add_string("general.name", "small")
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("c.weight", rng.integers(0, 255, size=(2, 34), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_gguf_reader_reads(small_gguf):
    ours, ref = GGUFFile(small_gguf), GGUFReader(small_gguf)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        if isinstance(want, float):
            assert got == pytest.approx(want)
        else:
            assert got == want, key
    assert ours.architecture == "gemma4"
    for t in ref.tensors:
        mine = ours.tensor(t.name)
        assert mine.ggml_type == int(t.tensor_type)
        assert list(mine.ne) == [int(x) for x in t.shape]
        assert mine.offset == t.data_offset and mine.n_bytes == t.n_bytes
        assert bytes(mine.data) == t.data.tobytes()


def test_load_checks_shape_and_presence(small_gguf):
    f = GGUFFile(small_gguf)
    assert tuple(f.load("a.weight", (3, 5)).shape) == (3, 5)
    with pytest.raises(TensorShapeError, match=r"small.gguf: shape \[3, 5\] where \[5, 3\].*a.weight"):
        f.load("a.weight", (5, 3))
    with pytest.raises(MissingTensorError, match="small.gguf: missing tensor .tensor nope."):
        f.load("nope")


def _assert_one_line(err: GGUFError, name: str) -> None:
    msg = str(err)
    assert "\n" not in msg and msg.startswith(name + ":"), msg


@pytest.mark.parametrize("frac", [0.0, 0.01, 0.05, 0.2, 0.4, 0.6, 0.8, 0.95, "last tensor byte"])
def test_truncated_file_gives_one_line_error(small_gguf, tmp_path, frac):
    data = small_gguf.read_bytes()
    if frac == "last tensor byte":  # the writer pads the end: cut inside the data, not the padding
        cut = max(t.offset + t.n_bytes for t in GGUFFile(small_gguf)) - 1
    else:
        cut = int(len(data) * frac)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(GGUFError) as e:
        GGUFFile(bad)
    _assert_one_line(e.value, "cut.gguf")
    if frac != 0.0 and frac != 0.01:
        assert isinstance(e.value, (TruncatedGGUFError, MalformedGGUFError))


def test_random_bytes_are_not_gguf(tmp_path):
    p = tmp_path / "noise.gguf"
    p.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(NotGGUFError, match="noise.gguf: not a GGUF file"):
        GGUFFile(p)


def _header(version=3, n_tensors=0, n_kv=0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


@pytest.mark.parametrize("case", [
    "huge_tensor_count", "huge_kv_count", "huge_string", "huge_array", "huge_string_array",
    "huge_dims", "too_many_dims", "offset_out_of_range", "unknown_value_type", "unknown_tensor_type",
])
def test_absurd_headers_fail_fast_without_allocating(tmp_path, case):
    body = {
        "huge_tensor_count": _header(n_tensors=2**60),
        "huge_kv_count": _header(n_kv=2**62),
        "huge_string": _header(n_kv=1) + struct.pack("<Q", 2**50) + b"abc",
        "huge_array": _header(n_kv=1) + _kv("x", 9, struct.pack("<IQ", 6, 2**61)),
        "huge_string_array": _header(n_kv=1) + _kv("x", 9, struct.pack("<IQ", 8, 2**40)),
        "huge_dims": _header(n_tensors=1) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 2)
                     + struct.pack("<QQ", 2**40, 2**40) + struct.pack("<IQ", 0, 0),
        "too_many_dims": _header(n_tensors=1) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 9000)
                         + b"\0" * 64,
        "offset_out_of_range": _header(n_tensors=1) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 1)
                               + struct.pack("<Q", 8) + struct.pack("<IQ", 0, 2**40) + b"\0" * 64,
        "unknown_value_type": _header(n_kv=1) + _kv("x", 77, b"\0" * 16),
        "unknown_tensor_type": _header(n_tensors=1) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 1)
                               + struct.pack("<Q", 32) + struct.pack("<IQ", 999, 0) + b"\0" * 64,
    }[case]
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(body + b"\0" * 32)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError) as e:
            GGUFFile(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _assert_one_line(e.value, p.name)
    assert peak < 20 * 2**20, f"{peak / 2**20:.1f} MiB allocated"


@pytest.mark.parametrize("version,match", [(1, "unsupported GGUF version 1"), (99, "version 99"),
                                           (3 << 16, "big-endian")])
def test_unsupported_version(tmp_path, version, match):
    p = tmp_path / "v.gguf"
    p.write_bytes(_header(version=version) + b"\0" * 64)
    with pytest.raises(UnsupportedVersionError, match=match):
        GGUFFile(p)


def test_unsupported_architecture_lists_supported(tmp_path):
    p = tmp_path / "llama.gguf"
    w = GGUFWriter(str(p), arch="llama")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedArchitectureError, match=r"unsupported architecture 'llama' \(supported: gemma4"):
        open_gguf(p)


def test_unsupported_tensor_type_names_tensor(tmp_path):
    p = tmp_path / "iq.gguf"
    w = GGUFWriter(str(p), arch="gemma4")
    # IQ2_XXS: 256 values in 66 bytes; we do not dequantize it.
    w.add_tensor("blk.0.attn_q.weight", np.zeros((1, 66), np.uint8), raw_dtype=GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedTensorTypeError, match=r"iq.gguf: unsupported tensor type IQ2_XXS \(tensor blk.0.attn_q.weight\)"):
        GGUFFile(p).load("blk.0.attn_q.weight")


def test_cli_reports_bad_file_in_one_line(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"GGUF" + b"\xff" * 10)
    r = subprocess.run([sys.executable, "-m", "app.cli", "info", str(p)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("edgegem: error: junk.gguf:"), r.stderr
    assert "Traceback" not in r.stderr


def _resident_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_released_mapped_pages_leave_the_rss_and_read_back_the_same(tmp_path):
    """A fused matrix copies its parts out of the file's map; `release_mapped` then drops their
    mapped pages from the RSS (31B's q/k/v and gate/up counted twice without it), and a later read
    faults the same bytes back in from the file. Memory that is not a GGUF map is left alone."""
    import torch

    from models.weights import release_mapped

    path = tmp_path / "big.gguf"
    w = GGUFWriter(str(path), arch="gemma4")
    w.add_tensor("big.weight", np.random.default_rng(1).standard_normal((4096, 1531)).astype(np.float32))  # 25 MB
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    t = torch.from_numpy(f.tensor("big.weight").mapped())
    total = float(t.view(torch.float32).double().sum())  # every page in
    before = _resident_kb()
    release_mapped(t)
    after = _resident_kb()
    assert before - after > 20_000, (before, after)
    assert float(t.view(torch.float32).double().sum()) == total
    other = torch.ones(1 << 20)
    release_mapped(other)  # not a map: untouched
    assert float(other.sum()) == 1 << 20
