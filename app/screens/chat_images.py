"""The chat screen's image input (issue 15): attach (F3, `/image PATH`, or a message that is only
an image's path), remove (Shift+F3 or the chip's ✕), keep the copies in the store when the message
is sent, and put a message's images back when it is edited.

A mixin of `ChatScreen` (app/screens/chat.py), kept apart so that file stays readable. Every
refusal is one notification and changes nothing else: the input keeps its text, no chip is added.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Optional

from app.attachments import AttachError, Attachment, load_attachment, looks_like_image_path, path_of
from app.screens.dialogs import TextPrompt
from app.widgets.attachments import AttachmentBar
from app.widgets.chat_input import ChatInput

IMAGE_COMMAND = "/image"
NO_ENCODER = ("This model takes no images: it has no vision encoder (for a GGUF model: --mmproj FILE, "
              "or an mmproj*.gguf beside it).")


class ImageInputMixin:
    """Needs from the screen: client, store, settings, notify, query_one, app, _saved."""

    @property
    def attachments(self) -> AttachmentBar:
        return self.query_one(AttachmentBar)

    def takes_images(self) -> bool:
        return bool(self.client.status().get("images"))

    def _refuse_image(self, why: str) -> bool:
        self.notify(why, title="Image not attached", severity="error", timeout=8)
        return False

    async def attach(self, path) -> bool:
        """Check one image file and add its chip; False (one notification) when refused."""
        if not self.takes_images():
            return self._refuse_image(NO_ENCODER)
        try:  # off the UI thread: decoding a 12-megapixel photo takes 0.1-0.3 s
            attachment = await asyncio.to_thread(load_attachment, path, int(self.settings["image_tokens"]))
        except AttachError as e:
            return self._refuse_image(str(e))
        await self.attachments.add(attachment)
        return True

    async def take_image_input(self, text: str) -> bool:
        """`/image PATH`, or a message that is only an existing image file's path: attach it (the
        input is cleared only when it was attached). True when the text was one of those."""
        if text == IMAGE_COMMAND or text.startswith(IMAGE_COMMAND + " "):
            arg = text[len(IMAGE_COMMAND):].strip()
            if not arg:
                self._refuse_image("Usage: /image PATH (or F3)")
                return True
            path = path_of(arg) or arg
        else:
            path = looks_like_image_path(text)
            if path is None:
                return False
        if await self.attach(path):
            self.query_one(ChatInput).clear()
            self.query_one(ChatInput).focus()
        return True

    def action_attach_image(self) -> None:
        async def done(path: Optional[str]) -> None:
            if path:
                await self.attach(path_of(path) or path)
            self.query_one(ChatInput).focus()
        self.app.push_screen(TextPrompt("Attach an image: path of the file"), done)

    async def action_remove_attachment(self) -> None:
        removed = await self.attachments.remove_attachment()
        if removed is not None:
            self.notify(f"Removed {removed.name}.")

    def keep_pending(self) -> Optional[list[dict]]:
        """Copy the pending images into the data folder: the records a message stores, or None
        (after a notice) when they cannot be sent or written."""
        pending = self.attachments.pending
        if pending and not self.takes_images():  # the model was reloaded without an encoder
            self._refuse_image(NO_ENCODER)
            return None
        return self._saved(lambda: [self.store.keep_image(a.data, a.name, a.n_tokens, a.ext) for a in pending],
                           "the images")

    async def restore_images(self, images: list[dict]) -> None:
        """A message's images back as pending chips (editing the last message)."""
        for im in images:
            try:
                a: Attachment = load_attachment(self.store.image_path(im), int(self.settings["image_tokens"]))
            except AttachError as e:
                self._refuse_image(f"{im['name']}: the kept copy is gone or unreadable ({e})")
                continue
            await self.attachments.add(replace(a, name=im["name"]))

    def message_images(self, m) -> dict:
        """The images of a stored message as the client takes them: the copies' paths."""
        return {"images": [str(self.store.image_path(im)) for im in m.images]} if m.images else {}
