"""Gemma 4 audio input: the USM-style Conformer tower and the projector (`embed_audio`) of E2B/E4B,
in plain torch. Features come from models/audio.py.

Spec: shared/design/gemma4-audio.md §3 (tower), §4 (projector, token count), §7 (mmproj GGUF).
Weights are kept under the mmproj's GGUF names (`a.blk.3.attn_q.weight`); HF folders are renamed
into them (`hf_names`) with the converter's two re-layouts done at load: `per_dim_scale` stored as
softplus(per_dim_scale), the depthwise conv as [H, 5]. Note the GGUF names of the conv module's
norms are swapped against HF's (§7.2): `conv_norm` is the norm *before* linear_start and
`norm_conv` the one after the depthwise conv; the forward below reads them that way.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from .audio import N_MEL, AudioError, AudioInput, log_mel
from . import encoder
from .encoder import EncoderTower, Trace, hf_layer_names, load_checked, plan_linears, rms
from .metadata import ConfigError, MetadataReader

# The real E2B/E4B ids (§1.2); a checkpoint's own config or vocabulary wins.
BOA_ID, AUDIO_ID, EOA_ID = 256000, 258881, 258883
BOA, AUDIO, EOA = "<|audio>", "<|audio|>", "<audio|>"
# GGUF name -> HF name inside `layers.i.` (§7.2); every one of these is a clippable linear
LINEARS = {"ffn_up": "feed_forward1.ffw_layer_1", "ffn_down": "feed_forward1.ffw_layer_2",
           "ffn_up_1": "feed_forward2.ffw_layer_1", "ffn_down_1": "feed_forward2.ffw_layer_2",
           "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_out": "self_attn.post", "conv_pw1": "lconv1d.linear_start", "conv_pw2": "lconv1d.linear_end"}
NORMS = {"ffn_norm": "feed_forward1.pre_layer_norm", "ffn_post_norm": "feed_forward1.post_layer_norm",
         "ffn_norm_1": "feed_forward2.pre_layer_norm", "ffn_post_norm_1": "feed_forward2.post_layer_norm",
         "attn_pre_norm": "norm_pre_attn", "attn_post_norm": "norm_post_attn", "ln2": "norm_out",
         "conv_norm": "lconv1d.pre_layer_norm", "norm_conv": "lconv1d.conv_norm"}  # swapped by name (§7.2)
K_SCALE = math.log(1 + math.e) / math.log(2)  # 1.894620 on every key (§3.4)


@dataclass(frozen=True)
class Gemma4AudioConfig:
    d_model: int  # H: 1024 for E2B/E4B
    n_layer: int  # 12
    n_head: int  # 8 (head dim 128)
    ffn_width: int  # 4H
    sscp_channels: tuple[int, int]  # (C0, C1) = (128, 32): the two stride-2 Conv2d widths
    out_width: int  # P = output_proj_dims (1536)
    text_width: int  # d of the language model: the projector's output (1536 E2B, 2560 E4B)
    conv_kernel: int = 5
    chunk: int = 12  # attention_chunk_size / context_left / context_right: only 12/13/0 exists (§3.2)
    context_left: int = 13
    context_right: int = 0
    logit_cap: float = 50.0
    residual_weight: float = 0.5
    rms_eps: float = 1e-6  # the GGUF's value is not trusted (§7.3): 1e-6 as llama.cpp
    clipped: bool = True
    boa_id: int = BOA_ID
    audio_id: int = AUDIO_ID
    eoa_id: int = EOA_ID
    pad_id: int = 0  # the PLE row used at audio positions (§5)

    def __post_init__(self):
        if self.d_model <= 0 or self.n_head <= 0 or self.d_model % self.n_head:
            raise ConfigError(f"audio width {self.d_model} over {self.n_head} heads")
        if (self.chunk, self.context_left, self.context_right) != (12, 13, 0):
            # HF's blocked attention equals the 12-key band only for these (its table has
            # (chunk + left - 1 + right) // 2 + 1 rows, its rel-shift assumes `left`: §3.2)
            raise ConfigError(f"audio attention chunk/left/right {self.chunk}/{self.context_left}/"
                              f"{self.context_right}: only 12/13/0 (E2B/E4B) is supported")
        if self.d_model % 2 or self.conv_kernel < 1:
            raise ConfigError(f"audio width {self.d_model} / conv kernel {self.conv_kernel}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def window(self) -> int:
        """Keys a token sees: itself and the 11 before it (context_left - 1; §3.4, §10 item 1)."""
        return self.context_left - 1

    @property
    def sscp_width(self) -> int:
        """The input projection's width: (128 mel / 4) · C1 (HF sizes it from C0; §3.1 trap)."""
        return (N_MEL // 4) * self.sscp_channels[1]

    @classmethod
    def from_hf(cls, config_json: Mapping[str, Any]) -> "Gemma4AudioConfig":
        a = config_json.get("audio_config")
        if not a:
            raise ConfigError("the model has no audio tower (no audio_config)")
        text = config_json.get("text_config", {})
        H = int(a.get("hidden_size", 1024))
        ch = tuple(int(c) for c in a.get("subsampling_conv_channels", (128, 32)))
        if len(ch) != 2:
            raise ConfigError(f"subsampling_conv_channels {list(ch)}: expected two widths")
        if a.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"audio activation {a.get('hidden_act')!r}: only silu is supported")
        eoa = config_json.get("eoa_token_index", config_json.get("eoa_token_id", EOA_ID))  # either (§1.2)
        return cls(d_model=H, n_layer=int(a.get("num_hidden_layers", 12)), n_head=int(a.get("num_attention_heads", 8)),
                   ffn_width=4 * H, sscp_channels=ch, out_width=int(a.get("output_proj_dims", 1536)),
                   text_width=int(text["hidden_size"]), conv_kernel=int(a.get("conv_kernel_size", 5)),
                   chunk=int(a.get("attention_chunk_size", 12)), context_left=int(a.get("attention_context_left", 13)),
                   context_right=int(a.get("attention_context_right", 0)),
                   logit_cap=float(a.get("attention_logit_cap", 50.0)),
                   residual_weight=float(a.get("residual_weight", 0.5)), rms_eps=float(a.get("rms_norm_eps", 1e-6)),
                   clipped=bool(a.get("use_clipped_linears", True)),
                   boa_id=int(config_json.get("boa_token_id", BOA_ID)),
                   audio_id=int(config_json.get("audio_token_id", AUDIO_ID)), eoa_id=int(eoa),
                   pad_id=int(text.get("pad_token_id", 0) or 0))

    @classmethod
    def from_gguf(cls, mmproj, token_ids: Optional[tuple[int, int, int, int]] = None) -> "Gemma4AudioConfig":
        """From an mmproj `GGUFFile` (§7.3). The GGUF carries no chunk/context/cap/residual/kernel
        constants and an untrustworthy epsilon: the constants, the kernel and P from the tensors'
        shapes. `token_ids`: (boa, audio, eoa, pad) from the text model's vocabulary."""
        key = MetadataReader(mmproj.metadata, "clip.", mmproj.path.name)
        if not key.bool("has_audio_encoder", False):
            raise ConfigError("the mmproj file has no audio encoder")
        kind = key.str("audio.projector_type", "")
        if kind != "gemma4a":
            raise ConfigError(f"mmproj audio projector type {kind!r} is not Gemma 4's (gemma4a)")
        if key.int("audio.num_mel_bins", N_MEL) != N_MEL:
            raise ConfigError(f"audio encoder reads {key.int('audio.num_mel_bins')} mel bins; the features have {N_MEL}")
        c0 = mmproj.tensor("a.conv1d.0.weight").shape[0]  # torch [C0, 1, 3, 3]
        c1 = mmproj.tensor("a.conv1d.1.weight").shape[0]
        boa, aud, eoa, pad = token_ids or (BOA_ID, AUDIO_ID, EOA_ID, 0)
        return cls(d_model=key.int("audio.embedding_length"), n_layer=key.layer_count("audio.block_count"),
                   n_head=key.int("audio.attention.head_count"), ffn_width=key.int("audio.feed_forward_length"),
                   sscp_channels=(int(c0), int(c1)), out_width=int(mmproj.tensor("a.pre_encode.out.weight").shape[0]),
                   text_width=key.int("audio.projection_dim"),
                   conv_kernel=int(mmproj.tensor("a.blk.0.conv_dw.weight").shape[-1]),
                   clipped=any(n.startswith("a.") and n.endswith(".input_min") for n in mmproj.tensors),
                   boa_id=boa, audio_id=aud, eoa_id=eoa, pad_id=pad)


