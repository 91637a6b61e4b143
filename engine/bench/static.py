"""`edgegem bench --static`: what a decode step costs on a GPU, read without one.

From a dry run of the synthetic E2B/E4B model on the meta device (`engine/bench/dry_run.py`):
  * kernels_per_step: every launch of one B = 1 decode step of the batched decoder, Triton and
    device-side torch ops, counted by intercepting them (`kernels.triton.launch.record_launches`);
  * weight_bytes_per_token: the device weights a decode step reads (`engine.bench.throughput.device_weight_bytes`:
    every quantized/dense/vector tensor on the device, the tied LM head included, the host lookup
    tables not);
  * per decode-GEMV format (those the model uses and every other one `QuantWeight` reads): the
    launches `QuantWeight.linear` makes for one token at each matrix shape of the model, compiled
    for `arch` with the wheel's ptxas (`kernels/triton/compile_check.py`), and from the SASS the
    instructions per weight byte = instructions in one K-loop iteration x warps per program /
    weight bytes the program reads in that iteration (`kernels.triton.qmatmul.gemv_launch_info`), and the
    share of peak bandwidth that caps the kernel at on the arch's reference GPU (issue rate /
    (instructions per byte x bandwidth)). A format's figure is the worst of its shapes (row lengths
    decide which pointers Triton sees as 16-byte aligned, so which loads vectorize). One SASS loop
    iteration is taken to be one iteration of the kernel's K loop: ptxas does not unroll a loop of
    hundreds of instructions with a runtime trip count (`ldg`, `ldg_bytes`: the global loads one
    iteration issues and the bytes they fetch, weights and x together).

`engine_specs` records the launches of decode (B = 1, 2, 4), verify and prefill steps for every KV
format, for the compile test (tests/kernels/test_kernel_compile.py).

Everything here imports the kernels as a GPU machine does (TRITON_INTERPRET=0): in a process that
runs the interpreter the work goes to a spawned worker (`kernels.triton.compile_check.gpu_pool`).
"""
from __future__ import annotations

from collections import Counter

import torch

from .static_gemv import (gemv_cost, gemv_formats, gemv_launch, gemv_launches, gemv_table_lines, model_gemv_shapes,
                          title_line)

KV_FORMATS = ("bf16", "fp16", "int8_per_token_head", "fp8_per_token_head", "fp32")
# The float32 (--exact) model's KV: bf16 is what "auto" gives it on CUDA, fp32 the exact choice,
# int8 the scaled FMA-dot attention (fp8 differs from it only in the byte decode, compiled with
# bf16 queries). Its decode runs at B = 1 only: B = 2 and 4 change no attention spec, only GEMV
# row blocks already compiled for bf16 x (a compile-time budget: 2 x 6 archs of ~300 specs).
EXACT_KV_FORMATS = ("bf16", "fp32", "int8_per_token_head")
# Issue 11's targets, shown beside the figures (stated for sm_86): GEMV instructions per weight byte
# (Q4_K and Q6_K 0.35, every other format 0.5) and kernels per B = 1 decode step.
KERNELS_PER_STEP_TARGETS = {"e2b": 450, "e4b": 520}
# The MoE's device path runs its experts with ops that have no meta kernel (`unique`): its dry run
# keeps the banks in host RAM, as `--cpu-moe` does beside a GPU.
HOST_EXPERT_VARIANTS = ("26b-a4b",)
STATIC_VARIANTS = ("e2b", "e4b", *HOST_EXPERT_VARIANTS)


def _kernels_interpreted() -> bool:
    """Whether kernels imported in this process would be (or were) the interpreter's."""
    import sys

    from kernels.triton.launch import interpreting

    mod = sys.modules.get("kernels.triton.qmatmul")
    return interpreting() or (mod is not None and type(getattr(mod, "_gemv_kernel", None)).__name__ ==
                              "InterpretedFunction")


def _run_as_on_gpu(fn, *args):
    """fn(*args) here, or in a spawned worker when this process runs the Triton interpreter."""
    if not _kernels_interpreted():
        return fn(*args)
    from kernels.triton.compile_check import gpu_pool

    with gpu_pool(1) as pool:
        return pool.submit(fn, *args).result()


