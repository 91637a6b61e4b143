"""The tool loop of the app and `edgegem chat`: generate; for each tool call of the reply ask
`approve`, run `call_tool`, and continue the same model turn with the results, until the model
answers, `should_stop()` says so (Escape) or `max_steps` replies have called tools.

Each continuation is the ids the model saw and wrote plus the result blocks' tokens
(`<|tool_response>response:NAME{...}<tool_response|>`, the template's own block), never the
conversation rendered again: the 26B/31B template's generation prompt opens an empty thought
channel that its rendering of history leaves out, so a re-rendered prompt parted from the cached
one before the call and re-prefilled it at every step. Appended, a step prefills the result
blocks' tokens and nothing else (tests/engine/test_tool_loop.py).
Runs in the caller's thread (a front end's worker): the engine's own thread only generates.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from models.tool_format import response_block

from .client import GenerationParams


DECLINED = "the user declined this call; it did not run"


@dataclass
class ToolOutcome:
    """One call of a reply and what came of it: `result` the text the model is given back."""

    call: dict  # {"id", "type", "function": {"name", "arguments"}} as the engine parsed it
    result: str = ""
    denied: bool = False
    error: bool = False


@dataclass
class LoopStep:
    """One reply of the loop: its text and tokens, its calls' outcomes, and what the step prefilled."""

    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    prefilled_tokens: int
    prompt_ids: list[int] = field(default_factory=list)  # what the model saw: the previous step's and
    outcomes: list[ToolOutcome] = field(default_factory=list)  # its reply and result blocks after it


@dataclass
class LoopResult:
    steps: list[LoopStep]
    stopped: Optional[str] = None  # None: the model answered; "step_limit" | "stopped" | "error"
    error: Optional[str] = None

    @property
    def answer(self) -> str:
        return self.steps[-1].text if self.steps and not self.steps[-1].outcomes else ""


def tool_result_text(value: Any) -> str:
    """What a tool returned as the text of a tool message (JSON for structured values)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def run_tool_loop(client, messages: Sequence[dict], params: GenerationParams,
                  call_tool: Callable[[dict], tuple[str, bool]],
                  approve: Callable[[dict], bool] = lambda call: True, max_steps: int = 8,
                  should_stop: Callable[[], bool] = lambda: False,
                  on_event: Optional[Callable[[Any], None]] = None,
                  on_submit: Optional[Callable[[int, int], None]] = None,
                  on_outcome: Optional[Callable[[ToolOutcome], None]] = None) -> LoopResult:
    """`call_tool(call) -> (result text, is_error)`; `approve(call) -> bool` (denied: the model
    is told so and nothing runs); `on_event(StreamEvent)` sees every event as it comes;
    `on_submit(step, request id)` each request as it is submitted (a front end aborts it on
    Escape); `on_outcome(ToolOutcome)` each call's outcome as it is known."""
    if max_steps < 1:
        raise ValueError(f"the tool step limit must be at least 1, not {max_steps}")
    tok = client.loaded.tokenizer
    close_id = _token_id(tok, "<|tool_response>")
    rid = client.submit(messages, params)
    ids = client.last_prompt_ids(rid)
    steps: list[LoopStep] = []
    while True:
        if on_submit is not None:
            on_submit(len(steps), rid)
        events = []
        for ev in client.stream(rid):
            events.append(ev)
            if on_event is not None:
                on_event(ev)
        gen = [t for ev in events for t in ev.token_ids]
        last = events[-1]
        step = LoopStep("".join(ev.text for ev in events), gen, last.finish_reason,
                        (last.stats or {}).get("prefilled_tokens", 0), ids)
        steps.append(step)
        if last.finish_reason == "error":
            return LoopResult(steps, "error", last.error)
        if last.finish_reason != "tool_calls" or not last.tool_calls:
            return LoopResult(steps)
        blocks = []
        for call in last.tool_calls:
            if should_stop():
                return LoopResult(steps, "stopped")
            name = call["function"]["name"]
            if approve(call):
                text, failed = call_tool(call)
                outcome = ToolOutcome(call, text, error=failed)
            else:
                outcome = ToolOutcome(call, DECLINED, denied=True)
            step.outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
            blocks.append(response_block(name, outcome.result))
        if should_stop():
            return LoopResult(steps, "stopped")
        if len(steps) >= max_steps:
            return LoopResult(steps, "step_limit")
        added = tok.encode("".join(blocks), add_bos=False)
        if gen and gen[-1] == close_id and added[:1] == [close_id]:
            added = added[1:]  # the model wrote the block's opening marker (its end-of-generation token)
        ids = ids + gen + added
        rid = client.submit_ids(ids, replace(params, continue_text=False))


def _token_id(tok, text: str) -> Optional[int]:
    ids = tok.encode(text, add_bos=False)
    return ids[0] if len(ids) == 1 else None
