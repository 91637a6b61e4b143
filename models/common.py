"""Plain-torch building blocks shared by the Gemma model files: norms, RoPE, attention, KV store.

Everything here is the reference path: exact math in the caller's dtype (float32 on the CPU,
float64 in the exactness tests). CUDA kernels in `kernels/` are checked against these.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

Trace = Optional[Callable[[str, int, torch.Tensor], None]]  # trace(name, layer, tensor); layer -1 = none


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


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_fused_module: list = []  # [kernels.fused or None], filled on first use


def _fused_for(*ts: torch.Tensor | None):
    """kernels.fused when every tensor given is an fp16/bf16/fp32 tensor with a unit last stride
    where the kernels run (CUDA; see kernels.launch.use_kernels for the interpreter and dry runs)
    and triton imports (checked once), else None. On CUDA the fused Triton kernels make one pass
    over memory where the torch path below runs several ops with fp32 temporaries; the CPU path
    (and float64) stays the torch reference."""
    from kernels.launch import use_kernels

    if not all(t is None or (t.dtype in _FUSED_DTYPES and t.stride(-1) == 1) for t in ts) or not use_kernels(*ts):
        return None
    if not _fused_module:
        try:
            from kernels import fused
        except ImportError:
            fused = None
        _fused_module.append(fused if fused is not None and fused.triton is not None else None)
    return _fused_module[0]


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-1/2 [* weight] over the last dim; float32 at least, cast back."""
    fused = _fused_for(x, weight)
    if fused is not None:  # CUDA: one Triton pass (kernels/fused.py), same fp32 math
        return fused.rms_norm(x, weight, eps)
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    w = None if weight is None else weight.to(xf.dtype)
    # F.rms_norm is one op (the composite form is 5, ~30 us each on a small CPU) and equals it
    # exactly in float32 and float64.
    return F.rms_norm(xf, (xf.shape[-1],), w, eps).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """y = x W^T for a dense [out, in] tensor, or a weight object exposing `.linear(x)`
    (quantized weights on the CUDA path)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return w.linear(x)


def qkv_projection(x: torch.Tensor, w: dict, b: str, n_q: int, n_kv: int):
    """q [.., n_q], k [.., n_kv], v [.., n_kv] or None (no attn_v: V = K) for layer prefix `b`,
    from separate attn_q/k/v weights or one fused `attn_qkv` (rows Q, K[, V])."""
    fused = w.get(b + "attn_qkv.weight")
    if fused is not None:
        y = linear(x, fused)
        if y.shape[-1] == n_q + 2 * n_kv:
            return y.split([n_q, n_kv, n_kv], dim=-1)
        q, k = y.split([n_q, n_kv], dim=-1)
        return q, k, None
    v = linear(x, w[b + "attn_v.weight"]) if b + "attn_v.weight" in w else None
    return linear(x, w[b + "attn_q.weight"]), linear(x, w[b + "attn_k.weight"]), v


def gated_mlp(m: torch.Tensor, w: dict, b: str) -> torch.Tensor:
    """down(gelu_tanh(gate m) * up m) for layer prefix `b` (gate/up possibly fused)."""
    fused = w.get(b + "ffn_gate_up.weight")
    if fused is not None:
        gate, up = linear(m, fused).chunk(2, dim=-1)
    else:
        gate, up = linear(m, w[b + "ffn_gate.weight"]), linear(m, w[b + "ffn_up.weight"])
    kern = _fused_for(gate, up)
    # CUDA: gelu_tanh(gate) * up in one Triton pass, reading the gate_up halves in place.
    act = kern.gelu_tanh_mul(gate, up) if kern is not None else gelu_tanh(gate) * up
    return linear(act, w[b + "ffn_down.weight"])


def embedding_rows(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a [V, D] table: a dense tensor or an object with `.rows(ids)` (host tables)."""
    if isinstance(table, torch.Tensor):
        return table.index_select(0, ids.to(table.device))
    return table.rows(ids)


