"""Synthetic E2B/E4B/26B-A4B/31B GGUF layouts: the real metadata and tensor table, no weight data.

`synthetic_layout("e2b")` quacks like `models.gguf.GGUFFile` for everything that does not read
weights: `.metadata`, `.tensors` (name -> SyntheticTensor with name/ggml_type/ne/shape/n_bytes),
`.path`, `in`, iteration, `tensor()`, `get()`, `architecture`, and `load("rope_freqs.weight")`.
So `Gemma4Config.from_gguf(synthetic_layout("e2b"))`, the memory planner and `edgegem info
--synthetic e2b` work without the multi-gigabyte files. Benchmarks that need weights can build on
`layout_tensors()` (names, shapes, types) and fill in random blocks of each type.

Config: spec §1.1-1.2 and §2.2 (hidden 1536/2560, 35/42 layers, 8 heads, 1/2 KV heads, head dims
256/512, window 512, [S,S,S,S,F]x7 / [S,S,S,S,S,F]x7, 20/18 KV-shared layers, FFN [6144]x15 +
[12288]x20 / 10240, PLE width 256, vocab 262144 given as `gemma4.vocab_size`, context 131072).
26B-A4B / 31B (§1.1, §2.5 "MoE tensors"): hidden 2816/5376, 30/60 layers, 16/32 heads, KV heads
8/16 on sliding layers and 2/4 on full ones (an INT32 head_count_kv array), [S x5, F], window
1024, context 262144, FFN 2112/21504, no PLE, no KV sharing, no attn_v on full layers (V = K); the
26B-A4B has 128 experts (top 8, width 704) on every layer: the F32 router `ffn_gate_inp` [d, E]
with its `.scale`, `ffn_gate_up_exps` [d, 2I, E] (fused, as the converter writes it),
`ffn_down_exps` [I, d, E] with its per-expert `.scale`, and three more norms.

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
    tensors, n = how many there are: 15 on E2B, 24 on E4B, 25 on 26B-A4B, 50 on 31B), else Q4_K.
  * ffn_down (and ffn_down_exps, whose layer llama.cpp reads from the name when n_expert > 1):
    Q6_K when use_more_bits(layer, n_layer), else Q4_K.
  * ffn_gate_inp (the router): never quantized -> the converter's F32.
  * every other 2-D or 3-D weight (attn_q/k/output, ffn_gate/up, ffn_gate_up_exps, inp_gate,
    proj): Q4_K (the default). The n_expert == 8 rules (Mixtral) do not apply to 128 experts.
  use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division).
  A row length that is not a multiple of 256 falls back (tensor_type_fallback: Q4_K -> Q5_0,
  Q6_K -> Q8_0): on the 26B-A4B the dense ffn_down (rows of 2112) and ffn_down_exps (704).
  llama.cpp's own quantizer gives the scaled-down `tiny-moe` / `tiny-dense` exactly these types
  (tests/models/test_big_models.py).

Totals this gives (`total_bytes`): E2B 3,400,303,756 B (3.40 GB, 3.17 GiB; 4.63 B parameters),
E4B 5,286,450,344 B (5.29 GB, 4.92 GiB; 7.46 B parameters). Published llama.cpp Q4_K_M E2B files
are listed at 3.41-3.43 GB (the vision/audio towers live in a separate mmproj file), so the
"about 3.1 GB" sometimes quoted is a smaller mix. Two thirds of either file is the two embedding
tables at Q6_K. 26B-A4B 16,780,192,888 B (16.78 GB; 25.23 B parameters), 31B 18,671,229,168 B
(18.67 GB; 30.70 B parameters), against ~16.9 GB and ~18.7 GB published.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from models.gguf import MissingTensorError, TensorShape, TensorTable

VOCAB = 262144
N_HEAD, HD_FULL, HD_SWA, PLE, WINDOW = 8, 512, 256, 256, 512
_REAL = dict(vocab=VOCAB, n_head=N_HEAD, hd_full=HD_FULL, hd_swa=HD_SWA, ple=PLE, window=WINDOW)
# The 26B-A4B and 31B (spec §1.1, §2.2, §2.5): no PLE, no KV-shared layers, window 1024, context
# 262,144, [S x5, F] pattern, fewer KV heads on the full layers (`n_kv_full`) and no attn_v there
# (attention_k_eq_v: V = K).
_BIG = dict(vocab=VOCAB, hd_full=HD_FULL, hd_swa=HD_SWA, ple=0, window=1024, period=6, n_shared=0,
            k_eq_v=True, context=262144)
VARIANTS: dict[str, dict[str, Any]] = {
    "e2b": dict(_REAL, n_layer=35, d=1536, period=5, n_kv=1, ffn=[6144] * 15 + [12288] * 20, n_shared=20),
    "e4b": dict(_REAL, n_layer=42, d=2560, period=6, n_kv=2, ffn=10240, n_shared=18),
    # 26B-A4B: every layer has the dense MLP (2112) and 128 experts of width 704, top 8 (§3.8).
    "26b-a4b": dict(_BIG, n_layer=30, d=2816, n_head=16, n_kv=8, n_kv_full=2, ffn=2112,
                    n_expert=128, n_expert_used=8, expert_ffn=704),
    "31b": dict(_BIG, n_layer=60, d=5376, n_head=32, n_kv=16, n_kv_full=4, ffn=21504),
    # A small model with the same structure for CPU tests: [S,S,F] x 2, the last 3 layers KV-shared
    # (two sliding ones reading layer 1, a full one reading layer 2), double-wide FFN on the shared
    # layers, PLE. Rows of 64 (proj) and 384 (PLE table) are not multiples of 256, so those
    # tensors take llama.cpp's fallback types (Q5_0, Q8_0), which the kernels also read.
    "tiny": dict(vocab=512, n_head=4, hd_full=128, hd_swa=64, ple=64, window=16, n_layer=6, d=256,
                 period=3, n_kv=1, ffn=[512] * 3 + [1024] * 3, n_shared=3),
    # The 26B-A4B's structure scaled down for the writer and the planner: [S,S,F] x 2 (the full
    # layers with 1 KV head and no attn_v), 6 experts of width 96 (rows of 96 fall back to
    # Q5_0/Q8_0 as the real 704 do), dense width 320 (not a multiple of 256 either, as 2112 is).
    "tiny-moe": dict(vocab=512, n_head=4, hd_full=128, hd_swa=64, ple=0, window=16, n_layer=6, d=256,
                     period=3, n_kv=2, n_kv_full=1, ffn=320, n_shared=0, k_eq_v=True, context=4096,
                     n_expert=6, n_expert_used=2, expert_ffn=96),
    # The 31B's structure scaled down: [S x5, F] x 2, 2 KV heads on sliding layers and 1 on full
    # ones (no attn_v there), no PLE, no sharing, no experts.
    "tiny-dense": dict(vocab=512, n_head=4, hd_full=128, hd_swa=64, ple=0, window=16, n_layer=12, d=256,
                       period=6, n_kv=2, n_kv_full=1, ffn=512, n_shared=0, k_eq_v=True, context=4096),
}
PUBLIC_VARIANTS = ("e2b", "e4b", "26b-a4b", "31b")  # the real models (`--synthetic`); the rest are for tests
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
# Types llama.cpp falls back to when a row length is not a multiple of 256 (llama-quant.cpp).
K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def rope_freqs(hd_full: int) -> list[float]:
    """Proportional RoPE: 25% of the full layers' head dims rotate (§2.6), the rest carry 1e30."""
    n_rot = hd_full // 8
    return [1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot)


