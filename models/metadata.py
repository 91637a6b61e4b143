"""Typed reads of GGUF metadata: every config constructor reads its keys through `MetadataReader`,
so a hostile or malformed file fails with a one-line `ConfigError` naming the key and the type
found, never inside int()/float()/len().
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np


class ConfigError(ValueError):
    """A model configuration that cannot describe a valid model (one-line message)."""


_MISSING = object()   # no default given: a missing key is an error


def _int_type(t: type) -> bool:
    return issubclass(t, (int, np.integer)) and not issubclass(t, bool)   # bool is an int in Python


def _number_type(t: type) -> bool:
    return _int_type(t) or issubclass(t, (float, np.floating))


def _bool_type(t: type) -> bool:
    return issubclass(t, (bool, np.bool_))


def _str_type(t: type) -> bool:
    return issubclass(t, str)


def _is_array(v: Any, dtype_kinds: str, item_type_ok: Callable[[type], bool]) -> bool:
    """A GGUF array: a 1-D numpy array of one of `dtype_kinds` (numeric arrays, as GGUFFile reads
    them), or a list (strings, nested arrays, hand-built metadata) whose items' types all pass
    `item_type_ok` (each distinct type tested once: 262144 tokens take ~5 ms)."""
    if isinstance(v, np.ndarray):
        return v.ndim == 1 and v.dtype.kind in dtype_kinds
    return isinstance(v, (list, tuple)) and all(map(item_type_ok, set(map(type, v))))


# kind -> (test, what the error says was expected, conversion of an accepted value). Arrays come
# back as stored (numpy array or list): a 262144-token vocabulary is not copied.
_KINDS: dict[str, tuple[Callable[[Any], bool], str, Callable[[Any], Any]]] = {
    "int": (lambda v: _int_type(type(v)), "an integer", int),
    "float": (lambda v: _number_type(type(v)), "a number", float),
    "bool": (lambda v: _bool_type(type(v)), "a bool", bool),
    "str": (lambda v: _str_type(type(v)), "a string", str),
    "ints": (lambda v: _is_array(v, "iu", _int_type), "an array of integers", lambda v: v),
    "floats": (lambda v: _is_array(v, "iuf", _number_type), "an array of numbers", lambda v: v),
    "bools": (lambda v: _is_array(v, "b", _bool_type), "an array of bools", lambda v: v),
    "strs": (lambda v: _is_array(v, "", _str_type), "an array of strings", lambda v: v),
}


def _gguf_type(v: Any) -> str:
    """What a metadata value is, for an error message: `float`, `string`, `array of int32`, ..."""
    if isinstance(v, np.ndarray):
        return f"array of {v.dtype}" if v.ndim == 1 else f"{v.ndim}-d array of {v.dtype}"
    if isinstance(v, (list, tuple)):
        return f"array of {_gguf_type(v[0])}" if v else "empty array"   # a GGUF array holds one type
    return {bool: "bool", str: "string"}.get(type(v), type(v).__name__)


MAX_LAYERS = 1024  # Gemma-4 31B has 60; anything near this is a malformed file


class MetadataReader:
    """Typed reads of GGUF metadata: `key.int("block_count")`, `key.float("rope.freq_base", 1e4)`,
    `key.ints(...)`, `key.read(name, ("int", "ints"))` for a value that may be either.

    Integer kinds take any GGUF integer type but not bool; `float` takes an integer or a float;
    arrays must hold the expected element kind. A value of another type, or a missing key without
    a default, raises `error` (one line naming the key and the type found), so a hostile file
    never reaches int()/float()/len() with the wrong type. A None value counts as missing
    (hand-built metadata dicts use it; GGUF files have no null)."""

    def __init__(self, metadata: Mapping[str, Any], prefix: str = "", where: Optional[str] = None,
                 error: type[Exception] = ConfigError) -> None:
        self.metadata, self.prefix, self.error = metadata, prefix, error
        self._where = f"{where}: " if where else ""

    def read(self, name: str, kinds: Sequence[str], default: Any = _MISSING) -> Any:
        k = self.prefix + name
        v = self.metadata.get(k)
        if v is None:
            if default is _MISSING:
                raise self.error(f"{self._where}missing metadata key {k}")
            return default
        for kind in kinds:
            ok, _, convert = _KINDS[kind]
            if ok(v):
                return convert(v)
        expected = " or ".join(_KINDS[kind][1] for kind in kinds)
        raise self.error(f"{self._where}metadata key {k} must be {expected}, found {_gguf_type(v)}")

    def int(self, name: str, default: Any = _MISSING) -> Any:
        return self.read(name, ("int",), default)

    def layer_count(self, name: str = "block_count") -> int:
        """A layer count: 1..MAX_LAYERS (a hostile huge value would make per-layer loops run for ever)."""
        n = self.int(name)
        if not 0 < n <= MAX_LAYERS:
            raise self.error(f"{self._where}metadata key {self.prefix}{name} = {n}: a model has 1 to "
                             f"{MAX_LAYERS} layers")
        return n

    def float(self, name: str, default: Any = _MISSING) -> Any:
        return self.read(name, ("float",), default)

    def bool(self, name: str, default: Any = _MISSING) -> Any:
        return self.read(name, ("bool",), default)

    def str(self, name: str, default: Any = _MISSING) -> Any:
        return self.read(name, ("str",), default)

    def ints(self, name: str, default: Any = _MISSING) -> Any:
        return self.read(name, ("ints",), default)

    def floats(self, name: str, default: Any = _MISSING) -> Any:
        return self.read(name, ("floats",), default)

    def bools(self, name: str, default: Any = _MISSING) -> Any:
        return self.read(name, ("bools",), default)

    def strs(self, name: str, default: Any = _MISSING) -> Any:
        return self.read(name, ("strs",), default)

    def int_or_ints(self, name: str, default: Any = _MISSING) -> Any:
        """A per-layer value: one integer for every layer, or an array of one per layer."""
        return self.read(name, ("int", "ints"), default)


def metadata_reader(gguf, arch: str) -> MetadataReader:
    """Typed reads of `{arch}.{name}` from the file's metadata; errors are one-line ConfigErrors
    naming the file."""
    return MetadataReader(gguf.metadata, f"{arch}.", gguf.path.name)


def vocab_size_of(gguf, declared: int = 0) -> int:
    """Vocabulary size: the tokenizer's token list, else the embedding rows, else `{arch}.vocab_size`."""
    tokens = MetadataReader(gguf.metadata, where=gguf.path.name).strs("tokenizer.ggml.tokens", None)
    if tokens:
        return len(tokens)
    if "token_embd.weight" in gguf:
        return int(gguf.tensor("token_embd.weight").shape[0])
    if declared:
        return int(declared)
    raise ConfigError(f"{gguf.path.name}: no vocabulary (no tokenizer.ggml.tokens, no token_embd.weight)")
