"""DRY and XTC in API requests, by llama-server's names (`dry_multiplier`, `dry_base`,
`dry_allowed_length`, `dry_penalty_last_n`, `dry_sequence_breakers`, `xtc_probability`,
`xtc_threshold`): the pydantic fields both schemas mix in, and the SamplingParams keywords of the
ones a request sets (the rest keep the engine's defaults, which are llama.cpp's: both off)."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, Field, StrictStr

FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
          "xtc_probability", "xtc_threshold")
MAX_BREAKERS = 16


class AntiRepeatFields(BaseModel):
    dry_multiplier: Optional[float] = Field(None, ge=0, le=100)
    dry_base: Optional[float] = Field(None, ge=1, le=100)  # llama-server swaps < 1 for 1.75; we say so
    dry_allowed_length: Optional[int] = Field(None, ge=0, le=2 ** 31 - 1)
    dry_penalty_last_n: Optional[int] = Field(None, ge=-1, le=2 ** 31 - 1)  # -1: the whole context
    # llama-server: "a non-empty array of strings"
    dry_sequence_breakers: Optional[list[StrictStr]] = Field(None, min_length=1, max_length=MAX_BREAKERS)
    xtc_probability: Optional[float] = Field(None, ge=0, le=1)
    xtc_threshold: Optional[float] = Field(None, ge=0, le=1)


def anti_repeat(req) -> dict:
    """The SamplingParams keywords of the DRY/XTC fields `req` (a request or Ollama options) sets."""
    out = {k: getattr(req, k, None) for k in FIELDS}
    out = {k: v for k, v in out.items() if v is not None}
    if "dry_sequence_breakers" in out:
        out["dry_sequence_breakers"] = tuple(out["dry_sequence_breakers"])
    return out
