"""llama.cpp's ggml on the CPU, through ctypes: the face of the toolchain.

  - `lib.py`: the binding to the libraries llama-cpp-python ships (load, threads, matrices and
    their products, `mul_mat_ref`);
  - `graph.py`: ggml compute graphs over torch tensors (`Graph`, `layout`);
  - `ops.py`: the fused CPU chains, one graph each, and the node builders they share (a graph cache,
    the input check, RMSNorm and RoPE nodes, the V view of a projection);
  - `attention.py`: one decode query's attention over a window of a KV slab (`flash_attn_ext`);
  - `moe.py`: expert banks [E, n, k] over GGUF bytes for `ggml_mul_mat_id` (`Bank`), the product
    and its reference.

A model's forward written as one ggml graph is a model file (models/gemma3_ggml.py), built from
the names below. Importing this package loads no library: `available()` or the first graph does,
once. Nothing here imports `kernels.triton`, nor it this (tests/repo/test_layering.py).
"""
from . import attention, graph, moe, ops
from .graph import Graph, layout
from .lib import (F32, PINNED, REPACK, TYPES, GGMLError, Matrix, available, cpu_features, library, mul_mat_ref,
                  node_info, reason, repacks, set_threads, supported, tensor_bytes, threads)
from .moe import Bank, mul_mat_id, mul_mat_id_ref
from .ops import cached_graph, check_cpu_float32, mlp_nodes, norm_nodes, raw_v, rope_nodes

__all__ = ["F32", "PINNED", "REPACK", "TYPES", "Bank", "GGMLError", "Graph", "Matrix", "attention", "available",
           "cached_graph", "check_cpu_float32", "cpu_features", "graph", "layout", "library", "moe", "mul_mat_id",
           "mlp_nodes", "mul_mat_id_ref", "mul_mat_ref", "node_info", "norm_nodes", "ops", "raw_v", "reason", "repacks",
           "rope_nodes", "set_threads", "supported", "tensor_bytes", "threads"]