ROPE_FREQS = rope_freqs(HD_FULL)  # 64 ones, 192 x 1e30


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


def _is_full(v: dict, i: int) -> bool:
    return (i + 1) % v["period"] == 0


def _n_kv(v: dict, i: int) -> int:
    return v.get("n_kv_full", v["n_kv"]) if _is_full(v, i) else v["n_kv"]


def synthetic_metadata(variant: str) -> dict[str, Any]:
    """GGUF metadata of the real model (§2.2), in the value types `GGUFFile` returns."""
    v, a = VARIANTS[variant], "gemma4"
    L, hd_f, hd_s = v["n_layer"], v["hd_full"], v["hd_swa"]
    ffn = np.array(v["ffn"], dtype=np.int32) if isinstance(v["ffn"], list) else v["ffn"]
    n_kv = [_n_kv(v, i) for i in range(L)]
    meta = {
        "general.architecture": a, "general.name": f"synthetic {variant.upper()}",
        "general.file_type": LLAMA_FTYPE_MOSTLY_Q4_K_M, "general.quantization_version": 2,
        f"{a}.block_count": L, f"{a}.context_length": v.get("context", 131072), f"{a}.embedding_length": v["d"],
        f"{a}.vocab_size": v["vocab"], f"{a}.feed_forward_length": ffn,
        f"{a}.attention.head_count": v["n_head"],
        # an INT32 array where the full layers have fewer KV heads (26B: [8,8,8,8,8,2] x 5), as the converter
        f"{a}.attention.head_count_kv": np.array(n_kv, dtype=np.int32) if len(set(n_kv)) > 1 else n_kv[0],
        f"{a}.attention.key_length": hd_f, f"{a}.attention.value_length": hd_f,
        f"{a}.attention.key_length_swa": hd_s, f"{a}.attention.value_length_swa": hd_s,
        f"{a}.rope.dimension_count": hd_f, f"{a}.rope.dimension_count_swa": hd_s,
        f"{a}.rope.freq_base": 1e6, f"{a}.rope.freq_base_swa": 1e4,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.attention.sliding_window": v["window"],
        f"{a}.attention.sliding_window_pattern": np.array([not _is_full(v, i) for i in range(L)]),
        f"{a}.attention.shared_kv_layers": v["n_shared"],
        f"{a}.embedding_length_per_layer_input": v["ple"], f"{a}.final_logit_softcapping": 30.0,
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
    }
    if v.get("n_expert"):
        meta.update({f"{a}.expert_count": v["n_expert"], f"{a}.expert_used_count": v["n_expert_used"],
                     f"{a}.expert_feed_forward_length": v["expert_ffn"]})
    return meta


