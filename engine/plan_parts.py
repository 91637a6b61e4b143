"""Bytes of the memory plan's parts that are not the text model: the image and audio encoders of an
mmproj GGUF and a draft model (engine/memory_plan.py adds them to the device side)."""
from __future__ import annotations


def _mmproj(mmproj):
    from models.gguf import GGUFFile
    return GGUFFile(mmproj) if isinstance(mmproj, (str, bytes)) or hasattr(mmproj, "__fspath__") else mmproj


def vision_bytes(mmproj, device: str) -> tuple[int, int]:
    """(weights, activation peak) of the image encoder on `device`: its tensors dequantized to the
    activation dtype (bf16 on CUDA, fp32 on the CPU), and one image at the largest budget (1120).
    (0, 0) when the mmproj holds no vision encoder."""
    from models.gemma4_vision import BUDGETS, activation_bytes

    f = _mmproj(mmproj)
    elem = 2 if device == "cuda" else 4
    m = f.metadata
    D, FF, H = (int(m.get(f"clip.vision.{k}", 0)) for k in ("embedding_length", "feed_forward_length",
                                                             "attention.head_count"))
    weights = sum(t.n_elements for t in f if t.name.startswith(("v.", "mm.")) and not t.name.startswith("mm.a."))
    if not weights:
        return 0, 0
    return weights * elem, activation_bytes(D, FF, max(H, 1), 9 * BUDGETS[-1], elem)


def audio_bytes(mmproj, device: str) -> tuple[int, int]:
    """(weights, activation peak) of the audio encoder on `device`, like vision_bytes: the `a.` and
    `mm.a.` tensors in the activation dtype, and one 30 s piece (2999 frames; longer clips are
    encoded a piece at a time). (0, 0) when the mmproj holds no audio encoder (or an unreadable one)."""
    from models.gemma4_audio import Gemma4AudioConfig, activation_bytes

    f = _mmproj(mmproj)
    elem = 2 if device == "cuda" else 4
    weights = sum(t.n_elements for t in f if t.name.startswith(("a.", "mm.a.")))
    if not weights:
        return 0, 0
    try:
        cfg = Gemma4AudioConfig.from_gguf(f)
    except ValueError:  # ConfigError / GGUFError: the weights still count
        return weights * elem, 0
    return weights * elem, activation_bytes(cfg, 2999, elem)


def draft_bytes(draft) -> int:
    if draft is None:
        return 0
    if isinstance(draft, (str, bytes)) or hasattr(draft, "__fspath__"):
        from models.gguf import GGUFFile
        draft = GGUFFile(draft)
    return sum(t.n_bytes for t in draft)
