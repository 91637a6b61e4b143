"""HF safetensors checkpoints (a folder with `config.json` and `*.safetensors` shards).

Tensors are renamed into the GGUF names the model files use, through the family's own
`HF_GLOBAL_NAMES` / `HF_LAYER_NAMES` tables, so one forward serves both formats.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from .weights import load_weights
from .gguf import GGUFError, MissingTensorError, TensorShapeError

# Text weights sit under one of these prefixes (multimodal wrapper first); the assistant's
# pre/post projections sit at the top level.
_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


class HFCheckpoint:
    """An opened HF checkpoint folder: `config` (dict) and tensors by GGUF name, memory-mapped."""

    def __init__(self, folder: str | Path, global_names: dict[str, str], layer_names: dict[str, str]):
        from safetensors import safe_open

        self.path = Path(folder)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise GGUFError(self.path, "not a model folder (no config.json)")
        try:
            self.config: dict[str, Any] = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise GGUFError(cfg_path, f"unreadable config.json: {e}") from None
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise GGUFError(self.path, "no *.safetensors files")
        self._where: dict[str, tuple[Any, str]] = {}
        self._handles = []
        for shard in shards:
            try:
                h = safe_open(str(shard), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad headers
                raise GGUFError(shard, f"unreadable safetensors file: {e}") from None
            self._handles.append(h)
            for hf_name in h.keys():
                name = self._gguf_name(hf_name, global_names, layer_names)
                if name is not None:
                    self._where[name] = (h, hf_name)

    @staticmethod
    def _gguf_name(hf_name: str, global_names: dict[str, str], layer_names: dict[str, str]) -> str | None:
        if hf_name == "lm_head.weight":
            return "output.weight"
        for p in _PREFIXES:
            if hf_name.startswith(p):
                rest = hf_name[len(p):]
                break
        else:
            return None  # vision / audio towers and anything else we do not run
        if rest in global_names:
            return global_names[rest]
        m = _LAYER.fullmatch(rest)
        if m and m.group(2) in layer_names:
            return f"blk.{m.group(1)}.{layer_names[m.group(2)]}"
        return None

    @property
    def tensors(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def load(self, name: str, shape: tuple[int, ...] | None = None, dtype=torch.float32) -> torch.Tensor:
        if name not in self._where:
            raise MissingTensorError(self.path, "missing tensor", name)
        handle, hf_name = self._where[name]
        t = handle.get_tensor(hf_name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            if t.numel() == 1 and tuple(shape) == (1,):
                t = t.reshape(1)  # layer_scalar may be stored as a 0-d buffer
            else:
                raise TensorShapeError(self.path, f"shape {list(t.shape)} where {list(shape)} was expected", name)
        return t.to(dtype)


def load_gemma4_hf(folder: str | Path, dtype=torch.float32, device="cpu", weight_dtype=None):
    """A Gemma4Model from an HF checkpoint (google/gemma-4-E2B-it naming)."""
    from . import gemma4

    ckpt = HFCheckpoint(folder, gemma4.HF_GLOBAL_NAMES, gemma4.HF_LAYER_NAMES)
    cfg = gemma4.Gemma4Config.from_hf(ckpt.config)
    present = ckpt.tensors
    weights = load_weights(ckpt, gemma4.tensor_plan(cfg, present), dtype, device, weight_dtype)
    return gemma4.Gemma4Model(cfg, weights, dtype=dtype, device=device), ckpt
