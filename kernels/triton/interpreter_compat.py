"""Triton's interpreter (TRITON_INTERPRET=1) with numpy >= 2.3 on triton 3.6, the GPU machines' version.

The interpreter holds every scalar of a kernel as a one-element numpy array: each int argument
(`_implicit_cvt` wraps it as `np.array([v])`) and each value made from one (`K // 256`,
`tl.program_id`, a loaded bound). A `range()` bound asks the scalar for `__index__`, which triton
3.6 answers with `int(self.handle.data)`; numpy 2.3 made `int()` of an array with ndim > 0 an error
("only 0-dimensional arrays can be converted to Python scalars"), so every kernel with a K loop or
a key loop (`kernels/triton/qmatmul.py` `_gemv_kernel`, `kernels/triton/attention.py`) failed under the
interpreter: 211 kernel tests. Passing plain ints from the launchers cannot help (they are plain
ints already; the interpreter wraps them, and the failing bounds are computed inside the kernels),
so this installs what triton 3.9 does: `int(data.squeeze())`. The compiled path is untouched.

Installed by `kernels.triton.launch.kernels_on_cpu()` (the models' kernel path on the CPU) and by the kernel
tests' set-up (tests/triton_env.py), never at `import kernels`: importing triton with
TRITON_INTERPRET=1 in a process that then compiles (the compile check's workers switch it off
around each task, before the task imports triton: `kernels.triton.compile_check._as_on_gpu`) makes `tl.standard`'s functions interpreted ones, and every
later `triton.compile` fails.
"""
from __future__ import annotations

__all__ = ["install"]


def install() -> bool:
    """Make the interpreter's scalar `__index__` take one-element arrays (idempotent). Returns
    whether the patch is in place; False when triton (or its interpreter) is absent."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - depends on the install
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # pragma: no cover - another interpreter layout: nothing known to fix
        return False
    if getattr(original, "edgegem_scalar_index", False):
        return True

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor.edgegem_scalar_index = True
    interpreter._patch_lang_tensor = _patch_lang_tensor  # looked up by name in _patch_lang at each launch
    return True
