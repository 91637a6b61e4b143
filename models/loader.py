"""Open any supported checkpoint: a GGUF file or an HF safetensors folder.

`load_model(path)` returns a `LoadedModel` (model, tokenizer, chat format, source info); the
architecture decides the model file. Every problem surfaces as a one-line `GGUFError` subclass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .metadata import ConfigError, MetadataReader
from .gguf import GGUFError, GGUFFile, UnsupportedArchitectureError
from .runtime import Runtime, runtime_of_flags

SUPPORTED_ARCHITECTURES = ("gemma4", "gemma3")


@dataclass
class LoadedModel:
    model: Any  # Gemma4Model | Gemma3Model
    arch: str
    path: Path
    tokenizer: Optional[Any] = None  # models.tokenizer.Tokenizer
    chat: Optional[Any] = None  # models.chat.ChatFormat
    source: Any = None  # the GGUFFile / HFCheckpoint
    vision: Optional[Any] = None  # models.gemma4_vision.Gemma4Vision: the image encoder, when present
    audio: Optional[Any] = None  # models.gemma4_audio.Gemma4Audio: the audio encoder, when present
    mmproj: Optional[Path] = None  # the GGUF file they came from (GGUF models)
    # one line each about what loaded differently than asked (a tower that could not be built), for
    # front ends to show: the CLI prints them on stderr
    notices: list[str] = field(default_factory=list)

    @property
    def config(self):
        return self.model.cfg

    @property
    def runtime(self) -> Runtime:
        """The runtime the model computes with (models/runtime.py), decided at load."""
        return self.model.runtime


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF whose architecture we can run (one-line error otherwise)."""
    f = GGUFFile(path)
    f.check_architecture(SUPPORTED_ARCHITECTURES)
    return f


def find_mmproj(model_path: str | Path) -> Optional[Path]:
    """An `mmproj*.gguf` beside a GGUF model (the first by name: llama.cpp's image/audio encoder
    files), else None. An HF folder carries its towers in its own safetensors: None."""
    p = Path(model_path)
    if p.is_dir():
        return None
    found = sorted(p.parent.glob("mmproj*.gguf"))
    return found[0] if found else None


def load_model(path: str | Path, dtype=torch.float32, device="cpu", with_tokenizer: bool = True,
               weight_dtype: Optional[torch.dtype] = None, quantized: bool = False,
               host_embeddings: bool = False, progress=None, cpu_quant: bool = False,
               mmproj: Optional[str | Path] = None, vision: bool = True,
               runtime: Optional[Runtime] = None, host_tensors: frozenset = frozenset()) -> LoadedModel:
    """`weight_dtype=torch.float16`: the fast CPU runtime format (models/weights.py); None: exact.
    `quantized`: GGUF matrices stay in their quantized bytes for the Triton kernels.
    `host_embeddings`: embedding lookup tables stay in host memory (`--embed-weights host`).
    `cpu_quant`: the CPU runtime format: with llama.cpp's kernels (the ggml runtime) the GGUF
    matrices as they are (models/formats/ggml.py), multiplied by ggml, and the elementwise chains
    as ggml graphs (models.ops.cpu_chains); without them the torch formats of models/cpu_quant.py
    (other matrices as `weight_dtype`).
    `runtime`: the runtime these flags were made for (`Runtime.load_flags`, as engine.api.open_model
    does); None reads it from the flags (`runtime_of_flags`). It is stored as `model.runtime`.
    `progress(done, total, bytes_done, bytes_total)`: called after each tensor (GGUF files).
    `mmproj`: the image and audio encoders of a GGUF model (default: an `mmproj*.gguf` beside it;
    one file may hold either or both); HF folders carry theirs. `vision=False`: never load them.
    `host_tensors`: a Gemma-4 MoE's expert banks kept in host RAM beside a GPU (the memory plan's
    placement), computed by the CPU (models/host_experts.py)."""
    path = Path(path)
    if runtime is None:
        runtime = runtime_of_flags(device, weight_dtype, quantized, cpu_quant, gguf=not path.is_dir())
    if path.is_dir():
        loaded = _load_hf(path, dtype, device, weight_dtype)
        loaded.model.runtime = runtime
        if vision:
            loaded.vision = _tower_or_notice(loaded, "image", _hf_vision, dtype, device)
            loaded.audio = _tower_or_notice(loaded, "audio", _hf_audio, dtype, device)
        return loaded
    f = open_gguf(path)
    try:
        if f.architecture == "gemma4":
            from .gemma4 import load_gemma4
            model = load_gemma4(f, dtype=dtype, device=device, weight_dtype=weight_dtype, quantized=quantized,
                                host_embeddings=host_embeddings, progress=progress, cpu_quant=cpu_quant,
                                host_tensors=host_tensors)
        elif host_tensors:
            raise ValueError(f"{path.name}: a {f.architecture} model has no expert banks to keep in host RAM")
        else:
            from .gemma3 import load_gemma3
            model = load_gemma3(f, dtype=dtype, device=device, weight_dtype=weight_dtype, quantized=quantized,
                                host_embeddings=host_embeddings, progress=progress, cpu_quant=cpu_quant)
    except ConfigError as e:
        raise GGUFError(path, str(e)) from None
    model.runtime = runtime  # on ggml the elementwise chains go to ggml too (models.ops.cpu_chains)
    tok = chat = None
    if with_tokenizer and "tokenizer.ggml.tokens" in f.metadata:
        from .chat import ChatFormat, ChatTemplateError
        from .tokenizer import Tokenizer, TokenizerError
        try:
            tok = Tokenizer.from_metadata(f.metadata)
            chat = ChatFormat.from_metadata(f.metadata)
        except (TokenizerError, ChatTemplateError) as e:  # name the file in the one-line error
            raise GGUFError(path, str(e)) from None
    loaded = LoadedModel(model, f.architecture, path, tok, chat, f)
    if vision and f.architecture == "gemma4":
        found = Path(mmproj) if mmproj is not None else find_mmproj(path)
        if found is not None:
            loaded.vision, loaded.audio = _gguf_encoders(found, tok, dtype, device, model.cfg.d_model)
            loaded.mmproj = found
    elif mmproj is not None:
        raise GGUFError(Path(mmproj), f"an image encoder for a {f.architecture} model (Gemma 4 only)")
    return loaded


