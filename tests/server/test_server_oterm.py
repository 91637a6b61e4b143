"""A real third-party client end to end: oterm (PyPI, a Textual client for Ollama) in tmux, pointed
at `edgegem serve` on the demo model by OLLAMA_HOST, lists the model (/api/tags, /api/show), and
answers a typed message (its chat goes through /v1/chat/completions, streamed).

oterm lives in a venv of its own under `.cache/oterm-venv` (tests/oterm_venv.py: installed with
pip from the package index on first use, like the llama.cpp sdist in conftest.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

pytest.importorskip("uvicorn")

from engine import api  # noqa: E402
from oterm_venv import oterm_exe  # noqa: E402
from server_helpers import LiveServer  # noqa: E402

MODEL = "gemma-3-270m-q4_k_m"


def _screen(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def _wait(session: str, cond, timeout: float) -> str:
    end = time.time() + timeout
    while time.time() < end:
        text = _screen(session)
        if cond(text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"oterm's screen never showed it:\n{_screen(session)}")


@pytest.mark.slow
def test_oterm_lists_the_model_and_answers_a_typed_message(gemma3_270m_path, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    exe = oterm_exe()
    server = LiveServer(api.open_model(gemma3_270m_path, exact=False), default_max_tokens=12)
    answers: list[str] = []
    real_poll = server.client.poll

    def poll(rid):  # what the engine streamed to oterm
        evs = real_poll(rid)
        for ev in evs:
            answers.append(ev.text)
        return evs
    server.client.poll = poll
    data = tmp_path / "oterm"
    data.mkdir()
    (data / "config.json").write_text('{"theme": "textual-dark", "splash-screen": false}')
    session = f"edgegem-oterm-{os.getpid()}"
    host = server.url.removeprefix("http://")
    # COLUMNS/LINES (pytest sets them) would override the pane's size in Textual
    env = f"env -u COLUMNS -u LINES OLLAMA_HOST={host} OTERM_DATA_DIR={data} HOME={tmp_path} TERM=xterm-256color"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "140", "-y", "45", f"{env} {exe}"], check=True)
    subprocess.run(["tmux", "resize-window", "-t", session, "-x", "140", "-y", "45"], capture_output=True)
    try:
        _wait(session, lambda s: "Ctrl+N to start a new chat" in s, 120)
        subprocess.run(["tmux", "send-keys", "-t", session, "C-n"], check=True)
        _wait(session, lambda s: MODEL in s and "Save" in s, 60)  # the list came from /api/tags
        time.sleep(2)  # the dialog settles (focus, the provider's model list)
        keys = [["Tab"], ["-l", MODEL], ["Tab"]]  # the model name, committed when its input loses focus
        for k in keys:
            subprocess.run(["tmux", "send-keys", "-t", session, *k], check=True)
            time.sleep(0.5)
        _wait(session, lambda s: f"Model: {MODEL}" in s and "0.8" in s, 60)  # /api/show read: size, parameters
        for _ in range(6):  # through the model list, system prompt and parameters to Save
            subprocess.run(["tmux", "send-keys", "-t", session, "Tab"], check=True)
            time.sleep(0.3)
        subprocess.run(["tmux", "send-keys", "-t", session, "Enter"], check=True)
        _wait(session, lambda s: f"chat #1 - {MODEL}" in s, 60)
        subprocess.run(["tmux", "send-keys", "-t", session, "-l", "Tell me about the sea."], check=True)
        subprocess.run(["tmux", "send-keys", "-t", session, "Enter"], check=True)
        end = time.time() + 180
        while time.time() < end and not ("".join(answers).strip() and server.state.in_flight == 0
                                         and server.state.served >= 1):
            time.sleep(0.5)
        answer = "".join(answers).strip()
        assert answer, "oterm's request never reached the engine"
        first_word = answer.split()[0]
        screen = _wait(session, lambda s: "Tell me about the sea." in s and first_word in
                       s.split("Tell me about the sea.", 1)[-1], 60)
        assert "Error" not in screen and "error" not in screen.split("Tell me about the sea.", 1)[-1], screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        server.close()
