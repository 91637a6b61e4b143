"""Chat prompt formatting for Gemma GGUFs (design spec §5.3-5.4, §8).

The GGUF's ``tokenizer.chat_template`` is authoritative; it is rendered as HF transformers does, in
the hardened sandbox of `models/chat_sandbox.py` (templates come from untrusted files: any reach for
Python internals, or past one render's budget, is a one-line ``ChatTemplateError``). Files without a
template get a built-in Gemma 4 E-series (§5.4) or Gemma 3 format. ``split_thinking`` parses output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .chat_sandbox import ChatTemplateError, compile_template, render_budget, render_template
from .metadata import MetadataReader
from .tool_format import ToolFormatError, has_tool_parts, prepare_tool_messages, render_gemma4_tools

__all__ = ["ChatFormat", "ChatTemplateError", "Message", "message_text", "split_thinking",
           "GEMMA4_STOP_STRINGS", "GEMMA3_STOP_STRINGS"]

# End-of-generation tokens (§5.3: llama.cpp's EOG set for gemma4; Gemma 3 ends turns with <end_of_turn>).
GEMMA4_STOP_STRINGS = ("<turn|>", "<eos>", "<|tool_response>")
GEMMA3_STOP_STRINGS = ("<end_of_turn>", "<eos>")
_OPEN, _CLOSE = "<|channel>", "<channel|>"   # reasoning channel: <|channel>thought\n...<channel|>


@dataclass(frozen=True)
class Message:
    role: str                    # "system" | "user" | "assistant" (Gemma templates print "model")
    content: str
    thinking: str | None = None  # reasoning of an assistant turn; never re-rendered into the prompt


def message_text(m: Mapping[str, Any]) -> str:
    """A message's text: a string, or the text parts of an OpenAI-style content list."""
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c or ""
    return "".join(p.get("text", "") for p in c if isinstance(p, Mapping) and p.get("type") == "text")


def _strip_thinking(text: str) -> str:
    """Drop <|channel>...<channel|> reasoning (unterminated: to the end), exactly as the Gemma 4 template."""
    return "".join(p.split(_OPEN)[0] for p in text.split(_CLOSE)).strip()


