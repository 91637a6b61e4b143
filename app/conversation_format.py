"""The export format of a conversation (`edgegem.conversation`, JSON) and its strict import check.

Version 2 adds `images` to a message: [{"file", "name", "bytes", "tokens"}], where `file` is a
path relative to the JSON file (the export writes the copies into `<stem>-images/` beside it);
version 3 adds `audio`: [{"file", "name", "bytes", "tokens", "seconds"}] (copies in
`<stem>-audio/`); version 4 adds tool calls: role "tool" (a call's result) and `tool`, on an
assistant message {"calls": [{"id", "name", "arguments"}]}, on a tool message {"call_id", "name",
"status": "ok" | "error" | "denied"}. Versions 1-3 still import. An import is untrusted input: anything malformed is
refused in one line (ValueError) before anything is written.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import PurePosixPath

FORMAT = "edgegem.conversation"
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
ROLES = ("system", "user", "assistant", "tool")
TOOL_STATUSES = ("ok", "error", "denied")
MAX_TOOL_CALLS = 64
STATUSES = ("done", "stopped", "error")
MAX_TITLE = 200
MAX_IMPORT_MESSAGES = 10_000
MAX_IMPORT_BYTES = 8 << 20
MAX_MESSAGE_IMAGES = 64
DEFAULT_TITLE = "New chat"
MESSAGE_KEYS = {"role", "content", "thinking", "status", "created", "stats", "images", "audio", "tool"}
IMAGE_KEYS = {"file", "name", "bytes", "tokens"}
AUDIO_KEYS = IMAGE_KEYS | {"seconds"}


def clean_title(title: str) -> str:
    title = " ".join(str(title).split())[:MAX_TITLE]
    return title or DEFAULT_TITLE


def _refuse(why: str) -> ValueError:
    return ValueError("import refused: " + " ".join(why.split()))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: object, where: str) -> float:
    try:  # float() of a 400-digit int raises OverflowError
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number):
        raise _refuse(f"{where} must be a finite number, not {_short(value)}")
    return number


def _count(value: object, where: str) -> int:
    if type(value) is not int or value < 0:
        raise _refuse(f"{where} must be a non-negative integer, not {_short(value)}")
    return value


def _text(value: object, where: str) -> str:
    # A lone surrogate ("\ud800" in the JSON) parses but cannot be stored as UTF-8 by sqlite3.
    if not isinstance(value, str):
        raise _refuse(f"{where} must be a string, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _refuse(f"{where} is not valid Unicode (lone surrogate)") from None
    return value


def _media(value: object, where: str, keys: set = IMAGE_KEYS) -> dict:
    """One image or audio reference: `file` must stay inside the export's folder (no absolute
    path, no ..)."""
    if not isinstance(value, dict):
        raise _refuse(f"{where} is not an object")
    if extra := set(value) - keys:
        raise _refuse(f"{where}: unknown key {_short(min(extra, key=str))}")
    file = _text(value.get("file"), f"{where}: file")
    path = PurePosixPath(file)
    if not file or path.is_absolute() or ".." in path.parts or "\\" in file or "\0" in file:
        raise _refuse(f"{where}: file {_short(file)} is not a path inside the export's folder")
    out = {"file": file, "name": _text(value.get("name", path.name), f"{where}: name")[:200],
           "bytes": _count(value.get("bytes", 0), f"{where}: bytes"),
           "tokens": _count(value.get("tokens", 0), f"{where}: tokens")}
    if "seconds" in keys:
        out["seconds"] = _number(value.get("seconds", 0.0), f"{where}: seconds")
    return out


def check_tool(value: object, role: str, where: str) -> dict:
    """A message's `tool` record (module doc), checked and normalised; {} for none."""
    if value in (None, {}):
        if role == "tool":
            raise _refuse(f"{where}: a tool message needs tool.call_id and tool.name")
        return {}
    if not isinstance(value, dict):
        raise _refuse(f"{where}: tool must be an object")
    if role == "assistant":
        calls = value.get("calls")
        if set(value) != {"calls"} or not isinstance(calls, list) or not 0 < len(calls) <= MAX_TOOL_CALLS:
            raise _refuse(f"{where}: tool must be {{\"calls\": [1 to {MAX_TOOL_CALLS} calls]}}")
        out = []
        for j, c in enumerate(calls):
            if not isinstance(c, dict) or set(c) - {"id", "name", "arguments"} or not isinstance(c.get("arguments", {}), dict):
                raise _refuse(f"{where}: call {j} must be {{id, name, arguments: object}}")
            out.append({"id": _text(c.get("id", f"call_{j}"), f"{where}: call {j} id"),
                        "name": _text(c.get("name"), f"{where}: call {j} name"), "arguments": c.get("arguments", {})})
        return {"calls": out}
    if role == "tool":
        if set(value) - {"call_id", "name", "status"} or value.get("status", "ok") not in TOOL_STATUSES:
            raise _refuse(f"{where}: tool must be {{call_id, name, status: {' | '.join(TOOL_STATUSES)}}}")
        return {"call_id": _text(value.get("call_id"), f"{where}: tool.call_id"),
                "name": _text(value.get("name"), f"{where}: tool.name"), "status": value.get("status", "ok")}
    raise _refuse(f"{where}: a {role} message has no tool record")


