"""The chat screen's image and audio input (issues 15, 23): attach (F3 / F9, `/image PATH` /
`/audio PATH`, the palette, or a message that is only an image's or a clip's path), remove
(Shift+F3 or the chip's ✕), keep the copies in the store when the message is sent, and put a
message's images and clips back when it is edited.

A mixin of `ChatScreen` (app/screens/chat.py), kept apart so that file stays readable. Every
refusal is one notification and changes nothing else: the input keeps its text, no chip is added.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Optional

from app.attachments import AttachError, Attachment, kind_of, load_attachment, looks_like_media_path, path_of
from app.screens.dialogs import TextPrompt
from app.widgets.attachments import AttachmentBar
from app.widgets.chat_input import ChatInput

COMMANDS = {"/image": "image", "/audio": "audio"}
NO_ENCODER = {
    "image": ("This model takes no images: it has no vision encoder (for a GGUF model: --mmproj FILE, "
              "or an mmproj*.gguf beside it)."),
    "audio": ("This model takes no audio: it has no audio encoder (Gemma 4 E2B/E4B with an mmproj that holds "
              "the audio tower: --mmproj FILE, or an mmproj*.gguf beside it)."),
}
STATUS_KEY = {"image": "images", "audio": "audio"}  # client.status() says whether each kind is taken


class MediaInputMixin:
    """Needs from the screen: client, store, settings, notify, query_one, app, _saved."""

    @property
    def attachments(self) -> AttachmentBar:
        return self.query_one(AttachmentBar)

    def takes(self, kind: str) -> bool:
        return bool(self.client.status().get(STATUS_KEY[kind]))

    def _refuse(self, why: str, kind: str = "image") -> bool:
        title = "Audio not attached" if kind == "audio" else "Image not attached"
        self.notify(why, title=title, severity="error", timeout=8)
        return False

    async def attach(self, path, kind: Optional[str] = None) -> bool:
        """Check one image or clip file (`kind`; None: by its suffix) and add its chip; False (one
        notification) when refused."""
        kind = kind or kind_of(Path(str(path)))
        if not self.takes(kind):
            return self._refuse(NO_ENCODER[kind], kind)
        try:  # off the UI thread: decoding a 12-megapixel photo or a long MP3 takes 0.1-1 s
            attachment = await asyncio.to_thread(load_attachment, path, int(self.settings["image_tokens"]), kind)
        except AttachError as e:
            return self._refuse(str(e), kind)
        await self.attachments.add(attachment)
        return True

    async def take_media_input(self, text: str) -> bool:
        """`/image PATH`, `/audio PATH`, or a message that is only an existing image's or clip's
        path: attach it (the input is cleared only when it was attached). True when the text was
        one of those."""
        command = next((c for c in COMMANDS if text == c or text.startswith(c + " ")), None)
        if command is not None:
            kind, arg = COMMANDS[command], text[len(command):].strip()
            if not arg:
                self._refuse(f"Usage: {command} PATH (or {'F9' if kind == 'audio' else 'F3'})", kind)
                return True
            path = path_of(arg) or arg
        else:
            kind, path = None, looks_like_media_path(text)
            if path is None:
                return False
        if await self.attach(path, kind):
            self.query_one(ChatInput).clear()
            self.query_one(ChatInput).focus()
        return True

    def _prompt_path(self, kind: str) -> None:
        async def done(path: Optional[str]) -> None:
            if path:
                await self.attach(path_of(path) or path, kind)
            self.query_one(ChatInput).focus()
        self.app.push_screen(TextPrompt(f"Attach {'an audio file' if kind == 'audio' else 'an image'}: "
                                        "path of the file"), done)

    def action_attach_image(self) -> None:
        self._prompt_path("image")

    def action_attach_audio(self) -> None:
        self._prompt_path("audio")

    async def action_remove_attachment(self) -> None:
        removed = await self.attachments.remove_attachment()
        if removed is not None:
            self.notify(f"Removed {removed.name}.")

    def keep_pending(self) -> Optional[dict]:
        """Copy the pending images and clips into the data folder: the records a message stores
        ({"images": [...], "audio": [...]}), or None (after a notice) when they cannot be sent or
        written."""
        pending = self.attachments.pending
        for kind in ("image", "audio"):  # the model may have been reloaded without that encoder
            if any(a.kind == kind for a in pending) and not self.takes(kind):
                self._refuse(NO_ENCODER[kind], kind)
                return None

        def keep() -> dict:
            return {"images": [self.store.keep_image(a.data, a.name, a.n_tokens, a.ext) for a in pending
                               if a.kind == "image"],
                    "audio": [self.store.keep_audio(a.data, a.name, a.n_tokens, a.ext, a.seconds) for a in pending
                              if a.kind == "audio"]}
        return self._saved(keep, "the attachments")

    async def restore_media(self, m) -> None:
        """A message's images and clips back as pending chips (editing the last message)."""
        budget = int(self.settings["image_tokens"])
        for kind, records, where in (("image", m.images, self.store.image_path),
                                     ("audio", m.audio, self.store.audio_path)):
            for r in records:
                try:
                    a: Attachment = load_attachment(where(r), budget, kind)
                except AttachError as e:
                    self._refuse(f"{r['name']}: the kept copy is gone or unreadable ({e})", kind)
                    continue
                await self.attachments.add(replace(a, name=r["name"]))

    def message_media(self, m) -> dict:
        """The images and clips of a stored message as the client takes them: the copies' paths."""
        out = {}
        if m.images:
            out["images"] = [str(self.store.image_path(im)) for im in m.images]
        if m.audio:
            out["audio"] = [str(self.store.audio_path(a)) for a in m.audio]
        return out
