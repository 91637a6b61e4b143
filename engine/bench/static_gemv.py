"""The decode GEMV's compiled cost per weight format, for the static reports (static.py for
E2B/E4B, static_host.py for the 26B-A4B with host experts): one launch per format and shape recorded
without a GPU, compiled for the target arch (SASS instructions per weight byte, registers, loads),
and the bandwidth cap that instruction rate allows; the table's rows."""
from __future__ import annotations

import torch

from .table import Column, header, row

GEMV_TARGETS = {"Q4_K": 0.35, "Q6_K": 0.35}
GEMV_TARGET_OTHER = 0.5


def gemv_formats(used=()) -> list[str]:
    """The formats the model's decode GEMVs use first, then every other one QuantWeight reads."""
    from models.formats import QuantWeight

    order = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"]
    rest = sorted(QuantWeight.TYPES - set(order))
    return list(dict.fromkeys([*used, *[f for f in order if f in QuantWeight.TYPES], *rest]))


def gemv_launches(fmt: str, shape, dtype=torch.bfloat16) -> list:
    """Every Triton launch `QuantWeight.linear` makes for one token of x at `shape` (n_out, n_in)."""
    from gguf import GGMLQuantizationType as T

    from kernels.triton.launch import record_launches
    from models.quant import row_bytes
    from models.formats import QuantWeight

    n_out, n_in = shape
    raw = torch.empty((n_out, row_bytes(int(T[fmt]), n_in)), dtype=torch.uint8, device="meta")
    w = QuantWeight(raw, int(T[fmt]), shape)
    with record_launches(torch_ops=False) as rec:
        w.linear(torch.empty((1, n_in), dtype=dtype, device="meta"))
    return list(rec.triton)


def gemv_launch(fmt: str, shape, dtype=torch.bfloat16):
    """The decode GEMV launch `QuantWeight.linear` makes for one token of x at `shape` (n_out, n_in)."""
    from kernels.triton.qmatmul import gemv_launch_info

    launches = gemv_launches(fmt, shape, dtype)
    for launch in launches:
        info = gemv_launch_info(launch)
        if info is not None:
            return launch, info
    raise RuntimeError(f"QuantWeight.linear on {fmt} launched no decode GEMV "
                       f"({', '.join(l.name for l in launches) or 'no Triton kernel'})")


def model_gemv_shapes(model) -> list[tuple[int, int]]:
    """Distinct (n_out, n_in) of the quantized matrices a decode step multiplies on the device."""
    from models.formats import QuantWeight

    return sorted({tuple(w.shape) for w in model.w.values()
                   if isinstance(w, QuantWeight) and w.packed is not None and w.device.type == model.device.type})


def _shape_cost(launch, info, res, arch) -> dict:
    from kernels.triton.compile_check import ARCHS, bandwidth_cap
    from kernels.triton.sass import loop_body, loop_loads

    row = {"kernel": res.spec.label(), "num_warps": info["num_warps"], "loop_bytes": info["loop_bytes"],
           "registers": res.registers, "spill_stores": res.spill_stores, "spill_loads": res.spill_loads,
           "shared": res.shared, "error": res.error}
    body = loop_body(res.sass) if not res.error else []
    if not res.error and not body:
        row["error"] = "no loop found in the SASS"
    if row["error"]:
        return row
    ipb = len(body) * info["num_warps"] / info["loop_bytes"]
    n_ldg, ldg_thread_bytes = loop_loads(body)
    row.update(loop_instructions=len(body), ldg=n_ldg, ldg_bytes=ldg_thread_bytes * 32 * info["num_warps"],
               instructions_per_byte=ipb, bandwidth_cap=bandwidth_cap(ipb, ARCHS[arch]))
    return row