# ------------------------------------------------------------------------- launches of the engine

def engine_specs(variant: str, kv_formats=KV_FORMATS, batches=(1, 2, 4), verify_rows: int = 3,
                 prefill: int = 2048, arch: str | None = None, exact_kv_formats=EXACT_KV_FORMATS,
                 exact_batches=(1,)) -> dict:
    """{KernelSpec: [run labels]} of every Triton launch the engine makes for `variant` in a decode
    step at each batch size, a verify step (B = 1, `verify_rows` rows) and a `prefill`-token chunk,
    for each KV format, as built for a GPU of `arch` ("sm_75"...; default kernels.arch.REFERENCE;
    formats the arch refuses, fp8 KV below sm_80, are left out); and the same runs of the float32
    model (`--exact` on CUDA: fp32 activations over the quantized matrices, FMA attention dots) for
    each of `exact_kv_formats`. Labels: "e2b decode B=2 bf16", "e2b verify T=3 fp16", "e2b prefill
    2048 ...", "e2b fp32 decode B=4 fp32"."""
    import contextlib

    from kernels.arch import assume_gpu, fp8_kv_supported
    from kernels.triton.compile_check import spec_of

    from .dry_run import decode_step, dry_model, prefill_chunk

    cap = (int(arch[3:-1]), int(arch[-1])) if arch else None

    def allowed(formats):
        return [kv for kv in formats if not cap or fp8_kv_supported(cap) or "fp8" not in kv]

    out: dict = {}
    with assume_gpu(cap) if cap else contextlib.nullcontext():
        for dtype, label, formats, bs in ((torch.bfloat16, variant, kv_formats, batches),
                                          (torch.float32, f"{variant} fp32", exact_kv_formats, exact_batches)):
            if formats:
                _engine_specs(out, dry_model(variant, dtype), label, allowed(formats), bs, verify_rows, prefill,
                              spec_of, decode_step, prefill_chunk)
    return out


def _engine_specs(out, model, variant, kv_formats, batches, verify_rows, prefill, spec_of, decode_step,
                  prefill_chunk) -> dict:
    for kv in kv_formats:
        runs = [(f"{variant} decode B={b} {kv}", lambda b=b: decode_step(model, b, 1, kv=kv, torch_ops=False))
                for b in batches]
        if verify_rows:
            runs.append((f"{variant} verify T={verify_rows} {kv}",
                         lambda: decode_step(model, 1, verify_rows, kv=kv, torch_ops=False)))
        if prefill:
            runs.append((f"{variant} prefill {prefill} {kv}",
                         lambda: prefill_chunk(model, prefill, kv=kv, torch_ops=False)))
        for label, run in runs:
            for launch in run().record.triton:
                labels = out.setdefault(spec_of(launch), [])
                if label not in labels:
                    labels.append(label)
    return out


def gpu_check_specs(variant: str = "e2b", kv: str = "bf16", arch: str = "sm_90",
                    prefills=(2048, 512), split_bench: int = 4) -> dict:
    """{KernelSpec: [labels]} of what the quick GPU check (packaging/gpu_check.py --quick) launches,
    as built for `arch`: the engine bench's B = 1 decode step and `prefills`-token chunks with KV
    `kv`, the decode step again with its GEMVs split over K `split_bench` ways (the split rerun),
    and the GEMV table's `QuantWeight.linear` launches (every decode GEMV format at the
    variant's matrix shapes, engine.bench.gemv.SHAPES, and its tile and K-split variants; a shape
    that is no whole number of a format's blocks is left out, as the table reports it)."""
    from kernels.arch import assume_gpu
    from kernels.triton.compile_check import spec_of

    from .gemv import BLOCK_FORMATS, BLOCK_MATRICES, SHAPES, VARIANTS
    from .gemv import variant as gemv_variant

    from kernels.triton.qmatmul import gemv_split

    specs: dict = {}
    runs = [((1,) if i == 0 else (), prefill, 1) for i, prefill in enumerate(prefills)]
    runs.append(((1,), 0, split_bench))  # the split-K rerun's decode step (EDGEGEM_GEMV_SPLIT)
    for batches, prefill, splits in runs:
        with gemv_split(splits):
            got = engine_specs(variant, (kv,), batches=batches, verify_rows=0, prefill=prefill, arch=arch,
                               exact_kv_formats=())
        for spec, labels in got.items():
            have = specs.setdefault(spec, [])
            for lab in labels:
                lab += f" split{splits}" if splits > 1 else ""
                if lab not in have:
                    have.append(lab)
    with assume_gpu((int(arch[3:-1]), int(arch[-1]))):
        for fmt in gemv_formats():
            for name, n_out, n_in in SHAPES[variant]:
                try:
                    launch, _ = gemv_launch(fmt, (n_out, n_in))
                except (RuntimeError, ValueError):
                    continue
                specs.setdefault(spec_of(launch), []).append(f"{variant} gemv {fmt} {name}")
                if fmt not in BLOCK_FORMATS or name not in BLOCK_MATRICES:
                    continue
                for v in VARIANTS:  # the table's tiles and K splits (a split adds its reduction launch)
                    with gemv_variant(v):
                        for launch in gemv_launches(fmt, (n_out, n_in)):
                            specs.setdefault(spec_of(launch), []).append(f"{variant} gemv {fmt} {name} {v}")
    return specs


