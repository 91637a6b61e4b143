"""`edgegem serve` as a command: settings that would expose the model are refused in one line before
anything loads; it prints its URL once the model is in; SIGTERM (and Ctrl+C) mid-stream ends the
stream with a reason and the process within 2 s, exit 143 (130), no traceback."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

from app.cli import main  # noqa: E402
from tiny_models import TinySpec, write_tiny_gemma4  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("cli-srv") / "tiny-gemma4.gguf", TinySpec(), seed=4)


@pytest.mark.parametrize("args, words", [
    (["--host", "0.0.0.0"], "--api-key"),
    (["--host", "192.168.7.7"], "reachable from other machines"),
    (["--api-key", "k", "--cors-origin", "*"], "any web page"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file"),
    (["--max-body", "10"], "--max-body"),
])
def test_unsafe_or_bad_settings_refuse_to_start_in_one_line(tiny, capsys, args, words):
    t0 = time.perf_counter()
    assert main(["serve", "--model", str(tiny), *args]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    assert time.perf_counter() - t0 < 5  # before the model loads


def test_the_apps_serve_flag_refuses_the_same_settings_before_the_app_starts(tiny, capsys, tmp_path):
    assert main(["--model", str(tiny), "--data-dir", str(tmp_path), "--serve", "8089", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and err.count("\n") == 1


def test_a_port_in_use_is_one_line(tiny, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(tiny), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1


def _start(tiny, *extra):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model", str(tiny), "--port", "0", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = p.stdout.readline()
    assert " at http://127.0.0.1:" in line, (line, p.stderr.read() if p.poll() is not None else "")
    return p, line.split(" at ")[1].split(" ")[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_serve_prints_its_url_answers_and_a_signal_mid_stream_ends_it_within_2s(tiny, sig, code):
    p, url = _start(tiny, "--api-key", "abc")
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/health")) as r:
            assert json.load(r) == {"status": "ok"}
        req = urllib.request.Request(url + "/v1/completions", headers={"content-type": "application/json",
                                                                       "authorization": "Bearer abc"},
                                     data=json.dumps({"prompt": "the cat", "max_tokens": 3000, "stream": True,
                                                      "temperature": 0}).encode())  # greedy: no early end of turn
        stream = urllib.request.urlopen(req)
        assert stream.readline().startswith(b"data: {")
        t0 = time.perf_counter()
        p.send_signal(sig)
        rest = stream.read().decode()
        assert p.wait(timeout=10) == code
        assert time.perf_counter() - t0 < 2.0
        assert "shutting down" in rest and rest.rstrip().endswith("data: [DONE]")  # the stream said why
        err = p.stderr.read()
        assert "Traceback" not in err and "ERROR" not in err, err
    finally:
        if p.poll() is None:
            p.kill()
