"""Images of one request: their content keys for the prefix cache and their soft-token rows.

Two different images give the same placeholder ids, so the prefix cache, the KV files and the
radix tree key every image position on the image's content instead: a negative key derived from
the sha256 of its resized pixels (positive keys are token ids). The same image at the same place
reuses KV; a different image diverges at its first placeholder. The images are encoded once, at
admission, and only when the cached prefix does not already cover them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


class ImageRequestError(ValueError):
    """An image request the engine refuses (one line)."""


def image_key(digest: str) -> int:
    """The cache key of every placeholder of an image: -(1 + 60 bits of its sha256)."""
    return -1 - int(digest[:15], 16)


@dataclass
class PromptImages:
    """`images` (models.gemma4_vision.ImageInput, in prompt order) filling the `<|image|>` runs of
    a prompt; `rows` (their embeddings, [n, d]) once encoded."""
    prompt_ids: list[int]
    images: list
    image_id: int
    pad_id: int = 0
    key_prompt: list[int] = field(init=False)
    mask: torch.Tensor = field(init=False)  # CPU bool [T]: image positions
    before: torch.Tensor = field(init=False)  # CPU int64 [T + 1]: image rows before each position
    rows: Optional[torch.Tensor] = None

    def __post_init__(self):
        ids = torch.tensor(self.prompt_ids, dtype=torch.long)
        self.mask = ids == self.image_id
        n_slots, counts = int(self.mask.sum()), [im.n_tokens for im in self.images]
        if n_slots != sum(counts):
            raise ImageRequestError(
                f"the prompt has {n_slots} image placeholder tokens; the images give {sum(counts)} "
                f"({' + '.join(map(str, counts)) or 'no images'})")
        self.before = torch.cat([torch.zeros(1, dtype=torch.long), self.mask.long().cumsum(0)])
        keys = torch.tensor([image_key(im.digest) for im in self.images for _ in range(im.n_tokens)],
                            dtype=torch.long)
        key = ids.clone()
        key[self.mask] = keys
        self.key_prompt = key.tolist()

    @property
    def last_image_pos(self) -> int:
        """Position of the last placeholder (-1: none)."""
        where = self.mask.nonzero()
        return int(where[-1]) if len(where) else -1

    def encode(self, vision) -> None:
        """Run the vision tower once over all images of the request (one padded batch)."""
        if self.rows is None:
            embeds = vision.encode(self.images)
            self.rows = torch.cat(embeds) if embeds else None

    def chunk(self, start: int, n: int):
        """models.gemma4.ImageRows for prompt positions [start, start + n) (None: no image there)."""
        from models.gemma4 import ImageRows

        end = min(start + n, len(self.prompt_ids))
        if start >= end or not bool(self.mask[start:end].any()):
            return None
        return ImageRows(self.mask[start:end], self.rows[int(self.before[start]):int(self.before[end])],
                         self.pad_id)


def prompt_images(prompt_ids: Sequence[int], images: Sequence, vision) -> Optional[PromptImages]:
    """Check a request's images against the model and its prompt (one-line errors)."""
    if not images:
        return None
    if vision is None:
        raise ImageRequestError("this model has no image encoder (for a GGUF model: --mmproj FILE, or an "
                                "mmproj*.gguf beside it)")
    return PromptImages(list(prompt_ids), list(images), vision.cfg.image_id, vision.cfg.pad_id)


def as_image_input(item, budget: int, name: str = ""):
    """An image as a request carries it: an ImageInput as is; a path or the file's bytes are
    opened and preprocessed at `budget` soft tokens (one-line models.gemma4_vision.ImageError,
    starting with `name`, else the file's name, else "image")."""
    from models.gemma4_vision import ImageInput, load_image

    if isinstance(item, ImageInput):
        return item
    return load_image(item, budget, name=name)


def place_markers(text: str, n_images: int, marker: str) -> str:
    """The user text with one `marker` per image: as written when it already has exactly that many,
    else the images first (none in the text). Other counts are a one-line error."""
    have = text.count(marker)
    if have == n_images:
        return text
    if have == 0:
        return marker * n_images + text
    raise ImageRequestError(f"the text has {have} {marker} markers for {n_images} images")


def expand_markers(ids: Sequence[int], images: Sequence, vision_cfg) -> list[int]:
    """Each single `<|image|>` id (one per image, in order) becomes boi + N×image + eoi (vision
    spec §4.2): the ids a rendered chat prompt is submitted with."""
    from models.gemma4_vision import image_block

    marks = [i for i, t in enumerate(ids) if t == vision_cfg.image_id]
    if len(marks) != len(images):
        raise ImageRequestError(f"the prompt has {len(marks)} image markers for {len(images)} images")
    out, prev = [], 0
    for at, im in zip(marks, images):
        out += list(ids[prev:at]) + image_block(vision_cfg, im.n_tokens)
        prev = at + 1
    return out + list(ids[prev:])
