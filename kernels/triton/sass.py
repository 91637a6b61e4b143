"""Reading `cuobjdump -sass` output: a kernel's main loop and the global loads in it.

cuobjdump prints one instruction per line as `/*addr*/  [@pred] OPCODE operands ;` (16 bytes per
instruction on sm_70 and later) and branch targets as addresses, so a loop is a `BRA` to a lower
address. `loop_body` takes the widest such span (the outermost loop); the static bench counts its
instructions (`loop_instructions`) and loads (`loop_loads`) per iteration.
"""
from __future__ import annotations

import re
from typing import Optional

__all__ = ["loop_body", "loop_instructions", "loop_loads", "sass_functions"]

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"^(?:@!?U?P\w+\s+)?BRA(?:\.[\w.]+)?\s+(?:[!\w]+,\s*)*(0x[0-9a-f]+)$")


def sass_functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> {function name: [(address, instruction), ...]}."""
    funcs, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return funcs


def loop_body(sass: str, function: Optional[str] = None) -> list[str]:
    """The SASS instructions of the kernel's main loop: of all backward branches (a `BRA` to a
    lower address: cuobjdump prints targets as addresses) the one spanning the most instructions,
    from its target to the branch inclusive. With nested loops that is the outermost one; [] if
    the kernel (its longest function, unless `function` names one) has no loop."""
    funcs = sass_functions(sass)
    if not funcs:
        return []
    code = funcs[function] if function else max(funcs.values(), key=len)
    index = {addr: i for i, (addr, _) in enumerate(code)}
    best = (0, 0)
    for i, (addr, ins) in enumerate(code):
        m = _BRANCH.match(ins)
        if m:
            target = int(m.group(1), 16)
            if target < addr and target in index and i + 1 - index[target] > best[1] - best[0]:
                best = (index[target], i + 1)
    return [ins for _, ins in code[best[0]:best[1]]]


def loop_instructions(sass: str, function: Optional[str] = None) -> int:
    """How many SASS instructions one iteration of the kernel's main loop executes (`loop_body`)."""
    return len(loop_body(sass, function))


_LDG = re.compile(r"\bLDG(?:STS)?(?:\.\w+)*")  # global loads (LDGSTS: global -> shared, sm_80+)


def _ldg_width(opcode: str) -> int:
    """Bytes one thread loads with an LDG opcode such as LDG.E.U8, LDG.E.128 (plain LDG.E: 4)."""
    parts = opcode.split(".")
    return next((b for mod, b in (("U8", 1), ("S8", 1), ("U16", 2), ("S16", 2), ("64", 8), ("128", 16))
                 if mod in parts), 4)


def loop_loads(body: list[str]) -> tuple[int, int]:
    """(global load instructions, bytes one thread loads with them) in a SASS loop body."""
    widths = [_ldg_width(m.group(0)) for ins in body if (m := _LDG.search(ins))]
    return len(widths), sum(widths)
