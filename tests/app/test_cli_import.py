"""`edgegem import FILE`: an exported conversation comes back; hostile files are refused in one line
and leave the database as it was."""
from __future__ import annotations

import json

import pytest

from app.cli import main
from app.store import Store


@pytest.fixture
def exported(tmp_path):
    store = Store(tmp_path / "src")
    c = store.new_conversation("Trip to Lyon", settings={"temperature": 0.3})
    store.add_message(c.id, "user", "Where should I eat?")
    store.add_message(c.id, "assistant", "Try a *bouchon*.", thinking="Lyon food", status="stopped")
    path = tmp_path / "trip.json"
    path.write_text(json.dumps(store.export_json(c.id)))
    store.close()
    return path


def test_import_round_trips_an_export(tmp_path, exported, capsys):
    assert main(["import", str(exported), "--data-dir", str(tmp_path / "dst")]) == 0
    assert "Trip to Lyon" in capsys.readouterr().out
    store = Store(tmp_path / "dst")
    try:
        (conv,) = store.conversations()
        msgs = store.messages(conv.id)
        assert conv.settings == {"temperature": 0.3}
        assert [(m.role, m.content, m.thinking, m.status) for m in msgs] == [
            ("user", "Where should I eat?", "", "done"), ("assistant", "Try a *bouchon*.", "Lyon food", "stopped")]
    finally:
        store.close()


@pytest.mark.parametrize("payload", [
    b"\x00\x01 not json",
    json.dumps({"format": "something.else", "version": 1, "messages": []}).encode(),
    json.dumps({"format": "edgegem.conversation", "version": 1,
                "messages": [{"role": "root", "content": "x"}]}).encode(),
    json.dumps({"format": "edgegem.conversation", "version": 1,
                "messages": [{"role": "user", "content": {"__class__": 1}}]}).encode(),
    b"[" * 100_000 + b"]" * 100_000,
    b" " * (9 << 20),
], ids=["binary", "wrong-format", "bad-role", "non-string-content", "deep-nesting", "oversized"])
def test_hostile_imports_are_refused_in_one_line(tmp_path, payload, capsys):
    path = tmp_path / "evil.json"
    path.write_bytes(payload)
    assert main(["import", str(path), "--data-dir", str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgegem: error:") and "refused" in err and "\n" not in err
    store = Store(tmp_path / "dst")
    try:
        assert store.conversations() == []
    finally:
        store.close()
