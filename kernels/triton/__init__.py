"""The Triton kernels: the face of the toolchain. Each kernel module holds its `@triton.jit`
kernels, their launchers and torch references; what models/ and engine/ call:

  - `launch`: where the kernels run (`use_kernels`, `interpreting`, `kernels_on_cpu`) and the
    launch recorder of the dry runs (`record_launches`, `LaunchRecord`);
  - `qpack`: the load-time repack of GGUF matrices (`pack`, `PackedQuant`, `dequantize_packed_ref`)
    on the GGML block table of `qformats`;
  - `qmatmul`: products in that layout (`qmatmul`, `qdequantize_packed`, `gemv_launch_info`) and,
    from `qdequant`, GGUF rows dequantized for embedding gathers (`qdequantize`);
  - `fused`, `qkv`: the fused elementwise chains and the attention prologue (models/ops.py takes
    them by module, `kernels.triton.fused` / `.qkv`);
  - `kv_store`, `attention`: KV slabs written and attended through slot lists (`decode_attention`,
    `decode_splits`);
  - `compile_check`, `sass`: recorded launches compiled for the GPU archs and their SASS read;
  - `interpreter_compat`: the Triton interpreter fix the kernel tests install.

Callers import from the module (`from kernels.triton.qmatmul import qmatmul`): this file imports
none of them, because importing a kernel module imports triton, which must come after
TRITON_INTERPRET is settled (the compile workers set it in their initializer, after this package
is imported), and because two launchers carry their module's name (`qmatmul`, `kv_store`), which a
re-export here would shadow as soon as the module is imported. GPU generations are `kernels.arch`,
shared with the rest of kernels/. Nothing here imports `kernels.ggml`, nor it this
(tests/repo/test_layering.py).
"""
__all__ = ["attention", "compile_check", "fused", "interpreter_compat", "kv_store", "launch", "qdequant",
           "qformats", "qkv", "qmatmul", "qpack", "sass"]