def decode_path(labels) -> bool:
    """A spec launched by a decode or verify step (the batched decoder's graph)."""
    return any(" decode " in lab or " verify " in lab for lab in labels)


# ------------------------------------------------------------------------------------ GEMV costs

def _static_report(variant: str, arch: str, kv: str, cache_dir) -> dict:
    from kernels.triton.compile_check import ARCHS
    from kernels.triton.qmatmul import gemv_launch_info

    from .throughput import device_weight_bytes
    from .dry_run import decode_step, dry_model

    model = dry_model(variant)
    step = decode_step(model, batch=1, rows=1, kv=kv)
    rec = step.record
    used = list(dict.fromkeys(info["format"] for info in map(gemv_launch_info, rec.triton) if info))
    shapes = model_gemv_shapes(model)
    ref = ARCHS[arch]
    return {
        "model": f"synthetic {variant.upper()} (Q4_K_M mix)", "variant": variant, "arch": arch,
        "reference_gpu": {"name": ref.gpu, "sms": ref.sms, "boost_ghz": ref.boost_ghz,
                          "bandwidth_gbps": ref.bandwidth_gbps, "smem_limit": ref.smem_limit},
        "kv_cache_dtype": kv, "context": step.context,
        "kernels_per_step": rec.total, "kernels_per_step_target": KERNELS_PER_STEP_TARGETS.get(variant),
        "triton_kernels": rec.n_triton, "torch_ops": rec.n_torch,
        "triton_breakdown": dict(rec.triton_counts().most_common()),
        "torch_breakdown": dict(Counter(rec.torch_ops).most_common()),
        "weight_bytes_per_token": device_weight_bytes(model),
        "gemv_formats_used": used, "gemv_shapes": [list(s) for s in shapes],
        "gemv": [gemv_cost(f, shapes, arch, cache_dir, used=f in used) for f in gemv_formats(used)],
    }


def static_report(variant: str, arch: str = "sm_86", kv: str = "bf16", cache_dir="default") -> dict:
    """The static decode report of the synthetic `variant` for `arch` with KV `kv`: "e2b"/"e4b", or
    "26b-a4b" with its expert banks in host RAM (engine/bench/static_host.py); "table" holds the
    human-readable form."""
    from kernels.triton.compile_check import ARCHS

    from ..kv.format import resolve_format

    variant = variant.lower()
    if variant not in STATIC_VARIANTS:
        raise ValueError(f"--static needs --synthetic {', '.join(STATIC_VARIANTS[:-1])} or {STATIC_VARIANTS[-1]}, "
                         f"not {variant!r}")
    kv = resolve_format(kv, "cuda").name
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (choose from {', '.join(ARCHS)})")
    if cache_dir not in (None, "default"):
        cache_dir = str(cache_dir)
    if variant in HOST_EXPERT_VARIANTS:
        from .static_host import static_host_report, static_host_table

        out = _run_as_on_gpu(static_host_report, variant, arch, kv, cache_dir)
        out["table"] = static_host_table(out)
        return out
    out = _run_as_on_gpu(_static_report, variant, arch, kv, cache_dir)
    out["table"] = static_table(out)
    return out


