"""The built-in tools: date and time, the file tools' sandbox (--allow-dir), the shell tool."""
from __future__ import annotations

import os
import sys
from datetime import datetime

import pytest

from app.tools import ToolBox
from app.tools.builtin import MAX_ENTRIES, MAX_READ_BYTES, BuiltinTools, date_time
from app.tools.results import MAX_TEXT_CHARS


@pytest.fixture
def allowed(tmp_path):
    root = tmp_path / "allowed"
    (root / "sub").mkdir(parents=True)
    (root / "notes.txt").write_text("hello\nworld\n", encoding="utf-8")
    (root / "sub" / "deep.md").write_text("# deep", encoding="utf-8")
    (tmp_path / "secret.txt").write_text("do not read", encoding="utf-8")
    return root


def _box(*dirs, shell=False) -> ToolBox:
    return ToolBox([BuiltinTools(dirs, shell=shell)])


def test_only_the_date_without_allowed_folders_and_no_shell_by_default():
    assert [t.name for t in _box().tools()] == ["date_time"]
    assert _box().call("read_file", {"path": "/etc/hostname"}).text == "error: unknown tool 'read_file'"


def test_date_time_has_the_zone_and_the_day():
    text = date_time("Asia/Tokyo")
    stamp = datetime.fromisoformat(text.split(" ")[0])
    assert stamp.utcoffset().total_seconds() == 9 * 3600 and text.endswith("time zone Asia/Tokyo")
    assert abs(stamp.timestamp() - datetime.now().timestamp()) < 60
    assert "(" + stamp.strftime("%A") + ")" in text
    local = _box().call("date_time", {})
    assert not local.is_error and "time zone" in local.text
    assert _box().call("date_time", {"timezone": "Mars/Olympus"}).text.startswith("error: unknown time zone")


def test_read_file_and_list_dir_inside_the_allowed_folder(allowed):
    box = _box(allowed)
    assert box.call("read_file", {"path": str(allowed / "notes.txt")}).text == "hello\nworld\n"
    assert box.call("read_file", {"path": "sub/deep.md"}).text == "# deep"  # relative to the first folder
    listing = box.call("list_dir", {}).text
    assert listing == f"{allowed.resolve()}:\nsub/\nnotes.txt  12 bytes"
    assert box.call("list_dir", {"path": "sub"}).text.endswith("deep.md  6 bytes")


@pytest.mark.parametrize("path", ["../secret.txt", "{tmp}/secret.txt", "/etc/passwd", "sub/../../secret.txt"])
def test_paths_outside_the_allowed_folders_are_refused_in_one_line(allowed, tmp_path, path):
    r = _box(allowed).call("read_file", {"path": path.format(tmp=tmp_path)})
    assert r.is_error and "outside the allowed folders" in r.text and "\n" not in r.text
    assert "do not read" not in r.text


def test_a_symlink_out_of_the_folder_is_refused(allowed, tmp_path):
    (allowed / "escape.txt").symlink_to(tmp_path / "secret.txt")
    (allowed / "escape_dir").symlink_to(tmp_path)
    box = _box(allowed)
    assert "outside the allowed folders" in box.call("read_file", {"path": "escape.txt"}).text
    assert "outside the allowed folders" in box.call("list_dir", {"path": "escape_dir"}).text
    assert "outside the allowed folders" in box.call("read_file", {"path": "escape_dir/secret.txt"}).text
    (allowed / "inside.txt").symlink_to(allowed / "notes.txt")  # a link that stays inside is fine
    assert box.call("read_file", {"path": "inside.txt"}).text == "hello\nworld\n"


def test_missing_files_folders_and_loops_are_one_line(allowed):
    box = _box(allowed)
    assert box.call("read_file", {"path": "nope.txt"}).text == "error: nope.txt: no such file or folder"
    assert box.call("read_file", {"path": "sub"}).text == "error: sub: a folder (list_dir lists it)"
    assert box.call("list_dir", {"path": "notes.txt"}).text == "error: notes.txt: not a folder"
    (allowed / "loop").symlink_to(allowed / "loop")
    assert box.call("read_file", {"path": "loop"}).is_error
    assert box.call("read_file", {}).text.startswith("error: the arguments do not match read_file's schema")


def test_binary_files_are_described_not_dumped(allowed):
    (allowed / "pic.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0" + bytes(range(256)) * 4)
    (allowed / "latin1.txt").write_bytes("café".encode("latin-1"))
    box = _box(allowed)
    assert box.call("read_file", {"path": "pic.png"}).text == "[pic.png: a binary file (image/png), 1,035 bytes, not shown]"
    assert "a binary file" in box.call("read_file", {"path": "latin1.txt"}).text


def test_big_files_and_folders_are_capped_with_a_note(allowed):
    (allowed / "big.txt").write_text("é" * (MAX_READ_BYTES * 2), encoding="utf-8")  # 2 bytes a char
    r = _box(allowed).call("read_file", {"path": "big.txt"})
    assert r.truncated and r.text.startswith("é" * MAX_TEXT_CHARS) and "[truncated: the result was" in r.text
    many = allowed / "many"
    many.mkdir()
    for i in range(MAX_ENTRIES + 3):
        (many / f"f{i:04}").touch()
    listing = _box(allowed).call("list_dir", {"path": "many"}).text
    assert listing.endswith("[3 more entries not shown]") and len(listing.splitlines()) == MAX_ENTRIES + 2


def test_an_allowed_folder_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        BuiltinTools([tmp_path / "nope"])


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX shell")
def test_the_shell_tool_is_opt_in_always_asks_and_is_capped(allowed):
    box = _box(allowed, shell=True)
    spec = box.find("shell")
    assert spec.always_ask and not spec.read_only
    r = box.call("shell", {"command": "pwd; echo oops >&2; exit 3"})
    assert r.is_error and r.text == f"exit status 3\n{allowed.resolve()}\noops\n"
    r = box.call("shell", {"command": "sleep 30 | cat"}, timeout=0.3)
    assert r.text == "error: the command did not finish within 0.3 s; it was killed"
    assert box.call("shell", {"command": f"head -c {MAX_TEXT_CHARS * 2} /dev/zero | tr '\\0' y"}).truncated
    assert os.getcwd() != str(allowed)


def test_the_engine_loops_call_shape(allowed):
    box = _box(allowed)
    call = {"id": "call_0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'}}
    assert box.spec_for_call(call).key == "builtin/read_file"
    assert box.call_for_loop(call) == ("hello\nworld\n", False)
    text, failed = box.call_for_loop({"function": {"name": "nope", "arguments": {}}})
    assert failed and text == "error: unknown tool 'nope'"
    assert box.spec_for_call({"function": {"name": "nope"}}) is None


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_fifo_is_refused_not_read(allowed):
    os.mkfifo(allowed / "pipe")
    assert _box(allowed).call("read_file", {"path": "pipe"}).text == "error: pipe: not a regular file"
