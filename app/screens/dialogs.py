"""Small modal screens: confirm, one-line text prompt, help, and the load-error screen."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, Markdown, Static

from app.backend import ErrorKind


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [("escape", "dismiss(False)", "Cancel")]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__()
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, classes="question", markup=False)
            with Horizontal(classes="buttons"):
                yield Button(self.yes, variant="error", id="yes")
                yield Button("Cancel", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class TextPrompt(ModalScreen["str | None"]):
    """Ask for one line of text (rename); Enter accepts, Escape cancels."""

    BINDINGS = [("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, value: str = "") -> None:
        super().__init__()
        self.title_text, self.value = title, value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, markup=False)
            yield Input(self.value, id="value")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)


HELP = """\
# edgegem

| Key | Action |
|---|---|
| Enter | send the message |
| Shift+Enter, Ctrl+J | new line in the message |
| Escape | stop generating (the partial answer is kept) |
| Ctrl+R | regenerate the last answer |
| Ctrl+L | edit and resend the last message |
| Ctrl+O | copy the last answer |
| Ctrl+B | copy the last code block |
| Ctrl+T | thinking on/off (Gemma-4: the thought shows in a collapsible pane) |
| F3, `/image PATH` | attach an image to the next message (or send just its path) |
| F9, `/audio PATH` | attach an audio file (WAV, FLAC, OGG, MP3) to the next message (or send just its path) |
| F5 | record from the microphone; F5 again stops and attaches the clip |
| Shift+F3 | remove the last attached image or clip (or click its ✕) |
| Ctrl+N | new conversation |
| Ctrl+F | search conversations |
| F2 | rename the conversation |
| F8 | delete the conversation |
| F4 | export the conversation to Markdown and JSON |
| Ctrl+S | settings (sampling, system prompt; engine flags reload the model) |
| Ctrl+G | tools: MCP servers and built-ins, each tool on/off, tools allowed always |
| Ctrl+P | command palette |
| F1 | this help |
| Ctrl+Q | quit |

Every finished or stopped message is saved at once (SQLite, in the data directory), so quitting or
a crash loses at most the answer being written. Switching back to a conversation reuses its KV
from the prefix cache while it is still resident.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape,f1,q", "dismiss(None)", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog help"):
            yield Markdown(HELP)


class LoadErrorScreen(Screen[None]):
    """A model that did not load: the one-line reason and what to try (by the failure's ErrorKind,
    engine.api.load_error_kind), never a traceback."""

    BINDINGS = [("q,escape", "app.quit", "Quit")]

    def __init__(self, error: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        super().__init__()
        self.error, self.kind = error, kind

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog error"):
            yield Label("The model could not be loaded", classes="heading")
            yield Static(self.error, id="error-text", markup=False)
            yield Static(LOAD_HINTS[self.kind], classes="hint", markup=False)
            yield Button("Quit", variant="error", id="quit")
        yield Footer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.app.exit(return_code=2)


_MEMORY_HINT = ("Try a larger --gpu-memory-budget, 8-bit KV (--kv-cache-dtype int8_per_token_head), "
                "--embed-weights host, or a smaller model (E2B instead of E4B). `edgegem info MODEL "
                "--gpu-memory-budget SIZE` shows the plan.")
# What to try, by why the load failed: the budget or the device's memory, the file or a flag, or us.
LOAD_HINTS = {
    ErrorKind.CAPACITY: _MEMORY_HINT,
    ErrorKind.OUT_OF_MEMORY: _MEMORY_HINT,
    ErrorKind.BAD_INPUT: ("Check the --model path (a .gguf file or an HF folder; edgegem runs Gemma-4 (gemma4) "
                          "and Gemma 3) and the flags; `edgegem info FILE` shows what a file contains."),
    ErrorKind.INTERNAL: ("This is a fault in edgegem, not in the file: please report it with the line above "
                         "(`edgegem doctor` shows the setup it ran on)."),
}
