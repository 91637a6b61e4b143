"""kernels/triton/compile_check.py and kernels/triton/sass.py: launches specialize as Triton's JIT would, compile
for real archs without a GPU, SASS loops and loads are found and counted, and the bandwidth cap
follows the issue's figures."""
from __future__ import annotations

import triton_env  # noqa: F401  (TRITON_INTERPRET=1 here: compiles go to spawned workers)

import pytest
import torch

from kernels.triton.compile_check import ARCHS, KernelSpec, bandwidth_cap, compile_specs, spec_of, specialize_value
from kernels.triton.sass import loop_body, loop_instructions, loop_loads
from kernels.triton.launch import Launch

from tiny_kernels import _flags_kernel, _sum_rows_kernel, _to_bf16_kernel  # noqa: E402


def _launch(kernel, *args, **kwargs) -> Launch:
    return Launch(kernel, (1,), args, kwargs)


@pytest.mark.parametrize("value", [0, 1, 2, 16, 17, 48, -16, -5, 2 ** 31 - 16, 2 ** 31, 2 ** 40 + 3, 2 ** 63 + 16,
                                   -(2 ** 31) - 1, 1.5, 0.0, True, False, None])
@pytest.mark.parametrize("specialize,align", [(True, True), (False, True), (True, False)])
def test_scalar_specialization_matches_triton(value, specialize, align):
    native = pytest.importorskip("triton._C.libtriton").__dict__.get("native_specialize_impl")
    if native is None:
        pytest.skip("this triton has no native_specialize_impl to compare with")
    from triton.backends.compiler import BaseBackend

    assert specialize_value(value, False, specialize, align) == tuple(native(BaseBackend, value, False, specialize,
                                                                             align))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8,
                                   torch.int32, torch.int64, torch.float8_e4m3fn, torch.bool])
@pytest.mark.parametrize("offset", [0, 1, 3, 8, 16])
def test_tensor_specialization_matches_triton(dtype, offset):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    t = torch.zeros(64, dtype=torch.uint8 if dtype == torch.bool else dtype)[offset:]
    t = t.view(torch.bool) if dtype == torch.bool else t
    for is_const, specialize in ((False, True), (True, True), (False, False)):
        assert specialize_value(t, is_const, specialize) == tuple(native_specialize_impl(BaseBackend, t, is_const,
                                                                                         specialize, True))


def test_meta_tensors_are_aligned_by_their_storage_offset():
    base = torch.empty(100, dtype=torch.float16, device="meta")
    assert specialize_value(base, False) == ("*fp16", "D")
    assert specialize_value(base[8:], False) == ("*fp16", "D")  # 16 bytes in
    assert specialize_value(base[3:], False) == ("*fp16", "")  # 6 bytes in


def test_spec_of_a_launch_names_constexprs_divisibility_and_options():
    x = torch.empty(7, 48, device="meta")
    spec = spec_of(_launch(_sum_rows_kernel, x[1:], torch.empty(7, device="meta"), 37, 48, 0.5, BLOCK=32,
                           num_warps=2))
    assert spec.name == "_sum_rows_kernel" and spec.module == "tiny_kernels"
    assert dict(spec.signature) == {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_cols": "i32", "stride": "i32",
                                    "scale": "fp32", "BLOCK": "constexpr"}
    assert spec.divisible == ("x_ptr", "out_ptr", "stride")  # row 1 starts 192 bytes in; 48 % 16 == 0
    assert spec.constexprs == (("BLOCK", 32),) and spec.options == (("num_warps", 2),)
    # n_cols == 1 becomes a constexpr, as Triton specializes it; equal launches are one spec
    one = spec_of(_launch(_sum_rows_kernel, x, x, 1, 48, 0.5, BLOCK=32, num_warps=2))
    assert ("n_cols", 1) in one.constexprs and dict(one.signature)["n_cols"] == "constexpr"
    assert one == spec_of(_launch(_sum_rows_kernel, x, x, 1, 48, 0.5, BLOCK=32, num_warps=2))


@pytest.mark.parametrize("kernel,args,kwargs", [
    (_sum_rows_kernel, ("x[3:]", "y", 37, 48, 0.5), {"BLOCK": 32}),
    (_sum_rows_kernel, ("x", "y[1:]", 1, 1, 2.0), {"BLOCK": 64}),
    (_flags_kernel, ("x", "y", 16, 32, 48, 1.0), {"BLOCK": 16}),
    (_flags_kernel, ("x[4:]", "y", 1, 1, 1, 0.5), {"BLOCK": 16}),
    (_flags_kernel, ("x", "y", 2 ** 40, 17, 2 ** 33, 1.0), {"BLOCK": 16}),
])
def test_spec_of_equals_the_specialization_of_tritons_jit_binder(kernel, args, kwargs):
    """The binder a JITFunction builds for its launches (runtime/jit.py) gives the same signature,
    constexprs and divisible parameters for the same (CPU) arguments."""
    jit = pytest.importorskip("triton.runtime.jit")
    if not hasattr(jit, "create_function_from_signature"):
        pytest.skip("this triton builds its binder differently")
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    tensors = {"x": torch.zeros(64), "y": torch.zeros(64, dtype=torch.float16)}
    real = tuple(eval(a, {}, tensors) if isinstance(a, str) else a for a in args)  # noqa: S307 ("x[3:]")
    flags = {k: v for k, v in getattr(kernel, "kwargs", {}).items() if k.startswith("do_not_specialize")}
    fn = jit.JITFunction(kernel.fn, **flags) if not isinstance(kernel, jit.JITFunction) else kernel
    binder = jit.create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 86, 32)))
    _, specialization, _ = binder(*real, **kwargs)
    spec = spec_of(_launch(kernel, *real, **kwargs))
    assert [t for _, t in spec.signature] == [s[0] for s in specialization]
    assert list(spec.divisible) == [n for n, s in zip(fn.arg_names, specialization) if s[0] != "constexpr" and
                                    s[1] == "D"]
    assert dict(spec.constexprs) == {n: s[1] for n, s in zip(fn.arg_names, specialization) if s[0] == "constexpr"}


