"""Multi-line message input: Enter sends; Shift+Enter or Ctrl+J inserts a newline."""
from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class ChatInput(TextArea):
    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, **kw) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)
        self.placeholder = "Message (Enter sends, Shift+Enter or Ctrl+J for a new line)"

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            # Empty too: a message may be only its attached images (the chat screen decides).
            self.post_message(self.Submitted(self.text.strip()))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
