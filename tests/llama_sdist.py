"""Files the tests take from the llama-cpp-python 0.3.36 sdist: llama.cpp's vocab GGUFs with their
test vectors, and its HF converter (`convert_hf_to_gguf.py`, the `conversion` package beside it and
`gguf-py`). The sdist comes from the package registry with pip, once, into the suite's own cache
(`.cache/test-data/`, or $EDGEGEM_TEST_CACHE); each set of files is extracted from it once. Nothing
is read from outside the repository and that cache, so a machine that never built edgegem runs
the same tests.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from filelock import FileLock  # torch's own dependency

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGEGEM_TEST_CACHE", REPO / ".cache" / "test-data"))
LLAMA_SDIST = "llama-cpp-python==0.3.36"
_TARBALL = "llama_cpp_python-0.3.36.tar.gz"
_VENDOR = "/vendor/llama.cpp/"


@contextlib.contextmanager
def cache_lock(name: str):
    """Held while one process fills CACHE's `name`: the suite runs in several pytest-xdist workers,
    and a second one must wait for the first's files, not rewrite them under it."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / f".{name}.lock")):
        yield


def sdist() -> Path:
    """The sdist tarball, downloaded with pip (no binary, no dependencies) on first use."""
    dl = CACHE / "sdist"
    tar = dl / _TARBALL
    if tar.exists():
        return tar
    with cache_lock("sdist"):
        if not tar.exists():
            _download(dl)
    return tar


def _download(dl: Path) -> None:
    """pip writes the tarball in place: it is downloaded into a fresh folder and renamed."""
    tmp = dl.with_name(".sdist.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                    "llama-cpp-python", LLAMA_SDIST, "-d", str(tmp)], check=True)
    shutil.rmtree(dl, ignore_errors=True)
    tmp.rename(dl)


def _extract(name: str, keep, flatten: bool) -> Path:
    """Members of the sdist's vendor/llama.cpp/ that `keep(relative path)` accepts, into
    CACHE/name (flat, or with their paths under vendor/llama.cpp/). Written to a temporary folder
    and renamed, so an interrupted extraction is never taken for a finished one."""
    out = CACHE / name
    if (out / ".complete").exists():
        return out
    with cache_lock(name):
        if not (out / ".complete").exists():
            _extract_into(out, keep, flatten)
    return out


def _extract_into(out: Path, keep, flatten: bool) -> None:
    name = out.name
    tmp = CACHE / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist()) as tf:
        for m in tf.getmembers():
            i = m.name.find(_VENDOR)
            if i < 0 or not m.isfile():
                continue
            rel = m.name[i + len(_VENDOR):]
            if keep(rel):
                m.name = Path(rel).name if flatten else rel
                tf.extract(m, tmp, filter="data")
    (tmp / ".complete").touch()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def vocab_dir() -> Path:
    """llama.cpp's `models/ggml-vocab-*` files (GGUF vocabularies and their .inp/.out vectors)."""
    return _extract("llama-vocab", lambda rel: rel.startswith("models/ggml-vocab-"), flatten=True)


def converter_dir() -> Path:
    """A folder holding llama.cpp's `convert_hf_to_gguf.py`, its `conversion/` package and `gguf-py/`."""
    return _extract("llama-convert", lambda rel: rel == "convert_hf_to_gguf.py" or
                    rel.startswith(("conversion/", "gguf-py/")), flatten=False)
