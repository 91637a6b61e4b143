"""Tool calls in the conversation store (schema 4, export format 4): an old database opens and
takes them, they round-trip through the JSON export, the Markdown shows them, malformed ones are
refused in one line, and a reopened conversation gives them back to the engine as tool messages."""
from __future__ import annotations

import sqlite3

import pytest

from app.conversation_format import prompt_message
from app.store import Store
from app.store_schema import SCHEMA_VERSION, _schema_v1, _schema_v2, _schema_v3
from models.tool_format import prepare_tool_messages

CALLS = {"calls": [{"id": "call_1", "name": "clock", "arguments": {"zone": "utc"}},
                   {"id": "call_2", "name": "read_file", "arguments": {"path": "notes.txt"}}]}


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data")
    yield s
    s.close()


def _chat(s: Store) -> int:
    c = s.new_conversation("tools")
    s.add_message(c.id, "user", "What time is it, and what is in my notes?")
    s.add_message(c.id, "assistant", "", thinking="two tools", tool=CALLS)
    s.add_message(c.id, "tool", '{"time": "12:34"}', tool={"call_id": "call_1", "name": "clock"})
    s.add_message(c.id, "tool", "the user declined this call; it did not run",
                  tool={"call_id": "call_2", "name": "read_file", "status": "denied"})
    s.add_message(c.id, "assistant", "It is 12:34. I may not read your notes.")
    return c.id


def test_a_schema_3_database_opens_keeps_its_rows_and_takes_tool_messages(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    db = sqlite3.connect(folder / "conversations.sqlite3")
    for step in (_schema_v1, _schema_v2, _schema_v3):
        step(db)
    db.execute("PRAGMA user_version = 3")
    db.execute("INSERT INTO conversations (title, created, updated, settings) VALUES ('old', 1.0, 2.0, '{}')")
    db.execute("INSERT INTO messages (id, conversation_id, role, content, created, audio) "
               "VALUES (7, 1, 'user', 'hi', 1.5, '[]')")
    db.commit()
    db.close()
    s = Store(folder)
    try:
        (old,) = s.messages(1)
        assert (old.id, old.content, old.tool) == (7, "hi", {})
        added = s.add_message(1, "tool", "42", tool={"call_id": "c", "name": "answer"})
        assert added.id == 8 and s.messages(1)[-1].tool == {"call_id": "c", "name": "answer", "status": "ok"}
        s.delete(1)  # the rebuilt table still cascades from its conversation
        assert s._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
        assert s.integrity_check() == "ok"
    finally:
        s.close()
    db = sqlite3.connect(folder / "conversations.sqlite3")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    db.close()


def test_tool_messages_round_trip_through_the_json_export(store):
    cid = _chat(store)
    doc = store.export_json(cid)
    assert doc["version"] == 4 and doc["messages"][1]["tool"] == CALLS and "tool" not in doc["messages"][0]
    back = store.import_json(doc)
    a, b = store.messages(cid), store.messages(back.id)
    assert [(m.role, m.content, m.thinking, m.tool) for m in a] == [(m.role, m.content, m.thinking, m.tool) for m in b]


def test_markdown_shows_each_call_and_result_fenced(store):
    cid = _chat(store)
    store.add_message(cid, "tool", "```\nnot the end\n```", tool={"call_id": "x", "name": "cat"})
    md = store.export_markdown(cid)
    assert "<summary>Tool call: clock</summary>" in md and '"zone": "utc"' in md
    assert "<summary>Result of read_file (denied)</summary>" in md
    assert "````\n```\nnot the end\n```\n````" in md


@pytest.mark.parametrize("message, why", [
    ({"role": "tool", "content": "x"}, "needs tool.call_id"),
    ({"role": "tool", "content": "x", "tool": {"call_id": "a", "name": "b", "status": "maybe"}}, "status"),
    ({"role": "assistant", "content": "", "tool": {"calls": []}}, "calls"),
    ({"role": "assistant", "content": "", "tool": {"calls": [{"name": "f", "arguments": "[]"}]}}, "arguments"),
    ({"role": "user", "content": "x", "tool": {"calls": [{"name": "f"}]}}, "no tool record"),
])
def test_malformed_tool_records_are_refused_in_one_line(store, message, why):
    doc = {"format": "edgegem.conversation", "version": 4, "messages": [message]}
    with pytest.raises(ValueError) as e:
        store.import_json(doc)
    assert why in str(e.value) and "\n" not in str(e.value) and store.conversations() == []
    with pytest.raises(ValueError):
        store.add_message(store.new_conversation().id, message["role"], "x", tool=message.get("tool"))


def test_a_reopened_conversation_gives_the_engine_its_calls_and_results(store):
    cid = _chat(store)
    msgs = [prompt_message(m) for m in store.messages(cid)]
    assert msgs[1]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                        "function": {"name": "clock", "arguments": {"zone": "utc"}}}
    assert msgs[2] == {"role": "tool", "content": '{"time": "12:34"}', "tool_call_id": "call_1", "name": "clock"}
    prepared = prepare_tool_messages(msgs)  # what the template renders: results folded into the call's turn
    assert [r["name"] for r in prepared[1]["tool_responses"]] == ["clock", "read_file"]
    assert prepared[1]["tool_responses"][0]["response"] == {"time": "12:34"}
