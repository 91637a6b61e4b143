"""Triton's interpreter with the GPU machines' triton (3.6) and numpy >= 2.3 (issue 21 item 6): every
scalar is a one-element array there, and a `range()` bound computed from one (a K loop, a key loop)
failed with "only 0-dimensional arrays can be converted to Python scalars" in 211 kernel tests.
`kernels/triton/interpreter_compat.py` restores what triton 3.9 does; `make test` runs the kernel tests
under triton 3.6 too (`make test-triton36`), where this file fails without it."""
from triton_env import DEVICE, INTERPRET  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch

if not INTERPRET:
    pytest.skip("the interpreter's scalars only", allow_module_level=True)


def test_the_kernel_tests_and_the_models_kernel_path_install_the_scalar_index_fix():
    from kernels.triton.interpreter_compat import install
    from kernels.triton.launch import kernels_on_cpu
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang_tensor, "edgegem_scalar_index", False)  # by triton_env
    with kernels_on_cpu():
        assert getattr(interpreter._patch_lang_tensor, "edgegem_scalar_index", False)
    assert install() is True  # idempotent


@pytest.mark.parametrize("n_cols", [1, 37, 300])
def test_a_loop_bound_from_a_scalar_argument_runs(n_cols):
    """tests/tiny_kernels.py `_sum_rows_kernel`: `for k in range(0, n_cols, BLOCK)` with n_cols an
    int argument, the interpreter's one-element array."""
    from tiny_kernels import _sum_rows_kernel

    x = torch.randn(3, n_cols, generator=torch.Generator().manual_seed(n_cols)).to(DEVICE)
    out = torch.empty(3, device=DEVICE)
    _sum_rows_kernel[(3,)](x, out, n_cols, x.stride(0), 0.5, BLOCK=32)
    torch.testing.assert_close(out, 0.5 * x.sum(1), rtol=1e-5, atol=1e-5)
