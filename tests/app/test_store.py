"""Conversation store: CRUD, search, export/import, refusals, WAL, and surviving SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from contextlib import closing
from pathlib import Path

import pytest

from app.store import Conversation, Message, Store, default_data_dir
from engine.env import reload

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data")
    yield s
    s.close()


def _chat(store: Store, title: str = "Chat") -> Conversation:
    c = store.new_conversation(title, settings={"temperature": 0.7})
    store.add_message(c.id, "system", "You are terse.")
    store.add_message(c.id, "user", "What is 2+2?")
    store.add_message(c.id, "assistant", "4", thinking="Add them.\nTwo plus two.",
                      stats={"prefill_tps": 900.5, "decode_tps": 41.0, "tokens": 1})
    return store.get(c.id)


def _snapshot(store: Store) -> list:
    """Everything in the database, for 'nothing changed' checks."""
    return [(c, store.messages(c.id)) for c in store.conversations()]


def test_default_data_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEGEM_DATA_DIR", str(tmp_path / "x"))
    reload()
    assert default_data_dir() == tmp_path / "x"
    monkeypatch.delenv("EDGEGEM_DATA_DIR")
    reload()
    assert default_data_dir().name == "edgegem"


def test_crud_and_ordering(store):
    a = store.new_conversation()
    b = store.new_conversation("Second", {"top_p": 0.9})
    assert a.title == "New chat" and b.settings == {"top_p": 0.9}
    assert [c.id for c in store.conversations()] == [b.id, a.id]

    m1 = store.add_message(a.id, "user", "hello")
    m2 = store.add_message(a.id, "assistant", "hi", thinking="greet", status="stopped", stats={"tokens": 1})
    assert isinstance(m1, Message) and m1.id < m2.id
    assert [c.id for c in store.conversations()] == [a.id, b.id]  # add_message bumps updated
    assert store.messages(a.id) == [m1, m2]

    store.update_message(m2.id, content="hi there", status="done", stats={"tokens": 2})
    got = store.messages(a.id)[1]
    assert (got.content, got.thinking, got.status, got.stats) == ("hi there", "greet", "done", {"tokens": 2})

    store.rename(b.id, "  Renamed\n title ")
    assert store.get(b.id).title == "Renamed title"
    assert store.conversations()[0].id == b.id  # rename bumps updated

    store.delete_message(m1.id)
    assert [m.id for m in store.messages(a.id)] == [m2.id]

    for bad in (lambda: store.get(999), lambda: store.rename(999, "x"), lambda: store.delete(999),
                lambda: store.add_message(999, "user", "x"), lambda: store.update_message(999, "x"),
                lambda: store.delete_message(999), lambda: store.update_settings(999, {})):
        with pytest.raises(KeyError):
            bad()
    with pytest.raises(ValueError):
        store.add_message(a.id, "tool", "x")
    with pytest.raises(ValueError):
        store.update_message(m2.id, status="finished")


def test_delete_cascades(store):
    a, b = _chat(store, "A"), _chat(store, "B")
    store.delete(a.id)
    assert [c.id for c in store.conversations()] == [b.id]
    assert store.messages(a.id) == []
    with store._lock:
        assert store._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 3


def test_settings_merge_and_reopen(tmp_path):
    with closing(Store(tmp_path)) as s:
        c = s.new_conversation(settings={"temperature": 0.7, "system": "be brief"})
        s.update_settings(c.id, {"temperature": 0.2, "max_tokens": 512})
        s.update_settings(c.id, {"system": None})  # None: back to the default
        m = s.add_message(c.id, "user", "persist me")
    with closing(Store(tmp_path)) as s:
        assert s.get(c.id).settings == {"temperature": 0.2, "max_tokens": 512}
        assert s.messages(c.id) == [m]


def test_title_from():
    assert Store.title_from("\n  Hello   world \nsecond line") == "Hello world"
    long = Store.title_from("word " * 40)
    assert len(long) == 48 and long.endswith("…")
    assert Store.title_from("   \n ") == "New chat"


def test_search(store):
    a = store.new_conversation("Groceries")
    store.add_message(a.id, "user", "buy milk and 100% cocoa")
    b = store.new_conversation("Code")
    store.add_message(b.id, "user", "rename my_var to x and then " + "pad " * 30 + "the end")
    c = store.new_conversation("Cocoa facts")  # title hit only

    assert [(x.id, s) for x, s in store.search("100%")] == [(a.id, "buy milk and 100% cocoa")]
    assert store.search("0%c") == []  # % is literal, not a wildcard
    assert [x.id for x, _ in store.search("my_var")] == [b.id]
    assert store.search("my_vaz") == [] and store.search("myXvar") == []  # _ is literal
    assert [x.id for x, _ in store.search("COCOA")] == [c.id, a.id]  # case-insensitive, newest first
    assert store.search("cocoa facts")[0][1] == "Cocoa facts"
    snippet = store.search("my_var")[0][1]
    assert "my_var" in snippet and snippet.endswith("…") and len(snippet) < 80 and "\n" not in snippet
    assert len(store.search("")) == 3
    assert store.search("back\\slash") == []


def test_export_markdown(store):
    c = _chat(store, "Math")
    store.add_message(c.id, "assistant", "partial", status="stopped")
    md = store.export_markdown(c.id)
    assert md.startswith("# Math\n")
    for heading in ("## System", "## User", "## Assistant"):
        assert heading in md
    assert "<details><summary>Thinking</summary>\n\nAdd them.\nTwo plus two.\n\n</details>" in md
    assert md.index("</details>") < md.index("\n4\n")
    assert "_(stopped)_" in md


def test_export_json_round_trip(store, tmp_path):
    c = _chat(store, "Round / trip: ünïcode")
    doc = store.export_json(c.id)
    assert doc["format"] == "edgegem.conversation" and doc["version"] == 4
    assert [m["role"] for m in doc["messages"]] == ["system", "user", "assistant"]

    md_path, json_path = store.export_to(c.id, tmp_path / "exports")
    assert md_path.name == f"round-trip-n-code-{c.id}.md" and json_path.suffix == ".json"
    assert md_path.read_text(encoding="utf-8") == store.export_markdown(c.id)

    for data in (doc, json.dumps(doc), json_path.read_bytes()):
        imported = store.import_json(data)
        assert imported.id != c.id
        assert (imported.title, imported.created, imported.settings) == (c.title, c.created, c.settings)
        assert store.export_json(imported.id) == doc
        strip = lambda ms: [(m.role, m.content, m.thinking, m.status, m.created, m.stats) for m in ms]
        assert strip(store.messages(imported.id)) == strip(store.messages(c.id))


def _valid() -> dict:
    return {"format": "edgegem.conversation", "version": 1, "title": "t", "created": 1.0, "settings": {},
            "messages": [{"role": "user", "content": "hi"}]}


def _valid_json() -> str:
    return json.dumps(_valid())


def _with(**changes) -> dict:
    return {**_valid(), **changes}


REFUSALS = {
    "too big": (json.dumps(_with(messages=[{"role": "user", "content": "x" * 2000}])), "limit"),
    "not json": (b"{\"format\": ", "not valid JSON"),
    "not utf-8": (b"\x80{}", "not valid JSON"),
    "dict with NaN": (_with(settings={"t": float("nan")}), "not JSON-serialisable"),
    "int key": ({**_valid(), 1: 2}, "unknown key"),
    "NaN": (json.dumps(_with(created=float("nan"))), "not valid JSON"),
    "deep": ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    "not an object": ("[1, 2]", "JSON object"),
    "wrong format": (_with(format="chatgpt"), "format"),
    "wrong version": (_with(version=5), "version"),
    "bool version": (_with(version=True), "version"),
    "bad role": (_with(messages=[{"role": "robot", "content": "x"}]), "role"),
    "bad status": (_with(messages=[{"role": "user", "content": "x", "status": "ok"}]), "status"),
    "too many": (_with(messages=[{"role": "user", "content": ""}] * 10_001), "10000"),
    "int content": (_with(messages=[{"role": "user", "content": 5}]), "content"),
    "missing content": (_with(messages=[{"role": "user"}]), "content"),
    "list thinking": (_with(messages=[{"role": "user", "content": "", "thinking": []}]), "thinking"),
    "surrogate": (_valid_json().replace('"hi"', '"\\ud800"'), "surrogate"),
    "long title": (_with(title="t" * 201), "title"),
    "huge created": (_with(created=10 ** 400), "created"),
    "unknown key": ({**_valid(), "ex\ntra": 1}, "unknown key"),
    "message not object": (_with(messages=["hi"]), "message 0"),
    "messages not list": (_with(messages={"role": "user"}), "list"),
    "settings not object": (_with(settings=[1]), "settings"),
    "later message bad": (_with(messages=[{"role": "user", "content": "ok"}] * 5 + [{"role": "x"}]),
                          "message 5"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_import_refusals(store, name):
    _chat(store)
    before = _snapshot(store)
    data, expected = REFUSALS[name]
    with pytest.raises(ValueError) as err:
        store.import_json(data, max_bytes=1000 if name == "too big" else 8 << 20)
    message = str(err.value)
    assert "\n" not in message and len(message) < 200 and message.startswith("import refused: ")
    assert expected in message, message
    assert _snapshot(store) == before


def test_import_accepts_minimal(store):
    c = store.import_json({"format": "edgegem.conversation", "version": 1,
                           "messages": [{"role": "user", "content": "hi"}]})
    assert c.title == "New chat" and c.settings == {}
    assert [(m.role, m.content, m.status) for m in store.messages(c.id)] == [("user", "hi", "done")]


def test_wal_and_integrity(store):
    with store._lock:
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert store._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    _chat(store)
    assert store.path.with_name(store.path.name + "-wal").exists()
    assert store.integrity_check() == "ok"


def test_newer_schema_refused(tmp_path):
    Store(tmp_path).close()
    db = sqlite3.connect(tmp_path / "conversations.sqlite3")
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(ValueError, match="newer"):
        Store(tmp_path)


def test_threads(store):
    c = store.new_conversation()

    def worker(n):
        for i in range(50):
            store.add_message(c.id, "user", f"{n}-{i}")
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = sorted(f"{n}-{i}" for n in range(4) for i in range(50))
    assert sorted(m.content for m in store.messages(c.id)) == expected


CHILD = """
import sys
from app.store import Store
store = Store(sys.argv[1])
c = store.new_conversation("crash")
print("conv", c.id, flush=True)
i = 0
while True:
    m = store.add_message(c.id, "assistant", f"message {i} " + "x" * (i % 500), thinking="t" * (i % 50))
    store.update_message(m.id, status="stopped", stats={"i": i})
    print(m.id, i, flush=True)
    i += 1
"""


def test_sigkill_loses_nothing_committed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, cwd=REPO, env=env)
    try:
        conv_id = int(child.stdout.readline().split()[1])
        lines = [child.stdout.readline() for _ in range(300)]
        child.send_signal(signal.SIGKILL)  # mid-loop: more adds are in flight
        rest, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    printed = [line.split() for line in lines + rest.splitlines() if line.strip()]
    assert len(printed) >= 300

    with closing(Store(tmp_path)) as s:
        assert s.integrity_check() == "ok"
        stored = {m.id: m for m in s.messages(conv_id)}
        for message_id, i in printed:
            m = stored[int(message_id)]
            assert m.content == f"message {i} " + "x" * (int(i) % 500)
            assert (m.status, m.stats) == ("stopped", {"i": int(i)})
