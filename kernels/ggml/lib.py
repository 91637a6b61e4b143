"""llama.cpp's own CPU matrix products: ggml's `mul_mat` called through ctypes on the shared
libraries that llama-cpp-python ships (`llama_cpp/lib/libggml-{base,cpu}.so`).

Why: CPU decode reads every weight once per token, and llama.cpp's kernels multiply GGUF blocks
directly with 8-bit-quantized activations (Q8_K / Q8_0, `vpmaddubsw` / VNNI dot products), where
torch's int4 kernel unpacks nibbles to float (7 G weights/s a core on AVX2 against ggml's ~10+).
The products here are the very kernels llama.cpp decodes and prefills with: the same weight
placement (GGUF bytes, or the CPU backend's repacked `CPU_REPACK` layout for the types it repacks
on this CPU, as llama.cpp loads them) and the same activation quantization, so for the same rows
they give llama.cpp's bits.

How (no C compiler, no struct layout written into this file):
  * a matrix is a ggml tensor [k, n] (ne0 = k) whose data is either our own GGUF bytes (zero copy:
    `ggml_backend_cpu_buffer_from_ptr` + `ggml_backend_tensor_alloc`) or ggml's repacked copy
    (`CPU_REPACK` extra buffer type, found through `ggml_backend_reg_get_proc_address`, filled by
    `ggml_backend_tensor_set`, which repacks);
  * a product is a graph of one `ggml_mul_mat` (weight x f32 activations [rows, k] -> f32
    [rows, n]) kept per (matrix, rows) and computed by one CPU backend with the engine's thread
    count (ggml's OpenMP build shares torch's libgomp when torch is loaded first: one pool);
  * activations and outputs are torch tensors: each call points the graph's input and output
    tensors at them. The one struct field touched, `ggml_tensor.data`, is found at load by
    probing (allocate a tensor at a known address, find the word that holds it, check it through
    `ggml_get_data`), never assumed.
The only by-value struct is `ggml_init_params` (3 fields). The binding is smoke-tested when it is
first loaded (a product against the dequantized reference); any failure leaves `available()`
False with a one-line `reason()` (`edgegem doctor` prints it) and the torch formats run instead.

Which types ggml repacks, and for which row counts, is internal to ggml: `REPACK` is the table
for the pinned version (read off `ggml_repack_get_optimal_repack_type` in ggml-cpu/repack.cpp of
llama-cpp-python 0.3.36), tested against what the library does. Q6_K, Q5_K and Q8_0 have no x86
repack (putting one in the repack buffer crashes ggml), so they stay GGUF bytes.

`mul_mat_ref` is the reference: the GGUF blocks dequantized by gguf-py (bit-exact with ggml's own
dequantization) times x in float64; ggml's result differs from it by its activation
quantization only (8-bit blocks of 32 or 256 values: ~1% relative per product, measured in the
tests).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..env import env

PINNED = "0.3.36"  # the llama-cpp-python release whose ggml this binding is written against
F32 = 0  # GGML_TYPE_F32
# ggml type ids (ggml.h `enum ggml_type`) -> name, for the types a GGUF matrix can hold and mul_mat reads
TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
         12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16"}
# The repack table of the pinned ggml on x86 (repack.cpp): type -> (CPU feature, row multiple).
REPACK = {"Q4_0": ("avx2", 8), "Q4_K": ("avx2", 8), "IQ4_NL": ("avx2", 8), "Q2_K": ("avx512", 8)}
_GRAPH_NODES = 8  # a graph of one mul_mat (ggml_new_graph_custom size)

_P = ctypes.c_void_p


class InitParams(ctypes.Structure):
    """struct ggml_init_params, the one struct passed by value (graphs build their contexts with it)."""
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _P), ("no_alloc", ctypes.c_bool)]


class GGMLError(RuntimeError):
    """The ggml binding cannot be used here (one line: why)."""


def _lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")  # not imported: that would load libllama too
    if spec is None or not spec.submodule_search_locations:
        raise GGMLError("llama-cpp-python is not installed (pip install 'edgegem[cpu]')")
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


class _Lib:
    """The loaded libraries, their function signatures, one CPU backend and the probed offsets."""

    def __init__(self):
        version = importlib.metadata.version("llama-cpp-python")
        if version != PINNED:
            raise GGMLError(f"llama-cpp-python {version} is installed; edgegem's ggml binding is pinned to "
                            f"{PINNED} (pip install 'edgegem[cpu]')")
        d = _lib_dir()
        torch.get_num_threads()  # torch (and its libgomp) first: ggml's OpenMP then uses the same runtime
        try:
            self.base = ctypes.CDLL(str(d / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(str(d / "libggml.so"), mode=ctypes.RTLD_GLOBAL)
            self.cpu = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise GGMLError(f"cannot load ggml from {d}: {e}") from None
        b, c, P, sz, i64 = self.base, self.cpu, _P, ctypes.c_size_t, ctypes.c_int64
        self.init = self.declare(b, "ggml_init", P, InitParams)
        self.free = self.declare(b, "ggml_free", None, P)
        self.tensor_overhead = self.declare(b, "ggml_tensor_overhead", sz)
        self.graph_overhead_custom = self.declare(b, "ggml_graph_overhead_custom", sz, sz, ctypes.c_bool)
        self.new_tensor_2d = self.declare(b, "ggml_new_tensor_2d", P, P, ctypes.c_int, i64, i64)
        self.new_tensor_3d = self.declare(b, "ggml_new_tensor_3d", P, P, ctypes.c_int, i64, i64, i64)  # banks
        self.mul_mat = self.declare(b, "ggml_mul_mat", P, P, P, P)
        self.new_graph_custom = self.declare(b, "ggml_new_graph_custom", P, P, sz, ctypes.c_bool)
        self.build_forward_expand = self.declare(b, "ggml_build_forward_expand", None, P, P)
        self.get_data = self.declare(b, "ggml_get_data", P, P)
        self.get_name = self.declare(b, "ggml_get_name", ctypes.c_char_p, P)
        self.op_desc = self.declare(b, "ggml_op_desc", ctypes.c_char_p, P)
        self.nbytes = self.declare(b, "ggml_nbytes", sz, P)
        self.row_size = self.declare(b, "ggml_row_size", sz, ctypes.c_int, i64)
        self.buffer_from_ptr = self.declare(b, "ggml_backend_cpu_buffer_from_ptr", P, P, sz)
        self.buffer_free = self.declare(b, "ggml_backend_buffer_free", None, P)
        self.tensor_alloc = self.declare(b, "ggml_backend_tensor_alloc", ctypes.c_int, P, P, P)
        self.tensor_set = self.declare(b, "ggml_backend_tensor_set", None, P, P, sz, sz)
        self.alloc_ctx_tensors = self.declare(b, "ggml_backend_alloc_ctx_tensors_from_buft", P, P, P)
        self.buft_name = self.declare(b, "ggml_backend_buft_name", ctypes.c_char_p, P)
        self.graph_compute = self.declare(b, "ggml_backend_graph_compute", ctypes.c_int, P, P)
        self.reg_dev_get = self.declare(b, "ggml_backend_reg_dev_get", P, P, sz)
        self.reg_get_proc_address = self.declare(b, "ggml_backend_reg_get_proc_address", P, P, ctypes.c_char_p)
        self.cpu_init = self.declare(c, "ggml_backend_cpu_init", P)
        self.cpu_reg = self.declare(c, "ggml_backend_cpu_reg", P)
        self.set_n_threads = self.declare(c, "ggml_backend_cpu_set_n_threads", None, P, ctypes.c_int)
        # ggml logs every repacked tensor to stderr: warnings and errors go to Python's logging instead
        self._log = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, _P)(_log_message)
        self.declare(b, "ggml_log_set", None, _P, _P)(ctypes.cast(self._log, _P), None)
        self.features = {name: bool(self.declare(c, f"ggml_cpu_has_{name}", ctypes.c_int)())
                         for name in ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx_vnni", "f16c", "fma")}
        self.backend = self.cpu_init()
        if not self.backend:
            raise GGMLError("ggml_backend_cpu_init returned NULL")
        self.threads = 0
        self.set_threads(torch.get_num_threads())
        self.lock = threading.Lock()  # one backend, one work buffer: products run one at a time
        self.repack_buft = self._repack_buffer_type()
        self.data_offset = self._probe_data_offset()

    @staticmethod
    def declare(lib, name: str, res, *args):
        """`name` of the CDLL `lib` with its result and argument types (GGMLError when this build lacks it)."""
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise GGMLError(f"ggml has no {name} (a llama-cpp-python other than {PINNED}?)") from None
        fn.restype, fn.argtypes = res, list(args)
        return fn

    def set_threads(self, n: int) -> None:
        n = max(1, int(n))
        if n != self.threads:
            self.set_n_threads(self.backend, n)
            self.threads = n

    def _repack_buffer_type(self):
        """The CPU backend's CPU_REPACK buffer type (None when this build has none)."""
        reg = self.cpu_reg()
        dev = self.reg_dev_get(reg, 0)
        addr = self.reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not addr:
            return None
        bufts = ctypes.CFUNCTYPE(ctypes.POINTER(_P), _P)(addr)(dev)
        i = 0
        while bufts and bufts[i]:
            if self.buft_name(bufts[i]) == b"CPU_REPACK":
                return bufts[i]
            i += 1
        return None

    def context(self, n_tensors: int, graph: bool = False) -> int:
        """A metadata-only ggml context (no_alloc) for `n_tensors` tensors and maybe one small graph."""
        size = n_tensors * self.tensor_overhead() + (self.graph_overhead_custom(_GRAPH_NODES, False) if graph else 0)
        ctx = self.init(InitParams(size + 256, None, True))
        if not ctx:
            raise GGMLError("ggml_init failed")
        return ctx

    def _probe_data_offset(self) -> int:
        """Byte offset of `data` in struct ggml_tensor: the word that holds a known address after
        ggml_backend_tensor_alloc, confirmed by writing another address there and reading it back
        through ggml_get_data."""
        ctx = self.context(1)
        try:
            buf = torch.zeros(64, dtype=torch.float32)
            t = self.new_tensor_2d(ctx, F32, 16, 2)
            backing = self.buffer_from_ptr(buf.data_ptr(), buf.numel() * 4)
            addr = buf.data_ptr() + 64  # 64-byte aligned inside the buffer, distinct from its base
            if self.tensor_alloc(backing, t, addr) != 0:
                raise GGMLError("ggml_backend_tensor_alloc failed in the probe")
            words = (ctypes.c_uint64 * 64).from_address(t)
            hits = [i for i in range(64) if words[i] == addr]
            if len(hits) != 1:
                raise GGMLError("cannot find ggml_tensor.data (an unknown ggml build)")
            offset = hits[0] * 8
            ctypes.c_void_p.from_address(t + offset).value = addr + 64
            if self.get_data(t) != addr + 64:
                raise GGMLError("ggml_tensor.data probe did not read back")
            self.buffer_free(backing)
            return offset
        finally:
            self.free(ctx)

    @functools.cached_property
    def src_offset(self) -> int:
        """Byte offset of `src[0]` in struct ggml_tensor (src[1] follows), probed on a mul_mat node:
        only the capture tool (reading llama.cpp's own graph nodes) needs it."""
        ctx = self.context(3)
        try:
            w = self.new_tensor_2d(ctx, F32, 32, 4)
            x = self.new_tensor_2d(ctx, F32, 32, 2)
            y = self.mul_mat(ctx, w, x)
            words = (ctypes.c_uint64 * 64).from_address(y)
            hits = [i for i in range(63) if words[i] == w and words[i + 1] == x]
            if len(hits) != 1:
                raise GGMLError("cannot find ggml_tensor.src (an unknown ggml build)")
            return hits[0] * 8
        finally:
            self.free(ctx)

    def point(self, tensor: int, ptr: int) -> None:
        """tensor->data = ptr (the probed field)."""
        ctypes.c_void_p.from_address(tensor + self.data_offset).value = ptr


