"""Images in API requests: bytes only, never a path or a URL to fetch (the server is offline and
nothing in a request may name a file on its disk). `data:` URLs (OpenAI) and bare base64
(Ollama) are decoded and their size read from the header against the per-image pixel cap before
the engine's own preprocessing sees them."""
from __future__ import annotations

import base64
import binascii
import io

from .errors import APIError


def from_data_url(url: str, max_pixels: int, where: str) -> bytes:
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "a path"
        raise APIError(400, f"{where}: only data: URLs are read (the server does not fetch {scheme} URLs "
                            f"or files): send the image as data:image/png;base64,...", where)
    head, sep, data = url[5:].partition(",")
    if not sep or not head.endswith(";base64"):
        raise APIError(400, f"{where}: a data: URL must be base64 (data:image/png;base64,...)", where)
    return from_base64(data, max_pixels, where)


def from_base64(data: str, max_pixels: int, where: str) -> bytes:
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: not valid base64", where) from None
    check_pixels(raw, max_pixels, where)
    return raw


def check_pixels(raw: bytes, max_pixels: int, where: str) -> None:
    """The image's width x height from its header (nothing decoded) against the cap."""
    from PIL import Image

    if not raw:
        raise APIError(400, f"{where}: empty image", where)
    try:
        with Image.open(io.BytesIO(raw)) as img:
            w, h = img.size
    except Exception:  # noqa: BLE001 - Pillow raises many types for hostile bytes
        raise APIError(400, f"{where}: not an image (or a format Pillow cannot read)", where) from None
    if w * h > max_pixels:
        raise APIError(400, f"{where}: image is {w}x{h} pixels, over the {max_pixels}-pixel cap per image "
                            f"(--max-image-pixels)", where)