def static_table(o: dict) -> str:
    lines = [title_line(o),
             f"kernels per step: {o['kernels_per_step']} ({o['triton_kernels']} Triton + {o['torch_ops']} torch)"
             + (f"; target <= {o['kernels_per_step_target']}" if o.get("kernels_per_step_target") else ""),
             "  Triton: " + ", ".join(f"{k} {v}" for k, v in o["triton_breakdown"].items()),
             "  torch:  " + ", ".join(f"{k} {v}" for k, v in o["torch_breakdown"].items()),
             f"weight bytes per token: {o['weight_bytes_per_token'] / 1e6:.1f} MB (device weights, tied head "
             "included, host lookup tables excluded)"]
    return "\n".join(lines + gemv_table_lines(o))


COMPILE_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_120")


def compile_engine_kernels(variants=("e2b", "e4b"), archs=COMPILE_ARCHS, kv_formats=KV_FORMATS, jobs: int = 2,
                           cache_dir="default", exact_kv_formats=EXACT_KV_FORMATS):
    """Record every launch `engine_specs` lists for each variant (bf16 and the float32 model) as
    built for each arch (launch parameters differ between FMA-dot archs, below sm_80, sm_80-89 and
    each arch from sm_90: recorded as sm_75, sm_86, and each sm_90+ itself) and compile each arch's
    distinct specs
    in a `gpu_pool(jobs)`: ({KernelSpec: [run labels]}, {(KernelSpec, arch): CompileResult})."""
    from kernels.triton.compile_check import compile_specs, gpu_pool

    def rec_arch(a: str) -> str:  # sm_90 and newer pick some tiles of their own (decode_tiles): recorded each
        return "sm_75" if int(a[3:]) < 80 else "sm_86" if int(a[3:]) < 90 else a

    specs: dict = {}
    per_class: dict = {}
    with gpu_pool(jobs) as pool:
        futs = {(c, v): pool.submit(engine_specs, v, tuple(kv_formats), arch=c,
                                    exact_kv_formats=tuple(exact_kv_formats))
                for c in dict.fromkeys(map(rec_arch, archs)) for v in variants}
        for (c, _), fut in futs.items():
            for spec, labels in fut.result().items():
                per_class.setdefault(c, set()).add(spec)
                have = specs.setdefault(spec, [])
                have.extend(lab for lab in labels if lab not in have)
        results: dict = {}
        for a in archs:
            results.update(compile_specs(sorted(per_class[rec_arch(a)], key=str), [a], cache_dir=cache_dir, pool=pool))
    return specs, results


def compile_summary(specs: dict, results: dict) -> str:
    """Per arch: kernels compiled, errors, max registers, max spill bytes (decode path / all), max
    shared memory against the arch's limit."""
    from kernels.triton.compile_check import ARCHS

    archs = list(dict.fromkeys(a for _, a in results))
    lines = [f"{len(specs)} distinct kernel specializations ({len({s.name for s in specs})} kernels) x "
             f"{len(archs)} archs",
             f"{'arch':6s} {'errors':>6s} {'max regs':>8s} {'spill B decode':>14s} {'spill B all':>11s} "
             f"{'max smem':>9s} {'limit':>7s}"]
    for arch in archs:
        rs = [(r, decode_path(specs[s])) for (s, a), r in results.items() if a == arch]
        ok = [(r, d) for r, d in rs if not r.error]
        spill = [r.spill_stores + r.spill_loads for r, _ in ok]
        spill_dec = [r.spill_stores + r.spill_loads for r, d in ok if d]
        lines.append(f"{arch:6s} {len(rs) - len(ok):6d} {max((r.registers for r, _ in ok), default=0):8d} "
                     f"{max(spill_dec, default=0):14d} {max(spill, default=0):11d} "
                     f"{max((r.shared for r, _ in ok), default=0):9d} {ARCHS[arch].smem_limit:7d}")
    return "\n".join(lines)