def _gguf_encoders(mmproj: Path, tok, dtype, device, text_width: int):
    """(vision, audio) from one mmproj file: either may be None, not both."""
    from . import gemma4_audio, gemma4_vision

    f = GGUFFile(mmproj)
    if f.architecture != "clip":
        raise GGUFError(f.path, f"not an mmproj file (architecture {f.architecture!r}, expected 'clip')")
    key = MetadataReader(f.metadata, "clip.", f.path.name)
    try:
        has_vision, has_audio = (key.bool(f"has_{k}_encoder", False) for k in ("vision", "audio"))
    except ConfigError as e:
        raise GGUFError(f.path, str(e)) from None
    if not has_vision and not has_audio:
        raise GGUFError(f.path, "the mmproj file has neither a vision nor an audio encoder")
    vision = audio = None
    if has_vision:
        ids = gemma4_vision.token_ids_from_vocab(tok.piece_to_id) if tok is not None else None
        vision = gemma4_vision.load_vision_gguf(f, ids, dtype=dtype, device=device)
        if vision.cfg.text_width != text_width:
            raise GGUFError(mmproj, f"projects images to width {vision.cfg.text_width}; the model's is {text_width}")
    if has_audio:
        ids = gemma4_audio.token_ids_from_vocab(tok.piece_to_id) if tok is not None else None
        try:
            cfg = gemma4_audio.Gemma4AudioConfig.from_gguf(f, ids)
        except ConfigError as e:
            raise GGUFError(f.path, str(e)) from None
        audio = gemma4_audio.load_audio_tower(f, cfg, dtype=dtype, device=device)
        if cfg.text_width != text_width:
            raise GGUFError(mmproj, f"projects audio to width {cfg.text_width}; the model's is {text_width}")
    return vision, audio


def _tower_or_notice(loaded: LoadedModel, medium: str, build, dtype, device):
    """An HF folder's `medium` tower from `build`, or None with a notice when its config or weights
    cannot make one: the text model is still useful without it. (transformers builds some towers it
    cannot run: an audio config with subsampling_conv_channels [8, 4] sizes the input projection
    [H, (8 // 4) * 4] while its convolutions feed it (128 / 4) * 4 = 128 features.)"""
    try:
        return build(loaded.path, loaded.source, dtype, device)
    except (GGUFError, ConfigError) as e:
        what = str(e)
        if isinstance(e, GGUFError):  # without the folder's name, which the notice starts with
            what = e.what + (f" (tensor {e.tensor})" if e.tensor else "")
        loaded.notices.append(f"{loaded.path.name}: {medium} input off: its {medium} tower cannot be built ({what})")
        return None


def _hf_audio(path: Path, ckpt, dtype, device):
    """The folder's audio tower, when its config and weights have one (else None)."""
    from .gemma4_audio import Gemma4AudioConfig, hf_names, load_audio_tower
    from .hf import HFCheckpoint

    if not ckpt.config.get("audio_config"):
        return None
    try:
        cfg = Gemma4AudioConfig.from_hf(ckpt.config)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise GGUFError(path, f"bad audio_config: {e}") from None
    ack = HFCheckpoint(path, hf_names(cfg.n_layer), {})
    if "a.conv1d.0.weight" not in ack:
        return None  # a save without the tower
    return load_audio_tower(ack, cfg, dtype, device)


def _hf_vision(path: Path, ckpt, dtype, device):
    """The folder's vision tower, when its config and weights have one (else None: text only)."""
    from .gemma4_vision import Gemma4VisionConfig, hf_names, load_vision
    from .hf import HFCheckpoint

    if not ckpt.config.get("vision_config") or not ckpt.config["vision_config"].get("hidden_size"):
        return None
    try:
        cfg = Gemma4VisionConfig.from_hf(ckpt.config)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise GGUFError(path, f"bad vision_config: {e}") from None
    vck = HFCheckpoint(path, hf_names(cfg.n_layer), {})
    if "v.patch_embd.weight" not in vck:
        return None  # a text-only save of a multimodal config
    return load_vision(vck, cfg, dtype, device)


def _load_hf(path: Path, dtype, device, weight_dtype) -> LoadedModel:
    import json

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise GGUFError(path, "not a model folder (no config.json)")
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type", "")
    except ValueError as e:
        raise GGUFError(cfg_file, f"unreadable config.json: {e}") from None
    if model_type not in ("gemma4", "gemma4_text"):
        raise UnsupportedArchitectureError(
            path, f"unsupported model_type '{model_type}' (supported: gemma4, gemma4_text)")
    from .hf import load_gemma4_hf
    try:
        model, ckpt = load_gemma4_hf(path, dtype=dtype, device=device, weight_dtype=weight_dtype)
    except (ConfigError, KeyError) as e:
        raise GGUFError(path, f"bad config.json: {e}") from None
    tok = None
    if (path / "tokenizer.json").is_file():
        from .tokenizer import Tokenizer
        if hasattr(Tokenizer, "from_hf_file"):
            tok = Tokenizer.from_hf_file(path / "tokenizer.json")
    return LoadedModel(model, "gemma4", path, tok, None, ckpt)