def rows_to_device(rows: torch.Tensor, device: torch.device, dtype) -> torch.Tensor:
    """Gathered embedding rows from host tables (`--embed-weights host`) to the device: through
    pinned memory, so the copy is asynchronous and overlaps the host's next work."""
    if rows.device.type == "cpu" and device.type == "cuda":
        return rows.pin_memory().to(device, non_blocking=True).to(dtype)
    return rows.to(device, dtype)


def rope_inv_freq(n_rot: int, base: float, freq_factors: Optional[Sequence[float]] = None,
                  dtype=torch.float64) -> torch.Tensor:
    """Inverse frequencies for NeoX RoPE over `n_rot` dims: base^(-2j/n_rot) / factor[j], j < n_rot/2.

    A factor >= 1e29 (Gemma 4's proportional RoPE marks non-rotating pairs with 1e30) means no
    rotation: inv_freq 0 exactly, rather than dividing by 1e30.
    """
    j = torch.arange(n_rot // 2, dtype=torch.float64)
    inv = base ** (-2.0 * j / n_rot)
    if freq_factors is not None:
        f = torch.tensor(list(freq_factors)[: n_rot // 2], dtype=torch.float64)
        inv = torch.where(f >= 1e29, torch.zeros_like(inv), inv / f)
    return inv.to(dtype)


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, dtype, pos_scale: float = 1.0):
    """cos, sin [T, 1, n_rot/2] of NeoX RoPE angles pos·inv_freq (float64 angles, cast to dtype)."""
    ang = (pos.to(torch.float64) * pos_scale)[:, None] * inv_freq.to(torch.float64)[None, :]
    return ang.cos().to(dtype)[:, None, :], ang.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (half-split) RoPE. x: [T, n_heads, hd]; cos, sin: [T, 1, n_rot/2].

    Dim j pairs with j + n_rot/2; dims >= n_rot pass through.
    """
    n_half = cos.shape[-1]
    x1, x2, rest = x[..., :n_half], x[..., n_half:2 * n_half], x[..., 2 * n_half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The q/k path: rms_norm over the head dim, then NeoX RoPE. x [T, H, hd]; cos, sin [T, 1, n_rot/2].
    CUDA: one Triton pass (kernels/fused.rms_norm_rope: fp32 math and fp32 angles, one read and one
    write of x instead of ~8 elementwise kernels); elsewhere the reference composition."""
    fused = _fused_for(x, weight)
    if fused is not None and cos.shape[-1] > 0:
        return fused.rms_norm_rope(x, weight, eps, cos.float(), sin.float())
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor, window: Optional[int], scale: float) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention.

    q: [T, n_h, hd]; k, v: [S, n_kv, hd]; q_pos: [T]; k_pos: [S] absolute positions.
    Key j is visible to query i iff k_pos[j] <= q_pos[i] and (no window or q_pos[i] - k_pos[j] < window):
    a window of W keys includes the query's own position (llama.cpp `is_masked_swa`).
    Returns [T, n_h * hd].
    """
    T, n_h, hd = q.shape
    n_kv = k.shape[1]
    diff = q_pos[:, None].to(k_pos.device) - k_pos[None, :]  # [T, S]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    group = n_h // n_kv
    # Fold each KV head's query group into the query axis rather than copying K/V per query head:
    # q [n_kv, group*T, hd] against k, v [n_kv, S, hd]; head h = kv*group + j reads KV head h // group.
    qg = q.reshape(T, n_kv, group, hd).permute(1, 2, 0, 3).reshape(n_kv, group * T, hd)
    o = F.scaled_dot_product_attention(qg, k.permute(1, 0, 2), v.permute(1, 0, 2),
                                       attn_mask=mask.repeat(group, 1), scale=scale)
    return o.reshape(n_kv, group, T, hd).permute(2, 0, 1, 3).reshape(T, n_h * hd)


def attend(cache, layer: int, source: int, q: torch.Tensor, pos: torch.Tensor, window: Optional[int],
           scale: float) -> torch.Tensor:
    """Attention of `layer` over the K/V of `source` (its KV source layer): a cache with its own
    `attend` (the engine's pooled KV, possibly a Triton backend) resolves the slab itself from the
    same `kv_shared_layers` list; a plain cache is read at `source`."""
    if hasattr(cache, "attend"):
        return cache.attend(layer, q, pos, window, scale)
    ks, vs, kpos = cache.read(source)
    return attention(q, ks, vs, pos, kpos, window, scale)


def softcap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    if not cap:
        return x
    fused = _fused_for(x)
    if fused is not None:  # CUDA: one Triton pass over the [T, vocab] logits
        return fused.softcap(x, cap)
    return torch.tanh(x / cap) * cap


class DecoderModel:
    """The whole pass, shared by the model files; each family provides embed / layer / norm / head.

    `embed(tokens)` -> (x [T, d], per-layer inputs [T, L, P] or None); `layer(i, x, pos, pl_i, cache,
    trace)` -> x; `norm(x)` -> post-final-norm y; `head(y)` -> logits.
    """

    cfg: object
    device: torch.device
    inv_freq: list  # [n_layer] inverse-frequency tensors (layers of one type share one object)
    pos_scale: Optional[list] = None  # [n_layer] position multipliers (linear RoPE scaling)
    _rope_memo: tuple = (None, {})

    def rope(self, i: int, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for layer i at `pos`, computed once per forward for each distinct frequency set."""
        if self._rope_memo[0] is not pos:
            self._rope_memo = (pos, {})
        scale = self.pos_scale[i] if self.pos_scale else 1.0
        key = (id(self.inv_freq[i]), scale, dtype)
        memo = self._rope_memo[1]
        if key not in memo:
            memo[key] = rope_cos_sin(pos, self.inv_freq[i], dtype, scale)
        return memo[key]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos: Optional[torch.Tensor] = None,
                cache: Optional["KVStore"] = None, logits_rows: Optional[torch.Tensor] = None,
                trace: Trace = None) -> torch.Tensor:
        """tokens [T] int64 at positions pos [T] (default 0..T-1) -> logits [R, V] for `logits_rows`
        (default: every row). Writes K/V of the owning layers into `cache` (a fresh one if None)."""
        tokens = tokens.to(self.device)
        pos = torch.arange(tokens.shape[0], device=self.device) if pos is None else pos.to(self.device)
        cache = DenseKVCache() if cache is None else cache
        x, pl = self.embed(tokens)
        if trace:
            trace("inp_scaled", -1, x)
        for i in range(self.cfg.n_layer):
            x = self.layer(i, x, pos, None if pl is None else pl[:, i], cache, trace)
        if logits_rows is not None:
            x = x[logits_rows]
        y = self.norm(x)
        if trace:
            trace("result_norm", -1, y)
        return self.head(y)


class KVStore(Protocol):
    """What a model's attention needs from a KV cache (the engine supplies pooled ones)."""

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k [S, n_kv, hd], v [S, n_kv, hd], positions [S]) of one layer."""
        ...


class DenseKVCache:
    """Contiguous per-layer KV for one sequence, grown by doubling; for `score`, `run` and tests.

    Only layers that are written get storage, so KV-shared layers cost nothing here either.
    """

    def __init__(self) -> None:
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._pos: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = self._len.get(layer, 0)
        T = k.shape[0]
        if layer not in self._k or n + T > self._k[layer].shape[0]:
            cap = max(64, 2 ** math.ceil(math.log2(n + T)))
            newk = k.new_empty((cap,) + tuple(k.shape[1:]))
            newv = v.new_empty((cap,) + tuple(v.shape[1:]))
            newp = torch.empty(cap, dtype=torch.long, device=k.device)
            if n:
                newk[:n], newv[:n], newp[:n] = self._k[layer][:n], self._v[layer][:n], self._pos[layer][:n]
            self._k[layer], self._v[layer], self._pos[layer] = newk, newv, newp
        self._k[layer][n:n + T] = k
        self._v[layer][n:n + T] = v
        self._pos[layer][n:n + T] = pos
        self._len[layer] = n + T

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self._len[layer]
        return self._k[layer][:n], self._v[layer][:n], self._pos[layer][:n]

    def truncate(self, n_tokens: int) -> None:
        """Drop every position >= n_tokens (positions are written in order)."""
        for layer in self._len:
            self._len[layer] = min(self._len[layer], n_tokens)

    def __len__(self) -> int:
        return max(self._len.values(), default=0)
