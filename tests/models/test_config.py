"""Configs from GGUF metadata reproduce the real E2B/E4B layer plans (spec §1.2), no weights needed."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from models.gemma3 import Gemma3Config
from models.gemma4 import Gemma4Config, kv_sharing_plan
from models.gguf import GGUFFile
from models.metadata import ConfigError, MetadataReader

E2B_KV_SOURCE = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 13, 13, 13, 13, 14, 13, 13, 13, 13, 14,
                 13, 13, 13, 13, 14, 13, 13, 13, 13, 14]
E4B_KV_SOURCE = list(range(24)) + [22, 22, 22, 22, 22, 23, 22, 22, 22, 22, 22, 23, 22, 22, 22, 22, 22, 23]


def write_meta_gguf(path, n_layer, d, period, n_kv, ffn, n_shared):
    """A metadata-only Gemma-4 GGUF with the real E-series keys (§2.2) and the rope_freqs tensor."""
    a = "gemma4"
    w = GGUFWriter(str(path), arch=a)
    w.add_uint32(f"{a}.block_count", n_layer)
    w.add_uint32(f"{a}.context_length", 131072)
    w.add_uint32(f"{a}.embedding_length", d)
    w.add_uint32(f"{a}.vocab_size", 262144)
    if isinstance(ffn, list):
        w.add_array(f"{a}.feed_forward_length", ffn)
    else:
        w.add_uint32(f"{a}.feed_forward_length", ffn)
    w.add_uint32(f"{a}.attention.head_count", 8)
    w.add_uint32(f"{a}.attention.head_count_kv", n_kv)
    for k, v in {"key_length": 512, "value_length": 512, "key_length_swa": 256, "value_length_swa": 256}.items():
        w.add_uint32(f"{a}.attention.{k}", v)
    w.add_uint32(f"{a}.rope.dimension_count", 512)
    w.add_uint32(f"{a}.rope.dimension_count_swa", 256)
    w.add_float32(f"{a}.rope.freq_base", 1e6)
    w.add_float32(f"{a}.rope.freq_base_swa", 1e4)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{a}.attention.sliding_window", 512)
    w.add_array(f"{a}.attention.sliding_window_pattern", [(i + 1) % period != 0 for i in range(n_layer)])
    w.add_uint32(f"{a}.attention.shared_kv_layers", n_shared)
    w.add_uint32(f"{a}.embedding_length_per_layer_input", 256)
    w.add_float32(f"{a}.final_logit_softcapping", 30.0)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * 64 + [1e30] * 192, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return GGUFFile(path)


@pytest.fixture()
def e2b(tmp_path):
    return Gemma4Config.from_gguf(write_meta_gguf(tmp_path / "e2b.gguf", 35, 1536, 5, 1,
                                                  [6144] * 15 + [12288] * 20, 20))


@pytest.fixture()
def e4b(tmp_path):
    return Gemma4Config.from_gguf(write_meta_gguf(tmp_path / "e4b.gguf", 42, 2560, 6, 2, 10240, 18))


def test_e2b_layer_plan(e2b):
    assert [i for i in range(35) if not e2b.is_sliding[i]] == [4, 9, 14, 19, 24, 29, 34]
    assert list(e2b.head_dim) == [256 if (i + 1) % 5 else 512 for i in range(35)]
    assert list(e2b.ffn_width) == [6144] * 15 + [12288] * 20
    assert [e2b.kv_source(i) for i in range(35)] == E2B_KV_SOURCE
    assert sum(e2b.has_kv(i) for i in range(35)) == 15
    assert set(e2b.n_kv_head) == {1} and e2b.ple_width == 256 and e2b.final_softcap == 30.0
    assert e2b.full_rope_freq_factors[:64] == (1.0,) * 64 and min(e2b.full_rope_freq_factors[64:]) >= 1e29


def test_e4b_layer_plan(e4b):
    assert [i for i in range(42) if not e4b.is_sliding[i]] == [5, 11, 17, 23, 29, 35, 41]
    assert set(e4b.ffn_width) == {10240} and set(e4b.n_kv_head) == {2}
    assert [e4b.kv_source(i) for i in range(42)] == E4B_KV_SOURCE
    assert sum(e4b.has_kv(i) for i in range(42)) == 24


def test_general_rule_not_llama_cpp_shortcut():
    # first = 4: layer 3 is sliding and layer 2 full, the reverse of E2B/E4B; llama.cpp's
    # "first-2 / first-1" shortcut would swap the sources, the general rule does not.
    plan = kv_sharing_plan([True, True, False, True, True, False], n_kv_shared=2)
    assert plan == ((4, 3), (5, 2))


def test_shared_group_without_source_is_refused():
    with pytest.raises(ConfigError, match=r"KV-shared layer 3 \(full\) has no earlier non-shared full layer"):
        kv_sharing_plan([True, True, True, False], n_kv_shared=1)
    with pytest.raises(ConfigError, match="-1 KV-shared layers"):
        kv_sharing_plan([True], n_kv_shared=-1)


def test_per_layer_array_length_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="feed_forward_length has 3 entries for 35 layers"):
        Gemma4Config.from_gguf(write_meta_gguf(tmp_path / "bad.gguf", 35, 1536, 5, 1, [1, 2, 3], 20))


def test_metadata_reader_types():
    """Integer keys take GGUF integer types only (not bool, not float); `float` takes either number;
    arrays must hold the expected element kind; a mismatch names the key and the type found."""
    meta = {"a.n": 8, "a.u64": np.uint64(2**64 - 1), "a.flag": True, "a.x": 1e-6, "a.name": "gemma4",
            "a.ffn": np.array([1, 2], np.int32), "a.pattern": np.array([True, False]), "a.none": None,
            "a.scores": np.array([0.5], np.float32), "a.toks": ["x", "y"], "a.nested": [np.array([1])]}
    key = MetadataReader(meta, "a.", "m.gguf")
    assert (key.int("n"), key.int("u64"), key.float("n"), key.float("x"), key.str("name")) == \
        (8, 2**64 - 1, 8.0, 1e-6, "gemma4")
    assert type(key.int("u64")) is int and type(key.float("n")) is float and key.bool("flag") is True
    assert key.int_or_ints("n") == 8 and list(key.int_or_ints("ffn")) == [1, 2]
    assert list(key.bools("pattern")) == [True, False] and key.strs("toks") == ["x", "y"]
    assert list(key.floats("scores")) == [0.5] and list(key.floats("ffn")) == [1, 2]
    assert key.int("missing", 7) == 7 and key.int("none", 7) == 7   # None counts as missing
    for read, name, found in [(key.int, "flag", "bool"), (key.int, "x", "float"), (key.int, "name", "string"),
                              (key.int, "ffn", "array of int32"), (key.float, "flag", "bool"),
                              (key.str, "n", "int"), (key.ints, "n", "int"), (key.ints, "scores", "array of float32"),
                              (key.ints, "toks", "array of string"), (key.bools, "ffn", "array of int32"),
                              (key.strs, "nested", "array of array of int64"), (key.bool, "n", "int"),
                              (key.int_or_ints, "pattern", "array of bool")]:
        with pytest.raises(ConfigError) as e:
            read(name)
        assert str(e.value).startswith(f"m.gguf: metadata key a.{name} must be ") and \
            str(e.value).endswith(f", found {found}"), str(e.value)
    with pytest.raises(ConfigError, match="^m.gguf: missing metadata key a.missing$"):
        key.int("missing")
    with pytest.raises(ValueError, match="must be an integer or an array of integers, found float"):
        MetadataReader(meta, "a.", error=ValueError).int_or_ints("x")


@pytest.mark.parametrize("key, value, found", [
    ("block_count", 35.0, "float"), ("attention.head_count", "8", "string"),
    ("feed_forward_length", np.array([6144.0] * 35, np.float32), "array of float32"),
    ("attention.sliding_window_pattern", np.array([1, 0] * 17 + [1], np.uint8), "array of uint8"),
    ("rope.freq_base", "1e6", "string"), ("final_logit_softcapping", True, "bool"),
    ("tokenizer.ggml.tokens", 262144, "int")])
def test_wrong_typed_metadata_is_a_config_error(tmp_path, key, value, found):
    f = write_meta_gguf(tmp_path / "e2b.gguf", 35, 1536, 5, 1, 6144, 20)
    f.metadata[key if key.startswith("tokenizer.") else f"gemma4.{key}"] = value
    with pytest.raises(ConfigError, match=f"^e2b.gguf: metadata key .*{key} must be .*, found {found}$"):
        Gemma4Config.from_gguf(f)


def test_gemma3_270m_pattern(gemma3_270m_path):
    cfg = Gemma3Config.from_gguf(GGUFFile(gemma3_270m_path))
    assert [i for i in range(cfg.n_layer) if not cfg.is_sliding[i]] == [5, 11, 17]
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.query_scale == pytest.approx(1 / 16)
    assert cfg.vocab_size == 262144 and cfg.sliding_window == 512


@pytest.mark.parametrize("n", [0, -3, 1 << 40])
def test_absurd_layer_counts_are_refused_before_any_per_layer_loop(n):
    from models.metadata import ConfigError, MetadataReader
    key = MetadataReader({"gemma3.block_count": n}, "gemma3.")
    with pytest.raises(ConfigError, match="1 to 1024 layers"):
        key.layer_count()
