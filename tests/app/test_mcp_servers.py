"""MCP servers through the SDK: the test server (tests/mcp_test_server.py), the real
`mcp-server-time` from PyPI, and hostile ones, all started together in the background; each
failure is one status line and the others go on."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.tools import ServerState, ToolBox
from app.tools.config import ToolsConfig, parse_servers
from app.tools.results import MAX_TEXT_CHARS

SERVER = str(Path(__file__).resolve().parents[1] / "mcp_test_server.py")
PY = sys.executable
START_TIMEOUT = 60.0  # a real server starts in ~1-2 s of CPU, longer on 2 busy cores


def _box(servers: dict, **kw) -> ToolBox:
    return ToolBox.create(ToolsConfig(None, parse_servers({"mcpServers": servers}, "test")),
                          start_timeout=kw.pop("start_timeout", START_TIMEOUT), **kw)


@pytest.fixture(scope="module")
def box():
    b = _box({
        "test": {"command": PY, "args": [SERVER, "--bad-schema"]},
        "other": {"command": PY, "args": [SERVER, "--name", "other"]},
        "time": {"command": PY, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]},
        "missing": {"command": "edgegem-no-such-command"},
        "exits": {"command": PY, "args": ["-c", "import sys; sys.stderr.write('missing API key\\n'); sys.exit(3)"]},
        "off": {"command": "edgegem-no-such-command", "disabled": True},
    }, start_timeout=60.0)  # real servers on 2 busy cores: seconds each; the test is not about their speed
    t0 = time.monotonic()
    b.start()
    assert time.monotonic() - t0 < 1.0, "start() must return at once: the chat opens while servers start"
    assert b.wait_started(90)
    yield b
    b.close()


@pytest.fixture(scope="module")
def hostile():
    b = _box({
        # reads its stdin and never answers
        "hangs": {"command": PY, "args": ["-c", "import sys; sys.stdin.read()"]},
        # answers every message with a line that is not JSON-RPC
        "garbage": {"command": PY, "args": ["-c", "import sys\nfor line in sys.stdin: print('{\"oops', flush=True)"]},
    }, start_timeout=2.0)
    with b:
        assert b.wait_started(30)
        yield b


def _status(box, name):
    return next(s for s in box.statuses() if s.name == name)


def test_every_server_is_one_status_line(box):
    lines = {s.name: s.line() for s in box.statuses()}
    assert lines["test"] == "test: ready (9 tools)" and lines["other"] == "other: ready (9 tools)"
    assert lines["time"] == "time: ready (2 tools)"
    assert lines["missing"] == "missing: failed (cannot run 'edgegem-no-such-command': no such file or command)"
    assert lines["exits"] == "exits: failed (exited before answering (stderr: missing API key))"
    assert lines["off"] == "off: disabled"
    assert all("\n" not in line for line in lines.values())


def test_a_server_that_hangs_or_writes_garbage_fails_at_the_start_timeout(hostile, box):
    lines = {s.name: s.line() for s in hostile.statuses()}
    assert lines["hangs"] == "hangs: failed (did not answer within 2 s)"
    assert lines["garbage"].startswith("garbage: failed (did not answer within 2 s (") and "not JSON-RPC" in lines["garbage"]
    assert [t.name for t in hostile.tools()] == ["date_time"]
    assert _status(box, "test").state is ServerState.READY  # the others go on


def test_a_tool_with_an_invalid_schema_is_refused_at_listing(box):
    (note,) = _status(box, "test").notes
    assert note.startswith("tool 'broken' refused: its input schema is not valid JSON Schema") and "bogus" in note
    assert box.find("test__broken") is None and box.find("broken") is None


def test_colliding_names_are_prefixed_and_unique_ones_are_not(box):
    names = {t.name for t in box.tools()}
    assert {"test__echo", "other__echo", "test__add", "other__add", "get_current_time", "date_time"} <= names
    assert "echo" not in names
    spec = box.find("get_current_time")
    assert (spec.server, spec.tool, spec.key) == ("time", "get_current_time", "time/get_current_time")
    assert box.find("time__get_current_time") == spec  # the prefixed form is always accepted
    assert box.call("echo", {"text": "x"}).text == "error: unknown tool 'echo' (did you mean test__echo or other__echo?)"


def test_listing_shows_description_schema_and_enabled(box):
    t = box.find("test__add")
    assert t.description == "Add two integers." and t.enabled and not t.always_ask
    assert t.input_schema["properties"].keys() == {"a", "b"} and t.input_schema["required"] == ["a", "b"]
    decl = t.declaration()
    assert decl == {"type": "function", "function": {"name": "test__add", "description": "Add two integers.",
                                                     "parameters": t.input_schema}}


def test_calls_return_text(box):
    assert box.call("test__echo", {"text": "héllo"}).text == "héllo"
    r = box.call("test__add", {"a": 2, "b": 3})
    assert (r.text, r.is_error) == ("5", False)
    assert box.call("other__add", '{"a": 1, "b": 1}').text == "2"  # arguments as the model wrote them


def test_the_real_time_server_from_pypi(box):
    r = box.call("get_current_time", {"timezone": "Europe/Paris"})
    assert not r.is_error and r.structured["timezone"] == "Europe/Paris" and r.structured["datetime"][:4] >= "2025"
    bad = box.call("get_current_time", {"timezone": "Nowhere/Nothing"})
    assert bad.is_error and "Nowhere/Nothing" in bad.text


def test_arguments_that_fail_the_schema_run_nothing(box):
    t0 = time.monotonic()
    r = box.call("test__slow", {"seconds": "ten"})
    assert r.is_error and r.text.startswith("error: the arguments do not match test__slow's schema: at seconds:")
    assert r.text.endswith("nothing was run")
    assert time.monotonic() - t0 < 0.5
    assert "'b' is a required property" in box.call("test__add", {"a": 1}).text
    assert "not JSON" in box.call("test__add", "{a: 1").text


def test_a_slow_tool_times_out_and_the_server_goes_on(box):
    t0 = time.monotonic()
    r = box.call("test__slow", {"seconds": 30}, timeout=0.5)
    assert r.is_error and r.text == "error: slow did not answer within 0.5 s"
    assert time.monotonic() - t0 < 3
    assert box.call("test__echo", {"text": "still here"}).text == "still here"


def test_a_tool_that_raises_is_an_error_result(box):
    r = box.call("test__fail", {})
    assert r.is_error and "fail" in r.text
    assert _status(box, "test").state is ServerState.READY


def test_a_megabyte_of_text_is_truncated_with_a_note(box):
    r = box.call("test__big", {})
    assert r.truncated and not r.is_error
    assert r.text.startswith("x" * MAX_TEXT_CHARS + "\n[truncated: the result was 1,048,576 characters")
    assert len(r.text) < MAX_TEXT_CHARS + 200


def test_an_image_comes_back_as_bytes_and_a_line(box):
    r = box.call("test__image", {})
    (data, mime), = r.images
    assert mime == "image/png" and data.startswith(b"\x89PNG")
    assert r.text == f"[image 1: image/png, {len(data)} bytes]"


def test_tools_of_failed_servers_are_not_offered_and_say_why(box):
    assert not [t for t in box.tools() if t.server in ("missing", "exits", "off")]
    assert box.call("exits__x", {}).text == "error: exits__x: exits: failed (exited before answering " \
                                           "(stderr: missing API key))"


def test_a_switched_off_tool_is_not_declared_and_not_run(box):
    box.set_enabled("test__add", False)
    try:
        assert "test__add" not in {d["function"]["name"] for d in box.declarations()}
        assert box.find("test__add").enabled is False
        assert box.call("test__add", {"a": 1, "b": 2}).text == "error: the tool 'test__add' is switched off"
    finally:
        box.set_enabled("test/add", True)
    assert box.call("test__add", {"a": 1, "b": 2}).text == "3"


def test_a_server_that_dies_mid_call_fails_alone():
    with _box({"crashy": {"command": PY, "args": [SERVER, "--name", "crashy"]}}) as b:
        assert b.wait_started(90)
        r = b.call("crash", {})
        assert r.is_error and r.text == "error: server 'crashy' exited during the call"
        st = b.statuses()[1]
        assert st.state is ServerState.FAILED and st.error.startswith("exited during a call to crash")
        assert b.call("echo", {"text": "x"}).text == "error: echo: crashy: failed (exited during a call to crash)"
        assert b.call("crashy__echo", {"text": "x"}).text.startswith("error: crashy__echo: crashy: failed")
        assert not b.call("date_time", {}).is_error  # the built-ins go on


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server_with_headers():
    port = _free_port()
    proc = subprocess.Popen([PY, SERVER, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the HTTP test server did not start"
                time.sleep(0.1)
        with _box({"web": {"url": f"http://127.0.0.1:{port}/mcp", "headers": {"X-Edgegem-Test": "yes"}}}) as b:
            assert b.wait_started(90)
            assert b.statuses()[1].line() == "web: ready (9 tools)"
            assert b.call("add", {"a": 20, "b": 22}).text == "42"
            assert b.call("header", {"name": "X-Edgegem-Test"}).text == "yes"
    finally:
        proc.terminate()
        proc.wait(10)


def test_an_http_server_that_is_not_there_fails_in_one_line():
    with _box({"nowhere": {"url": f"http://127.0.0.1:{_free_port()}/mcp"}}) as b:
        assert b.wait_started(30)
        st = b.statuses()[1]
        assert st.state is ServerState.FAILED and st.error and "\n" not in st.error


def test_close_stops_the_servers_and_later_calls_say_so(tmp_path):
    pidfile = tmp_path / "pid"
    b = _box({"test": {"command": PY, "args": [SERVER], "env": {"MCP_TEST_PIDFILE": str(pidfile)}}})
    b.start()
    assert b.wait_started(90)
    pid = int(pidfile.read_text())
    os.kill(pid, 0)  # running
    t0 = time.monotonic()
    b.close()
    assert time.monotonic() - t0 < 3
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped
    assert b.statuses()[1].state is ServerState.STOPPED
    assert b.call("echo", {"text": "x"}).text == "error: echo: test: stopped"


def test_schema_checks_in_one_line():
    from app.tools.schema import argument_problem, schema_problem
    assert schema_problem({"type": "object", "properties": {"a": {"type": "integer"}}}) is None
    assert schema_problem({}) is None  # no constraints: any object
    assert schema_problem({"type": "array"}) == "describes 'array' arguments, not an object of named ones"
    assert schema_problem("x") == "is not a JSON object"
    assert schema_problem({"type": "object", "required": "a"}).startswith("is not valid JSON Schema: 'a' is not")
    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}
    assert schema_problem(remote) is None and argument_problem(remote, {"a": 1}) is None  # no fetch, no crash
    assert argument_problem({"type": "object"}, []) == "the arguments must be a JSON object, not list"


def test_nothing_reaches_the_terminal(capfd):
    """The app draws the whole screen: a server's stderr and the SDK's warnings about a server that
    writes garbage go to a file and to `McpServers.log`, never to our stderr."""
    noisy = "import sys\nsys.stderr.write('noise\\n'); sys.stderr.flush()\nfor line in sys.stdin: print('{bad', flush=True)"
    with _box({"noisy": {"command": PY, "args": ["-c", noisy]}}, start_timeout=2.0) as b:
        assert b.wait_started(30)
        assert b.statuses()[1].error.startswith("did not answer within 2 s (stderr: noise)")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
