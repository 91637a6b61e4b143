"""One chat message: a role line, the model's thought in a collapsible pane, the Markdown body.

While streaming, the answer goes through `Markdown.get_stream()` (appends are batched by Textual
when they come faster than it renders); the thought pane is replaced whole on each coalesced chunk.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Optional

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Markdown, Static

from app.widgets.attachments import MediaChips

ROLE_LABEL = {"user": "You", "assistant": "Model", "system": "System", "tool": "Tool"}
_CODE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


def code_blocks(markdown: str) -> list[str]:
    """Fenced code blocks of a Markdown text, in order (an unclosed last fence counts too)."""
    blocks = [m.group(1) for m in _CODE.finditer(markdown)]
    rest = _CODE.sub("", markdown)
    if rest.count("```") % 2:  # still being written
        tail = rest[rest.rfind("```"):]
        blocks.append(tail.split("\n", 1)[1] if "\n" in tail else "")
    return blocks


def call_block(call: dict) -> Collapsible:
    """One call of a reply: its name, then its arguments as JSON (collapsed)."""
    return Collapsible(Static(json.dumps(call.get("arguments", {}), ensure_ascii=False, indent=1),
                              classes="tool-text", markup=False),
                       title=f"call {call['name']}", collapsed=True, classes="tool-call")


class TimedMarkdown(Markdown):
    """Markdown that remembers how long its last streamed append took (the chat paces updates by it)."""

    last_append_s = 0.0

    async def append(self, markdown: str):
        t0 = time.perf_counter()
        try:
            return await super().append(markdown)
        finally:
            self.last_append_s = time.perf_counter() - t0


class MessageView(Vertical):
    def __init__(self, role: str, content: str = "", thinking: str = "", status: str = "done",
                 message_id: Optional[int] = None, error: Optional[str] = None,
                 images: Optional[list] = None, audio: Optional[list] = None, tool: Optional[dict] = None) -> None:
        super().__init__(classes=f"message {role}")
        self.role, self.content, self.thinking, self.status = role, content, thinking, status
        self.message_id, self.error = message_id, error  # error: the one-line reason shown on it
        self.images = list(images or [])  # the store's records: file, name, bytes, tokens
        self.audio = list(audio or [])  # and seconds
        self.tool = dict(tool or {})  # the store's record: an assistant's calls, a tool message's call
        self._stream = None

    def compose(self) -> ComposeResult:
        yield Label(self._header(), classes="role")
        if self.images or self.audio:
            yield MediaChips(self.images, self.audio)
        with Collapsible(title="Thought", collapsed=True, classes="thought") as c:
            c.display = bool(self.thinking)
            yield Static(self.thinking, classes="thought-text", markup=False)
        if self.role == "tool":  # a call's result: collapsed, as text (never rendered as Markdown)
            with Collapsible(title=self._result_title(), collapsed=True, classes="tool-result"):
                yield Static(self.content, classes="tool-text", markup=False)
            return
        yield TimedMarkdown(self.content, classes="body")
        yield from map(call_block, self.tool.get("calls", ()))

    def _result_title(self) -> str:
        status = self.tool.get("status", "ok")
        return f"result of {self.tool.get('name', '?')}" + ("" if status == "ok" else f" ({status})")

    # --- tool calls while the loop runs --------------------------------------------------------
    async def show_calls(self, calls: list[dict]) -> None:
        """A finished reply's calls ({"id", "name", "arguments"}), as a reopened one shows them."""
        self.tool = {"calls": list(calls)}
        await self.mount_all([call_block(c) for c in calls])

    async def set_result(self, text: str, status: str, message_id: Optional[int], images: list = ()) -> None:
        """A tool message's result is in ("ok" | "error" | "denied"): text and title replace
        "running"; the images it brought (the store's records) as chips above it."""
        if images:
            self.images = list(images)
            await self.mount(MediaChips(self.images), after=self.query_one(".role", Label))
        self.content, self.message_id = text, message_id
        self.tool = {**self.tool, "status": status}
        self.status = "done"
        for t in self.query(".tool-text").results(Static):  # none yet when the app is closing mid-compose
            t.update(text)
        for c in self.query(".tool-result").results(Collapsible):
            c.title = self._result_title()
        for role in self.query(".role").results(Label):
            role.update(self._header())

    def _header(self) -> str:
        extra = {"stopped": "  (stopped)", "error": "  (error)", "streaming": "  …",
                 "running": "  running…"}.get(self.status, "")
        if self.error:
            extra = f"  ({self.error})"
        return ROLE_LABEL.get(self.role, self.role) + extra

    # --- streaming ---------------------------------------------------------------------------
    def start_stream(self) -> None:
        self.status = "streaming"
        self.query_one(".role", Label).update(self._header())
        self._stream = Markdown.get_stream(self.query_one(".body", Markdown))

    async def show(self, thought: Optional[str], answer: str) -> None:
        """New totals (not deltas): the thought so far and the answer so far."""
        if thought is not None and thought != self.thinking:
            self.thinking = thought
            pane = self.query_one(".thought", Collapsible)
            pane.display = bool(thought)
            self.query_one(".thought-text", Static).update(thought)
        if answer == self.content:
            return
        if self._stream is not None and answer.startswith(self.content):
            await self._stream.write(answer[len(self.content):])
        else:  # the answer changed shape (e.g. a held-back stop string): redraw
            await self.query_one(".body", Markdown).update(answer)
        self.content = answer

    @property
    def render_cost_s(self) -> float:
        return self.query_one(".body", TimedMarkdown).last_append_s

    async def finish(self, thought: Optional[str], answer: str, status: str, message_id: Optional[int],
                     error: Optional[str] = None) -> None:
        if self._stream is not None:
            # a stream started in this same tick (a tool loop's reply that wrote nothing) must run
            # once before it is stopped: cancelling a task that never started raises in its awaiter
            await asyncio.sleep(0)
            await self._stream.stop()
            self._stream = None
        await self.show(thought, answer)
        self.status, self.message_id, self.error = status, message_id, error
        self.query_one(".role", Label).update(self._header())
