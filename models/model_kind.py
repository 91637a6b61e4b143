"""Base (pretrained) model or chat model, from what the file says.

A base model continues text; a chat model answers turns. Asked a question in chat turns, a base
model such as the demo (Gemma 3 270M) writes the turn markers' neighbourhood back, often one word
over and over, so the app opens base models in a text-continuation mode instead.

The rule, first match wins (`model_kind`):
1. `general.finetune` (llama.cpp's converter fills it from the checkpoint's name: "it", "instruct",
   "pt"...) names a chat tuning -> chat, a pretrained checkpoint -> base;
2. the same words in `general.name` or `general.basename` ("gemma-3-270m-it", "... Instruct");
3. no `tokenizer.chat_template` -> base: a chat model is tuned on the turns its template prints,
   and checkpoints ship one with that tuning; a file without one (the demo has none, nor a
   fine-tune word) would get a built-in format its weights never learned;
4. otherwise chat (a template and no word against it).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

CHAT_WORDS = frozenset({"it", "instruct", "chat", "sft", "rlhf", "dpo", "assistant"})
BASE_WORDS = frozenset({"pt", "base", "pretrained", "pretrain"})


def _words(text: Any) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", text.lower())) if isinstance(text, str) else set()


def model_kind(meta: Mapping[str, Any], template: Optional[str]) -> tuple[str, str]:
    """("base" | "chat", why in a few words) for a file's metadata and its chat template."""
    for key in ("general.finetune", "general.name", "general.basename"):
        words = _words(meta.get(key))
        if words & CHAT_WORDS:
            return "chat", f"{key} says {sorted(words & CHAT_WORDS)[0]!r}"
        if words & BASE_WORDS:
            return "base", f"{key} says {sorted(words & BASE_WORDS)[0]!r}"
    if not template:
        return "base", "no chat template in the file"
    return "chat", "the file has a chat template"