def parse_import(data: bytes | str | dict, max_bytes: int) -> dict:
    """Validate an import and return it normalised (defaults filled in)."""
    if isinstance(data, dict):
        try:
            size = len(json.dumps(data, allow_nan=False).encode("utf-8"))
        except (TypeError, ValueError, RecursionError):
            raise _refuse("not JSON-serialisable") from None
    elif isinstance(data, (bytes, str)):
        size = len(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    else:
        raise _refuse(f"expected bytes, str or dict, got {type(data).__name__}")
    if size > max_bytes:
        raise _refuse(f"{size} bytes is over the {max_bytes}-byte limit")
    if not isinstance(data, dict):
        def no_constants(name: str):
            raise ValueError(f"{name} is not JSON")
        try:
            data = json.loads(data, parse_constant=no_constants)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise _refuse(f"not valid JSON ({str(e)[:80]})") from None
    if not isinstance(data, dict):
        raise _refuse(f"expected a JSON object, got {type(data).__name__}")
    allowed = {"format", "version", "title", "created", "settings", "messages"}
    if extra := set(data) - allowed:
        raise _refuse(f"unknown key {_short(min(extra, key=str))}")
    if data.get("format") != FORMAT:
        raise _refuse(f"format is {_short(data.get('format'))}, expected {FORMAT!r}")
    if type(data.get("version")) is not int or data["version"] not in READABLE_VERSIONS:
        raise _refuse(f"version {_short(data.get('version'))} is not supported "
                      f"(expected {' or '.join(map(str, READABLE_VERSIONS))})")
    title = _text(data.get("title", DEFAULT_TITLE), "title")
    if len(title) > MAX_TITLE:
        raise _refuse(f"title is {len(title)} characters, over the {MAX_TITLE} limit")
    settings = data.get("settings", {})
    if not isinstance(settings, dict):
        raise _refuse("settings must be an object")
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise _refuse("messages must be a list")
    if len(messages) > MAX_IMPORT_MESSAGES:
        raise _refuse(f"{len(messages)} messages is over the {MAX_IMPORT_MESSAGES} limit")
    created = _number(data.get("created", time.time()), "created")
    clean = []
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, dict):
            raise _refuse(f"{where} is not an object")
        if extra := set(m) - MESSAGE_KEYS:
            raise _refuse(f"{where}: unknown key {_short(min(extra, key=str))}")
        if m.get("role") not in ROLES:
            raise _refuse(f"{where}: role {_short(m.get('role'))} is not one of {', '.join(ROLES)}")
        if m.get("status", "done") not in STATUSES:
            raise _refuse(f"{where}: status {_short(m.get('status'))} is not one of {', '.join(STATUSES)}")
        if not isinstance(m.get("stats", {}), dict):
            raise _refuse(f"{where}: stats must be an object")
        images, audio = m.get("images", []), m.get("audio", [])
        for key, items in (("images", images), ("audio", audio)):
            if not isinstance(items, list) or len(items) > MAX_MESSAGE_IMAGES:
                raise _refuse(f"{where}: {key} must be a list of at most {MAX_MESSAGE_IMAGES}")
        clean.append({"role": m["role"], "content": _text(m.get("content"), f"{where}: content"),
                      "thinking": _text(m.get("thinking", ""), f"{where}: thinking"),
                      "status": m.get("status", "done"), "stats": m.get("stats", {}),
                      "created": _number(m.get("created", created), f"{where}: created"),
                      "images": [_media(im, f"{where}: image {j}") for j, im in enumerate(images)],
                      "audio": [_media(a, f"{where}: audio {j}", AUDIO_KEYS) for j, a in enumerate(audio)],
                      "tool": check_tool(m.get("tool"), m["role"], where)})
    return {"title": clean_title(title), "created": created, "settings": settings, "messages": clean}