def token_ids_from_vocab(piece_to_id: Callable[[str], Optional[int]], pad_id: int = 0):
    """(boa, audio, eoa, pad) ids looked up by their strings in a vocabulary, else the real ids."""
    return encoder.token_ids_from_vocab(piece_to_id, (BOA, AUDIO, EOA), (BOA_ID, AUDIO_ID, EOA_ID), pad_id)


# --- weights ---------------------------------------------------------------------------------
def tensor_plan(cfg: Gemma4AudioConfig, present: set[str]) -> dict[str, tuple[int, ...]]:
    """GGUF name -> torch shape of every tensor the tower reads (after the re-layouts of `load`)."""
    H, FF, (c0, c1), P = cfg.d_model, cfg.ffn_width, cfg.sscp_channels, cfg.out_width
    plan = {"a.conv1d.0.weight": (c0, 1, 3, 3), "a.conv1d.0.norm.weight": (c0,),
            "a.conv1d.1.weight": (c1, c0, 3, 3), "a.conv1d.1.norm.weight": (c1,),
            "a.input_projection.weight": (H, cfg.sscp_width), "a.pre_encode.out.weight": (P, H),
            "a.pre_encode.out.bias": (P,), "mm.a.input_projection.weight": (cfg.text_width, P)}
    shapes = {"ffn_up": (FF, H), "ffn_down": (H, FF), "ffn_up_1": (FF, H), "ffn_down_1": (H, FF),
              "attn_q": (H, H), "attn_k": (H, H), "attn_v": (H, H), "attn_out": (H, H),
              "conv_pw1": (2 * H, H), "conv_pw2": (H, H)}
    for i in range(cfg.n_layer):
        b = f"a.blk.{i}."
        plan_linears(plan, b, shapes, present)
        for name in NORMS:
            plan[b + name + ".weight"] = (H,)
        plan.update({b + "attn_k_rel.weight": (H, H), b + "per_dim_scale.weight": (cfg.head_dim,),
                     b + "conv_dw.weight": (H, cfg.conv_kernel)})
    return plan