def layout_tensors(variant: str) -> list[SyntheticTensor]:
    """Every tensor of the text model in file order, with its Q4_K_M type (rules in the module doc)."""
    v = VARIANTS[variant]
    L, d = v["n_layer"], v["d"]
    VOCAB, N_HEAD, HD_FULL, HD_SWA, PLE = v["vocab"], v["n_head"], v["hd_full"], v["hd_swa"], v["ple"]
    E, I = v.get("n_expert", 0), v.get("expert_ffn", 0)
    ffn = v["ffn"] if isinstance(v["ffn"], list) else [v["ffn"]] * L
    first_shared = L - v["n_shared"]
    # one attn_v per KV-owning layer, none on full layers where V = K (llama.cpp counts attn_v
    # tensors in file order: i_attention_wv of n_attention_wv)
    has_v = [i < first_shared and not (v.get("k_eq_v") and _is_full(v, i)) for i in range(L)]
    n_attn_v = sum(has_v)
    out = [SyntheticTensor("token_embd.weight", T.Q6_K, (d, VOCAB))]
    if PLE:
        out += [SyntheticTensor("per_layer_token_embd.weight", T.Q6_K, (L * PLE, VOCAB)),
                SyntheticTensor("per_layer_model_proj.weight", T.BF16, (d, L * PLE)),
                SyntheticTensor("per_layer_proj_norm.weight", T.F32, (PLE,))]
    out += [SyntheticTensor("rope_freqs.weight", T.F32, (HD_FULL // 2,)),
            SyntheticTensor("output_norm.weight", T.F32, (d,))]
    i_v = 0
    for i in range(L):
        b = f"blk.{i}."
        hd, n_kv = HD_FULL if _is_full(v, i) else HD_SWA, _n_kv(v, i)
        more_bits = T.Q6_K if use_more_bits(i, L) else T.Q4_K  # ffn_down and ffn_down_exps, by layer
        t = [(b + "attn_norm.weight", T.F32, (d,)), (b + "attn_q.weight", T.Q4_K, (d, N_HEAD * hd)),
             (b + "attn_q_norm.weight", T.F32, (hd,))]
        if i < first_shared:
            t.append((b + "attn_k.weight", T.Q4_K, (d, n_kv * hd)))
            if has_v[i]:
                t.append((b + "attn_v.weight", T.Q6_K if use_more_bits(i_v, n_attn_v) else T.Q4_K, (d, n_kv * hd)))
                i_v += 1
            t.append((b + "attn_k_norm.weight", T.F32, (hd,)))
        t += [(b + "attn_output.weight", T.Q4_K, (N_HEAD * hd, d)),
              (b + "post_attention_norm.weight", T.F32, (d,)), (b + "ffn_norm.weight", T.F32, (d,)),
              (b + "ffn_gate.weight", T.Q4_K, (d, ffn[i])), (b + "ffn_up.weight", T.Q4_K, (d, ffn[i])),
              (b + "ffn_down.weight", more_bits, (ffn[i], d)),
              (b + "post_ffw_norm.weight", T.F32, (d,)), (b + "layer_output_scale.weight", T.F32, (1,))]
        if E:  # the router stays F32 (converter; llama-quant.cpp never quantizes ffn_gate_inp)
            t += [(b + "ffn_gate_inp.weight", T.F32, (d, E)), (b + "ffn_gate_inp.scale", T.F32, (d,)),
                  (b + "ffn_gate_up_exps.weight", T.Q4_K, (d, 2 * I, E)),
                  (b + "ffn_down_exps.weight", more_bits, (I, d, E)),
                  (b + "ffn_down_exps.scale", T.F32, (E,)), (b + "pre_ffw_norm_2.weight", T.F32, (d,)),
                  (b + "post_ffw_norm_1.weight", T.F32, (d,)), (b + "post_ffw_norm_2.weight", T.F32, (d,))]
        if PLE:
            t += [(b + "inp_gate.weight", T.Q4_K, (d, PLE)), (b + "proj.weight", T.Q4_K, (PLE, d)),
                  (b + "post_norm.weight", T.F32, (d,))]
        out += [SyntheticTensor(n, int(ty), ne) for n, ty, ne in t]
    return [SyntheticTensor(x.name, int(_fallback(x.ggml_type, x.ne)), x.ne) for x in out]


def _fallback(ggml_type: int, ne: tuple[int, ...]) -> int:
    """llama.cpp's fallback for a K-quant whose rows are not whole 256-value blocks."""
    if len(ne) >= 2 and ne[0] % 256 and T(ggml_type) in K_FALLBACK:
        return K_FALLBACK[T(ggml_type)]
    return ggml_type


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
        return torch.tensor(rope_freqs(VARIANTS[self.variant]["hd_full"]), dtype=dtype or torch.float32)


def synthetic_layout(variant: str) -> SyntheticGGUF:
    variant = variant.lower()
    if variant not in VARIANTS:
        raise ValueError(f"unknown synthetic layout '{variant}' (choose from {', '.join(VARIANTS)})")
    return SyntheticGGUF(variant)


# --- random full-size weights -------------------------------------------------------------------
# Quantized blocks of each type the kernels read: (values per block, bytes per block, offsets of the
# fp16 fields). Random quant bytes with scale fields chosen so that every dequantized value has
# mean ~0 and standard deviation `std`:
#   Q6_K   d * s * (q - 32), q uniform 0..63 (var 341.25), s a random int8 (E s^2 = 5461.5)
#   Q4_K/Q5_K  d * sc * q - dmin * m with the 6-bit sub-block scales packed so that m == sc and
#          dmin = d * (qmax / 2): d * sc * (q - qmax / 2), E sc^2 = 1333.5
#   Q8_0   d * q, q a random int8;  Q5_0 d * (q - 16);  Q4_0 d * (q - 8)
_QMAX = {"Q4_K": 15, "Q5_K": 31}
_VALUE_VAR = {"Q6_K": 341.25 * 5461.5, "Q4_K": 21.25 * 1333.5, "Q5_K": 85.25 * 1333.5,
              "Q8_0": 5461.5, "Q5_0": 85.25 + 0.25, "Q4_0": 21.25 + 0.25}


def random_quant_bytes(type_name: str, n_rows: int, n_in: int, std: float, gen, device):
    """uint8 [n_rows, row_bytes] of random blocks whose dequantized values have std ~`std`.
    Built with a few whole-tensor torch ops on `device` (no per-block loops)."""
    import torch

    block, size = GGML_QUANT_SIZES[T[type_name]]
    nb = n_rows * (n_in // block)
    raw = torch.randint(0, 256, (nb, size), dtype=torch.uint8, device=device, generator=gen)
    d = std / math.sqrt(_VALUE_VAR[type_name])

    def f16(col: int, value: float) -> None:
        raw[:, col:col + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8).to(device)

    if type_name == "Q6_K":
        f16(208, d)
    elif type_name in ("Q4_K", "Q5_K"):
        sc = torch.randint(0, 64, (nb, 8), dtype=torch.int32, device=device, generator=gen)
        lo, hi = sc[:, :4], sc[:, 4:]
        packed = torch.cat([lo | ((hi >> 4) << 6), lo | ((hi >> 4) << 6), (hi & 15) | ((hi & 15) << 4)], 1)
        raw[:, 4:16] = packed.to(torch.uint8)
        f16(0, d)
        f16(2, d * _QMAX[type_name] / 2)
    else:  # Q8_0, Q5_0, Q4_0: one fp16 d first
        f16(0, d)
    return raw.reshape(n_rows, -1)


def matrix_std(name: str, shape, ple: int) -> float:
    """std of a random matrix: 1/sqrt(n_in); the PLE table 1/sqrt(P) (its rows are scaled by √P)."""
    return 1.0 / math.sqrt(ple if name == "per_layer_token_embd.weight" else shape[-1])


def synthetic_specs(variant: str) -> list[dict]:
    """What `synthetic_weights` builds, without building it: for every tensor the model reads
    (models.gemma4.tensor_plan over the layout), name, torch shape, GGML type name, kind
    ("quant": QuantWeight of the GGUF bytes, "dense": a torch matrix, "vector": 1-D float32) and
    its bytes (`n_bytes`, the GGUF size for quant and BF16/F32 tensors)."""
    from models.gemma4 import Gemma4Config, tensor_plan
    from models.formats import QuantWeight

    layout = synthetic_layout(variant)
    cfg = Gemma4Config.from_gguf(layout)
    out, plan = [], tensor_plan(cfg, set(layout.tensors))
    plan.setdefault("rope_freqs.weight", None)  # read by the config (proportional RoPE factors)
    for name, shape in plan.items():
        t = layout.tensor(name)
        tn = T(t.ggml_type).name
        # 3-D expert banks are dense tensors here, as load_weights gives them today
        kind = "vector" if len(t.ne) == 1 else "quant" if tn in QuantWeight.TYPES and len(t.ne) == 2 else "dense"
        out.append({"name": name, "shape": tuple(shape or t.shape), "type": tn, "kind": kind,
                    "n_bytes": t.n_bytes})
    return out


def synthetic_weights(variant: str, device="cpu", seed: int = 0, dtype=None,
                      host_embeddings: bool = True, quantized: bool = True, fill: str = "random",
                      host_tensors: frozenset = frozenset()) -> dict:
    """Random but numerically tame weights for every tensor of the synthetic layout the model reads,
    in the runtime form `load_weights(..., quantized=True)` gives a GGUF: K-quant (and fallback)
    matrices as `QuantWeight` of random blocks made on `device` (std ~ 1/sqrt(n_in), mean ~0),
    other matrices (per_layer_model_proj, BF16 in the file) dense in `dtype`, 1-D norm weights ~1
    (q/k norms ~ hd^-1/4 so q·k stays ~N(0, 1) at attention scale 1), layer_output_scale ~0.8 and
    the layout's rope_freqs. `host_embeddings` on a non-CPU device: the lookup tables live on the
    CPU (the tied head's copy stays on the device; "token_embd.host" is the lookup copy).
    `quantized=False`: the same random matrices dequantized to dense `dtype` tensors (the plain
    torch path, e.g. a CPU without the Triton interpreter). `fill="empty"`: uninitialised tensors
    of the same shapes and types (dry runs on the meta device, `engine/bench/dry_run.py`: nothing is
    computed, and the multi-gigabyte host tables cost no RAM until read). `host_tensors`: expert
    banks built in host RAM as the loader keeps a placed bank (`ExpertBank` over GGUF bytes, for
    llama.cpp's `mul_mat_id`): the first bank of each type and shape random, the others copies of
    it (26B-A4B: 60 banks, 15 GB, in seconds rather than minutes; the bytes a step reads are as
    many and as scattered, only not different)."""
    import torch

    from models.formats import QuantWeight
    from models.weights import fuse_projections

    if fill not in ("random", "empty"):
        raise ValueError(f"fill must be 'random' or 'empty', got {fill!r}")

    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    v = VARIANTS[variant.lower()]
    gen = torch.Generator(device=device).manual_seed(seed) if fill == "random" else None
    host = host_embeddings and device.type != "cpu"
    out: dict = {}
    token_raw = None
    banks: dict = {}  # (type, shape) -> the first host bank's bytes
    for s in synthetic_specs(variant.lower()):
        name, shape, kind = s["name"], s["shape"], s["kind"]
        where = torch.device("cpu") if host and name == "per_layer_token_embd.weight" else device
        if name in host_tensors:
            out[name] = _host_bank(s, banks, seed, fill)
            continue
        if fill == "empty":
            if kind == "quant":
                from models.quant import row_bytes
                raw = torch.empty((shape[0], row_bytes(int(T[s["type"]]), shape[1])), dtype=torch.uint8, device=where)
                w = QuantWeight(raw, int(T[s["type"]]), shape, lookup=name == "per_layer_token_embd.weight")
            else:
                w = torch.empty(shape, dtype=dtype if kind == "dense" else torch.float32, device=where)
        elif kind == "quant":
            g = gen if where == device else torch.Generator().manual_seed(seed + 1)
            raw = random_quant_bytes(s["type"], shape[0], shape[1], matrix_std(name, shape, v["ple"]), g, where)
            w = QuantWeight(raw, int(T[s["type"]]), shape, lookup=name == "per_layer_token_embd.weight")
            if name == "token_embd.weight":
                token_raw = raw  # GGUF rows for the host lookup copy
            if not quantized:
                from models.quant import dequantize
                w = dequantize(raw, w.ggml_type, shape).to(dtype)
        elif kind == "dense":
            w = (torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[-1])).to(dtype)
        elif name == "rope_freqs.weight":
            w = torch.tensor(rope_freqs(v["hd_full"]), dtype=torch.float32, device=device)
        elif name.endswith("layer_output_scale.weight"):
            w = torch.full(shape, 0.8, dtype=torch.float32, device=device)
        else:
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
            if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
                w = w * shape[0] ** -0.25
        out[name] = w
    if host and "output.weight" not in out:
        e = out["token_embd.weight"]
        if fill == "empty":  # no data to copy (the device copy may be on meta)
            from models.quant import row_bytes
            raw = torch.empty((e.shape[0], row_bytes(e.ggml_type, e.shape[1])), dtype=torch.uint8)
            out["token_embd.host"] = QuantWeight(raw, e.ggml_type, e.shape, lookup=True)
        elif quantized:
            out["token_embd.host"] = QuantWeight(token_raw.cpu(), e.ggml_type, e.shape, lookup=True)
        else:
            out["token_embd.host"] = e.cpu()
    if quantized:  # as load_weights does: q/k(/v) and gate/up stacked where they share a type
        fuse_projections(out)
    return out


def _host_bank(spec: dict, made: dict, seed: int, fill: str):
    """An expert bank [E, out, in] of the spec's type in host RAM (`synthetic_weights`)."""
    import torch

    from models.formats import ExpertBank
    from models.quant import row_bytes

    if not spec["name"].endswith("_exps.weight") or len(spec["shape"]) != 3:
        raise ValueError(f"{spec['name']}: only MoE expert banks stay in host RAM in a synthetic model")
    E, n, k = spec["shape"]
    key = (spec["type"], spec["shape"])
    if fill == "empty":
        raw = torch.empty((E, n, row_bytes(int(T[spec["type"]]), k)), dtype=torch.uint8)
    elif key in made:
        raw = made[key].clone()
    else:
        gen = torch.Generator().manual_seed(seed + 2)
        raw = made[key] = random_quant_bytes(spec["type"], E * n, k, 1.0 / math.sqrt(k), gen, torch.device("cpu"))
    return ExpertBank(raw, int(T[spec["type"]]), spec["shape"])


def synthetic_model(variant: str, device="cpu", seed: int = 0, dtype=None, host_embeddings: bool = True,
                    quantized: bool = True, fill: str = "random", host_tensors: frozenset = frozenset()):
    """A `Gemma4Model` of the synthetic layout with `synthetic_weights` (bf16 activations on CUDA,
    float32 elsewhere unless `dtype` says otherwise). `host_tensors`: expert banks in host RAM,
    computed by the CPU beside the device (`Gemma4Model.host_expert_layers`; a layer's banks
    together, as the memory plan places them)."""
    import torch

    from models.gemma4 import Gemma4Config, Gemma4Model

    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = Gemma4Config.from_gguf(synthetic_layout(variant))
    from models.runtime import runtime_of_flags

    if host_tensors:  # refused before any bank is built
        from models.weights import check_host_tensors
        check_host_tensors(host_tensors, {s["name"] for s in synthetic_specs(variant.lower())})
    w = synthetic_weights(variant, device, seed, dtype, host_embeddings, quantized, fill, frozenset(host_tensors))
    model = Gemma4Model(cfg, w, dtype=dtype, device=device)
    model.runtime = runtime_of_flags(device, quantized=quantized)
    if host_tensors:
        from models.host_experts import check_host_banks

        model.host_expert_layers = frozenset(int(t.split(".")[1]) for t in host_tensors)
        check_host_banks(model)
    return model


def weight_bytes(weights: dict, device=None) -> dict[str, int]:
    """Bytes of a weight dict by kind ("quant", "dense", "vector"), only tensors on `device` if given."""
    import torch

    from models.formats import QuantWeight
    from models.weights import weight_tensors

    out = {"quant": 0, "dense": 0, "vector": 0}
    for w in weights.values():
        ts = weight_tensors(w)
        if device is not None and ts[0].device.type != torch.device(device).type:
            continue
        kind = "quant" if isinstance(w, QuantWeight) else "vector" if ts[0].dim() == 1 else "dense"
        out[kind] += sum(t.numel() * t.element_size() for t in ts)
    return out