_state: dict = {}


def _log_message(level: int, text: bytes, user_data) -> None:
    """ggml's log callback: GGML_LOG_LEVEL_WARN (3) and ERROR (4) to the `edgegem.ggml` logger."""
    if level in (3, 4) and text:
        import logging

        logging.getLogger("edgegem.ggml").log(30 if level == 3 else 40, text.decode(errors="replace").rstrip())


def library() -> _Lib:
    """The libraries, loaded and smoke-tested on the first call; GGMLError (why, one line) when they
    cannot be used."""
    if "lib" not in _state:
        try:
            if env().cpu_kernels == "torch":
                raise GGMLError("EDGEGEM_CPU_KERNELS=torch: the torch formats are forced")
            lib = _Lib()
            _state["lib"] = lib
            _smoke_test()
        except Exception as e:  # noqa: BLE001 - any failure (import, symbol, probe, smoke test): the torch path runs
            _state["lib"] = None
            _state["reason"] = str(e).splitlines()[0] if str(e) else type(e).__name__
    if _state["lib"] is None:
        raise GGMLError(_state["reason"])
    return _state["lib"]


def available() -> bool:
    """ggml's CPU products can be used here (loaded and smoke-tested once)."""
    try:
        library()
        return True
    except GGMLError:
        return False


