"""Gemma 4 tool calls, parsing side: `<|tool_call>call:NAME{key:value,...}<tool_call|>` in model output
-> OpenAI-style tool calls (`{"id", "type": "function", "function": {"name", "arguments": JSON text}}`).

The argument syntax is the one the template writes (models/tool_format.py `format_argument` with
unquoted keys): strings between `<|"|>` delimiters, numbers, `true`/`false`, `null` (also Python's
`None`/`True`/`False`, which a template's `{{ value }}` prints), `[...]` and `{...}` with bare or
`<|"|>`-quoted keys. JSON-quoted strings are read too (models sometimes fall back to JSON).

`parse_tool_calls` reads a whole reply; `ToolCallStream` reads it delta by delta: text outside
calls goes out as content at once, except a tail that might be the start of `<|tool_call>`; a
call is held until it is complete and then given as one OpenAI stream delta (`index`, `id`,
`type`, `function.name`, `function.arguments`), so a call that turns out malformed was never
announced. A call that does not parse (or names a function not offered) stays in the content, with
one warning line on the `edgegem.tools` logger; a call the reply ends inside (cut off by a token
limit, or an end token mid-call) is dropped with such a line, as it is no text the model meant to
show and no call it finished; nothing here raises on model output.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Collection, Optional

__all__ = ["OPEN", "CLOSE", "BARE_KEY", "ToolCallStream", "ToolParse", "parse_tool_calls", "parse_arguments"]

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
log = logging.getLogger("edgegem.tools")

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBERISH = re.compile(r"-?[0-9][0-9.eE+\-]*|-$")
_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_WORD = re.compile(r"[A-Za-z]+")
_NAME = re.compile(r"[A-Za-z0-9_\-.]+")
BARE_KEY = re.compile(r"[^:,{}\[\]<\"\s][^:,{}\[\]<\"]*")   # a key written without quotes
_WS = re.compile(r"\s*")


class _Incomplete(Exception):
    """The text ends inside a call: more may come."""


class _Malformed(Exception):
    """The text cannot be a call, whatever follows."""


class _Reader:
    def __init__(self, s: str, i: int = 0):
        self.s, self.i = s, i

    def ws(self) -> None:
        self.i = _WS.match(self.s, self.i).end()

    def need(self, n: int = 1) -> None:
        if self.i + n > len(self.s):
            raise _Incomplete

    def literal(self, lit: str) -> None:
        got = self.s[self.i:self.i + len(lit)]
        if got != lit:
            if lit.startswith(got) and self.i + len(got) == len(self.s):
                raise _Incomplete
            raise _Malformed(f"expected {lit!r} at {self.i}")
        self.i += len(lit)

    def string(self) -> str:
        rest = self.s[self.i:self.i + len(QUOTE)]
        if rest.startswith(QUOTE) or (QUOTE.startswith(rest) and self.i + len(rest) == len(self.s)):
            self.literal(QUOTE)
            end = self.s.find(QUOTE, self.i)
            if end < 0:
                raise _Incomplete
            out, self.i = self.s[self.i:end], end + len(QUOTE)
            return out
        if not rest.startswith('"'):
            raise _Malformed(f"expected a string at {self.i}")
        try:   # a JSON string
            out, self.i = json.JSONDecoder().raw_decode(self.s, self.i)
        except json.JSONDecodeError as e:
            if e.msg.startswith("Unterminated string") or e.msg.startswith("Invalid \\escape") and \
                    self.s.endswith("\\"):
                raise _Incomplete from None
            raise _Malformed(f"bad string at {self.i}: {e.msg}") from None
        return out

    def key(self) -> str:
        self.need()
        c = self.s[self.i]
        if c == '"' or c == "<":
            return self.string()
        m = BARE_KEY.match(self.s, self.i)
        if not m:
            raise _Malformed(f"expected a key at {self.i}")
        self.i = m.end()
        self.need()   # a key runs up to its ':'
        return m.group().strip()

    def value(self, depth: int = 0) -> Any:
        if depth > 64:
            raise _Malformed("nested too deeply")
        self.ws()
        self.need()
        c = self.s[self.i]
        if c == "{":
            return self.mapping(depth)
        if c == "[":
            self.i += 1
            out: list = []
            self.ws()
            self.need()
            if self.s[self.i] == "]":
                self.i += 1
                return out
            while True:
                out.append(self.value(depth + 1))
                self.ws()
                self.need()
                c = self.s[self.i]
                self.i += 1
                if c == "]":
                    return out
                if c != ",":
                    raise _Malformed(f"expected ',' or ']' at {self.i - 1}")
        if c == "<" or c == '"':
            return self.string()
        m = _NUMBERISH.match(self.s, self.i)
        if m:
            if m.end() == len(self.s):
                raise _Incomplete   # digits may go on
            text = m.group()
            if not _NUMBER.fullmatch(text):
                raise _Malformed(f"bad number {text[:20]!r} at {self.i}")
            self.i = m.end()
            return int(text) if re.fullmatch(r"-?\d+", text) else float(text)
        m = _WORD.match(self.s, self.i)
        if m and m.group() in _WORDS:
            self.i = m.end()
            self.need()
            return _WORDS[m.group()]
        if m and m.end() == len(self.s) and any(w.startswith(m.group()) for w in _WORDS):
            raise _Incomplete
        raise _Malformed(f"unexpected {self.s[self.i:self.i + 12]!r} at {self.i}")

    def mapping(self, depth: int = 0) -> dict:
        self.literal("{")
        out: dict = {}
        self.ws()
        self.need()
        if self.s[self.i] == "}":
            self.i += 1
            return out
        while True:
            self.ws()
            k = self.key()
            self.ws()
            self.literal(":")
            out[k] = self.value(depth + 1)
            self.ws()
            self.need()
            c = self.s[self.i]
            self.i += 1
            if c == "}":
                return out
            if c != ",":
                raise _Malformed(f"expected ',' or '}}' at {self.i - 1}")


def parse_arguments(text: str) -> dict:
    """A Gemma argument mapping `{key:value,...}` (the whole text) -> dict; ValueError if it is not one."""
    r = _Reader(text.strip())
    try:
        out = r.mapping()
    except _Incomplete:
        raise ValueError("unterminated arguments") from None
    except _Malformed as e:
        raise ValueError(str(e)) from None
    if r.i != len(r.s):
        raise ValueError(f"text after the arguments at {r.i}")
    return out


def _call_at(s: str, i: int, at_end: bool) -> tuple[str, dict, int]:
    """(name, arguments, end) of the call starting at s[i] (an OPEN). With `at_end` the text is all
    there is, so a complete body without CLOSE counts (the model went straight to its end token)."""
    r = _Reader(s, i)
    r.literal(OPEN)
    r.ws()
    r.literal("call:")
    m = _NAME.match(s, r.i)
    if not m:
        r.need()
        raise _Malformed("expected a function name")
    r.i = m.end()
    r.need()
    args = r.mapping()
    r.ws()
    if s.startswith(CLOSE, r.i):
        return m.group(), args, r.i + len(CLOSE)
    if s.startswith(OPEN, r.i) or (at_end and r.i == len(s)):
        return m.group(), args, r.i
    if CLOSE.startswith(s[r.i:]) or OPEN.startswith(s[r.i:]):   # also: nothing after the body yet
        raise _Incomplete
    raise _Malformed(f"expected {CLOSE!r} after the arguments")


def _openai_call(name: str, args: dict) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


@dataclass
class ToolParse:
    content: str                                  # the reply with its parsed calls taken out
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)   # one line per call left in the content


class ToolCallStream:
    """Incremental parser (see the module docstring). `push(text)` and `finish()` return
    (content delta, [OpenAI tool-call stream deltas]); `calls` holds every parsed call so far."""

    def __init__(self, names: Optional[Collection[str]] = None):
        self.names = set(names) if names is not None else None
        self.calls: list[dict] = []
        self.errors: list[str] = []
        self._buf = ""

    def push(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        return self._drain(at_end=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._drain(at_end=True)

    def _reject(self, text: str, why: str, kept: bool = True) -> None:
        line = f"tool call {'left as text' if kept else 'dropped'} ({why}): {text[:80]!r}"
        self.errors.append(line)
        log.warning(line)

    def _drain(self, at_end: bool) -> tuple[str, list[dict]]:
        content, deltas, s = [], [], self._buf
        while s:
            at = s.find(OPEN)
            if at < 0:
                hold = 0 if at_end else next((k for k in range(min(len(OPEN) - 1, len(s)), 0, -1)
                                              if OPEN.startswith(s[-k:])), 0)
                content.append(s[:len(s) - hold])
                s = s[len(s) - hold:]
                break
            content.append(s[:at])
            s = s[at:]
            try:
                name, args, end = _call_at(s, 0, at_end)
            except _Incomplete:
                if not at_end:
                    break
                self._reject(s, "the reply ended inside it", kept=False)
                s = ""
                break
            except _Malformed as e:
                nxt = s.find(OPEN, 1)
                bad = s if nxt < 0 else s[:nxt]
                if nxt < 0 and not at_end:   # keep a possible OPEN prefix at the tail
                    k = next((k for k in range(min(len(OPEN) - 1, len(s) - 1), 0, -1) if OPEN.startswith(s[-k:])), 0)
                    bad = s[:len(s) - k]
                self._reject(bad, str(e))
                content.append(bad)
                s = s[len(bad):]
                continue
            if self.names is not None and name not in self.names:
                self._reject(s[:end], f"no tool named {name!r} was offered")
                content.append(s[:end])
            else:
                call = _openai_call(name, args)
                deltas.append({"index": len(self.calls), **call})
                self.calls.append(call)
            s = s[end:]
        self._buf = s
        return "".join(content), deltas


def parse_tool_calls(text: str, names: Optional[Collection[str]] = None) -> ToolParse:
    """A whole reply -> content and tool calls (`names`: the functions offered; None: any)."""
    st = ToolCallStream(names)
    a, _ = st.push(text)
    b, _ = st.finish()
    return ToolParse(a + b, st.calls, st.errors)
