"""One answer being written (the chat screen's `gen`): what the worker thread writes and the UI
thread reads. With tools, one answer is several replies (steps), each streamed into a view of its own."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from app.widgets.message_view import MessageView

_gen_ids = itertools.count(1)


@dataclass
class Generation:
    """One answer being written: which conversation, which view, the engine's request id. With
    tools, one answer is several replies (steps): each streams into a view of its own."""

    conversation_id: int
    view: MessageView
    id: int = field(default_factory=lambda: next(_gen_ids))
    request_id: Optional[int] = None
    stop_requested: bool = False
    prompt_tokens: int = 0
    tokens: int = 0
    # (step, raw text of that step so far, thought channel included): written by the worker only,
    # replaced whole so the UI never pairs one step's text with another's view
    live: tuple = (0, "")
    shown: str = ""  # what the view shows; UI thread only
    view_step: int = 0  # the step `view` streams (UI thread)
    view_done: bool = False  # `view` holds a finished reply with calls (UI thread)
    tool_views: dict = field(default_factory=dict)  # call id -> its "running" MessageView (UI thread)
    pending_calls: dict = field(default_factory=dict)  # call id -> the last reply's calls not yet answered
    tool_images: dict = field(default_factory=dict)  # call id -> [(bytes, mime)] a result brought (worker)
    tool_steps: int = 8  # the tool loop's step limit (this conversation's setting)
    last_stats: Optional[dict] = None  # the worker's last finished step
    error_kind: object = None

    @property
    def text(self) -> str:
        return self.live[1]

    def append(self, text: str, n_tokens: int = 0) -> None:
        self.live = (self.live[0], self.live[1] + text)
        self.tokens += n_tokens

    def new_step(self, step: int) -> None:
        self.live = (step, "")
