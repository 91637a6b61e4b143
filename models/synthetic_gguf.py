"""A synthetic layout (models/synthetic.py) as a real GGUF file: llama.cpp and `load_model` both read
it (`edgegem bench --device cpu --synthetic` runs the same file in both; `bench --keep-gguf` keeps
it). Every tensor of `layout_tensors` with random blocks of its Q4_K_M type as `random_quant_bytes`
makes them, BF16/F32 as `synthetic_weights` does, the layout's metadata and a filler vocabulary;
written tensor by tensor, so RAM stays at one tensor (the 26B-A4B's file is 16.8 GB).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from .synthetic import VARIANTS, SyntheticTensor, layout_tensors, matrix_std, random_quant_bytes, rope_freqs, \
    synthetic_metadata


def _vocab(n_vocab: int) -> tuple[list[str], list[int]]:
    """A `gemma4` BPE vocabulary of n_vocab entries: specials, the 256 byte tokens, letters, then
    unused fillers (llama.cpp and models/tokenizer.py both need one to load a file)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>"]
    types = [3] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    for c in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()\n":
        tokens.append(c)
        types.append(1)
    tokens += [f"<unused{i}>" for i in range(n_vocab - len(tokens))]
    types += [1] * (n_vocab - len(types))
    return tokens, types


def _vector(name: str, n: int, rng: np.random.Generator, hd_full: int) -> np.ndarray:
    """A 1-D tensor as `synthetic_weights` makes it: norms ~1 (q/k norms ~hd^-1/4), scale 0.8, RoPE."""
    if name == "rope_freqs.weight":
        return np.array(rope_freqs(hd_full), dtype=np.float32)
    if name.endswith("layer_output_scale.weight"):
        return np.full(n, 0.8, dtype=np.float32)
    w = 1.0 + 0.1 * rng.standard_normal(n)
    if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
        w = w * n ** -0.25
    return w.astype(np.float32)


def write_synthetic_gguf(variant: str, path, seed: int = 0, f32: bool = False) -> Path:
    """The synthetic layout as a real GGUF file (every tensor of `layout_tensors`, random blocks of
    its Q4_K_M type as `random_quant_bytes` makes them, BF16/F32 as `synthetic_weights` does, the
    metadata of `synthetic_metadata` and a filler vocabulary), written tensor by tensor (RAM stays
    at one tensor). llama.cpp and `load_model` both read it. `f32`: every tensor in F32 instead
    (what llama.cpp's quantizer takes: quantized to Q4_K_M it gives the layout's type mix)."""
    import torch
    from gguf import GGUFWriter

    variant, path = variant.lower(), Path(path)
    v, meta = VARIANTS[variant], synthetic_metadata(variant)
    w = GGUFWriter(str(path), arch="gemma4")
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, np.ndarray):
            w.add_array(key, [bool(x) for x in value] if value.dtype == bool else [int(x) for x in value])
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    tokens, types = _vocab(v["vocab"])
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", [-1000.0] * len(tokens))
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", ["▁ a"])
    w.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    layout = layout_tensors(variant)
    if f32:
        layout = [SyntheticTensor(t.name, int(T.F32), t.ne) for t in layout]
    for t in layout:
        block, size = GGML_QUANT_SIZES[T(t.ggml_type)]
        if t.ggml_type == T.F32:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes)
        else:  # bytes of each row of 256-value blocks: (..., rows, row bytes)
            lead = t.shape[:-1] or (1,)
            w.add_tensor_info(t.name, (*lead, t.n_bytes // math.prod(lead)), np.dtype(np.uint8), t.n_bytes,
                              raw_dtype=T(t.ggml_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    for t in layout:
        name, tn = t.name, T(t.ggml_type).name
        if t.ggml_type == T.F32 and len(t.shape) >= 2:  # the MoE router (kept in F32), or every matrix (f32)
            std = matrix_std(name, t.shape, v["ple"])
            data = (rng.standard_normal(t.shape, dtype=np.float32) * np.float32(std))
        elif t.ggml_type == T.F32:
            data = _vector(name, t.shape[0], rng, v["hd_full"])
        elif t.ggml_type == T.BF16:
            m = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1])
            data = m.to(torch.bfloat16).view(torch.uint8).numpy()
        else:
            rows = math.prod(t.shape[:-1])  # an expert bank [E, rows, n_in]: E x rows rows
            data = random_quant_bytes(tn, rows, t.shape[-1], matrix_std(name, t.shape, v["ple"]), gen,
                                       "cpu").numpy()
        w.write_tensor_data(data)
    w.close()
    return path
