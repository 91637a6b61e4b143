"""Attachment chips: the pending images and clips above the input, a recording in progress, and
a sent message's images and clips.

A pending image chip shows a preview (app/widgets/image_preview.py: the picture through
textual-image where the terminal draws sixel or kitty graphics, else half-block cells where it
draws colour), the file name, its size and its soft tokens, and a ✕ that removes it (click, or Tab
to it and Enter); a clip's chip shows ♪, its name, duration and tokens. While the microphone
records, a chip shows the elapsed time and a level meter (updated by the screen's timer).
"""
from __future__ import annotations

from typing import Optional

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, Label, Static

from app.attachments import Attachment, chip_label, duration
from app.widgets.image_preview import image_preview


def can_draw_preview(app) -> bool:
    """Colour cells are what the preview is made of: off with NO_COLOR or a monochrome terminal
    (Textual downgrades the colours to 256 or 16 where the terminal has no more: cruder, still there)."""
    return not getattr(app, "no_color", False) and app.console.color_system is not None


class AttachmentChip(Horizontal):
    """One pending image or clip: preview (♪ for a clip), name, size or duration · tokens, ✕."""

    def __init__(self, attachment: Attachment, preview: bool) -> None:
        super().__init__(classes="chip")
        self.attachment, self.preview = attachment, preview

    def compose(self) -> ComposeResult:
        a = self.attachment
        if a.kind == "audio":
            yield Static("♪", classes="preview audio-icon")
        else:
            picture = image_preview(a.data, self.preview)
            if picture is not None:
                yield picture
        with Vertical(classes="chip-text"):
            yield Label(a.name, classes="chip-name", markup=False)
            yield Label(a.info, classes="chip-info", markup=False)
        yield Button("✕", classes="remove", compact=True, tooltip=f"Remove {a.name}")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.post_message(AttachmentBar.Remove(self.attachment))


class AttachmentBar(Horizontal):
    """The attachments of the message being written (hidden when there are none)."""

    class Remove(Message):
        def __init__(self, attachment: Attachment) -> None:
            super().__init__()
            self.attachment = attachment

    class Changed(Message):
        """The pending list changed (the status panel counts its tokens)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.pending: list[Attachment] = []
        self.display = False

    @property
    def tokens(self) -> int:
        return sum(a.n_tokens for a in self.pending)

    async def add(self, attachment: Attachment) -> None:
        self.pending.append(attachment)
        self.display = True
        await self.mount(AttachmentChip(attachment, can_draw_preview(self.app)))
        self.post_message(self.Changed())

    async def remove_attachment(self, attachment: Optional[Attachment] = None) -> Optional[Attachment]:
        """Remove `attachment` (default: the last one); returns what was removed."""
        if not self.pending:
            return None
        attachment = attachment if attachment is not None else self.pending[-1]
        index = next((i for i, a in enumerate(self.pending) if a is attachment), None)
        if index is None:
            return None
        self.pending.pop(index)
        await self.query(AttachmentChip)[index].remove()
        self.display = bool(self.pending)
        self.post_message(self.Changed())
        return attachment

    async def clear(self) -> None:
        self.pending = []
        await self.remove_children()
        self.display = False
        self.post_message(self.Changed())

    async def on_attachment_bar_remove(self, event: "AttachmentBar.Remove") -> None:
        event.stop()
        await self.remove_attachment(event.attachment)


class RecordingChip(Horizontal):
    """The microphone being recorded: ● REC, the elapsed time, a level meter (`show`)."""

    def compose(self) -> ComposeResult:
        yield Static("●", classes="preview rec-dot")
        with Vertical(classes="chip-text"):
            yield Label("recording… F5 stops", classes="chip-name", markup=False)
            yield Label("0.0 s", classes="chip-info rec-info", markup=False)

    def on_mount(self) -> None:
        self.add_class("chip")

    def show(self, seconds: float, meter: str) -> None:
        self.query_one(".rec-info", Label).update(f"{duration(seconds)} {meter}")


class MediaChips(Static):
    """A sent message's images and clips, one line each: name · size or duration · tokens (from
    the store's records)."""

    def __init__(self, images: list[dict], audio: list[dict] = ()) -> None:
        lines = [f"▣ {chip_label(im['name'], im['bytes'], im['tokens'])}" for im in images]
        lines += [f"♪ {chip_label(a['name'], a['bytes'], a['tokens'], a.get('seconds', 0.0))}" for a in audio]
        super().__init__("\n".join(lines), classes="image-chips", markup=False)
        self.images, self.audio = images, list(audio)


ImageChips = MediaChips  # the name from when images were the only attachments
