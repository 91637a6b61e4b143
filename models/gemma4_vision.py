"""Gemma 4 image input: preprocessing, the vision tower (16-layer encoder with 2-D RoPE) and the
projector (`embed_vision`), in plain torch.

Spec: shared/design/gemma4-vision.md §2 (preprocessing), §3 (encoder), §4.1 (projector), §6 (mmproj
GGUF). HF (transformers) is the reference where llama.cpp differs: GELU-tanh in the MLP (llama.cpp's
mmproj files run GELU-quick) and the budget-filling resize (llama.cpp keeps the native size).
Weights are kept under the mmproj's GGUF names (`v.blk.3.attn_q.weight`); HF folders are renamed
into them (`hf_names`), and the conv-layout patch embedding is re-laid out at load.
"""
from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from . import encoder
from .encoder import EncoderTower, Trace, hf_layer_names, load_checked, matmul, plan_linears, rms
from .metadata import ConfigError, MetadataReader

BUDGETS = (70, 140, 280, 560, 1120)  # soft-token budgets HF accepts (§2 step 2)
DEFAULT_BUDGET = 280
# The real E2B/E4B ids (§1.2); a checkpoint's own config or vocabulary wins.
BOI_ID, IMAGE_ID, EOI_ID = 255999, 258880, 258882
BOI, IMAGE, EOI = "<|image>", "<|image|>", "<image|>"
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_out": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
NORMS = {"ln1": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
         "ln2": "pre_feedforward_layernorm", "ffn_post_norm": "post_feedforward_layernorm",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class ImageError(ValueError):
    """A one-line refusal of an image (not an image, a bomb, too small, too many for the context)."""


@dataclass(frozen=True)
class Gemma4VisionConfig:
    d_model: int  # D: 768 for E2B/E4B
    n_layer: int  # 16
    n_head: int  # 12
    ffn_width: int  # 3072
    text_width: int  # d of the language model: the projector's output (1536 E2B, 2560 E4B)
    pos_rows: int  # position-table rows per axis (10240)
    patch_size: int = 16
    pool: int = 3
    rope_theta: float = 100.0
    rms_eps: float = 1e-6
    clipped: bool = True  # use_clipped_linears (E2B/E4B)
    standardize: bool = False  # 26B/31B only
    gelu_quick: bool = False  # llama.cpp parity only (§8 item 1); HF uses GELU-tanh
    boi_id: int = BOI_ID
    image_id: int = IMAGE_ID
    eoi_id: int = EOI_ID
    pad_id: int = 0  # the PLE row used at image positions (§4.3)

    def __post_init__(self):
        if self.d_model <= 0 or self.n_head <= 0 or self.d_model % self.n_head:
            raise ConfigError(f"vision width {self.d_model} over {self.n_head} heads")
        if self.head_dim % 4:  # two axes, each NeoX-split in halves
            raise ConfigError(f"vision head dim {self.head_dim} is not a multiple of 4 (2-D RoPE)")
        if self.patch_size <= 0 or self.pool <= 0:
            raise ConfigError(f"vision patch {self.patch_size} / pooling {self.pool}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def patch_width(self) -> int:
        return 3 * self.patch_size ** 2

    @classmethod
    def from_hf(cls, config_json: Mapping[str, Any]) -> "Gemma4VisionConfig":
        v = config_json.get("vision_config")
        if not v:
            raise ConfigError("the model has no vision tower (no vision_config)")
        text = config_json.get("text_config", {})
        hd = int(v.get("head_dim") or v["hidden_size"] // v["num_attention_heads"])
        if hd * int(v["num_attention_heads"]) != int(v["hidden_size"]):
            raise ConfigError(f"vision head dim {hd} x {v['num_attention_heads']} heads != {v['hidden_size']}")
        if int(v.get("num_key_value_heads") or v["num_attention_heads"]) != int(v["num_attention_heads"]):
            raise ConfigError("vision attention with grouped KV heads is not supported")
        rope = v.get("rope_parameters") or {}
        return cls(d_model=int(v["hidden_size"]), n_layer=int(v["num_hidden_layers"]),
                   n_head=int(v["num_attention_heads"]), ffn_width=int(v["intermediate_size"]),
                   text_width=int(text["hidden_size"]), pos_rows=int(v.get("position_embedding_size", 10240)),
                   patch_size=int(v.get("patch_size", 16)), pool=int(v.get("pooling_kernel_size", 3)),
                   rope_theta=float(rope.get("rope_theta", 100.0)), rms_eps=float(v.get("rms_norm_eps", 1e-6)),
                   clipped=bool(v.get("use_clipped_linears", False)), standardize=bool(v.get("standardize", False)),
                   gelu_quick=v.get("hidden_activation") == "quick_gelu",
                   boi_id=int(config_json.get("boi_token_id", BOI_ID)),
                   image_id=int(config_json.get("image_token_id", IMAGE_ID)),
                   eoi_id=int(config_json.get("eoi_token_id", EOI_ID)),
                   pad_id=int(text.get("pad_token_id", 0) or 0))

    @classmethod
    def from_gguf(cls, mmproj, token_ids: Optional[tuple[int, int, int, int]] = None) -> "Gemma4VisionConfig":
        """From an mmproj `GGUFFile` (§6.2 metadata). θ and the pooling are not written: constants
        (llama.cpp hard-codes them too). `token_ids`: (boi, image, eoi, pad) from the text model's
        vocabulary (`token_ids_from_vocab`)."""
        key = MetadataReader(mmproj.metadata, "clip.", mmproj.path.name)
        if not key.bool("has_vision_encoder", False):
            raise ConfigError("the mmproj file has no vision encoder")
        kind = key.str("vision.projector_type", "")
        if kind != "gemma4v":
            raise ConfigError(f"mmproj projector type {kind!r} is not Gemma 4's (gemma4v)")
        pe = mmproj.tensor("v.position_embd.weight").shape  # torch [2, rows, D]
        boi, img, eoi, pad = token_ids or (BOI_ID, IMAGE_ID, EOI_ID, 0)
        return cls(d_model=key.int("vision.embedding_length"), n_layer=key.layer_count("vision.block_count"),
                   n_head=key.int("vision.attention.head_count"), ffn_width=key.int("vision.feed_forward_length"),
                   text_width=key.int("vision.projection_dim"), pos_rows=int(pe[1]),
                   patch_size=key.int("vision.patch_size", 16),
                   pool=int(key.float("vision.projector.scale_factor", 3)),
                   rms_eps=key.float("vision.attention.layer_norm_epsilon", 1e-6),
                   clipped=any(n.endswith(".input_min") for n in mmproj.tensors),
                   standardize="v.std_bias" in mmproj,  # GELU-tanh as HF (llama.cpp: GELU-quick, §8.1)
                   boi_id=boi, image_id=img, eoi_id=eoi, pad_id=pad)


def token_ids_from_vocab(piece_to_id: Callable[[str], Optional[int]], pad_id: int = 0):
    """(boi, image, eoi, pad) ids looked up by their strings in a vocabulary, else the real ids."""
    return encoder.token_ids_from_vocab(piece_to_id, (BOI, IMAGE, EOI), (BOI_ID, IMAGE_ID, EOI_ID), pad_id)


# --- weights ---------------------------------------------------------------------------------
def tensor_plan(cfg: Gemma4VisionConfig, present: set[str]) -> dict[str, Optional[tuple[int, ...]]]:
    """GGUF name -> torch shape of every tensor the tower reads (after the re-layouts of `load`)."""
    D, F_, hd = cfg.d_model, cfg.ffn_width, cfg.head_dim
    plan: dict[str, Optional[tuple[int, ...]]] = {
        "v.patch_embd.weight": (D, cfg.patch_width), "v.position_embd.weight": (2, cfg.pos_rows, D),
        "mm.input_projection.weight": (cfg.text_width, D)}
    if cfg.standardize:
        plan.update({"v.std_bias": (D,), "v.std_scale": (D,)})
    shapes = {"attn_q": (D, D), "attn_k": (D, D), "attn_v": (D, D), "attn_out": (D, D),
              "ffn_gate": (F_, D), "ffn_up": (F_, D), "ffn_down": (D, F_)}
    for i in range(cfg.n_layer):
        b = f"v.blk.{i}."
        plan_linears(plan, b, shapes, present)
        for name in NORMS:
            plan[b + name + ".weight"] = (hd,) if name in ("attn_q_norm", "attn_k_norm") else (D,)
    return plan


def hf_names(n_layer: int) -> dict[str, str]:
    """HF name (after `model.`) -> GGUF name, for `models.hf.HFCheckpoint`."""
    out = {"vision_tower.patch_embedder.input_proj.weight": "v.patch_embd.weight",
           "vision_tower.patch_embedder.position_embedding_table": "v.position_embd.weight",
           "vision_tower.std_bias": "v.std_bias", "vision_tower.std_scale": "v.std_scale",
           "embed_vision.embedding_projection.weight": "mm.input_projection.weight"}
    for i in range(n_layer):
        hf_layer_names(out, f"vision_tower.encoder.layers.{i}.", f"v.blk.{i}.", LINEARS, NORMS)
    return out


def _load_one(source, name: str, shape, cfg: Gemma4VisionConfig, dtype) -> torch.Tensor:
    from .gguf import GGUFFile

    if name == "v.patch_embd.weight" and isinstance(source, GGUFFile):
        # mmproj: a stride-16 conv kernel torch[D, 3, p, p]; our linear reads (py, px, ch), ch fastest.
        p = cfg.patch_size
        conv = source.load(name, (cfg.d_model, 3, p, p), dtype=dtype)
        return conv.permute(0, 2, 3, 1).reshape(cfg.d_model, cfg.patch_width)
    return load_checked(source, name, shape, dtype)


def activation_bytes(d_model: int, ffn_width: int, n_head: int, n_patches: int, elem: int = 4) -> int:
    """Peak working memory of encoding one image of `n_patches` patches (9·1120 at the largest
    budget): the residual, the normed input, q/k/v and the attention output (6·D a patch), the
    FFN's gate, up and product (3·FF), and the fused attention's per-head blocks of 256 queries."""
    return elem * (n_patches * (6 * d_model + 3 * ffn_width) + n_head * 256 * n_patches)


# --- preprocessing (§2) ------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: what a request carries and what the prefix cache keys on."""
    patches: torch.Tensor  # float32 [Np, 3·p²] in [0, 1], (py, px, ch) order, row-major patches
    positions: torch.Tensor  # int64 [Np, 2]: (x = column, y = row)
    grid: tuple[int, int]  # (gh, gw) patches
    n_tokens: int  # soft tokens N = (gh/k)·(gw/k)
    digest: str  # sha256 of the resized pixels: equal images, equal KV
    name: str = ""
    source_size: tuple[int, int] = (0, 0)  # (W, H) before resizing


def resized_size(h: int, w: int, budget: int, patch: int = 16, pool: int = 3) -> tuple[int, int]:
    """(H', W'): aspect kept, scaled up or down to fill `budget` soft tokens (HF's rule, §2 step 3)."""
    if budget not in BUDGETS:
        raise ImageError(f"image token budget {budget} is not one of {', '.join(map(str, BUDGETS))}")
    s = patch * pool
    f = math.sqrt(pool * pool * budget * patch * patch / (h * w))
    hh, ww = math.floor(f * h / s) * s, math.floor(f * w / s) * s
    if hh == 0 and ww == 0:
        raise ImageError(f"image {w}x{h} cannot be resized to the {budget}-token budget")
    if hh == 0:
        hh, ww = s, min(math.floor(w / h) * s, budget * s)
    elif ww == 0:
        ww, hh = s, min(math.floor(h / w) * s, budget * s)
    return hh, ww


def open_image(source: str | Path | bytes, name: str = ""):
    """A Pillow RGB image with its EXIF orientation applied, or a one-line ImageError.

    Pillow's decompression-bomb cap (Image.MAX_IMAGE_PIXELS, 89 M pixels) is a hard limit here:
    its warning band (1-2x the cap) is refused too."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    label = name or (Path(source).name if isinstance(source, (str, Path)) else "image")
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
    except OSError as e:
        raise ImageError(f"{label}: cannot read: {e.strerror or e}") from None
    if not data:
        raise ImageError(f"{label}: empty file, not an image")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h <= 1:
                raise ImageError(f"{label}: image is {w}x{h} pixels; too small to encode")
            img.load()
            img = ImageOps.exif_transpose(img).convert("RGB")
        except ImageError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageError(f"{label}: refused as a decompression bomb ({e})".split(" could be")[0]) from None
        except UnidentifiedImageError:
            raise ImageError(f"{label}: not an image (or a format Pillow cannot read)") from None
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise ImageError(f"{label}: unreadable image: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
                from None
    if img.width * img.height <= 1:
        raise ImageError(f"{label}: image is {img.width}x{img.height} pixels; too small to encode")
    return img


def preprocess(img, budget: int = DEFAULT_BUDGET, patch: int = 16, pool: int = 3, name: str = "") -> ImageInput:
    """RGB Pillow image -> patches and positions (§2 steps 3-6; no padding: it changes nothing)."""
    import numpy as np
    from PIL import Image

    w, h = img.size
    hh, ww = resized_size(h, w, budget, patch, pool)
    if (ww, hh) != (w, h):
        img = img.resize((ww, hh), Image.BICUBIC)
    px = np.asarray(img, dtype=np.uint8)  # [H', W', 3]
    digest = hashlib.sha256(px.tobytes() + f"{hh}x{ww}".encode()).hexdigest()
    gh, gw = hh // patch, ww // patch
    patches = (torch.from_numpy(px.copy()).float() / 255.0).reshape(gh, patch, gw, patch, 3)
    patches = patches.permute(0, 2, 1, 3, 4).reshape(gh * gw, 3 * patch * patch)
    r, c = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    positions = torch.stack([c.reshape(-1), r.reshape(-1)], dim=-1)
    return ImageInput(patches, positions, (gh, gw), (gh // pool) * (gw // pool), digest, name, (w, h))


def load_image(source: str | Path | bytes, budget: int = DEFAULT_BUDGET, name: str = "", patch: int = 16,
               pool: int = 3) -> ImageInput:
    """open_image + preprocess: a file (or its bytes) to what a request carries."""
    label = name or (Path(source).name if isinstance(source, (str, Path)) else "image")
    return preprocess(open_image(source, label), budget, patch, pool, label)


# --- the tower (§3) and the projector (§4.1) ---------------------------------------------------
def _gelu(x: torch.Tensor, quick: bool) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x) if quick else F.gelu(x, approximate="tanh")


def _rope_2d(u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """u [B, Np, H, hd]: dims [0, hd/2) rotate with x, [hd/2, hd) with y; NeoX half-split within each
    half (dim j pairs with j + hd/4). cos/sin [B, Np, 1, hd/2] = [x angles, y angles], hd/4 each."""
    half, q = u.shape[-1] // 2, u.shape[-1] // 4
    out = []
    for a in (0, 1):
        c, s = cos[..., a * q:(a + 1) * q], sin[..., a * q:(a + 1) * q]
        v1, v2 = u[..., a * half:a * half + q], u[..., a * half + q:(a + 1) * half]
        out += [v1 * c - v2 * s, v2 * c + v1 * s]
    return torch.cat(out, dim=-1)


class Gemma4Vision(EncoderTower):
    """The vision tower + projector over a weight dict keyed by mmproj GGUF names."""

    def __init__(self, cfg: Gemma4VisionConfig, weights: Mapping[str, torch.Tensor], dtype=torch.float32,
                 device="cpu"):
        super().__init__(cfg, weights, dtype, device)
        q = cfg.head_dim // 4  # frequencies per axis: ω_j = θ^(-2j / (hd/2)), j < hd/4
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(q, dtype=torch.float64) * 2 / (cfg.head_dim // 2))

    def activation_bytes(self, n_patches: int) -> int:
        return activation_bytes(self.cfg.d_model, self.cfg.ffn_width, self.cfg.n_head, n_patches, self.elem_size)

    @torch.no_grad()
    def encode(self, images: Sequence[ImageInput], trace: Trace = None) -> list[torch.Tensor]:
        """Images -> their soft-token embeddings, each [N_i, text_width] in the model dtype. Images
        with the same patch count run as one batch (the same budget and aspect: the usual case);
        no padding, so attention needs no mask and SDPA takes its fused path (a [Np, Np] score
        matrix per head is 406 MB at the 1120 budget in float32)."""
        groups: dict[int, list[int]] = {}
        for i, im in enumerate(images):
            if im.patches.shape[-1] != self.cfg.patch_width:
                raise ImageError(f"{im.name or 'image'}: patches of {im.patches.shape[-1]} values; the tower "
                                 f"reads {self.cfg.patch_width}")
            if int(im.positions.max()) >= self.cfg.pos_rows:
                raise ImageError(f"{im.name or 'image'}: grid {im.grid} exceeds the position table "
                                 f"({self.cfg.pos_rows} rows)")
            groups.setdefault(im.patches.shape[0], []).append(i)
        out: list[Optional[torch.Tensor]] = [None] * len(images)
        for idx in groups.values():
            for i, e in zip(idx, self._encode_batch([images[i] for i in idx], trace)):
                out[i] = e
        return out  # type: ignore[return-value]

    def _encode_batch(self, images: Sequence[ImageInput], trace: Trace) -> list[torch.Tensor]:
        cfg, w, dev, dt = self.cfg, self.w, self.device, self.dtype
        patches = torch.stack([im.patches for im in images]).to(dev, dt)  # [B, Np, 3·p²]
        pos = torch.stack([im.positions for im in images]).to(dev)  # [B, Np, 2]
        x = F.linear(2 * patches - 1, w["v.patch_embd.weight"])  # [B, Np, D]
        if trace:
            trace("inp_raw_scaled", -1, x)
        table = w["v.position_embd.weight"]
        x = x + table[0][pos[..., 0]] + table[1][pos[..., 1]]
        if trace:
            trace("pos_embd", -1, x)
        # 2-D RoPE angles in float64, then cast: [B, Np, 1, hd/2] = [x·ω, y·ω]
        ang = torch.cat([pos[..., a, None].double() * self.inv_freq.to(dev) for a in (0, 1)], -1)[:, :, None]
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        for i in range(cfg.n_layer):
            x = self._layer(i, x, cos, sin, trace)
        out = []
        for b, im in enumerate(images):
            (gh, gw), k = im.grid, cfg.pool
            h = x[b].reshape(gh // k, k, gw // k, k, cfg.d_model).mean(dim=(1, 3))
            s = h.reshape(-1, cfg.d_model) * math.sqrt(cfg.d_model)  # row-major over the pooled grid
            if trace:
                trace("pooled", b, s)
            if cfg.standardize:
                s = (s - w["v.std_bias"]) * w["v.std_scale"]
            e = matmul(rms(s, None, cfg.rms_eps), w["mm.input_projection.weight"])
            if trace:
                trace("projected", b, e)
            out.append(e)
        return out

    def _layer(self, i: int, x, cos, sin, trace: Trace):
        cfg, w, b, eps = self.cfg, self.w, f"v.blk.{i}.", self.cfg.rms_eps
        B, Np, H, hd = x.shape[0], x.shape[1], cfg.n_head, cfg.head_dim
        a = rms(x, w[b + "ln1.weight"], eps)
        q = _rope_2d(rms(self._linear(a, b + "attn_q").view(B, Np, H, hd), w[b + "attn_q_norm.weight"], eps),
                     cos, sin)
        k = _rope_2d(rms(self._linear(a, b + "attn_k").view(B, Np, H, hd), w[b + "attn_k_norm.weight"], eps),
                     cos, sin)
        v = rms(self._linear(a, b + "attn_v").view(B, Np, H, hd), None, eps)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           scale=1.0)  # bidirectional, scale 1 (§3)
        o = o.transpose(1, 2).reshape(B, Np, cfg.d_model)
        if trace:
            trace("attn_out", i, o)
        x = x + rms(self._linear(o, b + "attn_out"), w[b + "attn_post_norm.weight"], eps)
        m = rms(x, w[b + "ln2.weight"], eps)
        f = self._linear(_gelu(self._linear(m, b + "ffn_gate"), cfg.gelu_quick) * self._linear(m, b + "ffn_up"),
                         b + "ffn_down")
        x = x + rms(f, w[b + "ffn_post_norm.weight"], eps)
        if trace:
            trace("layer_out", i, x)
        return x


_GGML_MATRICES = (".attn_q.weight", ".attn_k.weight", ".attn_v.weight", ".attn_out.weight", ".ffn_gate.weight",
                  ".ffn_up.weight", ".ffn_down.weight", "mm.input_projection.weight")


def _ggml_matrix(source, name: str, shape, device):
    """A quantized mmproj matrix on llama.cpp's CPU kernels (models/formats/ggml.GGMLWeight: the file's
    bytes, not a float32 copy), when they are there and the tower runs on the CPU; else None."""
    from .formats import GGMLWeight
    from .runtime import ggml_available
    from .gguf import GGUFFile
    from .quant import type_name

    if not (isinstance(source, GGUFFile) and torch.device(device).type == "cpu" and name.endswith(_GGML_MATRICES)
            and shape is not None and len(shape) == 2 and ggml_available()):
        return None
    info = source.raw(name, shape)
    if type_name(info.ggml_type) in ("F32", "F16", "BF16"):
        return None  # dense: float32 through torch as before
    return GGMLWeight(torch.from_numpy(info.read()).reshape(shape[0], -1), info.ggml_type, shape)


def load_vision(source, cfg: Gemma4VisionConfig, dtype=torch.float32, device="cpu") -> Gemma4Vision:
    """The tower from an mmproj `GGUFFile` or an `HFCheckpoint` opened with `hf_names`. A quantized
    mmproj's matrices stay quantized on the CPU where llama.cpp's kernels are (`_ggml_matrix`)."""
    present = set(source.tensors)
    weights = {}
    for name, shape in tensor_plan(cfg, present).items():
        q = _ggml_matrix(source, name, shape, device)
        weights[name] = q if q is not None else _load_one(source, name, shape, cfg, dtype).to(device)
    if any(n.endswith(".out_scale.weight") for n in present):
        warnings.warn("mmproj has v.blk.*.out_scale (not in HF's Gemma 4); ignored (spec §8 item 2)")
    return Gemma4Vision(cfg, weights, dtype=dtype, device=device)


def load_vision_hf(folder: str | Path, dtype=torch.float32, device="cpu") -> Gemma4Vision:
    from .hf import HFCheckpoint

    import json
    config = json.loads((Path(folder) / "config.json").read_text())
    cfg = Gemma4VisionConfig.from_hf(config)
    ckpt = HFCheckpoint(folder, hf_names(cfg.n_layer), {})
    return load_vision(ckpt, cfg, dtype, device)


def load_vision_gguf(path, token_ids=None, dtype=torch.float32, device="cpu") -> Gemma4Vision:
    """From an mmproj path (or an opened `GGUFFile`)."""
    from .gguf import GGUFError, GGUFFile

    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    if f.architecture != "clip":
        raise GGUFError(f.path, f"not an mmproj file (architecture {f.architecture!r}, expected 'clip')")
    try:
        cfg = Gemma4VisionConfig.from_gguf(f, token_ids)
    except ConfigError as e:
        raise GGUFError(f.path, str(e)) from None
    return load_vision(f, cfg, dtype, device)


def image_rows(tokens: Sequence[int] | torch.Tensor, embeds: Sequence[torch.Tensor], cfg: Gemma4VisionConfig):
    """models.gemma4.ImageRows for a prompt: the images' soft tokens fill its `<|image|>` positions
    in order (each image's N rows, then the next image's). A count mismatch is a one-line error."""
    from .gemma4 import ImageRows

    ids = torch.as_tensor(tokens, dtype=torch.long).cpu()
    mask = ids == cfg.image_id
    n_slots, n_rows = int(mask.sum()), sum(int(e.shape[0]) for e in embeds)
    if n_slots != n_rows:
        raise ImageError(f"the prompt has {n_slots} image placeholder tokens; the images give {n_rows} "
                         f"({' + '.join(str(int(e.shape[0])) for e in embeds) or 'no images'})")
    rows = torch.cat(list(embeds)) if embeds else torch.zeros(0, cfg.text_width)
    return ImageRows(mask, rows, cfg.pad_id, image=mask)
