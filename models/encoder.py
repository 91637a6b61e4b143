"""What Gemma 4's two media towers share (models/gemma4_vision.py, models/gemma4_audio.py): weights
kept under the mmproj's GGUF names, HF folders renamed into them, clippable linears, RMSNorm in
float32, the marker ids looked up in the text model's vocabulary. Each tower keeps what differs:
its config, its tensor table, its re-layouts at load and its forward.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F

# A clippable linear's optional scalar bounds: clamp(W·clamp(x, in_min, in_max), out_min, out_max)
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")

Trace = Optional[Callable[[str, int, torch.Tensor], None]]


def token_ids_from_vocab(piece_to_id: Callable[[str], Optional[int]], pieces: tuple[str, str, str],
                         defaults: tuple[int, int, int], pad_id: int = 0) -> tuple[int, int, int, int]:
    """(begin, soft token, end, pad) ids: `pieces` looked up in a vocabulary, else `defaults` (the
    real E2B/E4B ids) when any of the three is missing."""
    ids = [piece_to_id(s) for s in pieces]
    if any(i is None for i in ids):
        return defaults[0], defaults[1], defaults[2], pad_id
    return ids[0], ids[1], ids[2], pad_id


def plan_linears(plan: dict, prefix: str, shapes: Mapping[str, tuple[int, ...]], present: set[str]) -> None:
    """Add a layer's clippable linears to a tensor plan: `prefix + name + ".weight"` at its shape,
    and each clip bound the file holds as a scalar (1,)."""
    for name, shape in shapes.items():
        plan[prefix + name + ".weight"] = shape
        for s in CLIP_BOUNDS:
            if prefix + f"{name}.{s}" in present:
                plan[prefix + f"{name}.{s}"] = (1,)


def hf_layer_names(out: dict, hf_prefix: str, gguf_prefix: str, linears: Mapping[str, str],
                   norms: Mapping[str, str]) -> None:
    """Add one layer's HF -> GGUF renames: each clippable linear (`<hf>.linear.weight` and its
    bounds) and each norm weight. `linears`, `norms`: GGUF short name -> HF name in the layer."""
    for gg, hh in linears.items():
        out[hf_prefix + hh + ".linear.weight"] = gguf_prefix + gg + ".weight"
        for s in CLIP_BOUNDS:
            out[hf_prefix + hh + "." + s] = gguf_prefix + gg + "." + s
    for gg, hh in norms.items():
        out[hf_prefix + hh + ".weight"] = gguf_prefix + gg + ".weight"


def load_checked(source, name: str, shape, dtype) -> torch.Tensor:
    """A tensor as stored, checked against the plan's shape (one-line TensorShapeError naming it)."""
    t = source.load(name, None, dtype=dtype)
    if shape == (1,) and t.numel() == 1:
        return t.reshape(1)  # HF keeps clip bounds as 0-d buffers
    if tuple(t.shape) != tuple(shape):
        from .gguf import TensorShapeError
        raise TensorShapeError(source.path, f"shape {list(t.shape)} where {list(shape)} was expected", name)
    return t


def rms(x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm in float32 at least (as HF computes every norm of both towers), cast back."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return F.rms_norm(xf, (x.shape[-1],), None if w is None else w.to(xf.dtype), eps).to(x.dtype)


def matmul(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x·Wᵀ for a torch matrix, or for a quantized one on llama.cpp's CPU kernels
    (models/formats/ggml.GGMLWeight, which the vision tower keeps; it carries no bias)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    assert bias is None, "a GGML matrix with a bias"
    return w.linear(x)


class EncoderTower:
    """A tower over a weight dict keyed by mmproj GGUF names (torch tensors, or GGMLWeight)."""

    def __init__(self, cfg, weights: Mapping[str, torch.Tensor], dtype=torch.float32, device="cpu"):
        self.cfg, self.w, self.dtype, self.device = cfg, dict(weights), dtype, torch.device(device)

    @property
    def n_params(self) -> int:
        return sum(t.numel() for t in self.w.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes for t in self.w.values())

    @property
    def elem_size(self) -> int:
        """Bytes of one activation element (the towers compute in `dtype`)."""
        return torch.tensor([], dtype=self.dtype).element_size()

    def _linear(self, x: torch.Tensor, name: str, bias: bool = False) -> torch.Tensor:
        """Clippable linear: clamp(W·clamp(x, in_min, in_max), out_min, out_max) (a missing bound: ±inf)."""
        w = self.w
        lo, hi = w.get(name + ".input_min"), w.get(name + ".input_max")
        if lo is not None or hi is not None:
            x = x.clamp(None if lo is None else float(lo), None if hi is None else float(hi))
        y = matmul(x, w[name + ".weight"], w[name + ".bias"] if bias else None)
        lo, hi = w.get(name + ".output_min"), w.get(name + ".output_max")
        if lo is not None or hi is not None:
            y = y.clamp(None if lo is None else float(lo), None if hi is None else float(hi))
        return y
