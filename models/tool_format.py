"""Gemma 4 tool syntax, rendering side (design spec §5.4 "Tools"; the GGUF template is authoritative).

* `prepare_tool_messages`: OpenAI-style messages -> what the Gemma 4 templates read. An assistant
  message's `tool_calls[].function.arguments` (a JSON string in the OpenAI API) becomes a mapping
  (the templates print a string argument verbatim, which would give `call:f{{"a": 1}}`), and the
  `role: "tool"` messages after it are folded into its `tool_responses` list (name, response) —
  the "Google/Gemma native" form both template revisions render (the older one, embedded in
  llama.cpp's vocab GGUF, knows no `role: tool`). A tool message whose content is a JSON object is
  passed as that object (`response:f{k:v}`), anything else as its text (`response:f{value:...}`).
* `format_argument`, `format_declaration` and `render_gemma4_tools`: the template's macros and
  message loop (llama.cpp `models/templates/google-gemma-4-31B-it.jinja`) in Python, for models
  whose file has no template (the built-in E-series format of models/chat.py). Tests compare them
  with the real templates' output byte for byte.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

__all__ = ["ToolFormatError", "prepare_tool_messages", "format_argument", "format_declaration",
           "render_gemma4_tools", "has_tool_parts", "QUOTE"]

QUOTE = '<|"|>'   # Gemma 4's string delimiter inside tool syntax (token 52)
_STANDARD_KEYS = ("description", "type", "properties", "required", "nullable")


class ToolFormatError(ValueError):
    """Tool messages that cannot be rendered (one-line message; an API maps it to a 400)."""


def _dictsort(m: Mapping) -> list[tuple[Any, Any]]:
    """Jinja's `dictsort`: by key, case-insensitively."""
    return sorted(m.items(), key=lambda kv: kv[0].lower() if isinstance(kv[0], str) else kv[0])


def _get(v: Any, key: str) -> Any:
    """`v[key]` as Jinja reads it: undefined (None here) unless v is a mapping holding key."""
    return v.get(key) if isinstance(v, Mapping) else None


def _upper(v: Any) -> str:
    """`v | upper`: undefined prints as ''."""
    return "" if v is None else str(v).upper()


def format_argument(arg: Any, escape_keys: bool = True) -> str:
    """The template's `format_argument`: strings in <|"|>, booleans lower case, mappings with
    sorted keys (quoted unless escape_keys=False), sequences in [], anything else as str()."""
    if isinstance(arg, str):
        return QUOTE + arg + QUOTE
    if isinstance(arg, bool):
        return "true" if arg else "false"
    if isinstance(arg, Mapping):
        return "{" + ",".join((QUOTE + str(k) + QUOTE if escape_keys else str(k)) + ":" +
                              format_argument(v, escape_keys) for k, v in _dictsort(arg)) + "}"
    if isinstance(arg, (list, tuple)):
        return "[" + ",".join(format_argument(x, escape_keys) for x in arg) + "]"
    return str(arg)


def _quoted_list(items: Sequence) -> str:
    return "[" + ",".join(QUOTE + str(x) + QUOTE for x in items) + "]"


def _format_parameters(properties: Mapping, required: Any) -> str:
    """The template's `format_parameters` (its newer revision): one `key:{...}` per property."""
    out, first = [], True
    for key, value in _dictsort(properties):
        if key in _STANDARD_KEYS:
            continue
        parts: list[str] = []
        T = _upper(_get(value, "type"))
        if _get(value, "description"):
            parts.append(f"description:{QUOTE}{_get(value, 'description')}{QUOTE}")
        if T == "STRING":
            if _get(value, "enum"):
                parts.append("enum:" + format_argument(_get(value, "enum")))
        elif T == "ARRAY":
            items = _get(value, "items")
            if isinstance(items, Mapping) and items:
                inner = []
                for ik, iv in _dictsort(items):
                    if iv is None:
                        continue
                    if ik == "properties":
                        body = _format_parameters(iv, _get(items, "required") or []) if isinstance(iv, Mapping) else ""
                        inner.append("properties:{" + body + "}")
                    elif ik == "required":
                        inner.append("required:" + _quoted_list(iv))
                    elif ik == "type":
                        inner.append("type:" + format_argument(iv.upper() if isinstance(iv, str)
                                                               else [_upper(x) for x in iv]))
                    else:
                        inner.append(f"{ik}:{format_argument(iv)}")
                parts.append("items:{" + ",".join(inner) + "}")
        if _get(value, "nullable"):
            parts.append("nullable:true")
        if T == "OBJECT":
            props = _get(value, "properties")
            if isinstance(props, Mapping):
                parts.append("properties:{" + _format_parameters(props, _get(value, "required") or []) + "}")
            elif isinstance(value, Mapping):
                parts.append("properties:{" + _format_parameters(value, _get(value, "required") or []) + "}")
            if _get(value, "required"):
                parts.append("required:" + _quoted_list(_get(value, "required")))
        parts.append(f"type:{QUOTE}{T}{QUOTE}")
        out.append(("" if first else ",") + f"{key}:{{" + ",".join(parts) + "}")
        first = False
    return "".join(out)


