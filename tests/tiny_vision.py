"""A tiny random multimodal Gemma-4 built with transformers (gemma4-vision.md §7), its float64
reference outputs, and our own GGUF writers for it: the text model and an mmproj file (§6.2 map).

The tiny vocab (512) has the image markers at ids 500/501/502 in both forms: config.json carries
them for HF folders, and the text GGUF's vocabulary holds the marker strings at those ids.
"""
from __future__ import annotations

from typing import Optional

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter

V, BOI, EOI, IMG = 512, 500, 501, 502
BUDGET = 70


# 26B-A4B / 31B in miniature (gemma4-architecture.md §1.1, gemma4-vision.md §1.2): no per-layer
# embeddings, no KV sharing, full layers with K = V, images attending both ways inside themselves on
# the sliding layers; a standardized tower without clipped linears. The 26B's MoE block on every
# layer. Window 8 against images of 60 soft tokens: each image row sees its whole image ahead and
# only 8 keys behind.
BIG_TEXT = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=True,
                num_global_key_value_heads=1, use_bidirectional_attention="vision",
                layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_hidden_layers=6)
BIG_VISION = dict(use_clipped_linears=False, standardize=True)
TEXT_26B = dict(BIG_TEXT, enable_moe_block=True, num_experts=5, top_k_experts=3, moe_intermediate_size=48)
TEXT_31B = BIG_TEXT


def build_tiny_multimodal(folder: Path, text: Optional[dict] = None, vision: Optional[dict] = None):
    """Save the §7 recipe's model to `folder` (`text` / `vision`: config values over the recipe's,
    e.g. TEXT_26B and BIG_VISION); returns the float64 eager transformers model."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    cfg = Gemma4Config(
        text_config=dict(dict(vocab_size=V, vocab_size_per_layer_input=V, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              global_head_dim=64, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                              final_logit_softcapping=30.0, use_bidirectional_attention=None, pad_token_id=0,
                              bos_token_id=2, eos_token_id=1), **(text or {})),
        vision_config=dict(dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
                                num_key_value_heads=3, head_dim=16, patch_size=16, pooling_kernel_size=3,
                                position_embedding_size=64, use_clipped_linears=True, standardize=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 100.0}), **(vision or {})),
        audio_config=None, boi_token_id=BOI, eoi_token_id=EOI, image_token_id=IMG)
    torch.manual_seed(0)
    m = Gemma4ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():  # the default init is degenerate (unit norms, constant tables, ±inf clips)
        for n, p in m.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in n else
                    torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1] if p.dim() > 1 else 2))
        for n, b in m.named_buffers():
            if n.endswith("layer_scalar") or n.endswith("std_scale"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
            if n.endswith("std_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
            for s, v in (("input_min", -1.5), ("input_max", 1.5), ("output_min", -2.0), ("output_max", 2.0)):
                if n.endswith(s):
                    b.fill_(v)
    m.save_pretrained(folder)
    m = Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager")
    if cfg.text_config.enable_moe_block:  # the grouped_mm experts take no float64
        m.set_experts_implementation("eager")
    return m.eval()


def random_image(h: int, w: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@dataclass
class Reference:
    embeds: list  # per image [N, 64] float64
    logits: torch.Tensor  # [T, V] float64
    ids: torch.Tensor  # [T]


def reference(model, images: list, ids_text: list[list[int]], budget: int = BUDGET) -> Reference:
    """transformers' float64 embeddings of `images` and logits of text pieces with one image block
    between consecutive pieces: piece0 <img0> piece1 <img1> ... (HF's PIL processor)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    f = Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=images, return_tensors="pt")
    ns = [int(n) for n in f["num_soft_tokens_per_image"]]
    ids = list(ids_text[0])
    for n, piece in zip(ns, ids_text[1:]):
        ids += [BOI] + [IMG] * n + [EOI] + list(piece)
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        pv, pos = f["pixel_values"].double(), f["image_position_ids"]
        emb = model.model.get_image_features(pv, pos).pooler_output
        if isinstance(emb, (tuple, list)):  # one [N_i, d] per image
            embeds = [e.reshape(-1, e.shape[-1]) for e in emb]
        else:
            embeds = list(torch.split(emb.reshape(-1, emb.shape[-1]), ns))
        # the processor's token types (1 at image soft tokens): HF's bidirectional mask reads them
        types = (ids_t == IMG).long()
        logits = model(input_ids=ids_t, pixel_values=pv, image_position_ids=pos, mm_token_type_ids=types).logits[0]
    return Reference(embeds, logits, ids_t[0])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def row_min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min())


