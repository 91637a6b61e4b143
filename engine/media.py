"""Media of one request (images and audio clips): their content keys for the prefix cache and
their soft-token rows, one path for every kind.

Two different images (or clips) give the same placeholder ids, so the prefix cache, the KV files
and the radix tree key every media position on the item's content instead: a negative key derived
from the sha256 of its resized pixels or 16 kHz samples (positive keys are token ids). The same
item at the same place reuses KV; a different one diverges at its first placeholder. Each kind's
encoder runs once per request, at admission, and only when the cached prefix does not already
cover the media; the rows of all kinds then fill their placeholders in prompt order with the
same language-model rules (no √d, the `<pad>` PLE row: models.gemma4.MediaRows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch


class MediaRequestError(ValueError):
    """A media request the engine refuses (one line)."""


ImageRequestError = MediaRequestError  # the name the image code used (this module began as engine/images.py)

NO_ENCODER = {
    "image": "this model has no image encoder (for a GGUF model: --mmproj FILE, or an mmproj*.gguf beside it)",
    "audio": "this model has no audio encoder (Gemma 4 E2B/E4B hear; for a GGUF model: an mmproj with the "
             "audio tower, --mmproj FILE or an mmproj*.gguf beside it)",
}
PLURAL = {"image": "images", "audio": "audio clips"}
SINGULAR = {"image": "image", "audio": "audio clip"}


def media_key(digest: str) -> int:
    """The cache key of every placeholder of an image or clip: -(1 + 60 bits of its sha256)."""
    return -1 - int(digest[:15], 16)


image_key = media_key


@dataclass(frozen=True)
class MediaKind:
    """One kind of soft-token input: its encoder and the ids of its block (begin, N×placeholder, end)."""
    name: str  # "image" | "audio"
    encoder: Any  # models.gemma4_vision.Gemma4Vision | models.gemma4_audio.Gemma4Audio
    begin_id: int
    placeholder_id: int
    end_id: int
    pad_id: int = 0

    def block(self, n_tokens: int) -> list[int]:
        return [self.begin_id] + [self.placeholder_id] * n_tokens + [self.end_id]


def media_kinds(vision=None, audio=None) -> dict[str, MediaKind]:
    """The kinds a model takes, from its encoders (None: that kind is refused)."""
    kinds = {}
    if vision is not None:
        c = vision.cfg
        kinds["image"] = MediaKind("image", vision, c.boi_id, c.image_id, c.eoi_id, c.pad_id)
    if audio is not None:
        c = audio.cfg
        kinds["audio"] = MediaKind("audio", audio, c.boa_id, c.audio_id, c.eoa_id, c.pad_id)
    return kinds


def describe_counts(items: Mapping[str, Sequence]) -> str:
    """What the media add to a prompt: "120 of them for 2 images and 1 audio clip"."""
    n = sum(x.n_tokens for xs in items.values() for x in xs)
    what = " and ".join(f"{len(xs)} {PLURAL[k] if len(xs) != 1 else SINGULAR[k]}" for k, xs in items.items() if xs)
    return f"{n} of them for {what}"


@dataclass
class PromptMedia:
    """`items` (kind -> models.gemma4_vision.ImageInput / models.audio.AudioInput, in prompt
    order) filling the placeholder runs of a prompt; `rows` (all embeddings in prompt order,
    [n, d]) once encoded."""
    prompt_ids: list[int]
    items: dict[str, list]
    kinds: dict[str, MediaKind]
    key_prompt: list[int] = field(init=False)
    mask: torch.Tensor = field(init=False)  # CPU bool [T]: media positions of every kind
    before: torch.Tensor = field(init=False)  # CPU int64 [T + 1]: media rows before each position
    counts: dict[str, int] = field(init=False)  # kind -> placeholder tokens
    rows: Optional[torch.Tensor] = None

    def __post_init__(self):
        ids = torch.tensor(self.prompt_ids, dtype=torch.long)
        key, self.mask, self.counts = ids.clone(), torch.zeros_like(ids, dtype=torch.bool), {}
        self._masks: dict[str, torch.Tensor] = {}
        for name, xs in self.items.items():
            kind = self.kinds[name]
            m = ids == kind.placeholder_id
            n_slots, per = int(m.sum()), [x.n_tokens for x in xs]
            if n_slots != sum(per):
                raise MediaRequestError(
                    f"the prompt has {n_slots} {name} placeholder tokens; the {PLURAL[name]} give {sum(per)} "
                    f"({' + '.join(map(str, per)) or 'no ' + PLURAL[name]})")
            key[m] = torch.tensor([media_key(x.digest) for x in xs for _ in range(x.n_tokens)], dtype=torch.long)
            self.mask |= m
            self._masks[name], self.counts[name] = m, n_slots
        self.before = torch.cat([torch.zeros(1, dtype=torch.long), self.mask.long().cumsum(0)])
        self.key_prompt = key.tolist()

    @property
    def last_media_pos(self) -> int:
        """Position of the last placeholder of any kind (-1: none)."""
        where = self.mask.nonzero()
        return int(where[-1]) if len(where) else -1

    def encode(self) -> None:
        """Run each kind's encoder once over its items; the rows of all kinds in prompt order."""
        if self.rows is not None:
            return
        rows = None
        for name, xs in self.items.items():
            if not xs:
                continue
            embeds = self.kinds[name].encoder.encode(xs)
            if not embeds:
                continue
            e = torch.cat(embeds)
            if rows is None:
                rows = e.new_zeros(int(self.mask.sum()), e.shape[-1])
            rows[self._masks[name][self.mask].to(rows.device)] = e  # this kind's slots among all media slots
        self.rows = rows

    def whole_images_end(self, start: int, end: int) -> int:
        """The end of a prefill chunk [start, end) moved so that it cuts no image: on 26B/31B an
        image's tokens attend to each other both ways (models/image_attention.py), so all of an
        image's rows not already in the cache must be in one forward. An end inside an image goes
        back to the image's first token, or, when the chunk starts inside or at that image (it is
        longer than the chunk, or a cached prefix ends inside it), on to its end: that chunk is
        then longer than asked, by at most one image (1120 tokens at the largest budget)."""
        image = self._masks.get("image")
        if image is None or not start < end < len(self.prompt_ids) or not (image[end - 1] and image[end]):
            return end
        text_before = (~image[:end]).nonzero()
        first = int(text_before[-1]) + 1 if len(text_before) else 0  # the image's first token
        if first > start:
            return first
        text_after = (~image[end:]).nonzero()
        return end + int(text_after[0]) if len(text_after) else len(self.prompt_ids)

    def chunk(self, start: int, n: int):
        """models.gemma4.MediaRows for prompt positions [start, start + n) (None: no media there)."""
        from models.gemma4 import MediaRows

        end = min(start + n, len(self.prompt_ids))
        if start >= end or not bool(self.mask[start:end].any()):
            return None
        pad = next(iter(self.kinds[k].pad_id for k in self.items))
        image = self._masks["image"][start:end] if "image" in self._masks else None
        return MediaRows(self.mask[start:end], self.rows[int(self.before[start]):int(self.before[end])], pad,
                         image=image)