def gemv_cost(fmt: str, shapes, arch: str = "sm_86", cache_dir="default", used: bool = False) -> dict:
    """Instructions per weight byte and bandwidth cap of `fmt`'s decode GEMV on `arch`: the worst
    over the matrix `shapes` (n_out, n_in) it is launched at (row lengths decide which pointers and
    ints Triton sees as 16-byte aligned, and so which loads vectorize); `shapes` lists each."""
    from kernels.triton.compile_check import compile_specs, spec_of

    from models.quant import block_size
    from gguf import GGMLQuantizationType as T

    row = {"format": fmt, "used_by_model": used, "arch": arch, "instructions_per_byte": None,
           "bandwidth_cap": None, "target": GEMV_TARGETS.get(fmt, GEMV_TARGET_OTHER), "error": None}
    fit = [s for s in shapes if s[1] % block_size(int(T[fmt]))[0] == 0]
    try:
        launches = [(shape, *gemv_launch(fmt, shape)) for shape in fit]
    except (RuntimeError, ValueError) as e:
        return {**row, "error": str(e)}
    if not launches:
        return {**row, "error": f"no shape of {shapes} has rows that are whole {fmt} blocks"}
    specs = [spec_of(launch) for _, launch, _ in launches]
    results = compile_specs(specs, [arch], jobs=1, cache_dir=cache_dir)
    per_shape = [{"shape": list(shape), **_shape_cost(launch, info, results[(spec, arch)], arch)}
                 for (shape, launch, info), spec in zip(launches, specs)]
    failed = [r for r in per_shape if r["error"]]
    worst = failed[0] if failed else max(per_shape, key=lambda r: r["instructions_per_byte"])
    row.update(worst)
    row["shapes"] = [{k: r.get(k) for k in ("shape", "kernel", "loop_instructions", "instructions_per_byte",
                                             "error")} for r in per_shape]
    return row


# ---------------------------------------------------------------------------------------- report


def title_line(o: dict, what: str = "") -> str:
    """A static report's first line: the model (and `what` of it), the step, the target."""
    g = o["reference_gpu"]
    return (f"{o['model']}{what}: one B = 1 decode step at context {o['context']}, KV {o['kv_cache_dtype']}, "
            f"compiled for {o['arch']} (reference GPU {g['name']}: {g['sms']} SMs, {g['boost_ghz']:.2f} GHz, "
            f"{g['bandwidth_gbps']:.0f} GB/s)")


GEMV_COLUMNS = (Column("format", 6, align="<"), Column("used", 4), Column("shape", 13), Column("warps", 5, "d"),
                Column("loop instr", 10, "d"), Column("B/iter", 7, "d"), Column("LDG", 4, "d"), Column("regs", 4, "d"),
                Column("instr/B", 8, ".3f"), Column("target", 6, ".2f"), Column("bw cap", 7))


def gemv_table_lines(o: dict) -> list[str]:
    """The report's decode GEMV table: one line per format (o["gemv"]), the worst of its shapes."""
    lines = [f"decode GEMV per format, the worst of the model's {len(o['gemv_shapes'])} matrix shapes:",
             header(GEMV_COLUMNS)]
    for r in o["gemv"]:
        used = "yes" if r["used_by_model"] else ""
        if r["error"]:
            lines.append(row(GEMV_COLUMNS, (r["format"], used)) + f"  error: {r['error'].splitlines()[0]}")
            continue
        lines.append(row(GEMV_COLUMNS, (r["format"], used, "x".join(map(str, r["shape"])), r["num_warps"],
                                        r["loop_instructions"], r["loop_bytes"], r["ldg"], r["registers"],
                                        r["instructions_per_byte"], r["target"], f"{100 * r['bandwidth_cap']:.1f}%")))
    lines.append("instr/B = SASS instructions of one K-loop iteration x warps per program / weight bytes the "
                 "program reads in it; bw cap = min(1, 4 warp-instr/clock/SM x SMs x clock / (instr/B x bandwidth)); "
                 "targets: issue 11 (sm_86)")
    return lines


# ------------------------------------------------------------------------------ the compile check