def reason() -> str:
    """Why `available()` is False ('' when it is True)."""
    return "" if available() else _state.get("reason", "")


def cpu_features() -> dict:
    """What ggml's CPU backend detected (avx2, avx512, avx512_vnni, ...)."""
    return dict(library().features)


def set_threads(n: int) -> None:
    """Threads for every later product (the engine's thread count)."""
    library().set_threads(n)


def threads() -> int:
    return library().threads


def repacks(ggml_type: int, rows: int) -> bool:
    """Whether the pinned ggml keeps this type in its repacked layout on this CPU (`REPACK`)."""
    lib = library()
    rule = REPACK.get(TYPES.get(int(ggml_type), ""))
    return lib.repack_buft is not None and rule is not None and lib.features[rule[0]] and rows % rule[1] == 0


def node_info(tensor: int) -> tuple[str, str, int, int]:
    """(op, name, src[0], src[1]) of a ggml graph node (tests read llama.cpp's nodes with it)."""
    lib = library()
    src = (ctypes.c_uint64 * 2).from_address(tensor + lib.src_offset)
    return lib.op_desc(tensor).decode(), lib.get_name(tensor).decode(), int(src[0]), int(src[1])


def tensor_bytes(tensor: int) -> bytes:
    """A host tensor's data as bytes (ggml_get_data + ggml_nbytes)."""
    lib = library()
    return ctypes.string_at(lib.get_data(tensor), lib.nbytes(tensor))


