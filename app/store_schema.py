"""The conversation store's SQLite schema (app/store.py runs the queries): the tables, and the
migrations that bring a database of any earlier version to this one.

_MIGRATIONS[i] takes the schema from version i to i + 1; the version lives in PRAGMA user_version
(in the database header), changed in the same transaction as the migration, so a crash midway
leaves the old version and the old tables. A database newer than this edgegem is refused, not
touched.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

from app.conversation_format import ROLES, STATUSES

V1_ROLES = ("system", "user", "assistant")  # the roles of schemas 1-3 (a migration builds what was)


def _schema_v1(db: sqlite3.Connection) -> None:
    db.execute("""CREATE TABLE conversations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        settings TEXT NOT NULL DEFAULT '{}')""")
    # AUTOINCREMENT: ids are never reused, so an id the UI still holds after a delete cannot
    # come to name another message.
    db.execute(f"""CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN {V1_ROLES!r}),
        content TEXT NOT NULL,
        thinking TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'done' CHECK (status IN {STATUSES!r}),
        created REAL NOT NULL,
        stats TEXT NOT NULL DEFAULT '{{}}')""")
    db.execute("CREATE INDEX messages_by_conversation ON messages(conversation_id, id)")
    db.execute("CREATE INDEX conversations_by_updated ON conversations(updated)")


def _schema_v2(db: sqlite3.Connection) -> None:
    """Images of a message (JSON list of the copies in <data-dir>/images/); '[]' for the old rows."""
    db.execute("ALTER TABLE messages ADD COLUMN images TEXT NOT NULL DEFAULT '[]'")


def _schema_v3(db: sqlite3.Connection) -> None:
    """Audio clips of a message (JSON list of the copies in <data-dir>/audio/)."""
    db.execute("ALTER TABLE messages ADD COLUMN audio TEXT NOT NULL DEFAULT '[]'")


def _schema_v4(db: sqlite3.Connection) -> None:
    """Tool calls: role 'tool' (a call's result) and the `tool` column: on an assistant message
    {"calls": [{"id", "name", "arguments"}]}, on a tool message {"call_id", "name", "status"}.
    SQLite cannot widen a CHECK, so the table is rebuilt (rows, ids and the index kept)."""
    db.execute(f"""CREATE TABLE messages_v4 (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN {ROLES!r}),
        content TEXT NOT NULL,
        thinking TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'done' CHECK (status IN {STATUSES!r}),
        created REAL NOT NULL,
        stats TEXT NOT NULL DEFAULT '{{}}',
        images TEXT NOT NULL DEFAULT '[]',
        audio TEXT NOT NULL DEFAULT '[]',
        tool TEXT NOT NULL DEFAULT '{{}}')""")
    db.execute("INSERT INTO messages_v4 (id, conversation_id, role, content, thinking, status, created, stats, "
               "images, audio) SELECT id, conversation_id, role, content, thinking, status, created, stats, "
               "images, audio FROM messages")
    db.execute("DROP TABLE messages")
    db.execute("ALTER TABLE messages_v4 RENAME TO messages")
    db.execute("CREATE INDEX messages_by_conversation ON messages(conversation_id, id)")


_MIGRATIONS = [_schema_v1, _schema_v2, _schema_v3, _schema_v4]
SCHEMA_VERSION = len(_MIGRATIONS)


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Bring the database at `path` to SCHEMA_VERSION; `db` is inside a write transaction."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise ValueError(f"{path}: schema version {version} is newer than this "
                         f"edgegem knows ({SCHEMA_VERSION}); upgrade edgegem")
    for step in _MIGRATIONS[version:]:
        step(db)
    if version != SCHEMA_VERSION:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
