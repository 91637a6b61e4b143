"""The kernels `make gpu-check --quick` launches compile for sm_90 (the H200 the GPU checks run on)
under the Triton installed here: `make test` runs this under triton 3.9 (the suite's venv) and again
under triton 3.6 (`make test-triton36`, the version GPU machines carry). The interpreter runs no code
generation, so without this a kernel that only triton 3.6 refuses to compile would first fail on the
GPU, in its rarest minutes.

The launch set: the quick bench's E2B engine runs with bf16 KV (a B = 1 decode step, a 512- and a
2048-token prefill chunk) and the GEMV table's `QuantWeight.linear` launches, every decode GEMV
format at E2B's matrix shapes (`engine.bench.static.gpu_check_specs`); recorded from meta-device dry runs as built for sm_90 and compiled
with the wheel's ptxas (kernels/triton/compile_check.py), cached on disk per Triton version and source.
Checked: no compile error, no register spill on the decode path; every spill is printed.
"""
from __future__ import annotations

import triton_env  # noqa: F401  (TRITON_INTERPRET=1 here: recording and compiles run in spawned workers)

import pytest

from conftest import CACHE

pytestmark = pytest.mark.slow
ARCH = "sm_90"


@pytest.fixture(scope="module")
def compiled(request):
    from engine.bench.static import _run_as_on_gpu, gpu_check_specs
    from kernels.triton.compile_check import compile_specs, gpu_pool

    specs = _run_as_on_gpu(gpu_check_specs, "e2b", "bf16", ARCH)
    with gpu_pool(2) as pool:
        results = compile_specs(sorted(specs, key=str), [ARCH], cache_dir=CACHE / "compile-check", pool=pool)
    import triton

    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        spills = [f"  {s.label()}: {r.spill_stores}/{r.spill_loads} B st/ld [{', '.join(specs[s][:2])}]"
                  for (s, _), r in results.items() if not r.error and r.spills]
        print(f"\ntriton {triton.__version__}, {ARCH}: {len(results)} quick-bench specializations, "
              f"{sum(bool(r.error) for r in results.values())} errors, {len(spills)} with spills"
              + ("\n" + "\n".join(spills) if spills else ""))
    return specs, results


def test_the_quick_gpu_checks_kernels_compile_for_sm90(compiled):
    specs, results = compiled
    names = {s.name for s, _ in results}
    assert {"_gemv_kernel", "_decode_split_kernel", "_extend_kernel", "_qkv_norm_rope_store_kernel"} <= names
    assert sum("gemv" in lab for labels in specs.values() for lab in labels) >= 6  # formats x shapes
    errors = [f"{s.label()}: {r.error.splitlines()[0] if r.error else ''}" for (s, _), r in results.items() if r.error]
    assert not errors, f"{len(errors)} compile errors on {ARCH}:\n  " + "\n  ".join(errors)


def test_the_quick_gpu_checks_decode_kernels_do_not_spill(compiled):
    from engine.bench.static import decode_path

    specs, results = compiled
    spilling = [f"{s.label()}: {r.spill_stores}/{r.spill_loads} B" for (s, _), r in results.items()
                if not r.error and r.spills and (decode_path(specs[s]) or any("gemv" in lab for lab in specs[s]))]
    assert not spilling, "decode-path spills:\n  " + "\n  ".join(spilling)