def format_declaration(tool: Mapping) -> str:
    """`declaration:NAME{description:...,parameters:{...}}` of one OpenAI tool (`{"type":
    "function", "function": {...}}`), as the template's `format_function_declaration | trim`."""
    fn = _get(tool, "function") or {}
    s = f"declaration:{_get(fn, 'name') or ''}{{description:{QUOTE}{_get(fn, 'description') or ''}{QUOTE}"
    params = _get(fn, "parameters")
    if params:
        s += ",parameters:{"
        if _get(params, "properties"):
            s += "properties:{" + _format_parameters(params["properties"], _get(params, "required")) + "},"
        if _get(params, "required"):
            s += "required:" + _quoted_list(params["required"]) + ","
        if _get(params, "type"):
            s += f"type:{QUOTE}{_upper(params['type'])}{QUOTE}}}"
    if isinstance(fn, Mapping) and "response" in fn:
        resp = fn["response"]
        s += ",response:{"
        if _get(resp, "description"):
            s += f"description:{QUOTE}{resp['description']}{QUOTE},"
        if _upper(_get(resp, "type")) == "OBJECT":
            s += f"type:{QUOTE}{_upper(resp['type'])}{QUOTE}}}"
    return (s + "}").strip()


# --- OpenAI messages -> the templates' form ---------------------------------------------------------

def has_tool_parts(messages: Sequence[Mapping]) -> bool:
    return any(m.get("tool_calls") or m.get("tool_responses") or m.get("role") == "tool" for m in messages)


def _arguments(call: Mapping, where: str) -> Any:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolFormatError(f"{where}: a tool call needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolFormatError(f"{where}: tool call {fn['name']!r} arguments are not JSON: {e}") from None
    if not isinstance(args, Mapping):
        raise ToolFormatError(f"{where}: tool call {fn['name']!r} arguments must be a JSON object")
    return {**call, "function": {**fn, "arguments": dict(args)}}


def _text_of(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")


def _response(content: Any) -> Any:
    text = _text_of(content)
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text
    return value if isinstance(value, dict) else text


def prepare_tool_messages(messages: Sequence[Mapping]) -> list[dict]:
    """See the module docstring. Messages without tool parts pass through unchanged."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"message {i}"
        if m.get("role") == "tool":
            prev = out[-1] if out else None
            if prev is None or prev.get("role") != "assistant" or not prev.get("tool_calls"):
                raise ToolFormatError(f"{where}: a 'tool' message must follow an assistant message with tool_calls")
            names = {c.get("id"): c["function"]["name"] for c in prev["tool_calls"]}
            name = names.get(m.get("tool_call_id")) or m.get("name")
            if not name:
                if len(prev["tool_calls"]) != 1:
                    raise ToolFormatError(f"{where}: tool_call_id {m.get('tool_call_id')!r} names no call "
                                          "of the assistant message before it")
                name = prev["tool_calls"][0]["function"]["name"]
            prev.setdefault("tool_responses", []).append({"name": name, "response": _response(m.get("content"))})
            continue
        d = dict(m)
        if d.get("tool_calls"):
            if not isinstance(d["tool_calls"], list):
                raise ToolFormatError(f"{where}: tool_calls must be a list")
            d["tool_calls"] = [_arguments(c, where) for c in d["tool_calls"]]
        out.append(d)
    return out


# --- the built-in renderer (files without a template) ------------------------------------------------

def _strip_thinking(text: str) -> str:
    return "".join(p.split("<|channel>")[0] for p in text.split("<channel|>")).strip()


def _response_block(name: str, response: Any) -> str:
    if isinstance(response, Mapping):
        body = ",".join(f"{k}:{format_argument(v, False)}" for k, v in _dictsort(response))
    else:
        body = "value:" + format_argument(response, False)
    return f"<|tool_response>response:{name}{{{body}}}<tool_response|>"


def response_block(name: str, content: Any) -> str:
    """A tool message's content (text; a JSON object's keys become the block's) as the template's
    result block: what the tool loop appends to a reply that called tools (engine/tool_loop.py)."""
    return _response_block(name, _response(content))


def render_gemma4_tools(msgs: list[dict], gen: bool, thinking: bool, bos: str, tools: Sequence | None) -> str:
    """The newer Gemma 4 template's rendering of a conversation with tools (messages already through
    `prepare_tool_messages`), E-series generation prompt (no empty thought channel after it)."""
    out = [bos]
    system = None
    if msgs and msgs[0]["role"] in ("system", "developer"):
        system, msgs = _text_of(msgs[0].get("content")).strip(), msgs[1:]
    prev_type = None
    if thinking or tools or system is not None:
        out.append("<|turn>system\n" + ("<|think|>\n" if thinking else "") + (system or ""))
        for tool in tools or ():
            out.append("<|tool>" + format_declaration(tool) + "<tool|>")
        out.append("<turn|>\n")
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    for i, m in enumerate(msgs):
        prev_type = None
        role = "model" if m["role"] == "assistant" else m["role"]
        if not (role == "model" and i and msgs[i - 1]["role"] == "assistant"):
            out.append(f"<|turn>{role}\n")
        thought = m.get("reasoning") or m.get("reasoning_content")
        if thought and i > last_user and m.get("tool_calls"):
            out.append(f"<|channel>thought\n{thought}\n<channel|>")
        for call in m.get("tool_calls") or ():
            fn = call["function"]
            args = fn["arguments"]
            body = (",".join(f"{k}:{format_argument(v, False)}" for k, v in _dictsort(args))
                    if isinstance(args, Mapping) else str(args))
            out.append(f"<|tool_call>call:{fn['name']}{{{body}}}<tool_call|>")
            prev_type = "tool_call"
        responded = False
        for r in m.get("tool_responses") or ():
            out.append(_response_block(r.get("name") or "unknown", r.get("response")))
            responded, prev_type = True, "tool_response"
        text = _text_of(m.get("content"))
        out.append(_strip_thinking(text) if role == "model" else text.strip())
        if prev_type == "tool_call" and not responded:
            out.append("<|tool_response>")
        elif not (responded and not m.get("content")):
            out.append("<turn|>\n")
    if gen and prev_type not in ("tool_response", "tool_call"):
        out.append("<|turn>model\n")
    return "".join(out)
