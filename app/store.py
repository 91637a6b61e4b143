"""Conversation store: SQLite (WAL) under the user's data directory; no Textual, no engine.
The queries live here, the tables and their migrations in app/store_schema.py.

Durability: every call that changes something commits before it returns, so a crash or `kill -9`
loses only the tokens still in flight. The database runs with `synchronous=NORMAL`: in WAL mode a
commit is a write() into the `-wal` file, which the OS keeps after the process dies; only a power
loss or OS crash can drop the last few commits, and even then the file stays consistent (no
corruption, the WAL is checksummed). `FULL` would add an fsync to every commit (about 1 ms on an
NVMe SSD, tens of ms on eMMC or a spinning disk), paid on the app's thread for a guarantee the
requirement (process crash or kill) does not ask for.

Thread safety: one connection opened with `check_same_thread=False`, every use under one lock,
so the UI thread and a generation worker can both call the store.

Images: a user message's images are copied into `<data-dir>/images/<sha256 of the file>.<ext>`
(content-addressed: the same picture twice is one file) and the message records
[{"file", "name", "bytes", "tokens"}], so the history survives the originals moving. Files no
message refers to any more go when their conversation is deleted. Audio clips the same way, in
`<data-dir>/audio/` ([{"file", "name", "bytes", "tokens", "seconds"}]).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from typing import Callable, Optional

from app.conversation_format import (DEFAULT_TITLE, MAX_IMPORT_BYTES, ROLES, STATUSES, check_tool, clean_title,
                                     parse_import, render_json, render_markdown)
from app.store_schema import migrate
from engine import failpoints

AUTO_TITLE_CHARS = 48
MAX_IMAGE_BYTES = 64 << 20  # one image file; a photo is a few MB, a bigger "image" is refused
# one audio file: 30 minutes (the decoder's cap) of 16 kHz mono WAV is 58 MB, of 44.1 kHz stereo
# 16-bit WAV 318 MB (over: FLAC or MP3 carry it)
MAX_AUDIO_BYTES = 256 << 20
_HEX = set("0123456789abcdef")


def default_data_dir() -> Path:
    """$EDGEGEM_DATA_DIR, else the platform's user data dir (~/.local/share/edgegem on Linux): the
    same folder `edgegem pull` and `doctor` use (engine/models_dir decides it for all)."""
    from engine.models_dir import data_dir
    return data_dir()


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    thinking: str = ""
    status: str = "done"  # "done" | "stopped" | "error"
    created: float = 0.0
    stats: dict = field(default_factory=dict)  # e.g. {"prefill_tps": .., "decode_tps": .., "tokens": ..}
    images: list = field(default_factory=list)  # [{"file", "name", "bytes", "tokens"}] (user messages)
    audio: list = field(default_factory=list)  # [{"file", "name", "bytes", "tokens", "seconds"}]
    tool: dict = field(default_factory=dict)  # {"calls": [...]} (assistant) or {"call_id", "name", "status"} (tool)


@dataclass
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    settings: dict


def _like_pattern(text: str) -> str:
    """`text` as a LIKE pattern matching it literally anywhere (escape char: backslash)."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _snippet(text: str, needle: str, width: int = 30) -> str:
    """About `width` chars either side of the first case-insensitive hit, on one line."""
    flat = " ".join(text.split())
    at = flat.lower().find(needle.lower())
    if at < 0:
        return flat[: 2 * width] + ("…" if len(flat) > 2 * width else "")
    start, end = max(0, at - width), min(len(flat), at + len(needle) + width)
    return ("…" if start else "") + flat[start:end] + ("…" if end < len(flat) else "")


def _slug(title: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40].strip("-")
    return slug or "chat"