def test_bandwidth_cap_reproduces_the_issue_figures():
    rtx3060 = ARCHS["sm_86"]
    assert (rtx3060.sms, rtx3060.bandwidth_gbps) == (28, 360.0)
    # Q4_K at 312 x 4 / 1152 ~ 1.08 instructions per byte: capped near 51% of 360 GB/s
    assert bandwidth_cap(312 * 4 / 1152, rtx3060) == pytest.approx(0.512, abs=0.005)
    # the break-even is ~0.55 instructions per byte: below it the cap is 1
    assert bandwidth_cap(0.54, rtx3060) == 1.0 and bandwidth_cap(0.56, rtx3060) < 1.0
    assert [ARCHS[a].smem_limit // 1024 for a in ("sm_75", "sm_80", "sm_86", "sm_89")] == [64, 163, 99, 99]


_SASS = """
\tcode for sm_86
\t\tFunction : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x0 */
        /*0010*/              @!P0 BRA 0x100 ;                              /* 0x0 */
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;                /* 0x0 */
        /*0030*/                   LDG.E.128 R4, [R2.64] ;                /* 0x0 */
        /*0040*/                   FADD R5, R5, R4 ;                      /* 0x0 */
        /*0050*/              @P1 BRA 0x40 ;                              /* 0x0 */
        /*0060*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;      /* 0x0 */
        /*0070*/              @!P0 BRA 0x20 ;                             /* 0x0 */
        /*0080*/                   EXIT ;                                 /* 0x0 */
        /*0090*/                   BRA 0x90;                              /* 0x0 */
"""


def test_loop_body_is_the_widest_backward_branch():
    # the outer loop 0x20..0x70 (6 instructions) holds an inner one 0x40..0x50; forward branches,
    # the self-loop after EXIT and the exit test do not count
    assert loop_instructions(_SASS) == 6
    assert loop_body(_SASS)[0].startswith("IADD3") and loop_body(_SASS)[-1] == "@!P0 BRA 0x20"
    assert loop_instructions(_SASS.replace("@!P0 BRA 0x20", "@!P0 BRA 0x80")) == 2
    assert loop_instructions("") == 0


def test_loop_loads_count_instructions_and_bytes_per_thread():
    body = ["LDG.E.U8 R1, [R2.64]", "LDG.E.128.CONSTANT R4, [R2.64]", "LDGSTS.E.BYPASS.128 [R1], [R2.64]",
            "LDG.E R3, [R4.64]", "LDG.E.64 R6, [R4.64+0x8]", "LDS R1, [R2]", "FADD R1, R2, R3"]
    assert loop_loads(body) == (5, 1 + 16 + 16 + 4 + 8)


@pytest.fixture(scope="module")
def small_compiles(tmp_path_factory):
    cache = tmp_path_factory.mktemp("compile-cache")
    x = torch.empty(5, 48, device="meta")
    loop = spec_of(_launch(_sum_rows_kernel, x, x, 37, 48, 0.5, BLOCK=32, num_warps=1))
    bf16 = spec_of(_launch(_to_bf16_kernel, torch.empty(240, dtype=torch.float16, device="meta"),
                           torch.empty(240, dtype=torch.bfloat16, device="meta"), 240, BLOCK=128, num_warps=4))
    first = compile_specs([loop, bf16, loop], ["sm_75", "sm_86"], jobs=2, cache_dir=cache)
    again = compile_specs([loop, bf16], ["sm_75", "sm_86"], jobs=1, cache_dir=cache)
    return loop, bf16, first, again


def test_compiles_report_registers_shared_memory_and_a_counted_loop(small_compiles):
    loop, bf16, first, _ = small_compiles
    assert len(first) == 4  # the duplicate spec compiled once per arch
    for arch in ("sm_75", "sm_86"):
        r = first[(loop, arch)]
        assert r.error is None and 0 < r.registers <= 255 and not r.spills
        assert f"code for {arch}" in r.sass and 4 <= loop_instructions(r.sass) < 100
        assert r.shared < ARCHS[arch].smem_limit
    assert first[(bf16, "sm_86")].error is None


def test_a_compile_error_is_a_result_with_the_compilers_message(small_compiles):
    _, bf16, first, _ = small_compiles
    r = first[(bf16, "sm_75")]
    assert r.error is not None and "requires .target sm_80" in r.error and r.cubin == b"" and r.sass == ""
    assert len(r.error.splitlines()) == len(set(r.error.splitlines())) <= 12  # each ptxas line once


def test_disk_cache_returns_the_same_facts(small_compiles):
    loop, bf16, first, again = small_compiles
    for key, r in again.items():
        assert r.cached
        assert (r.registers, r.spill_stores, r.spill_loads, r.shared, r.error, r.cubin) == \
            (first[key].registers, first[key].spill_stores, first[key].spill_loads, first[key].shared,
             first[key].error, first[key].cubin)


def test_a_spec_of_an_unknown_kernel_is_an_error_not_a_result():
    spec = KernelSpec("kernels.triton.qmatmul", "_no_such_kernel", (), (), (), ())
    with pytest.raises(AttributeError):
        compile_specs([spec], ["sm_86"], jobs=1, cache_dir=None)
