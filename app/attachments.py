"""Images and audio clips attached to the next message: checked and counted when attached, shown
as chips.

An `Attachment` holds the file's bytes (read once, so the original may move or change before the
message is sent) and what the chip shows: name, size (a clip: its duration), soft tokens. The
check is the engine's own preprocessing (`as_image_input` / `as_audio_input`, through
app/backend.py), so anything it would refuse at submit (not an image or not audio, a format it
cannot read, a decompression bomb or a header claiming hours, an empty, 1-pixel or 10 ms file) is
refused here in the same one line. No Textual in this file.
"""
from __future__ import annotations

import io
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlparse

from rich.style import Style
from rich.text import Text

from app.backend import as_audio_input, as_image_input, fmt_size

MAX_FILE_BYTES = 64 << 20  # what app.store keeps per image
MAX_AUDIO_FILE_BYTES = 256 << 20  # and per clip (app.store.MAX_AUDIO_BYTES)
# Names a message that is only a path is taken as an image by (then checked like /image PATH);
# formats Pillow cannot read are listed too, so they are refused in one line, not sent as text.
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".jpe", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".ico", ".ppm",
                  ".pgm", ".pbm", ".tga", ".jfif", ".heic", ".heif", ".avif", ".svg"}
# ... and as audio by these (libsndfile's formats, and common ones it cannot decode: refused in one line)
AUDIO_SUFFIXES = {".wav", ".wave", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aif", ".aiff", ".aifc", ".au",
                  ".snd", ".caf", ".w64", ".m4a", ".aac", ".wma", ".webm"}


class AttachError(ValueError):
    """One line: why this file cannot be attached."""


@dataclass(frozen=True)
class Attachment:
    name: str  # the original file name
    data: bytes
    n_tokens: int  # soft tokens at `budget`
    budget: int
    ext: str  # ".png" / ".wav": the copy's suffix, from the format Pillow / libsndfile found
    source_size: tuple[int, int]  # (W, H) pixels; (0, 0) for a clip
    kind: str = "image"  # "image" | "audio"
    seconds: float = 0.0  # a clip's duration

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def info(self) -> str:
        """What the chip says under the name: size (a clip: duration) · tokens."""
        what = duration(self.seconds) if self.kind == "audio" else human_bytes(self.size)
        return f"{what} · {self.n_tokens} tok"


def human_bytes(n: int) -> str:
    """An attachment's size: "125 B", "3.2 KiB", "64.0 MiB" (never GiB: files are capped far below)."""
    return fmt_size(n, ("B", "KiB", "MiB"), (0, 1, 1))


def duration(seconds: float) -> str:
    """"4.2 s", "1:05.3": a clip's length on its chip."""
    return f"{seconds:.1f} s" if seconds < 60 else f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def chip_label(name: str, size: int, tokens: int, seconds: Optional[float] = None) -> str:
    """One sent image or clip: "name · 12.3 KiB · 266 tok" / "name · 4.2 s · 105 tok"; a tool
    result's image, which the model does not read, has no tokens: "name · 69 B"."""
    label = f"{name} · {human_bytes(size) if seconds is None else duration(seconds)}"
    return label + (f" · {tokens} tok" if tokens else "")


def path_of(text: str) -> Optional[Path]:
    """The one path a message consists of, as terminals paste it: quoted, with backslash-escaped
    spaces, or a file:// URL; None when the text is not a single path."""
    text = text.strip()
    if not text or "\n" in text:
        return None
    if text.startswith("file://"):
        return Path(unquote(urlparse(text).path))
    try:
        parts = shlex.split(text)
    except ValueError:  # an unclosed quote: not a path
        return None
    return Path(parts[0]).expanduser() if len(parts) == 1 else None


def kind_of(path: Path) -> str:
    """"audio" for an audio suffix, else "image"."""
    return "audio" if path.suffix.lower() in AUDIO_SUFFIXES else "image"


def looks_like_media_path(text: str) -> Optional[Path]:
    """An existing file with an image or audio suffix that the message is made of, else None."""
    path = path_of(text)
    if path is None or path.suffix.lower() not in IMAGE_SUFFIXES | AUDIO_SUFFIXES:
        return None
    try:
        return path if path.is_file() else None
    except OSError:
        return None