class Store:
    def __init__(self, data_dir: Path | None = None):
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.data_dir / "conversations.sqlite3"
        self.images_dir = self.data_dir / "images"
        self.audio_dir = self.data_dir / "audio"
        self._lock = threading.Lock()
        self._last_time = 0.0
        # isolation_level=None: no implicit transactions; _tx() issues BEGIN/COMMIT itself.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                   timeout=5.0)
        self._db.row_factory = sqlite3.Row
        try:
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise OSError(f"{self.path}: cannot use WAL journal mode (got {mode})")
            self._db.execute("PRAGMA synchronous=NORMAL")  # why: see the module docstring
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    def _migrate(self) -> None:
        with self._tx() as db:
            migrate(db, self.path)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock, committed before the caller goes on."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if failpoints.ACTIVE:
                    failpoints.maybe_fail("store.write")
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args: tuple | dict = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _now(self) -> float:
        # Called under the lock. Strictly increasing within this store, so "most recently updated
        # first" has no ties even when two writes land in the same clock tick.
        self._last_time = max(time.time(), self._last_time + 1e-6)
        return self._last_time

    @staticmethod
    def _conversation(row: sqlite3.Row) -> Conversation:
        return Conversation(row["id"], row["title"], row["created"], row["updated"],
                            json.loads(row["settings"]))

    @staticmethod
    def _message(row: sqlite3.Row) -> Message:
        return Message(row["id"], row["conversation_id"], row["role"], row["content"],
                       row["thinking"], row["status"], row["created"], json.loads(row["stats"]),
                       json.loads(row["images"]), json.loads(row["audio"]), json.loads(row["tool"]))

    @staticmethod
    def title_from(text: str) -> str:
        """Sidebar title from the first user message: its first non-blank line, ≤ 48 chars."""
        line = next((ln for ln in text.splitlines() if ln.strip()), "")
        line = " ".join(line.split())
        if len(line) > AUTO_TITLE_CHARS:
            line = line[: AUTO_TITLE_CHARS - 1].rstrip() + "…"
        return line or DEFAULT_TITLE

    # --- conversations ---

    def new_conversation(self, title: str = DEFAULT_TITLE, settings: dict | None = None) -> Conversation:
        settings = json.dumps(dict(settings or {}))
        with self._tx() as db:
            now = self._now()
            cur = db.execute("INSERT INTO conversations (title, created, updated, settings) "
                             "VALUES (?, ?, ?, ?)", (clean_title(title), now, now, settings))
        return self.get(cur.lastrowid)

    def conversations(self) -> list[Conversation]:
        rows = self._read("SELECT * FROM conversations ORDER BY updated DESC, id DESC")
        return [self._conversation(r) for r in rows]

    def get(self, conversation_id: int) -> Conversation:
        rows = self._read("SELECT * FROM conversations WHERE id = ?", (conversation_id,))
        if not rows:
            raise KeyError(f"no conversation {conversation_id}")
        return self._conversation(rows[0])

    def _touch(self, db: sqlite3.Connection, conversation_id: int, sql: str = "", args: tuple = ()) -> None:
        """Bump `updated` (plus an optional `, col = ?` SET clause); KeyError if there is no such row."""
        cur = db.execute(f"UPDATE conversations SET updated = ?{sql} WHERE id = ?",
                         (self._now(), *args, conversation_id))
        if cur.rowcount == 0:
            raise KeyError(f"no conversation {conversation_id}")

    def rename(self, conversation_id: int, title: str) -> None:
        with self._tx() as db:
            self._touch(db, conversation_id, ", title = ?", (clean_title(title),))

    def delete(self, conversation_id: int) -> None:
        msgs = self.messages(conversation_id)
        files = {"images": {im["file"] for m in msgs for im in m.images}, "audio": {a["file"] for m in msgs for a in m.audio}}
        with self._tx() as db:  # messages go with it: ON DELETE CASCADE
            if db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)).rowcount == 0:
                raise KeyError(f"no conversation {conversation_id}")
            still = {col: {r["file"] for (js,) in db.execute(f"SELECT {col} FROM messages WHERE {col} != '[]'")
                           for r in json.loads(js)} for col in files}
        for col, folder in (("images", self.images_dir), ("audio", self.audio_dir)):
            for name in files[col] - still[col]:  # after the commit: a crash leaves a file, never a dangling row
                (folder / name).unlink(missing_ok=True)

    # --- image and audio files ---

    def _keep(self, folder: Path, data: bytes, name: str, tokens: int, ext: str) -> dict:
        """Copy bytes to folder/<sha256>.<ext> (once: same bytes, same file) and return the record a
        message stores. Written to a temporary name and renamed, so a crash never leaves half a
        file under the final name."""
        ext = "." + "".join(c for c in ext.lower().lstrip(".") if c.isalnum())[:8] if ext.strip(".") else ""
        file = hashlib.sha256(data).hexdigest() + ext
        dest = folder / file
        if not dest.exists():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{file}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)
        return {"file": file, "name": name, "bytes": len(data), "tokens": int(tokens)}

    def keep_image(self, data: bytes, name: str, tokens: int, ext: str) -> dict:
        """An image's copy in images_dir and its record (see _keep)."""
        return self._keep(self.images_dir, data, name, tokens, ext)

    def keep_audio(self, data: bytes, name: str, tokens: int, ext: str, seconds: float) -> dict:
        """A clip's copy in audio_dir and its record, with its duration (see _keep)."""
        return {**self._keep(self.audio_dir, data, name, tokens, ext), "seconds": round(float(seconds), 3)}

    def image_path(self, image: dict) -> Path:
        """Where a message's image record lives (the copy, not the original)."""
        return self.images_dir / Path(image["file"]).name

    def audio_path(self, clip: dict) -> Path:
        """Where a message's audio record lives (the copy, not the original)."""
        return self.audio_dir / Path(clip["file"]).name

    def update_settings(self, conversation_id: int, settings: dict) -> None:
        """Shallow merge into the stored settings; a key set to None is removed (back to default)."""
        with self._tx() as db:
            row = db.execute("SELECT settings FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
            if row is None:
                raise KeyError(f"no conversation {conversation_id}")
            merged = {**json.loads(row["settings"]), **settings}
            merged = {k: v for k, v in merged.items() if v is not None}
            self._touch(db, conversation_id, ", settings = ?", (json.dumps(merged),))

    # --- messages ---

    def add_message(self, conversation_id: int, role: str, content: str, thinking: str = "",
                    status: str = "done", stats: dict | None = None, images: list | None = None,
                    audio: list | None = None, tool: dict | None = None) -> Message:
        """`images` / `audio`: records `keep_image` / `keep_audio` returned (the files are already
        in images_dir / audio_dir); `tool`: an assistant's calls or a tool message's call
        (conversation_format.check_tool)."""
        if role not in ROLES or status not in STATUSES:
            raise ValueError(f"bad role {role!r} or status {status!r}")
        tool = check_tool(tool, role, "message")
        images, audio = [dict(im) for im in images or []], [dict(a) for a in audio or []]
        with self._tx() as db:
            created = self._now()
            self._touch(db, conversation_id)
            cur = db.execute("INSERT INTO messages (conversation_id, role, content, thinking, status, "
                             "created, stats, images, audio, tool) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             (conversation_id, role, content, thinking, status, created,
                              json.dumps(stats or {}), json.dumps(images), json.dumps(audio), json.dumps(tool)))
        return Message(cur.lastrowid, conversation_id, role, content, thinking, status, created,
                       dict(stats or {}), images, audio, tool)

    def update_message(self, message_id: int, content: str | None = None, thinking: str | None = None,
                       status: str | None = None, stats: dict | None = None) -> None:
        """Replace the given fields (stats is replaced whole, not merged)."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"bad status {status!r}")
        changes = {"content": content, "thinking": thinking, "status": status,
                   "stats": None if stats is None else json.dumps(stats)}
        changes = {k: v for k, v in changes.items() if v is not None}
        with self._tx() as db:
            conversation_id = self._conversation_of(db, message_id)
            if changes:
                sets = ", ".join(f"{k} = ?" for k in changes)
                db.execute(f"UPDATE messages SET {sets} WHERE id = ?", (*changes.values(), message_id))
            self._touch(db, conversation_id)

    def delete_message(self, message_id: int) -> None:
        with self._tx() as db:
            conversation_id = self._conversation_of(db, message_id)
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
            self._touch(db, conversation_id)

    @staticmethod
    def _conversation_of(db: sqlite3.Connection, message_id: int) -> int:
        row = db.execute("SELECT conversation_id FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return row[0]

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._read("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        return [self._message(r) for r in rows]

    def search(self, text: str) -> list[tuple[Conversation, str]]:
        """Conversations whose title or any message content contains `text`, newest first, each
        with a one-line snippet around the first hit. LIKE is case-insensitive for ASCII only
        (SQLite without ICU); `%`, `_` and `\\` in `text` match literally."""
        if not text:
            return [(c, "") for c in self.conversations()]
        rows = self._read(
            "SELECT * FROM (SELECT c.*, (SELECT m.content FROM messages m WHERE m.conversation_id = c.id"
            "  AND m.content LIKE :p ESCAPE '\\' ORDER BY m.id LIMIT 1) AS hit FROM conversations c)"
            " WHERE hit IS NOT NULL OR title LIKE :p ESCAPE '\\' ORDER BY updated DESC, id DESC",
            {"p": _like_pattern(text)})
        return [(self._conversation(r), _snippet(r["hit"] if r["hit"] is not None else r["title"], text))
                for r in rows]

    # --- export / import ---

    def export_markdown(self, conversation_id: int, image_folder: str = "", audio_folder: str = "") -> str:
        """Markdown; images as `![name](image_folder/file)`, clips as links into `audio_folder`
        (the copies export_to writes)."""
        return render_markdown(self.get(conversation_id), self.messages(conversation_id), image_folder, audio_folder)

    def export_json(self, conversation_id: int, image_folder: str = "", audio_folder: str = "") -> dict:
        """The export document; image and audio files as paths relative to it."""
        return render_json(self.get(conversation_id), self.messages(conversation_id), image_folder, audio_folder)

    def export_to(self, conversation_id: int, directory: Path) -> tuple[Path, Path]:
        """Write <slug>-<id>.md and .json into `directory` (created if missing), and the
        conversation's images and clips into <slug>-<id>-images/ and -audio/ beside them (both
        files refer to them)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stem = f"{_slug(self.get(conversation_id).title)}-{conversation_id}"
        md, js = directory / f"{stem}.md", directory / f"{stem}.json"
        msgs = self.messages(conversation_id)
        folders = {}
        for kind, records, where in (("images", [im for m in msgs for im in m.images], self.image_path),
                                     ("audio", [a for m in msgs for a in m.audio], self.audio_path)):
            files = sorted({r["file"] for r in records})
            folders[kind] = f"{stem}-{kind}" if files else ""
            for file in files:
                (directory / folders[kind]).mkdir(exist_ok=True)
                if where({"file": file}).exists():
                    shutil.copyfile(where({"file": file}), directory / folders[kind] / file)
        md.write_text(self.export_markdown(conversation_id, folders["images"], folders["audio"]), encoding="utf-8")
        js.write_text(json.dumps(self.export_json(conversation_id, folders["images"], folders["audio"]),
                                 ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        return md, js

    def import_file(self, path: Path | str, max_bytes: int = MAX_IMPORT_BYTES,
                    report: Optional[Callable[[str], None]] = None) -> Conversation:
        """`import_json` of a file (its images are looked up beside it); one too big is refused
        before it is read."""
        path = Path(path).expanduser()
        size = path.stat().st_size
        if size > max_bytes:
            raise ValueError(f"import refused: {path.name}: {size} bytes is over the {max_bytes}-byte limit")
        return self.import_json(path.read_bytes(), max_bytes, base_dir=path.parent, report=report)

    def import_json(self, data: bytes | str | dict, max_bytes: int = MAX_IMPORT_BYTES,
                    base_dir: Optional[Path] = None, report: Optional[Callable[[str], None]] = None
                    ) -> Conversation:
        """Add a conversation from `export_json` output. Anything malformed is refused with a
        one-line ValueError and nothing is written (one transaction). Images are copied in from
        `base_dir` (the JSON file's folder), clips too; those missing there (or with other bytes
        than their name's sha256) are left out and `report` gets one line saying so: the text
        still imports."""
        doc = parse_import(data, max_bytes)
        missing = []
        for m in doc["messages"]:
            for key in ("images", "audio"):
                kept = []
                for item in m[key]:
                    record = self._import_file(item, base_dir, key)
                    if record is None:
                        missing.append((key, item["name"]))
                    else:
                        kept.append(record)
                m[key] = kept
        with self._tx() as db:
            now = self._now()
            cur = db.execute("INSERT INTO conversations (title, created, updated, settings) "
                             "VALUES (?, ?, ?, ?)",
                             (doc["title"], doc["created"], now, json.dumps(doc["settings"])))
            db.executemany("INSERT INTO messages (conversation_id, role, content, thinking, status, created, "
                           "stats, images, audio, tool) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           [(cur.lastrowid, m["role"], m["content"], m["thinking"], m["status"],
                             m["created"], json.dumps(m["stats"]), json.dumps(m["images"]), json.dumps(m["audio"]),
                             json.dumps(m["tool"])) for m in doc["messages"]])
        if missing and report is not None:
            names = ", ".join(n for _, n in missing[:3]) + (", …" if len(missing) > 3 else "")
            counts = [(sum(k == key for k, _ in missing), what) for key, what in (("images", "image"),
                                                                                 ("audio", "audio clip"))]
            what = " and ".join(f"{n} {w}{'s' * (n > 1)}" for n, w in counts if n)
            report(f"{what} not found beside the file ({names}); imported the text without them")
        return self.get(cur.lastrowid)

    def _import_file(self, item: dict, base_dir: Optional[Path], key: str) -> Optional[dict]:
        """Copy one referenced image or clip into its folder; None when it is not there (or not intact)."""
        if base_dir is None:
            return None
        base = Path(base_dir).resolve()
        src = (base / item["file"]).resolve()
        cap = MAX_IMAGE_BYTES if key == "images" else MAX_AUDIO_BYTES
        if base not in src.parents or not src.is_file() or src.stat().st_size > cap:
            return None  # a link out of the folder counts as missing too
        data = src.read_bytes()
        stem = src.name.split(".")[0]
        if len(stem) == 64 and set(stem) <= _HEX and hashlib.sha256(data).hexdigest() != stem:
            return None  # our exports name copies by their sha256: other bytes are a damaged copy
        if key == "audio":
            return self.keep_audio(data, item["name"], item["tokens"], src.suffix, item.get("seconds", 0.0))
        return self.keep_image(data, item["name"], item["tokens"], src.suffix)

    # --- maintenance ---

    def integrity_check(self) -> str:
        return "; ".join(r[0] for r in self._read("PRAGMA integrity_check"))

    def close(self) -> None:
        with self._lock:
            self._db.close()
