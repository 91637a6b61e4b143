"""Stop at a blank line after a paragraph: the base-model continuation mode's end rule.

A base model has no end-of-turn token to stop on; left alone it writes to the token limit, one
paragraph after another. The continuation mode ends at the first blank line (a newline, optional
spaces or tabs, a newline) that follows some non-blank text; blank lines before any text (a model
that starts its continuation on a new paragraph) do not count. The text up to the blank line is
kept, the blank line dropped.
"""
from __future__ import annotations

import re

_BLANK = re.compile(r"\n[ \t]*\n")
_OPEN = re.compile(r"\n[ \t]*\Z")  # text that may still become a blank line


def blank_line_stop(text: str) -> int:
    """Index where `text` should be cut (its first blank line after non-blank text), or -1."""
    first = len(text) - len(text.lstrip())
    m = _BLANK.search(text, first)
    return m.start() if m else -1


def blank_line_hold(text: str) -> int:
    """How many trailing characters to hold back from streaming: a newline (and spaces) after
    non-blank text could be the start of the blank line, which is never shown."""
    if not text.strip():
        return 0
    m = _OPEN.search(text)
    return len(text) - m.start() if m else 0
