"""Messages the worker threads post to the UI (Textual's `post_message` is thread-safe).

Streaming text is not posted token by token: the chat screen's timer pulls it (at most 10 times a
second) and the status panel pulls `client.status()`, so a fast decode never floods the UI.
"""
from __future__ import annotations

from typing import Optional

from textual.message import Message


class LoadProgress(Message):
    def __init__(self, fraction: float, text: str) -> None:
        super().__init__()
        self.fraction, self.text = fraction, text


class Loaded(Message):
    def __init__(self, session) -> None:  # app.backend.Session
        super().__init__()
        self.session = session


class LoadFailed(Message):
    """`kind`: the engine's ErrorKind of the failure (engine.api.load_error_kind)."""

    def __init__(self, error: str, kind) -> None:
        super().__init__()
        self.error, self.kind = error, kind


class GenerationDone(Message):
    """`error_kind`: the engine's ErrorKind of an error the engine ended the answer with (None: the
    submit itself failed, or no error)."""

    def __init__(self, gen_id: int, text: str, reason: Optional[str], error: Optional[str],
                 stats: Optional[dict], error_kind=None, tool_end: Optional[str] = None) -> None:
        super().__init__()
        self.gen_id, self.text, self.reason, self.error, self.stats = gen_id, text, reason, error, stats or {}
        self.error_kind = error_kind
        # the tool loop stopped after a reply with calls ("stopped": Escape, "step_limit"): no
        # answer follows, `text` is empty
        self.tool_end = tool_end


class KVCheckProgress(Message):
    """kv-check's worker: fraction 0..1 of the chunks measured."""

    def __init__(self, fraction: float, text: str) -> None:
        super().__init__()
        self.fraction, self.text = fraction, text


class KVCheckDone(Message):
    """kv-check's worker ended: figures (engine/bench/kv_quality.py's dict), or an error, or cancelled."""

    def __init__(self, result: Optional[dict], error: Optional[str] = None, cancelled: bool = False) -> None:
        super().__init__()
        self.result, self.error, self.cancelled = result, error, cancelled


# --- the tool loop (app/screens/chat_tools.py): posted by the generation worker, in this order per
# step: ToolStepDone, then per call ToolCallStarted (when it runs) and ToolCallFinished, then
# ToolStepStarted for the continuation (or GenerationDone).
class ToolStepDone(Message):
    """A reply that called tools ended: its text (thought channel included) and its calls."""

    def __init__(self, gen_id: int, text: str, calls: list, stats: Optional[dict]) -> None:
        super().__init__()
        self.gen_id, self.text, self.calls, self.stats = gen_id, text, calls, stats or {}


class ToolCallStarted(Message):
    def __init__(self, gen_id: int, call: dict) -> None:
        super().__init__()
        self.gen_id, self.call = gen_id, call


class ToolCallFinished(Message):
    """`outcome`: engine.tool_loop.ToolOutcome (result text, error, denied)."""

    def __init__(self, gen_id: int, outcome) -> None:
        super().__init__()
        self.gen_id, self.outcome = gen_id, outcome


class ToolStepStarted(Message):
    """The continuation after the results was submitted: `step` (1, 2, ...) streams next."""

    def __init__(self, gen_id: int, step: int) -> None:
        super().__init__()
        self.gen_id, self.step = gen_id, step


class ToolApprovalNeeded(Message):
    """The worker waits on `reply` (app/screens/chat_tools.Reply) until the user answers."""

    def __init__(self, gen_id: int, spec, call: dict, reply) -> None:
        super().__init__()
        self.gen_id, self.spec, self.call, self.reply = gen_id, spec, call, reply
