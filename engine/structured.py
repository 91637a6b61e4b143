"""What `LocalClient` does for tools and structured output, in one place (small hooks in client.py).

* `request_grammar(params, tokenizer)`: the request's GrammarState, or None. The constraint is
  `params.constraint` (response_format / Ollama format / a grammar file) and `params.tool_choice`:
  a named function or `required` constrains the whole reply to calls; `none` bans the call token;
  `auto` with a JSON constraint allows either that JSON or tool calls (OpenAI's semantics: the
  model may still call a tool), with another grammar that grammar alone. With thinking on, JSON
  and tool-call constraints may be preceded by a thought channel.
* `ToolEvents`: per request with tools (tool_choice other than `none`): rewrites the engine's
  stream events so `text` is content only and `tool_call_deltas` carries each call as it
  completes (OpenAI stream shape); the final event has `tool_calls` (the whole list) and finish
  reason `tool_calls` when the model called any.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from models.tool_calls import ToolCallStream

from .constraints import Constraint, ConstraintError, GrammarState, checked
from .request import StreamEvent
from .tool_grammar import check_tools, tool_call_constraint, tool_choice_mode, tool_names

__all__ = ["request_grammar", "check_tool_request", "ToolEvents", "tool_events_for", "ollama_tool_calls",
           "ConstraintError"]


def _union(a: Constraint, b: Constraint) -> Constraint:
    """`start: a | b` of a single-rule JSON constraint and a tool-call grammar."""
    a_body = re.sub(r"^start\s*:", "json_reply:", a.lark, count=1, flags=re.M)
    b_body = re.sub(r"^start\s*:", "tool_reply:", b.lark, count=1, flags=re.M)
    return checked(Constraint(a.kind, "start: json_reply | tool_reply\n" + a_body + "\n" + b_body, a.name))


def request_grammar(params, tokenizer) -> Optional[GrammarState]:
    """The GrammarState for a request's GenerationParams (ConstraintError: a one-line 400)."""
    constraint: Optional[Constraint] = params.constraint
    tools, choice = params.tools, params.tool_choice
    if tools is not None:
        if not isinstance(tools, (list, tuple)):
            raise ConstraintError("tools must be a list")
        check_tools(tools)
    if constraint is None and not tools and choice in (None, "auto", "none"):
        return None
    if tokenizer is None:
        raise ConstraintError("structured output needs the model's tokenizer")
    thinking = params.thinking and tokenizer.piece_to_id("<|channel>") is not None
    if constraint is not None and thinking and constraint.kind != "grammar":
        constraint = constraint.with_thinking()
    mode, _ = tool_choice_mode(choice, tools) if tools else ("auto", None)
    if tools and mode in ("named", "required"):
        constraint = tool_call_constraint(tools, choice, tokenizer, thinking)
    elif tools and mode == "auto" and constraint is not None and constraint.kind in ("json_schema", "json_object"):
        constraint = _union(constraint, tool_call_constraint(tools, "required", tokenizer, thinking))
    elif tools and mode == "none" and constraint is None:
        constraint = tool_call_constraint(tools, "none", tokenizer)
    elif not tools:
        tool_call_constraint(None, choice)   # a forced tool_choice without tools: refused
    return GrammarState(constraint, tokenizer) if constraint is not None else None


def check_tool_request(tools, tool_choice) -> None:
    """What `request_grammar` refuses about `tools` / `tool_choice`, checked without the tokenizer
    (an API server names the field before it renders anything): ConstraintError, one line."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ConstraintError("tools must be a list")
    tool_call_constraint(list(tools) if tools else None, tool_choice)   # the tools, the choice, the schemas


class ToolEvents:
    """Stream-event rewriting for one request (see the module docstring)."""

    def __init__(self, names):
        self.parser = ToolCallStream(names)

    def apply(self, ev: StreamEvent) -> StreamEvent:
        content, deltas = self.parser.push(ev.text)
        if ev.finished:
            more, late = self.parser.finish()
            content, deltas = content + more, deltas + late
            ev.tool_calls = list(self.parser.calls)
            if self.parser.calls and ev.finish_reason == "stop":
                ev.finish_reason = "tool_calls"
        ev.text = content
        ev.tool_call_deltas = deltas
        return ev


def tool_events_for(params) -> Optional[ToolEvents]:
    """A ToolEvents when the reply may hold calls (tools offered, tool_choice not `none`)."""
    if not params.tools or params.tool_choice == "none":
        return None
    return ToolEvents(tool_names(params.tools))


def ollama_tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI-style calls -> Ollama's `message.tool_calls` (arguments as an object)."""
    return [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls]