def supported(ggml_type: int) -> bool:
    return int(ggml_type) in TYPES


class Matrix:
    """A [n, k] GGUF matrix (`raw`: uint8 [n, row bytes], the file's blocks) multiplied by ggml.

    `repack`: None = as llama.cpp places it on this CPU (`repacks`); False keeps the GGUF bytes
    (zero copy: `raw` must stay alive, and does: the matrix holds it); True forces the repacked
    layout where the type has one. Repacked, the bytes live in ggml's buffer and `raw` is dropped
    (the same size). `mul(x)` -> x W^T for float32 x [rows, k]; `node` is its ggml tensor (a graph's
    operand: `Graph.matrix`)."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int], repack: Optional[bool] = None):
        lib = library()
        self.ggml_type, self.shape = int(ggml_type), (int(shape[0]), int(shape[1]))
        n, k = self.shape
        if self.ggml_type not in TYPES:
            raise GGMLError(f"ggml type {ggml_type} is not a matrix type this binding multiplies")
        raw = raw.contiguous().view(torch.uint8).reshape(-1)
        if raw.data_ptr() % 32:  # ggml's TENSOR_ALIGNMENT; numpy buffers may be 16-aligned
            raw = raw.clone()  # torch's allocator aligns to 64
        if raw.numel() != lib.row_size(self.ggml_type, k) * n:
            raise ValueError(f"{TYPES[self.ggml_type]} [{n}, {k}]: {raw.numel()} bytes, expected "
                             f"{lib.row_size(self.ggml_type, k) * n}")
        self.repacked = repacks(self.ggml_type, n) if repack is None else bool(repack) and repacks(self.ggml_type, n)
        self._lib, self._graphs, self.raw = lib, {}, None
        self._ctx = lib.context(1)
        self.node = lib.new_tensor_2d(self._ctx, self.ggml_type, k, n)
        if self.repacked:
            self._buffer = lib.alloc_ctx_tensors(self._ctx, lib.repack_buft)
            if not self._buffer:
                raise GGMLError("cannot allocate a CPU_REPACK buffer")
            lib.tensor_set(self.node, raw.data_ptr(), 0, raw.numel())  # repacks into ggml's buffer
        else:
            self.raw = raw  # zero copy: ggml reads these bytes
            self._buffer = lib.buffer_from_ptr(raw.data_ptr(), raw.numel())
            if lib.tensor_alloc(self._buffer, self.node, raw.data_ptr()) != 0:
                raise GGMLError("ggml_backend_tensor_alloc failed for a weight")
        self.nbytes = int(raw.numel())

    def _graph(self, rows: int) -> tuple:
        """(ctx, x tensor, y tensor, graph) of x [rows, k] -> y [rows, n], built once per row count."""
        g = self._graphs.get(rows)
        if g is None:
            lib, k = self._lib, self.shape[1]
            if len(self._graphs) >= 12:  # prefill row counts vary (the last chunk): keep the decode ones
                for r in [r for r in self._graphs if r > 16][:4]:
                    lib.free(self._graphs.pop(r)[0])
            ctx = lib.context(3, graph=True)
            x = lib.new_tensor_2d(ctx, F32, k, rows)
            y = lib.mul_mat(ctx, self.node, x)
            graph = lib.new_graph_custom(ctx, _GRAPH_NODES, False)
            lib.build_forward_expand(graph, y)
            g = self._graphs[rows] = (ctx, x, y, graph)
        return g

    def mul(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x W^T: float32 x [rows, k] (contiguous) -> float32 [rows, n] (`out` when given)."""
        n, k = self.shape
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"ggml mul_mat [{n}, {k}]: x must be contiguous CPU float32 [rows, {k}], "
                             f"got {x.dtype} {tuple(x.shape)}")
        rows = x.shape[0]
        if out is None:
            out = torch.empty(rows, n, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (rows, n) or not out.is_contiguous():
            raise ValueError(f"ggml mul_mat: out must be contiguous float32 [{rows}, {n}]")
        if rows == 0:
            return out
        lib = self._lib
        _, xt, yt, graph = self._graph(rows)
        with lib.lock:
            lib.point(xt, x.data_ptr())
            lib.point(yt, out.data_ptr())
            status = lib.graph_compute(lib.backend, graph)
        if status != 0:
            raise GGMLError(f"ggml graph compute failed (status {status})")
        return out

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        try:
            for ctx, *_ in self._graphs.values():
                lib.free(ctx)
            lib.buffer_free(self._buffer)
            lib.free(self._ctx)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone already
            pass


def mul_mat_ref(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """The reference: GGUF blocks dequantized by gguf-py (ggml's own dequantization, bit for bit),
    x W^T in float64 -> [rows, n] float64."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = shape
    w = dequantize(raw.contiguous().view(torch.uint8).numpy().reshape(n, -1), GGMLQuantizationType(int(ggml_type)))
    return x.double() @ torch.from_numpy(np.ascontiguousarray(w, dtype=np.float64)).reshape(n, k).t()


def _smoke_test() -> None:
    """A Q8_0 product of odd shape against the reference (one block row quantized by hand)."""
    n, k = 24, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (n, k // 32, 32), dtype=torch.int8, generator=g)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half()
    raw = torch.cat([d.view(torch.uint8).reshape(n, k // 32, 2), q.view(torch.uint8)], dim=2).reshape(n, -1)
    x = torch.randn(3, k, generator=g)
    y = Matrix(raw, 8, (n, k)).mul(x)
    want = mul_mat_ref(raw, 8, (n, k), x)
    err = float((y.double() - want).norm() / want.norm())
    if not err < 0.02:  # Q8_0 x Q8_0 activations: ~0.4% here
        raise GGMLError(f"ggml smoke test: a Q8_0 product is {err:.3g} off the reference")