def hf_names(n_layer: int) -> dict[str, str]:
    """HF name (after `model.`) -> GGUF name, for `models.hf.HFCheckpoint`."""
    t = "audio_tower."
    out = {t + "subsample_conv_projection.layer0.conv.weight": "a.conv1d.0.weight",
           t + "subsample_conv_projection.layer0.norm.weight": "a.conv1d.0.norm.weight",
           t + "subsample_conv_projection.layer1.conv.weight": "a.conv1d.1.weight",
           t + "subsample_conv_projection.layer1.norm.weight": "a.conv1d.1.norm.weight",
           t + "subsample_conv_projection.input_proj_linear.weight": "a.input_projection.weight",
           t + "output_proj.weight": "a.pre_encode.out.weight", t + "output_proj.bias": "a.pre_encode.out.bias",
           "embed_audio.embedding_projection.weight": "mm.a.input_projection.weight"}
    for i in range(n_layer):
        h, g = f"{t}layers.{i}.", f"a.blk.{i}."
        hf_layer_names(out, h, g, LINEARS, NORMS)
        out[h + "self_attn.relative_k_proj.weight"] = g + "attn_k_rel.weight"
        out[h + "self_attn.per_dim_scale"] = g + "per_dim_scale.weight"
        out[h + "lconv1d.depthwise_conv1d.weight"] = g + "conv_dw.weight"
    return out


