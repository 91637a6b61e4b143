"""A tool's output as the model and the user get it: text capped, binary described, images kept.

The model reads every character of a result as prompt tokens, so text is cut at MAX_TEXT_CHARS
(16,000 characters: ~4,000 tokens of English, an eighth of E2B's 32K default context) with a note
saying how much there was; the user sees the same text. Binary content (audio, blobs) is one line
(type and size), never dumped; images come back as bytes for the app to show as chips (and to pass
to a model that takes images), up to MAX_IMAGE_BYTES each, with a line in the text naming them.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any, Iterable

from .base import ToolResult

MAX_TEXT_CHARS = 16_000
MAX_IMAGE_BYTES = 16 << 20  # a screenshot is ~1 MB; the app's own attachments stop at 64 MB
MAX_IMAGES = 8


def cap_text(text: str, limit: int = MAX_TEXT_CHARS) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return (text[:limit] + f"\n[truncated: the result was {len(text):,} characters; the first {limit:,} are shown]",
            True)


def describe_binary(n_bytes: int, mime: str, what: str = "binary content") -> str:
    return f"[{what}: {mime or 'unknown type'}, {n_bytes:,} bytes, not shown]"


def _b64_size(data: str) -> int:
    return len(data) * 3 // 4 - data[-2:].count("=") if data else 0


def from_mcp(content: Iterable[Any], is_error: bool = False, structured: Any = None,
             limit: int = MAX_TEXT_CHARS) -> ToolResult:
    """An MCP CallToolResult's content blocks (TextContent, ImageContent, AudioContent,
    EmbeddedResource, ResourceLink; read by their `type` field)."""
    parts: list[str] = []
    images: list[tuple[bytes, str]] = []
    for block in content:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "image":
            size = _b64_size(block.data)
            if size > MAX_IMAGE_BYTES or len(images) >= MAX_IMAGES:
                parts.append(describe_binary(size, block.mime_type, "image, too big to show"
                                             if size > MAX_IMAGE_BYTES else "image beyond the first 8"))
                continue
            try:
                data = base64.b64decode(block.data, validate=True)
            except (binascii.Error, ValueError):
                parts.append(f"[image: {block.mime_type}, not valid base64]")
                continue
            images.append((data, block.mime_type))
            parts.append(f"[image {len(images)}: {block.mime_type}, {len(data):,} bytes]")
        elif kind == "audio":
            parts.append(describe_binary(_b64_size(block.data), block.mime_type, "audio"))
        elif kind == "resource":
            res = block.resource
            if getattr(res, "text", None) is not None:
                parts.append(res.text)
            else:
                parts.append(describe_binary(_b64_size(getattr(res, "blob", "")), res.mime_type or "",
                                             f"resource {res.uri}"))
        elif kind == "resource_link":
            parts.append(f"[resource link: {block.uri}" + (f" ({block.name})" if block.name else "") + "]")
        else:
            parts.append(f"[content of type {kind!r}, not shown]")
    if not parts and structured is not None:
        import json
        parts.append(json.dumps(structured, ensure_ascii=False))
    text, truncated = cap_text("\n".join(parts), limit)
    return ToolResult(text=text, is_error=is_error, images=images, truncated=truncated, structured=structured)
