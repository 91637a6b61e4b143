"""Byte sizes as users write and read them (`8GiB`, "1.4 GiB"), and the memory plan's refusal: one
module below the planner, so the planner and its refusal (engine/plan_refusal.py) both import it."""
from __future__ import annotations

import re

MiB, GiB = 2 ** 20, 2 ** 30
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": MiB, "mib": MiB, "mb": 10**6,
          "g": GiB, "gib": GiB, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


class BudgetTooSmall(ValueError):
    """The model does not fit. `needed`/`budget` in bytes; `suggestions`: [(flags, option overrides)]."""

    def __init__(self, msg: str, needed: int, budget: int, suggestions: list):
        super().__init__(msg)
        self.needed, self.budget, self.suggestions = needed, budget, suggestions


def parse_size(s) -> int:
    """Bytes from 8GiB, 8G (binary, like nvidia-smi's MiB), 7.5GiB, 8000MB (decimal), 123 or an int."""
    if isinstance(s, (int, float)):
        return int(s)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read the size {s!r} (examples: 8GiB, 7.5G, 8000MB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_UNIT_BYTES = {"B": 1, "KiB": 2**10, "MiB": MiB, "GiB": GiB, "TiB": 2**40}


def fmt_size(n: float, units: tuple[str, ...] = ("MiB", "GiB"), decimals: tuple[int, ...] = (1, 1)) -> str:
    """`n` bytes in the largest of `units` (smallest first) that |n| reaches, else the smallest, with
    that unit's `decimals`: "3.1 GiB", "512.0 MiB". The one byte formatter of engine and app: the
    status panel's (0, 2) gives "512 MiB" / "1.40 GiB", an attachment chip's ("B", "KiB", "MiB")
    "125 B" / "3.2 KiB"."""
    i = len(units) - 1
    while i > 0 and abs(n) < _UNIT_BYTES[units[i]]:
        i -= 1
    return f"{n / _UNIT_BYTES[units[i]]:.{decimals[i]}f} {units[i]}"
