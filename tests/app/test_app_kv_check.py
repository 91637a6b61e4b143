"""The app's "Measure KV formats (kv-check)" palette action: a modal measures in a worker with
progress, Escape cancels, and the settings screen then shows the figures next to the KV format;
the real backend measures the loaded model and caches per model file."""
from __future__ import annotations

import threading

import pytest

from app.app import EdgegemApp
from app.backend import EngineBackend
from app.screens.chat import ChatScreen
from app.screens.kv_check import KVCheckScreen, figure_lines
from app.screens.settings import SettingsScreen
from app.store import Store
from engine.api import EngineOptions
from tests.app_fakes import KV_RESULT, FakeBackend
from tests.tiny_models import TinySpec, write_tiny_gemma4

SIZE = (120, 36)
TITLE = "Measure KV formats (kv-check)"


async def until(pilot, cond, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached in time")


async def open_chat(pilot) -> ChatScreen:
    await until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen) and pilot.app.screen.is_mounted)
    return pilot.app.screen


def palette(app, chat, title: str):
    return next(c for c in app.get_system_commands(chat) if c.title == title)


def text_of(screen, selector: str) -> str:
    return str(screen.query_one(selector).render())


async def test_palette_action_measures_and_the_settings_show_the_figures(tmp_path):
    app = EdgegemApp(FakeBackend(), Store(tmp_path / "data"), plan_seconds=0.0)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen) and app.screen.is_mounted)
        assert not app.screen.query("#kv-figures")  # not measured yet: no row
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is chat)

        palette(app, chat, TITLE).callback()
        await until(pilot, lambda: isinstance(app.screen, KVCheckScreen) and app.screen.done)
        modal = app.screen
        assert modal.query_one("#kv-progress").progress == 1000
        assert "int8: KLD 4.8e-03 mean, top-1 95.1%, 1560 B/tok" in text_of(modal, "#kv-status")
        assert app.backend.kv_check_cached(None, app.store.data_dir) == KV_RESULT  # cached in the data dir
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is chat)

        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen) and app.screen.is_mounted)
        figures = app.screen.query_one("#kv-figures")
        assert text_of(app.screen, "#kv-figures").splitlines() == figure_lines(KV_RESULT) == [
            "vs fp32 KV on cpu, 1024 tokens (2026-12-01)",
            "bf16: KLD 2.6e-05 mean, top-1 99.8%, 3072 B/tok",
            "int8: KLD 4.8e-03 mean, top-1 95.1%, 1560 B/tok"]
        assert figures.region.height == 3  # every line shown, none wrapped or cut by the grid row
        assert figures.region.y == app.screen.query_one("#kv_cache_dtype").region.y + 1  # right below the choice


async def test_escape_stops_the_measurement_and_nothing_is_cached(tmp_path):
    hold = threading.Event()
    app = EdgegemApp(FakeBackend(kv_hold=hold), Store(tmp_path / "data"), plan_seconds=0.0)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        palette(app, chat, TITLE).callback()
        await until(pilot, lambda: isinstance(app.screen, KVCheckScreen) and app.screen.is_mounted
                    and app.screen.query_one("#kv-progress").progress == 250)
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is chat)
        assert app.backend.kv_check_cached(None, app.store.data_dir) is None


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("appkv") / "tiny.gguf", TinySpec())


def test_real_backend_measures_the_loaded_model_and_caches_per_file(tmp_path, tiny_path):
    backend = EngineBackend(str(tiny_path), EngineOptions(), device="cpu")
    session = backend.load(lambda frac, text: None)
    try:
        assert backend.kv_check_cached(session, tmp_path) is None
        steps = []
        r = backend.kv_check(session, tmp_path, lambda frac, text: steps.append(frac), lambda: False,
                             n_tokens=24, chunk=8)
        assert steps == [1 / 3, 2 / 3, 1.0] and r["tokens"] == 24 and r["model"]["file"] == "tiny.gguf"
        assert backend.kv_check_cached(session, tmp_path) == r
        assert len(list((tmp_path / "kv-check").glob("tiny-*-cpu.json"))) == 1
    finally:
        session.client.close()