def _load_one(source, name: str, shape, dtype, hf: bool) -> torch.Tensor:
    if hf and name.endswith(".per_dim_scale.weight"):  # the GGUF stores softplus(p) (§7.1): so do we
        return F.softplus(source.load(name, shape, dtype=torch.float64)).to(dtype)
    if hf and name.endswith(".conv_dw.weight"):  # HF torch[H, 1, K] -> [H, K] as the converter
        return source.load(name, None, dtype=dtype).reshape(shape)
    return load_checked(source, name, shape, dtype)


def activation_bytes(cfg: Gemma4AudioConfig, n_frames: int = 2999, elem: int = 4) -> int:
    """Peak working memory of encoding one 30 s piece (2999 frames, 750 tokens): the larger of the
    first SSCP conv's stage (its output [C0, F/2, 64], the LayerNorm's permuted copy and the ReLU's:
    3 tensors, 147 MB in fp32 for E2B) and one Conformer layer (the residual and five H-wide
    temporaries, the FFN's two 4H, and the attention's key and value windows [N, 12, H] each)."""
    f1, n = -(-n_frames // 2), -(-n_frames // 4)
    sscp = 3 * cfg.sscp_channels[0] * f1 * (N_MEL // 2)
    layer = n * (6 * cfg.d_model + 2 * cfg.ffn_width + 3 * cfg.window * cfg.d_model)
    return elem * (max(sscp, layer) + n_frames * N_MEL)


def relative_table(width: int, window: int) -> torch.Tensor:
    """float64 [window, width]: row δ = [sin(δ·ω_i) | cos(δ·ω_i)], halves concatenated, with
    ω_i = exp(-i·ln(10⁴) / (width/2 - 1)) (§3.2). Only δ < window is ever visible."""
    half = width // 2
    omega = torch.exp(-torch.arange(half, dtype=torch.float64) * math.log(1e4) / max(half - 1, 1))
    ang = torch.arange(window, dtype=torch.float64)[:, None] * omega
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class Gemma4Audio(EncoderTower):
    """The audio tower + projector over a weight dict keyed by mmproj GGUF names."""

    def __init__(self, cfg: Gemma4AudioConfig, weights: Mapping[str, torch.Tensor], dtype=torch.float32,
                 device="cpu"):
        super().__init__(cfg, weights, dtype, device)
        self.rel = relative_table(cfg.d_model, cfg.window).to(self.device, dtype)  # [12, H]

    def activation_bytes(self, n_frames: int = 2999) -> int:
        return activation_bytes(self.cfg, n_frames, self.elem_size)

    @torch.no_grad()
    def encode(self, clips: Sequence[AudioInput], trace: Trace = None) -> list[torch.Tensor]:
        """Clips -> their soft-token embeddings, each [N_i, text_width] in the model dtype. Each
        30 s piece is encoded on its own (llama.cpp's rule for long clips), one after the other:
        no padding and no frame mask exist, and the activation peak stays one piece's (what the
        memory plan counts; batching two 30 s pieces measured twice the peak for no gain at 750
        rows a matmul)."""
        out = []
        for clip in clips:
            rows = [self.encode_features(log_mel(piece)[None], trace)[0] for piece in clip.pieces()]
            e = torch.cat(rows)
            if e.shape[0] != clip.n_tokens:
                raise AudioError(f"{clip.name or 'audio'}: the tower gave {e.shape[0]} rows for {clip.n_tokens} tokens")
            out.append(e)
        return out

    def encode_features(self, feats: torch.Tensor, trace: Trace = None) -> torch.Tensor:
        """Features [B, F, 128] (all frames valid) -> projected rows [B, ceil(F/4), text_width]."""
        cfg, w = self.cfg, self.w
        if feats.shape[1] == 0:
            raise AudioError("a clip with no audio frames (at least 161 samples at 16 kHz)")
        x = feats.to(self.device, self.dtype)[:, None]  # NCHW [B, 1, F, 128]: H = time, W = mel
        for j in (0, 1):  # stride-2 3x3 conv, LayerNorm over channels (no bias), ReLU (§3.1)
            x = F.conv2d(x, w[f"a.conv1d.{j}.weight"], stride=2, padding=1)
            x = x.permute(0, 2, 3, 1)  # [B, T, f, C]: channels last for the norm
            xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
            x = F.relu(F.layer_norm(xf, (x.shape[-1],), w[f"a.conv1d.{j}.norm.weight"].to(xf.dtype), None,
                                    cfg.rms_eps).to(x.dtype)).permute(0, 3, 1, 2)
        B, C1, N, Fq = x.shape
        x = x.permute(0, 2, 3, 1).reshape(B, N, Fq * C1)  # frequency-major, channel fastest (§3.1 step 4)
        h = F.linear(x, w["a.input_projection.weight"])  # [B, N, H], not clipped
        if trace:
            trace("sscp", -1, h)
        for i in range(cfg.n_layer):
            h = self._layer(i, h)
            if trace:
                trace("layer", i, h)
        out = self._linear(h, "a.pre_encode.out", bias=True)  # [B, N, P]
        if trace:
            trace("tower_out", -1, out)
        return F.linear(rms(out, None, cfg.rms_eps), w["mm.a.input_projection.weight"])  # embed_audio (§4.1)

    def _ffn(self, h: torch.Tensor, b: str, suffix: str) -> torch.Tensor:
        """h + ½·RMSNorm(CL₂(silu(CL₁(RMSNorm(h))))): no gate; the ½ after the post-norm (§3.6)."""
        eps, w = self.cfg.rms_eps, self.w
        f = self._linear(F.silu(self._linear(rms(h, w[f"{b}ffn_norm{suffix}.weight"], eps), f"{b}ffn_up{suffix}")),
                         f"{b}ffn_down{suffix}")
        return h + self.cfg.residual_weight * rms(f, w[f"{b}ffn_post_norm{suffix}.weight"], eps)

    def _attention(self, a: torch.Tensor, b: str) -> torch.Tensor:
        """Banded causal attention with a per-distance bias (§3.4), one batched op over all tokens:
        token t sees keys s = t-11..t (the 12-key window), logit q_t·k_s + q_t·r_{t-s}, 50·tanh(z/50),
        masked (-1e9, after the cap) where s < 0. Keys and values are gathered as windows
        [B, N, heads, hd, 12] (views of the left-padded K/V), so the cost is 12 keys a token, not N.
        In float32 at least, as HF runs this block."""
        cfg, w = self.cfg, self.w
        B, N, H = a.shape
        nh, hd, W = cfg.n_head, cfg.head_dim, cfg.window
        cdt = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float32
        q = self._linear(a, b + "attn_q").to(cdt).view(B, N, nh, hd)
        q = q * ((hd ** -0.5) / math.log(2)) * w[b + "per_dim_scale.weight"].to(cdt)  # softplus already applied
        k = (self._linear(a, b + "attn_k").to(cdt) * K_SCALE).view(B, N, nh, hd)
        v = self._linear(a, b + "attn_v").to(cdt).view(B, N, nh, hd)
        # window slot j holds key s = t - (W-1) + j, at distance δ = W-1-j
        r = F.linear(self.rel.to(cdt), w[b + "attn_k_rel.weight"].to(cdt)).view(W, nh, hd).flip(0)  # [W(slot), nh, hd]
        kw = F.pad(k, (0, 0, 0, 0, W - 1, 0)).unfold(1, W, 1)  # [B, N, nh, hd, W]
        vw = F.pad(v, (0, 0, 0, 0, W - 1, 0)).unfold(1, W, 1)
        z = torch.einsum("bnhd,bnhdw->bnhw", q, kw) + torch.einsum("bnhd,whd->bnhw", q, r)
        z = cfg.logit_cap * torch.tanh(z / cfg.logit_cap)
        slot = torch.arange(W, device=a.device)
        before_start = slot[None, :] < (W - 1) - torch.arange(N, device=a.device)[:, None]  # [N, W]: s < 0
        z = z.masked_fill(before_start[None, :, None, :], -1e9)
        o = torch.einsum("bnhw,bnhdw->bnhd", torch.softmax(z, dim=-1), vw).reshape(B, N, H)
        return self._linear(o.to(a.dtype), b + "attn_out")

    def _conv_module(self, h: torch.Tensor, b: str) -> torch.Tensor:
        """RMSNorm -> CL H->2H -> GLU (first half value, second gate) -> causal depthwise conv
        (kernel 5, zeros before t=0) -> RMSNorm -> SiLU -> CL H->H, full residual (§3.5)."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_eps
        y = self._linear(rms(h, w[b + "conv_norm.weight"], eps), b + "conv_pw1")  # GGUF conv_norm = HF pre
        y = y[..., :cfg.d_model] * torch.sigmoid(y[..., cfg.d_model:])
        y = F.conv1d(F.pad(y.transpose(1, 2), (cfg.conv_kernel - 1, 0)), w[b + "conv_dw.weight"][:, None, :],
                     groups=cfg.d_model).transpose(1, 2)
        y = F.silu(rms(y, w[b + "norm_conv.weight"], eps))  # GGUF norm_conv = HF conv_norm
        return h + self._linear(y, b + "conv_pw2")

    def _layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """One Conformer layer (§3.3): FFN₁, attention, conv module, FFN₂, RMSNorm."""
        w, b, eps = self.w, f"a.blk.{i}.", self.cfg.rms_eps
        h = self._ffn(h, b, "")
        h = h + rms(self._attention(rms(h, w[b + "attn_pre_norm.weight"], eps), b), w[b + "attn_post_norm.weight"], eps)
        h = self._conv_module(h, b)
        h = self._ffn(h, b, "_1")
        return rms(h, w[b + "ln2.weight"], eps)


OPTIONAL_LLAMA_CPP = ("a.conv1d.0.bias", "a.conv1d.1.bias", "a.input_projection.bias", "mm.a.soft_emb_norm.weight")


def load_audio_tower(source, cfg: Gemma4AudioConfig, dtype=torch.float32, device="cpu") -> Gemma4Audio:
    """The tower from an mmproj `GGUFFile` or an `HFCheckpoint` opened with `hf_names`."""
    from .hf import HFCheckpoint

    present, hf = set(source.tensors), isinstance(source, HFCheckpoint)
    weights = {name: _load_one(source, name, shape, dtype, hf).to(device)
               for name, shape in tensor_plan(cfg, present).items()}
    extra = [n for n in present if n in OPTIONAL_LLAMA_CPP or n.endswith(".per_dim_k_scale.weight")]
    if extra:
        warnings.warn(f"mmproj has {', '.join(sorted(extra)[:3])} (not in HF's Gemma 4); ignored (spec §7.2)")
    return Gemma4Audio(cfg, weights, dtype=dtype, device=device)


def load_audio_hf(folder: str | Path, dtype=torch.float32, device="cpu") -> Gemma4Audio:
    from .hf import HFCheckpoint

    cfg = Gemma4AudioConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
    return load_audio_tower(HFCheckpoint(folder, hf_names(cfg.n_layer), {}), cfg, dtype, device)

