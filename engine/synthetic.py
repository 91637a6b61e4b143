"""Synthetic E2B/E4B GGUF layouts: the real metadata and tensor table, no weight data.

`synthetic_layout("e2b")` quacks like `models.gguf.GGUFFile` for everything that does not read
weights: `.metadata`, `.tensors` (name -> SyntheticTensor with name/ggml_type/ne/shape/n_bytes),
`.path`, `in`, iteration, `tensor()`, `get()`, `architecture`, and `load("rope_freqs.weight")`.
So `Gemma4Config.from_gguf(synthetic_layout("e2b"))`, the memory planner and `edgegem info
--synthetic e2b` work without the multi-gigabyte files. Benchmarks that need weights can build on
`layout_tensors()` (names, shapes, types) and fill in random blocks of each type.

Config: spec §1.1-1.2 and §2.2 (hidden 1536/2560, 35/42 layers, 8 heads, 1/2 KV heads, head dims
256/512, window 512, [S,S,S,S,F]x7 / [S,S,S,S,S,F]x7, 20/18 KV-shared layers, FFN [6144]x15 +
[12288]x20 / 10240, PLE width 256, vocab 262144 given as `gemma4.vocab_size`, context 131072).

Tensors: §2.5, with no k/v/k_norm on KV-shared layers (llama.cpp loads them as optional and never
reads them; leaving them out reproduces the spec's parameter counts, 4.63 B / 7.46 B) and a tied
head (no `output.weight`).

Tensor types follow llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M mix (src/llama-quant.cpp, the copy
vendored in llama-cpp-python 0.3.36):
  * 1-D tensors (norms, layer_output_scale, rope_freqs): never quantized -> F32.
  * per_layer_model_proj: excluded from quantization ("not too big") -> stays at the converter's
    type, BF16 here.
  * token_embd and per_layer_token_embd: both are the TOKEN_EMBD category, and with tied
    embeddings (no output.weight) llama.cpp gives that category the output tensor's type -> Q6_K.
  * attn_v: Q6_K when use_more_bits(i, n) over the attn_v tensors in file order (i counts attn_v
    tensors, n = how many there are: 15 on E2B, 24 on E4B), else Q4_K.
  * ffn_down: Q6_K when use_more_bits(layer, n_layer), else Q4_K.
  * every other 2-D weight (attn_q/k/output, ffn_gate/up, inp_gate, proj): Q4_K (the default).
  use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division).
  Every row length here is a multiple of 256, so no type falls back.

Totals this gives (`total_bytes`): E2B 3,400,303,756 B (3.40 GB, 3.17 GiB; 4.63 B parameters),
E4B 5,286,450,344 B (5.29 GB, 4.92 GiB; 7.46 B parameters). Published llama.cpp Q4_K_M E2B files
are listed at 3.41-3.43 GB (the vision/audio towers live in a separate mmproj file), so the
"about 3.1 GB" sometimes quoted is a smaller mix. Two thirds of either file is the two embedding
tables at Q6_K.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from models.gguf import MissingTensorError, TensorShape, TensorTable

VARIANTS: dict[str, dict[str, Any]] = {
    "e2b": dict(n_layer=35, d=1536, period=5, n_kv=1, ffn=[6144] * 15 + [12288] * 20, n_shared=20),
    "e4b": dict(n_layer=42, d=2560, period=6, n_kv=2, ffn=10240, n_shared=18),
}
VOCAB = 262144
N_HEAD, HD_FULL, HD_SWA, PLE, WINDOW = 8, 512, 256, 256, 512
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
ROPE_FREQS = [1.0] * 64 + [1e30] * 192  # proportional RoPE: 25% of the 512 dims rotate (§2.6)


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's rule for which attn_v / ffn_down tensors get Q6_K under Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(frozen=True)
class SyntheticTensor(TensorShape):
    name: str
    ggml_type: int
    ne: tuple[int, ...]  # ggml order (innermost first), as in the GGUF

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[T(self.ggml_type)]
        return self.n_elements // block * size


def synthetic_metadata(variant: str) -> dict[str, Any]:
    """GGUF metadata of the real E2B/E4B (§2.2), in the value types `GGUFFile` returns."""
    v, a = VARIANTS[variant], "gemma4"
    L = v["n_layer"]
    ffn = np.array(v["ffn"], dtype=np.int32) if isinstance(v["ffn"], list) else v["ffn"]
    return {
        "general.architecture": a, "general.name": f"synthetic {variant.upper()}",
        "general.file_type": LLAMA_FTYPE_MOSTLY_Q4_K_M, "general.quantization_version": 2,
        f"{a}.block_count": L, f"{a}.context_length": 131072, f"{a}.embedding_length": v["d"],
        f"{a}.vocab_size": VOCAB, f"{a}.feed_forward_length": ffn,
        f"{a}.attention.head_count": N_HEAD, f"{a}.attention.head_count_kv": v["n_kv"],
        f"{a}.attention.key_length": HD_FULL, f"{a}.attention.value_length": HD_FULL,
        f"{a}.attention.key_length_swa": HD_SWA, f"{a}.attention.value_length_swa": HD_SWA,
        f"{a}.rope.dimension_count": HD_FULL, f"{a}.rope.dimension_count_swa": HD_SWA,
        f"{a}.rope.freq_base": 1e6, f"{a}.rope.freq_base_swa": 1e4,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.attention.sliding_window": WINDOW,
        f"{a}.attention.sliding_window_pattern": np.array([(i + 1) % v["period"] != 0 for i in range(L)]),
        f"{a}.attention.shared_kv_layers": v["n_shared"],
        f"{a}.embedding_length_per_layer_input": PLE, f"{a}.final_logit_softcapping": 30.0,
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
    }


def layout_tensors(variant: str) -> list[SyntheticTensor]:
    """Every tensor of the text model in file order, with its Q4_K_M type (rules in the module doc)."""
    v = VARIANTS[variant]
    L, d, n_kv = v["n_layer"], v["d"], v["n_kv"]
    ffn = v["ffn"] if isinstance(v["ffn"], list) else [v["ffn"]] * L
    first_shared = L - v["n_shared"]
    n_attn_v = first_shared  # one attn_v per KV-owning layer
    out = [SyntheticTensor("token_embd.weight", T.Q6_K, (d, VOCAB)),
           SyntheticTensor("per_layer_token_embd.weight", T.Q6_K, (L * PLE, VOCAB)),
           SyntheticTensor("per_layer_model_proj.weight", T.BF16, (d, L * PLE)),
           SyntheticTensor("per_layer_proj_norm.weight", T.F32, (PLE,)),
           SyntheticTensor("rope_freqs.weight", T.F32, (HD_FULL // 2,)),
           SyntheticTensor("output_norm.weight", T.F32, (d,))]
    i_v = 0
    for i in range(L):
        b = f"blk.{i}."
        hd = HD_SWA if (i + 1) % v["period"] else HD_FULL
        t = [(b + "attn_norm.weight", T.F32, (d,)), (b + "attn_q.weight", T.Q4_K, (d, N_HEAD * hd)),
             (b + "attn_q_norm.weight", T.F32, (hd,))]
        if i < first_shared:
            t += [(b + "attn_k.weight", T.Q4_K, (d, n_kv * hd)),
                  (b + "attn_v.weight", T.Q6_K if use_more_bits(i_v, n_attn_v) else T.Q4_K, (d, n_kv * hd)),
                  (b + "attn_k_norm.weight", T.F32, (hd,))]
            i_v += 1
        t += [(b + "attn_output.weight", T.Q4_K, (N_HEAD * hd, d)),
              (b + "post_attention_norm.weight", T.F32, (d,)), (b + "ffn_norm.weight", T.F32, (d,)),
              (b + "ffn_gate.weight", T.Q4_K, (d, ffn[i])), (b + "ffn_up.weight", T.Q4_K, (d, ffn[i])),
              (b + "ffn_down.weight", T.Q6_K if use_more_bits(i, L) else T.Q4_K, (ffn[i], d)),
              (b + "post_ffw_norm.weight", T.F32, (d,)), (b + "layer_output_scale.weight", T.F32, (1,)),
              (b + "inp_gate.weight", T.Q4_K, (d, PLE)), (b + "proj.weight", T.Q4_K, (PLE, d)),
              (b + "post_norm.weight", T.F32, (d,))]
        out += [SyntheticTensor(n, int(ty), ne) for n, ty, ne in t]
    return [SyntheticTensor(x.name, int(x.ggml_type), x.ne) for x in out]


class SyntheticGGUF(TensorTable):
    """A metadata-and-layout stand-in for `GGUFFile` (no tensor data except rope_freqs)."""

    def __init__(self, variant: str):
        self.variant = variant
        self.path = Path(f"synthetic-{variant}")
        self.metadata = synthetic_metadata(variant)
        self.tensors = {t.name: t for t in layout_tensors(variant)}

    @property
    def total_bytes(self) -> int:
        return sum(t.n_bytes for t in self)

    def load(self, name: str, shape: Optional[tuple[int, ...]] = None, dtype=None):
        import torch

        if name != "rope_freqs.weight":
            raise MissingTensorError(self.path, "synthetic layout has no weight data", name)
        return torch.tensor(ROPE_FREQS, dtype=dtype or torch.float32)


def synthetic_layout(variant: str) -> SyntheticGGUF:
    variant = variant.lower()
    if variant not in VARIANTS:
        raise ValueError(f"unknown synthetic layout '{variant}' (choose from {', '.join(VARIANTS)})")
    return SyntheticGGUF(variant)