def _as_dict(m: Message | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(m, Message):
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.thinking:
            d["reasoning_content"] = m.thinking   # HF name; Gemma templates drop it outside tool calls
    elif isinstance(m, Mapping):
        d = dict(m)
        if d.get("thinking") and "reasoning_content" not in d:
            d["reasoning_content"] = d["thinking"]
    else:
        raise TypeError(f"message must be a Message or a mapping, not {type(m).__name__}")
    if not isinstance(d.get("role"), str):
        raise ChatTemplateError(f"message has no string 'role': {d!r}"[:200])
    return d


def _render_gemma4(msgs: list[dict], gen: bool, thinking: bool, bos: str) -> str:
    """§5.4 E-series: <bos>, optional system turn (<|think|> first when thinking), turns, `<|turn>model\\n`."""
    out = [bos]
    system = None
    if msgs[0]["role"] in ("system", "developer"):
        system, msgs = message_text(msgs[0]).strip(), msgs[1:]
    if thinking or system is not None:
        out.append("<|turn>system\n" + ("<|think|>\n" if thinking else "") + (system or "") + "<turn|>\n")
    for m in msgs:
        role = "model" if m["role"] == "assistant" else m["role"]
        body = _strip_thinking(message_text(m)) if role == "model" else message_text(m).strip()
        out.append(f"<|turn>{role}\n{body}<turn|>\n")
    if gen:
        out.append("<|turn>model\n")   # E-series: no empty thought channel after it
    return "".join(out)


def _render_gemma3(msgs: list[dict], gen: bool, thinking: bool, bos: str) -> str:
    """Google's Gemma 3 template: no system role, so the system text prefixes the first user turn."""
    out, prefix = [bos], ""
    if msgs[0]["role"] == "system":
        prefix, msgs = message_text(msgs[0]) + "\n\n", msgs[1:]
    for i, m in enumerate(msgs):
        if (m["role"] == "user") != (i % 2 == 0):
            raise ChatTemplateError("chat template error: Conversation roles must alternate user/assistant/...")
        role = "model" if m["role"] == "assistant" else m["role"]
        out.append(f"<start_of_turn>{role}\n{prefix if i == 0 else ''}{message_text(m).strip()}<end_of_turn>\n")
    if gen:
        out.append("<start_of_turn>model\n")
    return "".join(out)


_BUILTINS = {"gemma4": _render_gemma4, "gemma3": _render_gemma3}
_STOPS = {"gemma4": GEMMA4_STOP_STRINGS, "gemma3": GEMMA3_STOP_STRINGS}


def _family(arch: str, template: str | None) -> str:
    """Which Gemma chat dialect: by architecture, else by the markers the template prints."""
    if arch.startswith("gemma4") or (template and "<|turn>" in template):
        return "gemma4"
    if arch.startswith("gemma3") or (template and "<start_of_turn>" in template):
        return "gemma3"
    return "other"


class ChatFormat:
    """Renders conversations to prompt text; knows the stop strings and whether the text carries BOS."""

    def __init__(self, template: str | None = None, *, family: str = "gemma4", bos_token: str = "<bos>",
                 eos_token: str = "<eos>", source: str | None = None) -> None:
        if template is None and family not in _BUILTINS:
            raise ChatTemplateError(f"no chat template and no built-in format for {family!r}")
        self.family = family
        self.template = template
        self.source = source or ("gguf" if template is not None else f"builtin-{family}")
        self.bos_token, self.eos_token = bos_token, eos_token
        self.stop_strings: tuple[str, ...] = _STOPS.get(family, (eos_token,))
        self.stop_token_ids: tuple[int, ...] = ()   # filled by from_metadata (needs the vocab)
        self._tmpl = compile_template(template) if template is not None else None
        self.bos_in_template = self._probe_bos()

    stop_token_names = property(lambda self: self.stop_strings, doc="Alias of stop_strings (EOG token names).")

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "ChatFormat":
        key = MetadataReader(meta, error=ChatTemplateError)   # wrong GGUF types: one-line error
        arch = key.str("general.architecture", "")
        tokens = key.strs("tokenizer.ggml.tokens", [])

        def tok(name: str, default: str) -> str:
            i = key.int(name, None)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else default

        tmpl = meta.get("tokenizer.chat_template")
        if isinstance(tmpl, (bytes, bytearray)):
            tmpl = tmpl.decode("utf-8")
        else:
            tmpl = key.str("tokenizer.chat_template", None)
        tmpl = tmpl if tmpl and tmpl.strip() else None
        fmt = cls(tmpl, family=_family(arch, tmpl), bos_token=tok("tokenizer.ggml.bos_token_id", "<bos>"),
                  eos_token=tok("tokenizer.ggml.eos_token_id", "<eos>"))
        wanted = set(fmt.stop_strings)
        ids = {t: i for i, t in enumerate(tokens) if t in wanted}
        fmt.stop_token_ids = tuple(ids[s] for s in fmt.stop_strings if s in ids)
        return fmt

    def render(self, messages: Sequence[Message | Mapping[str, Any]], add_generation_prompt: bool = True,
               thinking: bool = False, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """`tools`: OpenAI function tools (`{"type": "function", "function": {...}}`); assistant
        `tool_calls` and `role: tool` messages are rendered too (models/tool_format.py)."""
        msgs = [_as_dict(m) for m in messages]
        if not msgs:
            raise ChatTemplateError("cannot render an empty conversation")
        with_tools = bool(tools) or has_tool_parts(msgs)
        if with_tools:
            try:
                msgs = prepare_tool_messages(msgs)
            except ToolFormatError as e:
                raise ChatTemplateError(str(e)) from None
            except (TypeError, AttributeError) as e:   # a call's id or name of the wrong type (a list, a number)
                raise ChatTemplateError(f"tool calls cannot be read: {type(e).__name__}: {str(e)[:120]}") from None
        if self._tmpl is None:
            if with_tools:
                if self.family != "gemma4":
                    raise ChatTemplateError(f"the built-in {self.family} chat format has no tool syntax")
                try:
                    return render_gemma4_tools(msgs, bool(add_generation_prompt), bool(thinking), self.bos_token,
                                               tools)
                except (TypeError, AttributeError, KeyError, RecursionError) as e:
                    # a request's malformed tool (`"properties": [1]`), refused as a template refuses it
                    raise ChatTemplateError(f"tools or tool messages cannot be rendered: "
                                            f"{type(e).__name__}: {str(e)[:120]}") from None
            return _BUILTINS[self.family](msgs, bool(add_generation_prompt), bool(thinking), self.bos_token)
        ctx = {"messages": msgs, "add_generation_prompt": bool(add_generation_prompt),
               "enable_thinking": bool(thinking),   # always an explicit bool (undefined may read as true)
               "bos_token": self.bos_token, "eos_token": self.eos_token,
               "tools": [dict(t) for t in tools] if tools else None}
        return render_template(self._tmpl, ctx, len(msgs))

    def _probe_bos(self) -> bool:
        if self._tmpl is None:
            return bool(self.bos_token)
        with render_budget(1, share=0.1):   # a hostile template costs 0.2 s here, not 2 s
            try:
                return bool(self.bos_token) and \
                    self.render([{"role": "user", "content": "Hi"}]).startswith(self.bos_token)
            except ChatTemplateError:
                return "bos_token" in (self.template or "")


def split_thinking(text: str) -> tuple[str | None, str]:
    """`<|channel>thought\\n...<channel|>answer` -> (thought, answer). Streaming, an unterminated channel
    gives (thought so far, ""); an empty channel gives (None, answer); no channel (None, text). Stop
    tokens and whitespace around the answer are removed."""
    s = text.lstrip()
    if not s.startswith(_OPEN):
        if s and _OPEN.startswith(s):
            return None, ""                      # the opening marker itself is still streaming in
        return None, _clean_answer(text)
    body = s[len(_OPEN):]
    head, nl, rest = body.partition("\n")        # channel name line, e.g. "thought"
    if nl and head.isidentifier():
        body = rest
    elif not nl and body.isidentifier():
        body = ""                                # only part of the channel name so far
    end = body.find(_CLOSE)
    if end < 0:                                  # streaming: hold back a partial closing marker
        for k in range(len(_CLOSE) - 1, 0, -1):
            if body.endswith(_CLOSE[:k]):
                body = body[:-k]
                break
        return body.strip() or None, ""
    return body[:end].strip() or None, _clean_answer(body[end + len(_CLOSE):])


def _clean_answer(text: str) -> str:
    """Trim whitespace and any trailing stop tokens the caller left in."""
    text = text.strip()
    while stop := next((s for s in GEMMA4_STOP_STRINGS + GEMMA3_STOP_STRINGS if text.endswith(s)), None):
        text = text[: -len(stop)].rstrip()
    return text
