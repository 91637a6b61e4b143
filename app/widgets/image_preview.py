"""An image chip's preview: the picture itself through textual-image (the `preview` extra) where
the terminal draws graphics (sixel, or kitty's graphics protocol), else today's half-block cells.

textual-image asks the terminal what it supports when it is imported, which only works before
Textual takes over stdin: this module imports it at import time (the app imports it before it
runs). Off a terminal (tests, pipes) it finds no graphics and the half-block preview is used;
EDGEGEM_IMAGE_PREVIEW=blocks forces that fallback anywhere.
"""
from __future__ import annotations

import io
from typing import Optional

from textual.widget import Widget
from textual.widgets import Static

from app.attachments import half_block_preview
from engine.env import env

PREVIEW_CELLS = (8, 3)  # columns, rows: the chip's picture (16 pixel rows in half blocks)


def _graphics_widget() -> Optional[type]:
    """textual-image's widget class for this terminal's graphics protocol; None when it is not
    installed, the terminal has none (it would draw half cells or unicode), or the user said so."""
    if env().image_preview == "blocks":
        return None
    try:
        from textual_image import renderable
        from textual_image.widget import SixelImage, TGPImage
    except Exception:  # noqa: BLE001 - not installed, or its terminal query failed: the fallback
        return None
    if renderable.Image is renderable.SixelImage:
        return SixelImage
    if renderable.Image is renderable.TGPImage:
        return TGPImage
    return None  # half cells or unicode: ours is the same picture, and snapshot-stable


GRAPHICS: Optional[type] = _graphics_widget()  # tests set it to draw through textual-image


def protocol() -> str:
    """What previews use here: "sixel", "kitty" or "blocks"."""
    if GRAPHICS is None:
        return "blocks"
    return "sixel" if "Sixel" in GRAPHICS.__name__ else "kitty"


def image_preview(data: bytes, colour: bool) -> Optional[Widget]:
    """The preview widget of an image's bytes, or None (undecodable, or no colour for blocks)."""
    if GRAPHICS is not None:
        from PIL import Image

        try:
            img = Image.open(io.BytesIO(data))
            img.load()
        except Exception:  # noqa: BLE001 - a preview is optional; the chip still shows the name
            return None
        widget = GRAPHICS(img, classes="preview graphic")
        widget.styles.width, widget.styles.height = PREVIEW_CELLS
        return widget
    picture = half_block_preview(data, *PREVIEW_CELLS) if colour else None
    return None if picture is None else Static(picture, classes="preview")