def load_attachment(path: Path | str, budget: int, kind: Optional[str] = None) -> Attachment:
    """Read and check one image or clip (`kind`; None: by the file's suffix); AttachError, one
    line, when it cannot be sent."""
    path = Path(path).expanduser()
    name = path.name or str(path)
    kind = kind or kind_of(path)
    cap = MAX_AUDIO_FILE_BYTES if kind == "audio" else MAX_FILE_BYTES
    try:
        if not path.exists():
            raise AttachError(f"{name}: no such file")
        if not path.is_file():
            raise AttachError(f"{name}: not a file")
        size = path.stat().st_size
        if size > cap:
            raise AttachError(f"{name}: {human_bytes(size)} is over the {human_bytes(cap)} limit")
        data = path.read_bytes()
    except OSError as e:
        raise AttachError(f"{name}: cannot read: {e.strerror or e}") from None
    return attachment_from_bytes(data, name, budget, kind, path.suffix)


def attachment_from_bytes(data: bytes, name: str, budget: int, kind: str = "image", suffix: str = "") -> Attachment:
    """Check bytes as an image or a clip (a recording, a kept copy): AttachError, one line."""
    try:
        if kind == "audio":
            clip = as_audio_input(data, name=name)
            return Attachment(name, data, clip.n_tokens, budget, _audio_ext(data, suffix), (0, 0), "audio",
                              clip.seconds)
        image = as_image_input(data, budget, name=name)
    except ValueError as e:  # models.*Error / engine MediaRequestError: one line already
        raise AttachError(str(e).splitlines()[0]) from None
    return Attachment(name, data, image.n_tokens, budget, _ext(data, Path("x" + suffix)), tuple(image.source_size))


def shown_image(data: bytes) -> str:
    """An image only shown (a tool's result): its copy's suffix; AttachError when Pillow cannot
    read it. Not checked for encoding (size, budget): the model does not read it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.verify()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise AttachError(f"not an image Pillow can read ({e.__class__.__name__})") from None
    return _ext(data, Path("x"))


def _audio_ext(data: bytes, suffix: str) -> str:
    import soundfile as sf

    try:
        fmt = sf.info(io.BytesIO(data)).format
    except Exception:  # noqa: BLE001 - already checked by as_audio_input; the suffix will do
        fmt = ""
    return {"WAV": ".wav", "FLAC": ".flac", "OGG": ".ogg", "MP3": ".mp3", "AIFF": ".aiff"}.get(
        fmt, suffix.lower() or ".audio")


def _ext(data: bytes, path: Path) -> str:
    from PIL import Image

    try:
        fmt = Image.open(io.BytesIO(data)).format or ""
    except Exception:  # noqa: BLE001 - already checked by as_image_input; the suffix will do
        fmt = ""
    ext = {"JPEG": ".jpg", "TIFF": ".tif"}.get(fmt, f".{fmt.lower()}" if fmt else path.suffix.lower())
    return ext or ".img"


def half_block_preview(data: bytes, cols: int = 8, rows: int = 3) -> Optional[Text]:
    """A tiny picture in text: each cell is `▀` with the upper pixel as foreground and the lower
    one as background, so `rows` cells show 2·rows pixel rows (cells are about twice as tall as
    wide, which makes the pixels roughly square). None when the bytes cannot be drawn."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        img.draft("RGB", (cols * 4, rows * 8))  # JPEG: decode at a reduced scale, cheap for photos
        img = img.convert("RGB")
        img.thumbnail((cols, 2 * rows), Image.BILINEAR)
    except Exception:  # noqa: BLE001 - a preview is optional; the chip still shows the name
        return None
    w, h = img.size  # thumbnail keeps at least 1 pixel per side
    px = img.load()
    out = Text()
    for y in range(0, h, 2):
        for x in range(w):
            top, bottom = px[x, y], px[x, min(y + 1, h - 1)]  # an odd last row repeats itself
            out.append("▀", Style(color=f"rgb{tuple(top)}", bgcolor=f"rgb{tuple(bottom)}"))
        if y + 2 < h:
            out.append("\n")
    return out
