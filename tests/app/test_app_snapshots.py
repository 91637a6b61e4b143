"""Snapshot tests (pytest-textual-snapshot) of the main screens, on the scripted fake engine.

Update after an intended UI change with `pytest tests/app/test_app_snapshots.py --snapshot-update`
and look at the SVGs in tests/app/__snapshots__/ before committing them.
"""
from __future__ import annotations

import threading

import pytest

from app.app import EdgegemApp
from app.screens.chat import ChatScreen
from app.screens.dialogs import HelpScreen, LoadErrorScreen
from app.screens.settings import SettingsScreen
from app.store import Store
from app.widgets.chat_input import ChatInput
from tests.app_fakes import FakeBackend, FakeClient

SIZE = (120, 34)


def _app(tmp_path, backend=None) -> EdgegemApp:
    ChatInput.cursor_blink = False  # a blinking cursor would make the pictures flaky
    return EdgegemApp(backend or FakeBackend(FakeClient()), Store(tmp_path / "data"), plan_seconds=0.0)


async def _until(pilot, cond, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached in time")


async def _chat_with_one_answer(pilot) -> None:
    await _until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen))
    chat = pilot.app.screen
    chat.query_one("#input").text = "How do I print in Python?"
    await pilot.press("enter")
    await _until(pilot, lambda: chat.gen is None and len(chat.messages) == 2)
    await pilot.pause(0.2)


def test_snapshot_loading_screen(snap_compare, tmp_path):
    hold = threading.Event()
    app = _app(tmp_path, FakeBackend(hold=hold))

    async def run_before(pilot) -> None:
        await pilot.pause(0.3)
        threading.Timer(1.0, hold.set).start()  # let the load finish after the picture

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_chat_screen(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=_chat_with_one_answer)


def test_snapshot_chat_with_an_image_attached(snap_compare, tmp_path):
    """A sent message with its image chip, and a pending chip (preview, name, size, tokens, ✕)."""
    from PIL import Image

    photo = tmp_path / "sunset.png"
    img = Image.new("RGB", (48, 32))
    img.putdata([(250 - 4 * y, 120 + 2 * x, 40 + 5 * y) for y in range(32) for x in range(48)])
    img.save(photo)

    async def run_before(pilot) -> None:
        await _until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen))
        chat = pilot.app.screen
        for text in (f"/image {photo}", "What is in this picture?"):
            chat.query_one("#input").text = text
            await pilot.press("enter")
        await _until(pilot, lambda: chat.gen is None and len(chat.messages) == 2)
        chat.query_one("#input").text = f"/image {photo}"
        await pilot.press("enter")
        await _until(pilot, lambda: len(chat.attachments.pending) == 1)
        await pilot.pause(0.7)  # the status panel's next refresh

    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_snapshot_chat_with_an_audio_clip_attached(snap_compare, tmp_path):
    """A sent message with its clip's chip (♪ name · duration · tokens), a pending clip chip, and
    a recording in progress (its elapsed time and level meter)."""
    import numpy as np
    import soundfile as sf

    from app.recorder import Recorder

    memo = tmp_path / "voice memo.wav"
    t = np.arange(40000) / 16000
    sf.write(str(memo), (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000, subtype="PCM_16")

    class Stream:
        def __init__(self, samplerate, channels, dtype, callback):
            self.samplerate, self.callback = samplerate, callback

        def start(self):
            x = (0.2 * np.sin(2 * np.pi * 300 * np.arange(33600) / 16000)).astype(np.float32)  # 2.1 s
            self.callback(x[:, None], len(x), None, None)

        def stop(self):
            pass

        def close(self):
            pass

    async def run_before(pilot) -> None:
        await _until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen))
        chat = pilot.app.screen
        for text in (f"/audio {memo}", "What did I say?"):
            chat.query_one("#input").text = text
            await pilot.press("enter")
        await _until(pilot, lambda: chat.gen is None and len(chat.messages) == 2)
        chat.query_one("#input").text = f"/audio {memo}"
        await pilot.press("enter")
        await _until(pilot, lambda: len(chat.attachments.pending) == 1)
        chat.recorder_factory = lambda: Recorder(stream_factory=Stream, samplerate=16000)
        await pilot.press("f5")
        await pilot.pause(0.7)  # the meter's and the status panel's next refresh

    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_snapshot_settings_screen(snap_compare, tmp_path):
    app = _app(tmp_path)

    async def run_before(pilot) -> None:
        await _chat_with_one_answer(pilot)
        await pilot.press("ctrl+s")
        await _until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen))
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_help_screen(snap_compare, tmp_path):
    app = _app(tmp_path)

    async def run_before(pilot) -> None:
        await _until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen))
        await pilot.press("f1")
        await _until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen))
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_load_error_screen(snap_compare, tmp_path):
    from engine.memory_plan import BudgetTooSmall  # the memory plan's refusal: a CAPACITY load error

    app = _app(tmp_path, FakeBackend(error=BudgetTooSmall(
        "gpu memory budget too small: the weights alone need 3.1 GiB of the 2.0 GiB budget", 3 << 30, 2 << 30, [])))

    async def run_before(pilot) -> None:
        await _until(pilot, lambda: isinstance(pilot.app.screen, LoadErrorScreen))
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def _screenshot_module():
    """packaging/screenshot.py (by path: `packaging` is also the name of a PyPI library)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "packaging" / "screenshot.py"
    spec = importlib.util.spec_from_file_location("edgegem_screenshot", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cpu_kernels() -> str:
    """The ggml kernel family this CPU runs: a seeded answer on llama.cpp's kernels rounds as the
    CPU's products do (AVX-512 and AVX2-only machines pick other tokens at a near tie, as
    llama.cpp itself does), so the demo's answer has one snapshot per family."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "other"
    return "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "other"


@pytest.mark.parametrize("cpu", [_cpu_kernels()])
def test_snapshot_demo_first_answer(snap_compare, tmp_path, gemma3_270m_path, cpu):
    """The real demo model's first answer to docs/app.md's message at the app's defaults (seeded):
    continued as text, DRY on, ended at a blank line; the README screenshot is this scenario (taken
    on an AVX-512 machine)."""
    shot = _screenshot_module()
    app = shot.demo_app(tmp_path / "data")

    async def run_before(pilot) -> None:
        await shot.first_answer(pilot, blank_speeds=True)
        chat = pilot.app.screen
        (answer,) = [m for m in chat.messages if m.role == "assistant"]
        assert answer.status == "done" and answer.content.strip()
        assert "\n\n" not in answer.content.strip()  # one paragraph, no loop

    assert snap_compare(app, terminal_size=shot.SIZE, run_before=run_before)
