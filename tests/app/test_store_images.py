"""The store's images (issue 15): schema v2 over an old database, content-addressed copies,
exports with an images folder, imports that bring them back (or say in one line they could not)."""
from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from app.store import Store
from app.store_schema import SCHEMA_VERSION, _schema_v1

PICTURE = b"\x89PNG\r\n\x1a\n not really decoded by the store"


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data")
    yield s
    s.close()


def _old_database(folder: Path) -> None:
    """A conversations.sqlite3 as edgegem wrote it before images (schema 1), with one chat."""
    folder.mkdir(parents=True)
    db = sqlite3.connect(folder / "conversations.sqlite3")
    _schema_v1(db)
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO conversations (title, created, updated, settings) VALUES ('old', 1.0, 2.0, '{}')")
    db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'hi', 1.5)")
    db.commit()
    db.close()


def test_an_old_database_opens_keeps_its_messages_and_takes_images(tmp_path):
    _old_database(tmp_path / "data")
    s = Store(tmp_path / "data")
    try:
        (conv,) = s.conversations()
        (old,) = s.messages(conv.id)
        assert (conv.title, old.content, old.images) == ("old", "hi", [])
        record = s.keep_image(PICTURE, "cat.png", 64, ".png")
        m = s.add_message(conv.id, "user", "and this?", images=[record])
        assert s.messages(conv.id)[-1] == m and m.images == [record]
        assert s.integrity_check() == "ok"
    finally:
        s.close()
    db = sqlite3.connect(tmp_path / "data" / "conversations.sqlite3")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    db.close()
    Store(tmp_path / "data").close()  # a second open migrates nothing


def test_copies_are_content_addressed(store, tmp_path):
    a = store.keep_image(PICTURE, "a.png", 10, ".PNG")
    b = store.keep_image(PICTURE, "same bytes, other name.png", 10, "png")
    sha = hashlib.sha256(PICTURE).hexdigest()
    assert a == {"file": f"{sha}.png", "name": "a.png", "bytes": len(PICTURE), "tokens": 10}
    assert b["file"] == a["file"] and store.image_path(a).read_bytes() == PICTURE
    assert [p.name for p in store.images_dir.iterdir()] == [f"{sha}.png"]  # no temporary left
    assert store.keep_image(PICTURE, "x", 1, "../../e vil")["file"] == f"{sha}.evil"  # a suffix, nothing more


def test_deleting_a_conversation_removes_only_the_images_no_one_else_uses(store):
    shared, own = b"shared picture", b"only in the first"
    c1, c2 = store.new_conversation(), store.new_conversation()
    store.add_message(c1.id, "user", "1", images=[store.keep_image(shared, "s.png", 1, ".png"),
                                                  store.keep_image(own, "o.png", 1, ".png")])
    store.add_message(c2.id, "user", "2", images=[store.keep_image(shared, "s.png", 1, ".png")])
    store.delete(c1.id)
    left = {p.name for p in store.images_dir.iterdir()}
    assert left == {hashlib.sha256(shared).hexdigest() + ".png"}


def _chat_with_image(store: Store) -> int:
    c = store.new_conversation("Look [here]")
    store.add_message(c.id, "user", "what is it?", images=[store.keep_image(PICTURE, "cat [1].png", 64, ".png")])
    store.add_message(c.id, "assistant", "a cat")
    return c.id


def test_export_writes_the_images_beside_and_refers_to_them(store, tmp_path):
    cid = _chat_with_image(store)
    md, js = store.export_to(cid, tmp_path / "out")
    folder = tmp_path / "out" / f"{md.stem}-images"
    sha = hashlib.sha256(PICTURE).hexdigest()
    assert (folder / f"{sha}.png").read_bytes() == PICTURE
    text = md.read_text()
    assert f"![cat (1).png]({folder.name}/{sha}.png)" in text  # brackets would end the alt text
    assert text.index("![cat") < text.index("what is it?")
    doc = json.loads(js.read_text())
    assert doc["version"] == 4
    assert doc["messages"][0]["images"] == [{"file": f"{folder.name}/{sha}.png", "name": "cat [1].png",
                                             "bytes": len(PICTURE), "tokens": 64}]
    assert "images" not in doc["messages"][1]
    no_images = store.new_conversation("plain")
    store.add_message(no_images.id, "user", "hi")
    md2, _ = store.export_to(no_images.id, tmp_path / "out")
    assert not (tmp_path / "out" / f"{md2.stem}-images").exists()


def test_import_brings_the_images_back_into_another_data_folder(store, tmp_path):
    _, js = store.export_to(_chat_with_image(store), tmp_path / "out")
    other = Store(tmp_path / "elsewhere")
    try:
        said = []
        conv = other.import_file(js, report=said.append)
        user, answer = other.messages(conv.id)
        assert not said and answer.images == []
        assert user.images[0]["name"] == "cat [1].png" and other.image_path(user.images[0]).read_bytes() == PICTURE
    finally:
        other.close()


def test_import_without_the_images_keeps_the_text_and_says_so_in_one_line(store, tmp_path):
    md, js = store.export_to(_chat_with_image(store), tmp_path / "out")
    for p in (tmp_path / "out" / f"{md.stem}-images").iterdir():
        p.write_bytes(b"damaged")  # other bytes than the name's sha256: not taken
    other = Store(tmp_path / "elsewhere")
    try:
        said = []
        conv = other.import_file(js, report=said.append)
        assert said == ["1 image not found beside the file (cat [1].png); imported the text without them"]
        assert [(m.content, m.images) for m in other.messages(conv.id)] == [("what is it?", []), ("a cat", [])]
        assert not other.images_dir.exists()
        said.clear()
        other.import_json(js.read_bytes(), report=said.append)  # no folder to look in at all
        assert len(said) == 1
    finally:
        other.close()


@pytest.mark.parametrize("file", ["/etc/passwd", "../secret.png", "a/../../b.png", "C:\\x.png", ""])
def test_import_refuses_image_paths_outside_the_export(store, file):
    doc = {"format": "edgegem.conversation", "version": 2,
           "messages": [{"role": "user", "content": "x", "images": [{"file": file, "name": "n"}]}]}
    with pytest.raises(ValueError, match="import refused: message 0: image 0: file"):
        store.import_json(doc)
    assert store.conversations() == []


def test_an_image_link_out_of_the_folder_is_not_followed(store, tmp_path):
    (tmp_path / "secret.txt").write_text("private")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "pic.png").symlink_to(tmp_path / "secret.txt")
    doc = {"format": "edgegem.conversation", "version": 2,
           "messages": [{"role": "user", "content": "x", "images": [{"file": "pic.png", "name": "pic.png"}]}]}
    (tmp_path / "out" / "c.json").write_text(json.dumps(doc))
    said = []
    conv = store.import_file(tmp_path / "out" / "c.json", report=said.append)
    assert store.messages(conv.id)[0].images == [] and len(said) == 1
