"""`tool_choice` as a grammar: the whole `<|tool_call>call:NAME{...}<tool_call|>` of Gemma 4, its
arguments following the function's JSON schema in Gemma's own argument syntax (not JSON: that is
what the model was trained to write, models/tool_format.py): keys bare and in the template's
sorted order, strings between `<|"|>` delimiters, numbers / booleans / null as in JSON (those
parts are inlined as llguidance `%json` schemas, so `minimum`, `enum` of numbers etc. hold).

Supported schema keywords: type (also a list), properties, required, enum, const, items,
minItems, maxItems, minLength, maxLength, anyOf, oneOf, $ref to local $defs/definitions, nullable.
An object with properties is closed (only those keys); one without is any mapping. Other
keywords (pattern, format, ...) are not enforced inside tool arguments.

`none` bans the `<|tool_call>` token (the tools stay in the prompt: the conversation may use
them); `auto` is no constraint; `required` is one or more calls of any offered function; a named
function is exactly one call of it. With thinking on, a thought channel may come first.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

from models.tool_calls import BARE_KEY

from .constraints import Constraint, ConstraintError, checked

__all__ = ["tool_call_constraint", "tool_names", "tool_choice_mode", "check_tools"]

# Gemma 4 markers (spec §5.3); named as tokens when the vocabulary has them, else as text.
_MARKERS = {"open": "<|tool_call>", "close": "<tool_call|>", "quote": '<|"|>'}
_NO_QUOTE = '/(?s:.*)/ & ~/(?s:.*)<\\|"\\|>(?s:.*)/'   # string text never spells the delimiter


def tool_names(tools: Optional[Sequence[Mapping]]) -> list[str]:
    return [t["function"]["name"] for t in tools or ()]


def check_tools(tools: Sequence[Mapping]) -> None:
    """Each tool is {"type": "function", "function": {"name": NAME, ...}} (ConstraintError if not)."""
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise ConstraintError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-." for c in name):
            raise ConstraintError(f"tools[{i}].function.name must be letters, digits, '_', '-' or '.'")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise ConstraintError(f"tools[{i}].function.parameters must be a JSON schema object")


def tool_choice_mode(tool_choice: Any, tools: Optional[Sequence[Mapping]]) -> tuple[str, Optional[str]]:
    """("auto" | "none" | "required" | "named", name) of an OpenAI tool_choice (None: auto)."""
    if tool_choice is None or tool_choice == "auto":
        return "auto", None
    if tool_choice in ("none", "required"):
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ConstraintError('tool_choice must be "auto", "none", "required" or '
                              '{"type": "function", "function": {"name": ...}}')
    if name not in tool_names(tools):
        raise ConstraintError(f"tool_choice names {name!r}, which is not in tools")
    return "named", name


class _Rules:
    """Lark rules for Gemma-syntax values of JSON schemas (one rule per schema node)."""

    def __init__(self, marker):
        self.marker, self.root = marker, {}   # root: the schema `$ref`s resolve in (set per tool)
        self.lines: list[str] = []
        self._refs: dict[tuple[int, str], str] = {}
        self.n = 0

    def new(self, body: str) -> str:
        self.n += 1
        name = f"v{self.n}"
        self.lines.append(f"{name}: {body}")
        return name

    def string(self, s: Mapping) -> str:
        lo, hi = s.get("minLength"), s.get("maxLength")
        text = "GTEXT"
        if lo is not None or hi is not None:
            self.n += 1
            text = f"GTEXT{self.n}"
            self.lines.append(f"{text}: /(?s:.){{{int(lo or 0)},{'' if hi is None else int(hi)}}}/ & "
                              f"~/(?s:.*)<\\|\"\\|>(?s:.*)/")
        return self.new(f"{self.marker('quote')} {text} {self.marker('quote')}")

    def literal(self, v: Any) -> str:
        if isinstance(v, str):
            return f"{self.marker('quote')} {json.dumps(v, ensure_ascii=False)} {self.marker('quote')}"
        if isinstance(v, (dict, list)):
            return f"%json {json.dumps({'const': v})}"   # rare: a structured const/enum in JSON form
        return json.dumps(json.dumps(v))   # numbers, true/false, null: their JSON text

    def resolve(self, ref: str) -> Mapping:
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                node = self.root.get(prefix[2:-1], {}).get(ref[len(prefix):])
                if isinstance(node, Mapping):
                    return node
        raise ConstraintError(f"tool parameters: cannot resolve $ref {ref!r} (only local $defs/definitions)")

    def value(self, s: Any) -> str:
        if s is True or s == {} or s is None:
            return "gvalue"
        if s is False:
            raise ConstraintError("tool parameters: a schema of `false` allows no value")
        if not isinstance(s, Mapping):
            raise ConstraintError(f"tool parameters: a schema must be an object, not {type(s).__name__}")
        if "$ref" in s:
            key = (id(self.root), s["$ref"])
            if key not in self._refs:
                self.n += 1
                name = self._refs[key] = f"ref{self.n}"
                self.lines.append(f"{name}: {self.value(self.resolve(s['$ref']))}")
            return self._refs[key]
        if "const" in s:
            return self.new(self.literal(s["const"]))
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise ConstraintError("tool parameters: enum must be a non-empty list")
            return self.new(" | ".join(self.literal(v) for v in s["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self.new(" | ".join(self.value(x) for x in s[key]))
        t = s.get("type")
        alts = [self.typed(x, s) for x in t] if isinstance(t, list) else [self.typed(t, s)]
        if s.get("nullable"):
            alts.append('"null"')
        return alts[0] if len(alts) == 1 else self.new(" | ".join(alts))

    def typed(self, t: Optional[str], s: Mapping) -> str:
        if t is None:
            t = "object" if "properties" in s else "array" if "items" in s else None
        if t is None:
            return "gvalue"
        if t == "string":
            return self.string(s)
        if t in ("integer", "number", "boolean", "null"):
            scalar = {k: v for k, v in s.items() if k in ("minimum", "maximum", "exclusiveMinimum",
                                                          "exclusiveMaximum", "multipleOf")}
            return self.new("%json " + json.dumps({"type": t, **scalar}))
        if t == "array":
            return self.array(s)
        if t == "object":
            return self.object(s)
        raise ConstraintError(f"tool parameters: unknown type {t!r}")

    def array(self, s: Mapping) -> str:
        item = self.value(s.get("items", {}))
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        more = f'("," {item}){{{max(lo - 1, 0)},{"" if hi is None else max(int(hi) - 1, 0)}}}'
        if hi is not None and int(hi) == 0:
            return self.new('"[" "]"')
        body = f'"[" {item} {more} "]"'
        return self.new(body if lo > 0 else f'"[" "]" | {body}')

    def object(self, s: Mapping) -> str:
        props = s.get("properties")
        if not isinstance(props, Mapping) or not props:
            return "gmapping"
        return self.new('"{" ' + self.members(props, s.get("required") or []) + ' "}"')

    def members(self, props: Mapping, required: Sequence) -> str:
        """Keys in the template's order (case-insensitive sort), optional ones may be left out,
        commas only between the present ones: first_i / more_i rules over the suffixes."""
        keys = sorted(props, key=str.lower)
        # a key the parser reads bare is written bare (the template's form), others <|"|>-quoted
        kv = [f"{json.dumps(k + ':', ensure_ascii=False)} {self.value(props[k])}"
              if BARE_KEY.fullmatch(k) and k == k.strip() else
              f"{self.literal(k)} \":\" {self.value(props[k])}" for k in keys]
        req = [k in required for k in keys]
        n = len(keys)
        self.n += 1
        tag = self.n
        for i in range(n, -1, -1):   # more_i: the members from i on, after one already written
            alts, firsts = [], []
            for j in range(i, n):
                alts.append(f'"," {kv[j]} m{tag}_{j + 1}')
                firsts.append(f"{kv[j]} m{tag}_{j + 1}")
                if req[j]:
                    break
            else:
                alts.append("")
                firsts.append("")
            self.lines.append(f"m{tag}_{i}: " + " | ".join(a or '""' for a in alts))
            self.lines.append(f"f{tag}_{i}: " + " | ".join(a or '""' for a in firsts))
        return f"f{tag}_0"

_GENERIC = r"""
gvalue: gstring | gmapping | glist | %json {"type": ["number", "boolean", "null"]}
gmapping: "{" "}" | "{" GKEY ":" gvalue ("," GKEY ":" gvalue)* "}"
glist: "[" "]" | "[" gvalue ("," gvalue)* "]"
GKEY: /[A-Za-z_][A-Za-z0-9_\-.]*/
"""


def tool_call_constraint(tools: Optional[Sequence[Mapping]], tool_choice: Any, tokenizer=None,
                         thinking: bool = False) -> Optional[Constraint]:
    """The Constraint for `tool_choice` (None for auto); `tokenizer` says which markers are tokens."""
    if not tools:
        if tool_choice not in (None, "auto", "none"):
            raise ConstraintError("tool_choice needs tools")
        return None
    check_tools(tools)
    mode, name = tool_choice_mode(tool_choice, tools)
    ids = {k: (tokenizer.piece_to_id(v) if tokenizer is not None else None) for k, v in _MARKERS.items()}

    def marker(k: str) -> str:
        return f"<[{ids[k]}]>" if ids[k] is not None else json.dumps(_MARKERS[k])

    if mode == "auto":
        return None
    if mode == "none":
        if ids["open"] is None:
            return None
        return checked(Constraint("tool_call", f"start: <[^{ids['open']}]>*", "none"))
    chosen = [t for t in tools if mode == "required" or t["function"]["name"] == name]
    rules, calls = _Rules(marker), []
    for k, t in enumerate(chosen):
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        rules.root = params
        try:
            if isinstance(params, Mapping) and params.get("type", "object") == "object" and \
                    not params.get("properties") and "properties" in params:
                args = rules.new('"{" "}"')   # declared with no parameters: `call:f{}`
            else:
                args = rules.value({**params, "type": "object"} if "type" not in params else params)
        except ConstraintError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError, RecursionError) as e:
            # a keyword of the wrong type (`"maxLength": "x"`, `"required": 5`): the request's fault
            raise ConstraintError(f"tools: {fn['name']}'s parameters: a schema keyword has the wrong "
                                  f"type ({type(e).__name__}: {str(e)[:120]})") from None
        rules.lines.append(f"call{k}: {marker('open')} \"call:{fn['name']}\" {args} {marker('close')}")
        calls.append(f"call{k}")
    start = "start: " + ("(" + " | ".join(calls) + ")+" if mode == "required" else calls[0])
    strings = [f"GTEXT: {_NO_QUOTE}", f"gstring: {marker('quote')} GTEXT {marker('quote')}"]
    c = Constraint("tool_call", "\n".join([start] + rules.lines + strings) + _GENERIC, name or "required")
    return checked(c.with_thinking() if thinking else c)
