"""Capture the matrix products inside llama.cpp's own forward (its eval callback), so a test can
recompute each one through edgegem's ggml binding and compare bit for bit."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from engine.cpu_runtime import default_threads


def capture_mul_mats(path: Path, batches: list[list[int]], weights: set[str], n_ctx: int = 256,
                     n_threads: int = 0) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Run llama.cpp (CPU, F32 KV) over `batches` of tokens, one llama_decode each, and return
    (weight name, x float32 [rows, k], y float32 [rows, n]) for every MUL_MAT whose src0 is one
    of `weights` (the file's tensors; attention's K·Q products are left out)."""
    import llama_cpp as L

    from kernels import ggml
    from tiny_models import quiet_llama_cpp

    quiet_llama_cpp()
    L.llama_backend_init()
    out: list = []

    @L.ggml_backend_sched_eval_callback
    def observe(t, ask, user_data):
        op, name, src0, src1 = ggml.node_info(t)
        if op != "MUL_MAT":
            return bool(not ask)
        w_name = ggml.node_info(src0)[1]
        if w_name not in weights:
            return bool(not ask)
        if ask:
            return True
        x = np.frombuffer(ggml.tensor_bytes(src1), dtype=np.float32).copy()
        y = np.frombuffer(ggml.tensor_bytes(t), dtype=np.float32).copy()
        out.append((w_name, x, y))
        return True

    _decode(path, batches, observe, n_ctx, n_threads)
    return out


def capture_nodes(path: Path, batches: list[list[int]], names: set[str], n_ctx: int = 256, n_threads: int = 0,
                  extra_bufts: bool = True) -> dict[str, list[np.ndarray]]:
    """Run llama.cpp (CPU, F32 KV) over `batches` of tokens, one llama_decode each, and return the
    float32 data of every graph node named in `names` (llama.cpp's `cb` names: "attn_out-0"), one
    flat array a batch (ggml's ne0 innermost: reshape(-1, row length)). `extra_bufts` False: llama.cpp
    keeps every weight in the GGUF layout (no CPU_REPACK copy), the placement edgegem's expert
    banks have."""
    import llama_cpp as L

    from kernels import ggml
    from tiny_models import quiet_llama_cpp

    quiet_llama_cpp()
    L.llama_backend_init()
    out: dict = {n: [] for n in names}

    @L.ggml_backend_sched_eval_callback
    def observe(t, ask, user_data):
        name = ggml.node_info(t)[1]
        if name not in names:
            return bool(not ask)
        if ask:
            return True
        out[name].append(np.frombuffer(ggml.tensor_bytes(t), dtype=np.float32).copy())
        return True

    _decode(path, batches, observe, n_ctx, n_threads, extra_bufts)
    return out


def _decode(path: Path, batches: list[list[int]], observe, n_ctx: int, n_threads: int, extra_bufts: bool = True) -> None:
    """llama.cpp (CPU, F32 KV, no flash attention) over `batches`, one llama_decode each, with the
    eval callback `observe` on every graph node; `extra_bufts` False keeps the GGUF weight layout."""
    import llama_cpp as L

    mp = L.llama_model_default_params()
    mp.use_extra_bufts = extra_bufts
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_ctx, n_ctx
    cp.n_threads = cp.n_threads_batch = n_threads or default_threads()
    cp.type_k = cp.type_v = 0  # F32 KV
    cp.flash_attn_type = 0  # disabled
    cp.cb_eval, cp.cb_eval_user_data = observe, None
    ctx = L.llama_init_from_model(model, cp)
    try:
        for tokens in batches:
            arr = (ctypes.c_int32 * len(tokens))(*tokens)
            if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) != 0:
                raise RuntimeError("llama_decode failed")
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)
