"""SIGTERM / SIGINT to `edgegem run`, `edgegem chat` and the app: they end within 2 seconds with exit
status 143 / 130, without a traceback; the app's finished answers are in the database."""
from __future__ import annotations

import os
import pty
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from tiny_models import TinySpec, write_tiny_gemma4

CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("sig") / "tiny.gguf", TinySpec(), seed=3)


def _wait_for(cond, timeout=120.0, what=""):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _signal_and_time(proc, sig) -> float:
    t0 = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=10)
    return time.monotonic() - t0


class _Reader:
    """Collects a pipe's bytes in a thread (so the child never blocks on a full pipe)."""

    def __init__(self, fd_or_file):
        self.data = b""
        self._src = fd_or_file
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                chunk = os.read(self._src, 4096) if isinstance(self._src, int) else self._src.read1(4096)
            except OSError:
                return
            if not chunk:
                return
            self.data += chunk


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("cmd", ["run", "chat"])
def test_cli_ends_within_two_seconds_on_a_signal(tiny, tmp_path, cmd, sig):
    args = [sys.executable, "-m", "app.cli", cmd, "--model", str(tiny), "--device", "cpu", "--max-tokens", "100000",
            "--temperature", "0", "--kv-session" if cmd == "run" else "--system", str(tmp_path / "k.safetensors")
            if cmd == "run" else "be brief"]
    if cmd == "run":
        args += ["--prompt", "the cat", "--raw"]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = _Reader(proc.stdout), _Reader(proc.stderr)
    if cmd == "chat":
        proc.stdin.write(b"the cat\n")
        proc.stdin.flush()
    # chat: the reply has started (or already ended: then the signal finds it waiting for input)
    _wait_for(lambda: b"model> " in out.data if cmd == "chat" else len(out.data) > 20, what="generated text")
    time.sleep(0.3)
    took = _signal_and_time(proc, sig)
    time.sleep(0.1)
    assert proc.returncode == CODES[sig], err.data.decode()
    assert took < 2.0, took
    assert b"Traceback" not in err.data and b"Traceback" not in out.data


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_app_ends_within_two_seconds_and_keeps_the_finished_answer(tiny, tmp_path, sig):
    data = tmp_path / "data"
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "36"}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "--model", str(tiny), "--device", "cpu",
                             "--data-dir", str(data)], stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True)
    os.close(slave)
    screen = _Reader(master)
    db = data / "conversations.sqlite3"

    def answers():
        if not db.exists():
            return []
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            return c.execute("SELECT role, status FROM messages ORDER BY id").fetchall()

    try:
        _wait_for(lambda: b"Type a message" in screen.data or b"Enter" in screen.data and db.exists(),
                  what="the chat screen")
        time.sleep(1.0)
        os.write(master, b"the cat\r")
        _wait_for(lambda: ("assistant", "done") in answers(), what="a finished answer")
        took = _signal_and_time(proc, sig)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert proc.returncode == CODES[sig], screen.data[-2000:]
    assert took < 2.0, took
    assert answers()[:2] == [("user", "done"), ("assistant", "done")]
    assert b"Traceback" not in screen.data
