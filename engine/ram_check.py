"""Refuse a model that cannot fit in host memory before loading it.

A 26B-A4B (16.8 GB) on a 16 GB laptop used to spend ~28 s reading tensors and then die on a raw
allocator message. `check_host_ram` compares what the CPU runtime must hold in RAM with
`MemAvailable` first and raises `RamTooSmall` (a `BudgetTooSmall`: `engine.api.load_error_kind`
gives ErrorKind.CAPACITY) in one line naming both byte counts.

What a load on the CPU holds, as a lower bound (a model refused here cannot load; one let through
may still fall short, e.g. by the KV pool the engine adds afterwards):
  * reference (`--exact`): every tensor the model reads as float32 (`load_weights` dequantizes all
    of them, the embedding tables too): 4 bytes a value;
  * ggml / cpu_torch: the tensors in their GGUF bytes (ggml keeps them; cpu_torch repacks the
    4-bit types at that size and widens the rest), except the lookup-only tables (the PLE table, an
    untied token table), which stay in the file and are read a row at a time;
  * an HF folder: its safetensors bytes (bf16 on disk, float32 or float16 once loaded).
A GPU load reads one tensor at a time into device memory: its RAM use is the host tables only,
which the memory plan (`host` column) already counts, so nothing is checked here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .memory_plan import BudgetTooSmall, host_available

GB = 10 ** 9
LOOKUP_ONLY = ("per_layer_token_embd.weight",)


class RamTooSmall(BudgetTooSmall):
    """The model's weights need more host memory than is available (`needed`/`budget` in bytes)."""

    def __init__(self, msg: str, needed: int, available: int):
        super().__init__(msg, needed, available, [])


def gguf_ram_bytes(layout, runtime: str) -> int:
    """Bytes of host memory the weights of a GGUF layout take on the CPU `runtime`
    ("reference", "ggml", "cpu_torch"; module doc)."""
    from .memory_plan import layout_config, read_tensors

    read = read_tensors(layout, layout_config(layout))
    if runtime == "reference":
        return sum(layout.tensor(n).n_elements * 4 for n in read)
    lookup = set(LOOKUP_ONLY) | ({"token_embd.weight"} if "output.weight" in layout else set())
    return sum(layout.tensor(n).n_bytes for n in read - lookup)


def model_ram_bytes(path: Path, runtime: str) -> int:
    """`gguf_ram_bytes` of a GGUF file, or the safetensors bytes of an HF folder."""
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    from models.loader import open_gguf

    return gguf_ram_bytes(open_gguf(path), runtime)


def check_host_ram(path: Path, runtime: str, available: Optional[int] = None) -> None:
    """Raise RamTooSmall when the model at `path` cannot fit in host memory on the CPU `runtime`
    (`available`: MemAvailable unless given)."""
    _check(Path(path).name, model_ram_bytes(path, runtime), runtime, available)


def check_layout_ram(layout, runtime: str, available: Optional[int] = None) -> None:
    """check_host_ram for an opened layout (a synthetic one before its GGUF is written)."""
    _check(layout.path.name, gguf_ram_bytes(layout, runtime), runtime, available)


def decimal_size(n: int) -> str:
    """Bytes as model files are quoted (16.8 GB, decimal); below 0.1 GB in MB."""
    return f"{n / GB:.1f} GB" if n >= GB // 10 else f"{n / 10 ** 6:.1f} MB"


def _check(name: str, needed: int, runtime: str, available: Optional[int]) -> None:
    available = host_available() if available is None else available
    if needed > available:
        raise RamTooSmall(f"{name}: its weights need {decimal_size(needed)} of RAM on the CPU ({runtime} runtime) "
                          f"and {decimal_size(available)} is available; use a smaller model or quantization, "
                          f"or free memory", needed, available)
