"""A tiny random Gemma-4 with an audio tower built with transformers (gemma4-audio.md §9), its
float64 reference outputs, test clips, and llama.cpp's converter for its mmproj.

The model also has a small vision tower: llama.cpp's converter refuses a folder without one (§7.1).
The tiny vocab (512) holds the image markers at 500/501/502 (tests/tiny_vision.py) and the audio
markers at 503/504/505, in config.json and in the text GGUF's vocabulary.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llama_sdist import converter_dir
from tiny_vision import BOI, EOI, IMG, V

BOA, EOA, AUD = 503, 504, 505


def build_tiny_audio(folder: Path):
    """Save the §9 recipe's model to `folder`; returns transformers' float64 eager model (its audio
    attention's `per_dim_scale` kept in float32: HF's attention refuses float64 otherwise, §3.4)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    cfg = Gemma4Config(
        text_config=dict(vocab_size=V, vocab_size_per_layer_input=V, hidden_size=96, intermediate_size=160,
                         num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         global_head_dim=64, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                         sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                         "sliding_attention", "full_attention"],
                         final_logit_softcapping=30.0, use_bidirectional_attention=None, pad_token_id=0,
                         bos_token_id=2, eos_token_id=1),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=3,
                           num_key_value_heads=3, head_dim=16, patch_size=16, pooling_kernel_size=3,
                           position_embedding_size=64, use_clipped_linears=True, standardize=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        # C0 must stay 128 (= the mel bins, §3.1 trap); chunk 12 / left 13 / right 0 as the real ones (§3.2)
        audio_config=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                          subsampling_conv_channels=[128, 8], output_proj_dims=48, conv_kernel_size=5,
                          attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
                          attention_logit_cap=50.0, use_clipped_linears=True, hidden_act="silu"),
        boi_token_id=BOI, eoi_token_id=EOI, image_token_id=IMG,
        boa_token_id=BOA, eoa_token_index=EOA, audio_token_id=AUD)
    torch.manual_seed(0)
    m = Gemma4ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():  # the default init is degenerate (unit norms, zero scales, ±inf clips)
        for n, p in m.named_parameters():
            if n.endswith("per_dim_scale"):  # softplus over about [-0.5, 3.5]: it matters (§9)
                p.copy_(-0.5 + 4 * torch.rand(p.shape, generator=g))
            elif "norm" in n:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif n.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1] if p.dim() > 1 else 2))
            if "audio_tower" in n and (".q_proj." in n or ".k_proj." in n):
                p.mul_(2.0)  # logits up to |z| ~ 50: the tanh cap bites (§9)
        for n, b in m.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
            audio = "audio_tower" in n
            for s, v in (("input_min", -2.0 if audio else -1.5), ("input_max", 2.0 if audio else 1.5),
                         ("output_min", -3.0 if audio else -2.0), ("output_max", 3.0 if audio else 2.0)):
                if n.endswith(s):
                    b.fill_(v)
    m.save_pretrained(folder)
    # what llama.cpp's converter reads besides config.json (the published folders carry it)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "feature_size": 128,
         "sampling_rate": 16000}))
    ref = Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float64,
                                                         attn_implementation="eager").eval()
    for layer in ref.model.audio_tower.layers:
        layer.self_attn.per_dim_scale.data = layer.self_attn.per_dim_scale.data.float()
    return ref


def make_clip(seconds: float, seed: int = 0, rate: int = 16000) -> np.ndarray:
    """Tones + a chirp + noise, PCM16-scaled float32 in [-1, 1] (§9 check 1)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * rate))) / rate
    f0 = 180 + 60 * seed
    x = 0.3 * np.sin(2 * np.pi * f0 * t) + 0.2 * np.sin(2 * np.pi * 2.7 * f0 * t + seed)
    x += 0.15 * np.sin(2 * np.pi * (300 * t + 1500 * t * t / max(seconds, 1e-3)))  # chirp 300 -> 3300 Hz
    x += 0.05 * rng.standard_normal(t.shape)
    x *= np.minimum(1, 40 * t) * (0.5 + 0.5 * np.abs(np.sin(2 * np.pi * 1.3 * t)))  # onset, and quiet bins
    pcm = np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)
    return pcm.astype(np.float32) / 32768.0


@dataclass
class AudioReference:
    features: list  # per clip [n_valid, 128] float32 (HF's extractor)
    tower: list  # per clip [N, P] float64 (audio_tower output, valid rows)
    embeds: list  # per clip [N, d] float64 (embed_audio)
    logits: torch.Tensor  # [T, V] float64
    ids: torch.Tensor  # [T]


def reference(model, clips: list, ids_text: list[list[int]]) -> AudioReference:
    """transformers' float64 outputs for `clips` (one batch, padded as HF pads) and the logits of
    piece0 <clip0> piece1 <clip1> ... (each clip boa + N×audio + eoa)."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    fe = Gemma4AudioFeatureExtractor()
    f = fe([np.asarray(c, dtype=np.float32) for c in clips], return_tensors="pt")  # a list: a batch (§8 trap)
    feats, mask = f["input_features"].double(), f["input_features_mask"]
    with torch.no_grad():
        out = model.model.audio_tower(feats, mask, return_dict=True)
        valid = out.attention_mask
        tower = [out.last_hidden_state[i][valid[i]] for i in range(len(clips))]
        embeds = [model.model.embed_audio(inputs_embeds=t[None])[0] for t in tower]
        ids = list(ids_text[0])
        for e, piece in zip(embeds, ids_text[1:]):
            ids += [BOA] + [AUD] * e.shape[0] + [EOA] + list(piece)
        ids_t = torch.tensor([ids])
        logits = model(input_ids=ids_t, input_features=feats, input_features_mask=mask).logits[0]
    features = [f["input_features"][i][mask[i]].float() for i in range(len(clips))]
    return AudioReference(features, tower, embeds, logits, ids_t[0])


def convert_mmproj(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's own converter (the 0.3.36 sdist's convert_hf_to_gguf.py --mmproj): the audio
    tensors' names and re-layouts as published mmproj files have them (§7.1)."""
    llama_cpp = converter_dir()
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "NO_LOCAL_GGUF": ""}
    cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--mmproj",
           "--outtype", outtype, "--outfile", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{r.stderr[-3000:]}")
    return out


def write_text_gguf_with_audio(folder: Path, path: Path) -> Path:
    """The text model as a `gemma4` GGUF (tests/tiny_vision.py's writer) whose vocabulary also
    holds the audio markers at 503/504/505."""
    from tiny_vision import write_text_gguf
    return write_text_gguf(folder, path, {BOA: "<|audio>", EOA: "<audio|>", AUD: "<|audio|>"})


def wav_file(path: Path, samples: np.ndarray, rate: int = 16000, subtype: str = "PCM_16") -> Path:
    import soundfile as sf
    sf.write(str(path), samples, rate, subtype=subtype)
    return path
