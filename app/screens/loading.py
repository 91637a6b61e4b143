"""Startup: the model loads in a worker thread; a progress bar counts tensors and bytes to the
device, then the memory plan is shown for a moment before the chat opens."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Label, ProgressBar, Static

from app.messages import LoadProgress


class LoadingScreen(Screen[None]):
    def __init__(self, title: str, note: str = "") -> None:
        super().__init__()
        self.title_text, self.note = title, note

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog loading"):
            yield Label(self.title_text, classes="heading", markup=False)
            if self.note:
                yield Static(self.note, classes="note", markup=False)
            yield ProgressBar(total=1000, show_eta=False, id="progress")
            yield Static("", id="progress-text", markup=False)
            yield Static("", id="plan", markup=False)

    def on_load_progress(self, msg: LoadProgress) -> None:
        self.query_one("#progress", ProgressBar).update(progress=int(msg.fraction * 1000))
        self.query_one("#progress-text", Static).update(msg.text)

    def show_plan(self, lines: list[str]) -> None:
        self.query_one("#plan", Static).update("\n".join(lines))
