"""Two small Triton kernels for tests/kernels/test_compile_check.py, in a module of their own: the compile
workers import kernels by module name with TRITON_INTERPRET=0, which a test module (it imports
triton_env, which skips without a GPU when the interpreter is off) cannot be imported with."""
import triton
import triton.language as tl


@triton.jit
def _sum_rows_kernel(x_ptr, out_ptr, n_cols, stride, scale, BLOCK: tl.constexpr):
    """out[r] = scale * sum(x[r, :n_cols]): a K loop with a runtime trip count, as the GEMV has."""
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, n_cols, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc) * scale)


@triton.jit
def _to_bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = x rounded to bfloat16; from float16 x that needs sm_80 (ptxas refuses it on sm_75)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n).to(tl.bfloat16), mask=i < n)


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["m"])
def _flags_kernel(x_ptr, out_ptr, n, m, k: tl.int32, f: tl.float32, BLOCK: tl.constexpr):
    """Parameters Triton specializes differently: unspecialized, unaligned, annotated."""
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i) * (n + m + k) * f)