def prompt_media(prompt_ids: Sequence[int], items: Mapping[str, Sequence], kinds: Mapping[str, MediaKind],
                 strict: bool = False) -> Optional[PromptMedia]:
    """Check a request's media against the model and its prompt (one-line errors); None: none.
    `strict`: a kind the model takes whose placeholders appear is checked even with no items
    (`score`'s ids); otherwise such ids are plain tokens, as in a text-only request."""
    for k, v in items.items():
        if v and k not in kinds:
            raise MediaRequestError(NO_ENCODER[k])
    ids = set(prompt_ids) if strict else set()
    items = {k: list(v) for k, v in items.items() if v or (k in kinds and kinds[k].placeholder_id in ids)}
    if not items:
        return None
    if len({kinds[k].pad_id for k in items}) > 1:
        raise MediaRequestError("the image and audio encoders disagree on the pad id")
    return PromptMedia(list(prompt_ids), items, dict(kinds))


def as_image_input(item, budget: int, name: str = ""):
    """An image as a request carries it: an ImageInput as is; a path or the file's bytes are
    opened and preprocessed at `budget` soft tokens (one-line models.gemma4_vision.ImageError,
    starting with `name`, else the file's name, else "image")."""
    from models.gemma4_vision import ImageInput, load_image

    if isinstance(item, ImageInput):
        return item
    return load_image(item, budget, name=name)


