"""The models directory: where edgegem keeps its data and its GGUF files, how a model name finds
its file, and `edgegem pull`, which fetches one from a Hugging Face repo into it.

  local.py  the data and models directories, the GGUF files under them, names -> files
  hub.py    `edgegem pull owner/name[:QUANT]`: pick, download (resumable), verify, check

Everything outside this package uses the names below (the app's `pull`, `models`, `doctor` and its
store, the engine's model resolution, kv-check's cache); the modules are its own.
"""
from __future__ import annotations

from .hub import PullResult, RemoteFile, RepoSpec, pull
from .local import (DEFAULT_QUANT, LocalModel, data_dir, find_model, gguf_summary, local_models, models_dir,
                    quant_label, quant_matches)

__all__ = ["DEFAULT_QUANT", "LocalModel", "PullResult", "RemoteFile", "RepoSpec", "data_dir", "find_model",
           "gguf_summary", "local_models", "models_dir", "pull", "quant_label", "quant_matches"]
