"""edgegem's environment switches, read once into a frozen dataclass (docs/configuration.md).

Every `EDGEGEM_*` variable the program honours is read here and nowhere else: `env()` parses
`os.environ` the first time it is called and hands back the same `Env` after, so a switch cannot
change under a running model and no module keeps a copy of its own. Every layer reads the switches,
so this module sits in the lowest one and imports nothing of ours (app/ reaches it through
engine/env.py).

Re-reading is explicit: `reload()` parses `os.environ` again (cheap: ten dictionary lookups). A
test that sets a switch with `monkeypatch.setenv` calls `reload()` after it; tests/conftest.py
reloads before and after every test, so one test's values never reach the next.

A bad value is a `ConfigError` (a ValueError) of one line naming the variable and what it takes,
raised by the first `env()`; the command line calls `env()` before anything else and prints it as
`edgegem: error: ...` (exit 2), so a typo never surfaces as a traceback deep inside a forward.
An empty value counts as unset. `EDGEGEM_FAILPOINTS` is kept as its text: its grammar and point
names belong to engine/failpoints.py, which parses it (its own one-line error).

Not here: `TRITON_INTERPRET`, which Triton itself reads (kernels/triton/launch.py `interpreting()`), and
the standard `OMP_NUM_THREADS` (engine/cpu_runtime.py) and `XDG_CACHE_HOME`
(kernels/triton/compile_check.py), which torch, OpenMP and every XDG program read as well.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

__all__ = ["ConfigError", "Env", "VARIABLES", "env", "reload"]

# Every variable Env.from_environ reads (tests/kernels/test_env.py checks the two agree and that
# docs/configuration.md documents each).
VARIABLES = ("EDGEGEM_CPU_KERNELS", "EDGEGEM_CPU_ATTENTION", "EDGEGEM_CPU_LAYER_GRAPH", "EDGEGEM_CPU_STEP_GRAPH",
             "EDGEGEM_CPU_REPACK", "EDGEGEM_CPU_HUGEPAGES", "EDGEGEM_IMAGE_PREVIEW", "EDGEGEM_FAILPOINTS", "EDGEGEM_DATA_DIR", "EDGEGEM_MODELS_DIR",
             "EDGEGEM_COMPILE_CACHE", "EDGEGEM_GEMV_SPLIT")

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


class ConfigError(ValueError):
    """A variable with a value it does not take: one line, naming it."""


@dataclass(frozen=True)
class Env:
    """The switches, parsed; the defaults are what an unset variable means."""
    cpu_kernels: str = "auto"         # EDGEGEM_CPU_KERNELS: "auto" (llama.cpp's where they load) | "torch"
    cpu_attention: str = "ggml"       # EDGEGEM_CPU_ATTENTION: decode attention on ggml | "torch"
    cpu_layer_graph: bool = True      # EDGEGEM_CPU_LAYER_GRAPH: a decode layer as one ggml graph
    cpu_step_graph: bool = True       # EDGEGEM_CPU_STEP_GRAPH: a decode token as one ggml graph
    cpu_repack: str = "auto"          # EDGEGEM_CPU_REPACK: "auto" | "on" | "off" (models/formats/ggml.py)
    cpu_hugepages: str = "auto"       # EDGEGEM_CPU_HUGEPAGES: "auto" | "on" | "off" (models/formats/ggml.py)
    image_preview: str = "auto"       # EDGEGEM_IMAGE_PREVIEW: "auto" (graphics where the terminal has them) | "blocks"
    failpoints: str = ""              # EDGEGEM_FAILPOINTS: "NAME@N[,NAME@N...]", parsed by engine/failpoints.py
    data_dir: Optional[Path] = None   # EDGEGEM_DATA_DIR (~ expanded); None: the platform's user data dir
    models_dir: Optional[Path] = None  # EDGEGEM_MODELS_DIR (~ expanded); None: <data dir>/models
    compile_cache: Optional[Path] = None  # EDGEGEM_COMPILE_CACHE; None: ~/.cache/edgegem/compile-check
    gemv_split: int = 1               # EDGEGEM_GEMV_SPLIT: one-row CUDA GEMVs split over K (1..64)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Env":
        """Parse `environ` (os.environ, or a dict in tests); ConfigError on a bad value."""
        return cls(
            cpu_kernels=_choice(environ, "EDGEGEM_CPU_KERNELS", ("auto", "torch")),
            cpu_attention=_choice(environ, "EDGEGEM_CPU_ATTENTION", ("ggml", "torch")),
            cpu_layer_graph=_switch(environ, "EDGEGEM_CPU_LAYER_GRAPH", default=True),
            cpu_step_graph=_switch(environ, "EDGEGEM_CPU_STEP_GRAPH", default=True),
            cpu_repack=_choice(environ, "EDGEGEM_CPU_REPACK", ("auto", "on", "off")),
            cpu_hugepages=_choice(environ, "EDGEGEM_CPU_HUGEPAGES", ("auto", "on", "off")),
            image_preview=_choice(environ, "EDGEGEM_IMAGE_PREVIEW", ("auto", "blocks")),
            failpoints=environ.get("EDGEGEM_FAILPOINTS", ""),
            data_dir=_folder(environ, "EDGEGEM_DATA_DIR", expand=True),
            models_dir=_folder(environ, "EDGEGEM_MODELS_DIR", expand=True),
            compile_cache=_folder(environ, "EDGEGEM_COMPILE_CACHE", expand=False),
            gemv_split=_count(environ, "EDGEGEM_GEMV_SPLIT", 1, 64, default=1),
        )


def _choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """One of `choices` (any case); unset or empty: the first."""
    raw = environ.get(name, "")
    if not raw:
        return choices[0]
    if raw.strip().lower() not in choices:
        raise ConfigError(f"{name}={raw!r}: expected one of {', '.join(choices)} (default {choices[0]})")
    return raw.strip().lower()


def _switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name, "")
    if not raw:
        return default
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"{name}={raw!r}: expected 1 or 0 (also true/false, on/off, yes/no; "
                          f"default {int(default)})")
    return value in _TRUE


def _count(environ: Mapping[str, str], name: str, lo: int, hi: int, default: int) -> int:
    raw = environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={raw!r}: expected a whole number from {lo} to {hi} (default {default})")
    return value


def _folder(environ: Mapping[str, str], name: str, expand: bool) -> Optional[Path]:
    raw = environ.get(name, "")
    if not raw:
        return None
    return Path(raw).expanduser() if expand else Path(raw)


@functools.lru_cache(maxsize=1)
def env() -> Env:
    """The switches, parsed from os.environ on the first call (ConfigError on a bad value)."""
    return Env.from_environ(os.environ)


def reload() -> Env:
    """Parse os.environ again (after a test sets a variable) and return the new `Env`."""
    env.cache_clear()
    return env()