def as_audio_input(item, name: str = ""):
    """A clip as a request carries it: an AudioInput as is; a path or the file's bytes are decoded
    to 16 kHz mono (one-line models.audio.AudioError, starting with `name`, else the file's name)."""
    from models.audio import AudioInput, load_audio

    if isinstance(item, AudioInput):
        return item
    return load_audio(item, name=name)


def place_markers(text: str, n_items: int, marker: str) -> str:
    """The user text with one `marker` per item: as written when it already has exactly that many,
    else the items first (none in the text). Other counts are a one-line error."""
    have = text.count(marker)
    if have == n_items:
        return text
    if have == 0:
        return marker * n_items + text
    what = "images" if "image" in marker else "audio clips"
    raise MediaRequestError(f"the text has {have} {marker} markers for {n_items} {what}")


def expand_markers(ids: Sequence[int], items: Mapping[str, Sequence], kinds: Mapping[str, MediaKind]) -> list[int]:
    """Each single placeholder id of a kind the model takes (one per item, in order) becomes its
    block, begin + N×placeholder + end: the ids a rendered chat prompt is submitted with."""
    for k, xs in items.items():
        if xs and k not in kinds:
            raise MediaRequestError(NO_ENCODER[k])
    by_id = {kind.placeholder_id: kind for kind in kinds.values()}
    marks = {k: [i for i, t in enumerate(ids) if t == kinds[k].placeholder_id] for k in kinds}
    for k, where in marks.items():
        if len(where) != len(items.get(k, ())):
            raise MediaRequestError(f"the prompt has {len(where)} {k} markers for {len(items.get(k, ()))} "
                                    f"{PLURAL[k]}")
    out, taken = [], {k: 0 for k in kinds}
    for t in ids:
        kind = by_id.get(t)
        if kind is None:
            out.append(t)
            continue
        out += kind.block(items[kind.name][taken[kind.name]].n_tokens)
        taken[kind.name] += 1
    return out


BASE64_FORMATS = ("wav", "mp3", "flac", "ogg")  # OpenAI's input_audio names wav and mp3; libsndfile reads all four
MAX_BASE64_AUDIO_BYTES = 64 << 20


def audio_from_base64(data: str, fmt: Optional[str] = None, name: str = "input_audio"):
    """An API `input_audio` part (base64 of a wav/mp3/flac/ogg file; `fmt` the declared format, or
    None) as a models.audio.AudioInput. Every refusal is one line (models.audio.AudioError, a
    ValueError): a format name not in BASE64_FORMATS, data that is not base64, over
    MAX_BASE64_AUDIO_BYTES (checked before decoding), or bytes that are not audio of that kind
    (as load_audio refuses them: not audio, bad codec, empty, too short, absurd header, too long)."""
    import base64
    import binascii

    from models.audio import AudioError, load_audio

    if fmt is not None and str(fmt).lower() not in BASE64_FORMATS:
        raise AudioError(f"{name}: format {str(fmt)[:20]!r} is not one of {', '.join(BASE64_FORMATS)}")
    if not isinstance(data, str) or not data:
        raise AudioError(f"{name}: data must be a non-empty base64 string")
    if len(data) * 3 // 4 > MAX_BASE64_AUDIO_BYTES:
        raise AudioError(f"{name}: over the {MAX_BASE64_AUDIO_BYTES >> 20} MiB limit")
    try:
        raw = base64.b64decode(data.split(",", 1)[1] if data.startswith("data:") else data, validate=True)
    except (binascii.Error, ValueError):
        raise AudioError(f"{name}: data is not valid base64") from None
    return load_audio(raw, name=name)
