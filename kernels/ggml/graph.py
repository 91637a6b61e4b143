"""Small ggml compute graphs over torch tensors: the CPU fused chains (kernels/ggml/ops.py), decode
attention (kernels/ggml/attention.py) and the Gemma 3 decode graphs (models/gemma3_ggml.py).

A graph is built once for given shapes and strides: its inputs are ggml views with the torch
tensors' own strides, its outputs contiguous tensors; both are pointed at the caller's torch
tensors on each `run`, so nothing is copied in or out. Intermediates live in one buffer that
ggml's graph allocator (`ggml_gallocr`) sizes and reuses. Constants (norm weights, a matrix) are
bound once when the graph is built. A run is one `ggml_backend_graph_compute` of all nodes: ~4 us
of overhead where the same chain as torch ops costs ~6 us per op on this CPU (an add + two
RMSNorms: 6.4 us against 23 us, bit-identical).

Views of inputs and outputs are taken only through `input()` (ggml computes a view's data
pointer when the graph is allocated, so the views the builder makes itself are re-pointed with
their base on every run); views of intermediates are stable (the allocator's buffer stays put).
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

from .lib import F32, GGMLError, InitParams, Matrix, library

I32, I64, F16, BF16 = 26, 27, 1, 30  # GGML_TYPE_*
_P = ctypes.c_void_p
_DTYPES = {torch.float32: (F32, 4), torch.int32: (I32, 4), torch.int64: (I64, 8), torch.float16: (F16, 2),
           torch.bfloat16: (BF16, 2)}
_extra: dict = {}


def _fns():
    """The graph-building functions (declared once, on top of kernels/ggml/lib.py's library)."""
    if not _extra:
        lib = library()
        b, f, P, i64, sz, fl = lib.base, lib.declare, _P, ctypes.c_int64, ctypes.c_size_t, ctypes.c_float
        i = ctypes.c_int
        _extra.update(
            rms_norm=f(b, "ggml_rms_norm", P, P, P, fl), mul=f(b, "ggml_mul", P, P, P, P),
            add=f(b, "ggml_add", P, P, P, P), sub=f(b, "ggml_sub", P, P, P, P),
            scale=f(b, "ggml_scale", P, P, P, fl), tanh=f(b, "ggml_tanh", P, P, P),
            gelu=f(b, "ggml_gelu", P, P, P), geglu=f(b, "ggml_geglu", P, P, P),
            concat=f(b, "ggml_concat", P, P, P, P, ctypes.c_int), cont=f(b, "ggml_cont", P, P, P),
            cast=f(b, "ggml_cast", P, P, P, ctypes.c_int),
            permute=f(b, "ggml_permute", P, P, P, i, i, i, i), set_rows=f(b, "ggml_set_rows", P, P, P, P, P),
            flash_attn_ext=f(b, "ggml_flash_attn_ext", P, P, P, P, P, P, fl, fl, fl),
            new_1d=f(b, "ggml_new_tensor_1d", P, P, ctypes.c_int, i64),
            new_4d=f(b, "ggml_new_tensor_4d", P, P, ctypes.c_int, i64, i64, i64, i64),
            view_4d=f(b, "ggml_view_4d", P, P, P, i64, i64, i64, i64, sz, sz, sz, sz),
            set_output=f(b, "ggml_set_output", None, P), set_input=f(b, "ggml_set_input", None, P),
            # the MoE block's nodes (llama.cpp's build_moe_ffn; models/gemma4_ggml.py)
            mul_mat_id=f(b, "ggml_mul_mat_id", P, P, P, P, P), soft_max=f(b, "ggml_soft_max", P, P, P),
            argsort_top_k=f(b, "ggml_argsort_top_k", P, P, P, i), get_rows=f(b, "ggml_get_rows", P, P, P, P),
            sum_rows=f(b, "ggml_sum_rows", P, P, P), div=f(b, "ggml_div", P, P, P, P),
            clamp=f(b, "ggml_clamp", P, P, P, fl, fl), geglu_split=f(b, "ggml_geglu_split", P, P, P, P),
            reshape_2d=f(b, "ggml_reshape_2d", P, P, P, i64, i64),
            reshape_3d=f(b, "ggml_reshape_3d", P, P, P, i64, i64, i64),
            repeat_4d=f(b, "ggml_repeat_4d", P, P, P, i64, i64, i64, i64),
            gallocr_new=f(b, "ggml_gallocr_new", P, P), gallocr_free=f(b, "ggml_gallocr_free", None, P),
            gallocr_alloc=f(b, "ggml_gallocr_alloc_graph", ctypes.c_bool, P, P),
            cpu_buft=f(b, "ggml_backend_cpu_buffer_type", P),
            view_init=f(b, "ggml_backend_view_init", ctypes.c_int, P),
        )
        # Inputs and outputs get a placeholder address before the allocator runs (so it leaves
        # them alone); they are pointed at real tensors before every compute. Never dereferenced.
        _extra["placeholder"] = lib.buffer_from_ptr(4096, 1 << 50)
    return _extra


def _ne_nb(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """ggml ne (innermost first, 4 dims) and nb (bytes) of a torch tensor's shape and strides."""
    el = t.element_size()
    ne, nb = list(t.shape)[::-1] or [1], [s * el for s in t.stride()[::-1]] or [el]
    while len(ne) < 4:
        nb.append(nb[-1] * ne[-1])
        ne.append(1)
    return ne, nb


def shared_allocator():
    """The one ggml graph allocator that big graphs share (`Graph(shared=True)`: prefill chunks,
    built for one run): their intermediates (E2B's MLP at 512 rows: ~50 MB) live in one buffer,
    reused by the next, instead of one buffer per layer and chunk length."""
    f = _fns()
    if "shared" not in f:
        f["shared"] = f["gallocr_new"](f["cpu_buft"]())
    return f["shared"]


class Graph:
    """Build: `x = g.input(tensor_like)`, ops (`g.rms_norm(x, eps)`, ...), `g.output(node)`;
    `g.finish()`; then `g.run(inputs, outputs)` with tensors of the shapes and strides it was
    built for. Node handles are ggml tensor pointers (ints). `shared`: intermediates in the shared
    allocator's buffer, valid until the next shared graph is finished (so: build, run, drop)."""

    def __init__(self, max_nodes: int = 96, shared: bool = False):
        self.shared = shared
        self.lib, self.f = library(), _fns()
        size = 3 * max_nodes * self.lib.tensor_overhead() + self.lib.graph_overhead_custom(max_nodes, False)
        self.ctx = self.lib.init(InitParams(size + 1024, None, True))
        if not self.ctx:
            raise GGMLError("ggml_init failed for a graph")
        self.max_nodes = max_nodes
        self._inputs: list[tuple[int, int]] = []  # (view, base): both re-pointed per run
        self._outputs: list[int] = []
        self._first: list[int] = []  # nodes computed before the outputs (`expand`)
        self._aliases: list[tuple[int, int]] = []  # (view node, input index): re-pointed with that input
        self._keep: list = []  # constants bound at build: kept alive with the graph
        self._graph = self._galloc = None

    # --- building -------------------------------------------------------------------------
    def _placeholder(self, t: int) -> None:
        if self.lib.tensor_alloc(self.f["placeholder"], t, 4096) != 0:
            raise GGMLError("cannot place a graph input")

    def _strided(self, like: torch.Tensor) -> tuple[int, int]:
        """(view with like's shape and strides, its 1-D base), both placeholders."""
        typ, el = _DTYPES[like.dtype]
        ne, nb = _ne_nb(like)
        span = 1 + sum((n - 1) * s // el for n, s in zip(ne, nb))
        base = self.f["new_1d"](self.ctx, typ, span)
        self._placeholder(base)
        view = self.f["view_4d"](self.ctx, base, ne[0], ne[1], ne[2], ne[3], nb[1], nb[2], nb[3], 0)
        if self.f["view_init"](view) != 0:
            raise GGMLError("cannot place a graph input view")
        return view, base

    def input(self, like: torch.Tensor) -> int:
        """A per-run input with `like`'s dtype (float32, float16, bfloat16 or int32), shape and strides."""
        view, base = self._strided(like)
        self.f["set_input"](base)
        self._inputs.append((view, base))
        return view

    def raw_input(self, ggml_type: int, n_values: int, n_rows: int) -> int:
        """A per-run input of GGUF rows: a contiguous [n_rows, n_values] tensor of `ggml_type`, to be
        pointed at a uint8 torch tensor of its row bytes."""
        t = self.f["new_4d"](self.ctx, int(ggml_type), n_values, n_rows, 1, 1)
        self._placeholder(t)
        self.f["set_input"](t)
        self._inputs.append((t, t))
        return t

    def constant(self, t: torch.Tensor) -> int:
        """A tensor bound once (a norm weight, cos/sin of a fixed table): kept alive by the graph."""
        view, base = self._strided(t)
        self.lib.point(base, t.data_ptr())
        self.lib.point(view, t.data_ptr())
        self._keep.append(t)
        return view

    def keep(self, *objs) -> None:
        """Tensors the graph must keep alive besides its constants (a cache key holding their ids)."""
        self._keep.extend(objs)

    def matrix(self, m: Matrix) -> int:
        """A weight matrix's ggml tensor (its own buffer: GGUF bytes or ggml's repacked copy)."""
        self._keep.append(m)
        return m.node

    def output(self, node: int) -> None:
        """`node` is written to the run's next output tensor (contiguous, node's shape)."""
        self._placeholder(node)
        self.f["set_output"](node)
        self._outputs.append(node)

    def expand(self, node: int) -> None:
        """Compute `node` (and what it needs) before the outputs' nodes: a store into an input
        (`ggml_set_rows`) that a later node reads through another input."""
        self._first.append(node)

    def alias(self, node: int, input_index: int) -> None:
        """`node` is a view of input `input_index` made by an op (ggml_set_rows returns a view of
        its destination): its data pointer is re-pointed with that input on every run."""
        self._aliases.append((node, input_index))

    def view(self, a: int, ne: Sequence[int], nb: Sequence[int], offset: int) -> int:
        """A view of an intermediate node (ne innermost first, nb in bytes; 4 dims, padded)."""
        ne, nb = list(ne) + [1] * (4 - len(ne)), list(nb)
        while len(nb) < 4:
            nb.append(nb[-1] * ne[len(nb) - 1])
        return self.f["view_4d"](self.ctx, a, ne[0], ne[1], ne[2], ne[3], nb[1], nb[2], nb[3], offset)

    def __getattr__(self, name: str):
        """Node ops: rms_norm(a, eps), mul(a, b), add, sub, scale(a, s), tanh(a), gelu(a),
        geglu(a), concat(a, b, dim), cont(a), cast(a, ggml_type), mul_mat(w, x), permute(a, 0, 2, 1, 3),
        set_rows(dst, rows, indices) (a view of dst: `expand` it, `alias` it to dst's input),
        flash_attn_ext(q, k, v, mask, scale, max_bias, softcap); for MoE: mul_mat_id(bank, x, ids),
        soft_max(a), argsort_top_k(a, k), get_rows(a, ids), sum_rows(a), div(a, b), clamp(a, lo, hi),
        geglu_split(gate, up), reshape_2d(a, ne0, ne1), reshape_3d(a, ne0, ne1, ne2),
        repeat_4d(a, ne0, ne1, ne2, ne3)."""
        if name == "mul_mat":
            return lambda w, x: self.lib.mul_mat(self.ctx, w, x)
        fn = _fns().get(name)
        if fn is None or name in ("new_1d", "new_4d", "view_4d", "placeholder", "view_init", "cpu_buft",
                                  "gallocr_new", "gallocr_free", "gallocr_alloc", "set_output", "set_input"):
            raise AttributeError(name)
        return lambda *args: fn(self.ctx, *args)

    def finish(self) -> "Graph":
        self._graph = self.lib.new_graph_custom(self.ctx, self.max_nodes, False)
        for node in self._first + self._outputs:
            self.lib.build_forward_expand(self._graph, node)
        galloc = shared_allocator() if self.shared else self.f["gallocr_new"](self.f["cpu_buft"]())
        self._galloc = None if self.shared else galloc
        if not self.f["gallocr_alloc"](galloc, self._graph):
            raise GGMLError("ggml could not allocate a graph's intermediates")
        return self

    # --- running --------------------------------------------------------------------------
    def run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Compute with `inputs` (the shapes and strides built for; the caller guarantees them)
        into `outputs` (contiguous)."""
        lib = self.lib
        with lib.lock:
            for (view, base), t in zip(self._inputs, inputs):
                ptr = t.data_ptr()
                lib.point(view, ptr)
                lib.point(base, ptr)
            for node, t in zip(self._outputs, outputs):
                lib.point(node, t.data_ptr())
            for node, i in self._aliases:
                lib.point(node, inputs[i].data_ptr())
            status = lib.graph_compute(lib.backend, self._graph)
        if status != 0:
            raise GGMLError(f"ggml graph compute failed (status {status})")

    def __del__(self):
        try:
            if self._galloc:
                self.f["gallocr_free"](self._galloc)
            self.lib.free(self.ctx)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone already
            pass


def layout(t: Optional[torch.Tensor]) -> tuple:
    """What a graph's input depends on: dtype, shape and strides (None for an absent input)."""
    return None if t is None else (t.dtype, tuple(t.shape), t.stride())
