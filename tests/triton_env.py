"""Set-up shared by the Triton kernel tests; import it before anything that imports triton.

TRITON_INTERPRET=1 unless the caller set it (the kernels then run on the CPU); the test module is
skipped when triton is not installed, or when the interpreter is off and there is no CUDA device.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from kernels.triton.launch import interpreting  # noqa: E402  (imports no kernel: nothing is @triton.jit yet)

INTERPRET = interpreting()  # Triton's parse of the variable, as the launchers read it
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device", allow_module_level=True)
# triton 3.6's interpreter with numpy >= 2.3: scalar range() bounds (kernels/triton/interpreter_compat.py)
if INTERPRET:
    from kernels.triton.interpreter_compat import install

    install()
