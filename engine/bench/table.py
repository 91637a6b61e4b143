"""Fixed-width text tables of the bench reports: each column's title, width and value format in
one place, used for the header and for every row, so a title and its values cannot drift apart."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Column:
    title: str
    width: int
    spec: str = "s"  # the values' format after alignment and width: "d", ".1f", "s" (preformatted text)
    align: str = ">"  # "<": a label column

    def head(self) -> str:
        return format(self.title, f"{self.align}{self.width}s")

    def cell(self, value) -> str:
        return format(value, f"{self.align}{self.width}{self.spec}")


def header(columns: Iterable[Column]) -> str:
    return " ".join(c.head() for c in columns)


def row(columns: Sequence[Column], values: Sequence) -> str:
    """The first len(values) columns of a row (a row that stops early, e.g. at an error, is a prefix)."""
    return " ".join(c.cell(v) for c, v in zip(columns, values))