# --- our own GGUF writers ----------------------------------------------------------------------
def _state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _add_matrix(w: GGUFWriter, name: str, arr: np.ndarray, quant: Optional[str]) -> None:
    """A matrix as is, or quantized to `quant` where its rows are whole blocks (32 values)."""
    if quant is None or arr.shape[-1] % 32:
        w.add_tensor(name, arr)
        return
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    t = GGMLQuantizationType[quant]
    w.add_tensor(name, quantize(arr.astype(np.float32), t), raw_dtype=t)


def write_mmproj(folder: Path, path: Path, f16_patch: bool = False, quant: Optional[str] = None) -> Path:
    """The vision tower + projector of an HF folder as an mmproj GGUF, by the §6.2 map (the conv
    re-layout of the patch embedding, clip bounds as [1] tensors, the llama.cpp metadata keys).
    `quant` ("Q8_0"): the linears and the projection whose inputs are whole blocks of 32 values
    (here the FFN's down projection) quantized by gguf-py."""
    from models.gemma4_vision import LINEARS, NORMS

    cfg = json.loads((folder / "config.json").read_text())
    v, text = cfg["vision_config"], cfg["text_config"]
    sd = _state(folder)
    D, p = v["hidden_size"], v["patch_size"]
    w = GGUFWriter(str(path), arch="clip")
    w.add_string("general.type", "mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.vision.projector_type", "gemma4v")
    w.add_uint32("clip.vision.projection_dim", text["hidden_size"])
    w.add_uint32("clip.vision.embedding_length", D)
    w.add_uint32("clip.vision.feed_forward_length", v["intermediate_size"])
    w.add_uint32("clip.vision.block_count", v["num_hidden_layers"])
    w.add_uint32("clip.vision.attention.head_count", v["num_attention_heads"])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v["rms_norm_eps"])
    w.add_uint32("clip.vision.patch_size", p)
    w.add_uint32("clip.vision.image_size", 224)
    w.add_array("clip.vision.image_mean", [0.0, 0.0, 0.0])
    w.add_array("clip.vision.image_std", [1.0, 1.0, 1.0])
    pre = "model.vision_tower."
    pe = sd[pre + "patch_embedder.input_proj.weight"].reshape(D, p, p, 3).permute(0, 3, 1, 2).contiguous()
    w.add_tensor("v.patch_embd.weight", pe.numpy().astype(np.float16 if f16_patch else np.float32))
    w.add_tensor("v.position_embd.weight", sd[pre + "patch_embedder.position_embedding_table"].numpy())
    for i in range(v["num_hidden_layers"]):
        h, g = f"{pre}encoder.layers.{i}.", f"v.blk.{i}."
        for gg, hh in LINEARS.items():
            _add_matrix(w, g + gg + ".weight", sd[h + hh + ".linear.weight"].numpy(), quant)
            for s in ("input_min", "input_max", "output_min", "output_max"):
                if h + hh + "." + s in sd:  # use_clipped_linears (E2B/E4B)
                    w.add_tensor(g + gg + "." + s, sd[h + hh + "." + s].reshape(1).numpy())
        for gg, hh in NORMS.items():
            w.add_tensor(g + gg + ".weight", sd[h + hh + ".weight"].numpy())
    _add_matrix(w, "mm.input_projection.weight", sd["model.embed_vision.embedding_projection.weight"].numpy(), quant)
    if v.get("standardize"):  # 26B/31B
        for s in ("std_bias", "std_scale"):
            w.add_tensor(f"v.{s}", sd[pre + s].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_text_gguf(folder: Path, path: Path, special: dict | None = None) -> Path:
    """The language model of an HF folder as a `gemma4` GGUF, by the inverse of models.gemma4's
    HF name tables, with a tiny vocabulary that holds the image markers at 500/501/502 (and the
    control tokens of `special`: id -> text)."""
    from models.gemma4 import HF_GLOBAL_NAMES, HF_LAYER_NAMES
    from tiny_models import add_tiny_tokenizer

    cfg = json.loads((folder / "config.json").read_text())
    c = cfg["text_config"]
    sd = _state(folder)
    arch, L = "gemma4", c["num_hidden_layers"]
    sliding = [t == "sliding_attention" for t in c["layer_types"]]
    hd_s = c["head_dim"]
    hd_f = max([int(o.get("head_dim", hd_s)) for o in (c.get("per_layer_config") or {}).values()] + [hd_s])
    if "global_head_dim" in c:
        hd_f = c["global_head_dim"]
    w = GGUFWriter(str(path), arch=arch)
    # a chat model (models/model_kind.py), as the E2B-it it stands for: without it the file has no
    # template and no fine-tune word, so `run`, `chat` and the app would continue its text
    w.add_string("general.finetune", "it")
    w.add_uint32(f"{arch}.block_count", L)
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.embedding_length", c["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", c["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", c["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", c["num_key_value_heads"])
    for suffix, hd in (("", hd_f), ("_swa", hd_s)):
        w.add_uint32(f"{arch}.attention.key_length{suffix}", hd)
        w.add_uint32(f"{arch}.attention.value_length{suffix}", hd)
        w.add_uint32(f"{arch}.rope.dimension_count{suffix}", hd)
    rp = c["rope_parameters"]
    w.add_float32(f"{arch}.rope.freq_base", rp["full_attention"]["rope_theta"])
    w.add_float32(f"{arch}.rope.freq_base_swa", rp["sliding_attention"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_uint32(f"{arch}.attention.sliding_window", c["sliding_window"])
    w.add_array(f"{arch}.attention.sliding_window_pattern", sliding)
    w.add_uint32(f"{arch}.attention.shared_kv_layers", c["num_kv_shared_layers"])
    w.add_uint32(f"{arch}.embedding_length_per_layer_input", c["hidden_size_per_layer_input"])
    w.add_float32(f"{arch}.final_logit_softcapping", c["final_logit_softcapping"])
    if c.get("enable_moe_block"):
        w.add_uint32(f"{arch}.expert_count", c["num_experts"])
        w.add_uint32(f"{arch}.expert_used_count", c["top_k_experts"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", c["moe_intermediate_size"])
    add_tiny_tokenizer(w, V, {BOI: "<|image>", EOI: "<image|>", IMG: "<|image|>", **(special or {})})
    # proportional RoPE on full layers: the first partial_rotary_factor of the pairs rotate
    rf = rp["full_attention"]
    n_rot = int(float(rf.get("partial_rotary_factor", 1.0)) * hd_f / 2) if rf.get("rope_type") == "proportional" \
        else hd_f // 2
    w.add_tensor("rope_freqs.weight", np.array([1.0 if j < n_rot else 1e30 for j in range(hd_f // 2)],
                                               dtype=np.float32))
    pre = "model.language_model."
    for hf, gg in HF_GLOBAL_NAMES.items():
        if pre + hf in sd:
            w.add_tensor(gg, sd[pre + hf].float().numpy())
    for i in range(L):
        for hf, gg in HF_LAYER_NAMES.items():
            key = f"{pre}layers.{i}.{hf}"
            if key in sd:
                w.add_tensor(f"blk.{i}.{gg}", sd[key].float().reshape(-1).numpy() if sd[key].dim() == 0
                             else sd[key].float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_logits_with_images(path: Path, pieces: list) -> np.ndarray:
    """llama.cpp's logits at every position ([T, vocab] float32, F32 KV cache) of a prompt given as
    pieces: token ids (a list) or image soft-token rows (a float32 array [N, d]). Each image is one
    batch of embeddings decoded with causal attention off, as mtmd's `mtmd_helper_decode_image_chunk`
    does for a model where `mtmd_decode_use_non_causal` holds (gemma4v unless n_embd is 1536 or
    2560); gemma4's `LLAMA_NON_CAUSAL_TYPE_SWA_ONLY` then lifts the causal mask on the SWA layers
    only. The batch holds the whole prompt piece, so an image is never split (n_ubatch = n_ctx)."""
    import ctypes

    import llama_cpp

    from tiny_models import default_threads, quiet_llama_cpp

    quiet_llama_cpp()
    n_ctx = 512
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          type_k=0, type_v=0, n_threads=default_threads(), verbose=False, flash_attn=False)
    ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()
    out, n_past = [], 0
    try:
        for piece in pieces:
            image = isinstance(piece, np.ndarray)
            n = len(piece)
            batch = llama_cpp.llama_batch_init(n, piece.shape[1] if image else 0, 1)
            try:
                batch.n_tokens = n
                if image:
                    rows = np.ascontiguousarray(piece, dtype=np.float32)
                    ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
                for i in range(n):
                    if not image:
                        batch.token[i] = int(piece[i])
                    batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = n_past + i, 1, 0, 1
                llama_cpp.llama_set_causal_attn(ctx, not image)
                try:
                    assert llama_cpp.llama_decode(ctx, batch) == 0
                finally:
                    llama_cpp.llama_set_causal_attn(ctx, True)
                for i in range(n):
                    row = llama_cpp.llama_get_logits_ith(ctx, i)
                    out.append(np.ctypeslib.as_array(row, shape=(n_vocab,)).copy())
            finally:
                llama_cpp.llama_batch_free(batch)
            n_past += n
    finally:
        llm.close()
    return np.stack(out)
