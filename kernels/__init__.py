"""Triton kernels, each beside its plain-torch reference (README, "Kernels (CUDA fast path)")."""
import os as _os

if _os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
    from .interpreter_compat import install as _install  # triton 3.6's interpreter with numpy >= 2.3

    _install()
