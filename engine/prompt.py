"""Prompts as token ids, built in one place: the chat template or a base model's text, the BOS, the
media markers and their blocks, and truncation to the context.

Every front end reaches this through the client (`LocalClient.submit`, `chat_prompt_ids`) or
engine.api (`run_prompt`, `prompt_ids`, `tokenize`). A message is {"role", "content", optional
"images": [ImageInput | path | bytes, ...], optional "audio": [AudioInput | path | bytes, ...]};
each item gets a marker in its message's text (`<|image|>` / `<|audio|>`, images first, then clips,
before the text unless the text places them), and each marker becomes its block (begin +
N×placeholder + end: engine/media.py).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from .media import as_audio_input, as_image_input, expand_markers, place_markers
from .scheduler import ContextOverflowError


def image_marker() -> str:
    """The text that stands for one image in a message (Gemma-4's `<|image|>`): images are placed
    there, in order (messages without markers get their images before the text)."""
    from models.gemma4_vision import IMAGE
    return IMAGE


def audio_marker() -> str:
    """The text that stands for one audio clip in a message (Gemma-4's `<|audio|>`), as image_marker."""
    from models.gemma4_audio import AUDIO
    return AUDIO


def with_markers(text: str, n_images: int, n_audio: int) -> str:
    """`text` with a marker per item: images first, then clips, then the text, unless it places them."""
    return place_markers(place_markers(text, n_audio, audio_marker()), n_images, image_marker())


def with_media_markers(message: dict, image_tokens: int) -> dict:
    """A message with `images` / `audio` turned into ImageInput / AudioInput (`image_tokens`: the
    soft-token budget of images given as paths or bytes) and their markers in its text."""
    if not message.get("images") and not message.get("audio"):
        return message
    from models.chat import message_text

    images = [as_image_input(im, image_tokens) for im in message.get("images", ())]
    audio = [as_audio_input(clip) for clip in message.get("audio", ())]
    return {**message, "images": images, "audio": audio, "content": with_markers(message_text(message), len(images),
                                                                               len(audio))}


def continuation_text(messages: Sequence[dict]) -> str:
    """A conversation as one text to continue (a base model): each answer continues the text
    before it as written; a user message after others starts a new paragraph (unless the text
    already ends with a newline). System messages are text like the rest."""
    from models.chat import message_text

    out = ""
    for m in messages:
        text = message_text(m)
        if out and m.get("role") != "assistant" and not out.endswith("\n"):
            out += "\n\n"
        out += text
    return out


def user_turn(prompt: str, system: Optional[str] = None, images=(), audio=()) -> list[dict]:
    """One prompt as messages: the system prompt (if any), then the user's, with its media."""
    user = {"role": "user", "content": prompt, **({"images": list(images)} if images else {}),
            **({"audio": list(audio)} if audio else {})}
    return ([{"role": "system", "content": system}] if system else []) + [user]


def text_ids(tokenizer, text: str, kinds: Mapping, images=(), audio=()) -> list[int]:
    """Raw text (no template) as ids, BOS as the tokenizer adds it; `images` / `audio`
    (ImageInput / AudioInput): a marker each placed in the text, expanded to their blocks when the
    model takes media (`kinds`: engine.media.media_kinds) or the text carries some."""
    ids = tokenizer.encode(with_markers(text, len(images), len(audio)))
    if kinds or images or audio:
        ids = expand_markers(ids, {"image": list(images), "audio": list(audio)}, kinds)
    return ids


def conversation_ids(lm, messages: Sequence[dict], thinking: bool = False, tools=None,
                     continue_text: bool = False) -> list[int]:
    """Messages (markers in place, not expanded) as ids: rendered by the model's chat template, a
    BOS added unless the template writes it; `continue_text` (a base model): their contents
    joined (continuation_text), BOS as the tokenizer adds it. `tools`: rendered by the template
    (a chat format without tool support never sees the key)."""
    if continue_text:
        return lm.tokenizer.encode(continuation_text(messages))
    extra = {"tools": tools} if tools else {}
    text = lm.chat.render(messages, add_generation_prompt=True, thinking=thinking, **extra)
    return lm.tokenizer.encode(text, add_bos=not lm.chat.bos_in_template)


def prompt_ids(lm, messages: Sequence[dict], kinds: Mapping, thinking: bool = False, image_tokens: int = 280,
               tools=None, continue_text: bool = False, limit: Optional[int] = None,
               truncate: bool = False) -> tuple[list[int], dict]:
    """(ids, media) a conversation is submitted with. `media`: {"image": [...], "audio": [...]} in
    prompt order. `limit` with `truncate`: the oldest whole turns after the system prompt are
    dropped (with their media) until the prompt is shorter than `limit`; the last message alone
    too long is a ContextOverflowError. Without `truncate` a long prompt is the scheduler's to refuse."""
    msgs = [with_media_markers(m, image_tokens) for m in messages]
    while True:
        ids = conversation_ids(lm, msgs, thinking, tools, continue_text)
        media = {k: [x for m in msgs for x in m.get(key, ())] for k, key in (("image", "images"), ("audio", "audio"))}
        if any(media.values()) or kinds:
            ids = expand_markers(ids, media, kinds)
        if limit is None or len(ids) < limit or not truncate:
            return ids, media
        first = 1 if msgs and msgs[0].get("role") == "system" else 0
        # Drop the oldest whole turn (a user message and the replies after it), keep the last.
        nxt = next((i for i in range(first + 1, len(msgs)) if msgs[i].get("role") == "user"), None)
        if nxt is None:
            raise ContextOverflowError(
                f"the last message alone ({len(ids)} tokens) does not fit the {limit}-token context")
        msgs = msgs[:first] + msgs[nxt:]