def prompt_message(m) -> dict:
    """A stored message (app.store.Message) as the engine's chat message: an assistant's calls as
    OpenAI `tool_calls`, a tool message with its `tool_call_id` and `name` (the template renders
    them as Gemma-4 blocks, models/tool_format.py)."""
    out: dict = {"role": m.role, "content": m.content}
    tool = getattr(m, "tool", None) or {}
    if m.role == "assistant" and tool.get("calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in tool["calls"]]
    elif m.role == "tool":
        out.update(tool_call_id=tool.get("call_id"), name=tool.get("name"))
    return out


# --- export ------------------------------------------------------------------------------------
def _joined(folder: str, file: str) -> str:
    return f"{folder}/{file}" if folder else file


def _fence(text: str) -> str:
    """A code fence longer than any run of backticks in `text`."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    return "`" * max(3, longest + 1)


def render_markdown(conv, messages: list, image_folder: str = "", audio_folder: str = "") -> str:
    """app.store Conversation + Messages as Markdown; each image `![name](image_folder/file)`, each
    clip a link `[▶ name · 12.3 s](audio_folder/file)`."""
    out = [f"# {conv.title}", ""]
    for m in messages:
        out += [f"## {m.role.capitalize()}", ""]
        for im in m.images:
            alt = im["name"].replace("[", "(").replace("]", ")")
            out += [f"![{alt}]({_joined(image_folder, im['file'])})", ""]
        for clip in getattr(m, "audio", []):
            alt = clip["name"].replace("[", "(").replace("]", ")")
            out += [f"[▶ {alt} · {clip.get('seconds', 0.0):.1f} s]({_joined(audio_folder, clip['file'])})", ""]
        if m.thinking:
            out += ["<details><summary>Thinking</summary>", "", m.thinking, "", "</details>", ""]
        tool = getattr(m, "tool", None) or {}
        if m.role == "tool":
            out += [f"<details><summary>Result of {tool.get('name', '?')} ({tool.get('status', 'ok')})</summary>", "",
                    _fence(m.content), m.content, _fence(m.content), "", "</details>", ""]
            continue
        out += [m.content, ""] if m.content else []
        for c in tool.get("calls", ()):
            out += [f"<details><summary>Tool call: {c['name']}</summary>", "", "```json",
                    json.dumps(c["arguments"], ensure_ascii=False, indent=1), "```", "", "</details>", ""]
        if m.status != "done":
            out += [f"_({m.status})_", ""]
    return "\n".join(out)


def render_json(conv, messages: list, image_folder: str = "", audio_folder: str = "") -> dict:
    """The export document; a message's images and clips only when it has some, `file` relative
    to the JSON."""
    def message(m) -> dict:
        out = {"role": m.role, "content": m.content, "thinking": m.thinking, "status": m.status,
               "created": m.created, "stats": m.stats}
        if m.images:
            out["images"] = [{**im, "file": _joined(image_folder, im["file"])} for im in m.images]
        if getattr(m, "audio", None):
            out["audio"] = [{**a, "file": _joined(audio_folder, a["file"])} for a in m.audio]
        if getattr(m, "tool", None):
            out["tool"] = m.tool
        return out
    return {"format": FORMAT, "version": FORMAT_VERSION, "title": conv.title, "created": conv.created,
            "settings": conv.settings, "messages": [message(m) for m in messages]}
