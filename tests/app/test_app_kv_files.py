"""The app keeps each conversation's KV on disk (<data-dir>/kv/): quit and reopen, and the next turn
prefills only what an app that never quit would prefill; deleting the conversation deletes its file;
the settings show the disk use and clear it. Real engine, tiny Gemma-4."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.app import EdgegemApp
from app.backend import EngineBackend
from app.screens.dialogs import ConfirmScreen
from app.screens.settings import SettingsScreen
from app.store import Store
from app.widgets.status_panel import StatusPanel
from engine.api import EngineOptions
from tests.app.test_app import SIZE, on_screen, open_chat, say, until
from tests.tiny_models import TinySpec, write_tiny_gemma4

SETTINGS = {"temperature": 0.0, "max_tokens": 24}
LONG = "tell me everything about the cat and the mat and the hat " * 6


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("appkvf") / "tiny.gguf", TinySpec(), seed=5)


def _app(data: Path, tiny_path, kv: bool = True) -> EdgegemApp:
    opts = EngineOptions(kv_save="evict", kv_dir=str(data / "kv")) if kv else EngineOptions()
    backend = EngineBackend(str(tiny_path), opts, device="cpu")
    return EdgegemApp(backend, Store(data), plan_seconds=0.0, default_settings=SETTINGS)


def _save_now(app) -> None:
    """Write the dirty conversations' KV files now (the app would at eviction or close)."""
    app.session.client.call(lambda engine: (engine.sessions.save_dirty(), engine.sessions.flush()))


async def test_quit_and_reopen_prefills_only_the_new_message(tmp_path, tiny_path):
    # what an app that never quits prefills for turn 2 (its prefix cache still holds turn 1)
    control = _app(tmp_path / "control", tiny_path, kv=False)
    async with control.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, LONG)
        await say(pilot, "and the dog?")
        want = control.store.messages(chat.conversation_id)[-1].stats
        want_text = control.store.messages(chat.conversation_id)[-1].content

    data = tmp_path / "data"
    app = _app(data, tiny_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, LONG)
        conv = chat.conversation_id
        assert not (data / "kv" / f"{conv}.safetensors").exists()  # saved when it leaves the cache
    kv = data / "kv" / f"{conv}.safetensors"
    assert kv.exists()  # ... or when the app closes

    app = _app(data, tiny_path)  # a restart: a new engine with empty pools
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        assert chat.conversation_id == conv
        await say(pilot, "and the dog?")
        got = app.store.messages(conv)[-1].stats
        assert got["restored_tokens"] > 0 and got["restored_tokens"] == got["cached_tokens"]
        assert got["prefilled_tokens"] == want["prefilled_tokens"] < got["prompt_tokens"] // 3
        assert app.store.messages(conv)[-1].content == want_text
        chat.refresh_status()
        lines = chat.query_one(StatusPanel).lines
        assert f"disk    restored {got['restored_tokens']} tokens from disk" in lines


async def test_deleting_a_conversation_deletes_its_kv_file(tmp_path, tiny_path):
    data = tmp_path / "data"
    app = _app(data, tiny_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "the cat")
        conv = chat.conversation_id
    kv = data / "kv" / f"{conv}.safetensors"
    assert kv.exists()
    app = _app(data, tiny_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "more")  # pending again (dirty): deleting must also drop the pending save
        await pilot.press("f8")
        await on_screen(pilot, ConfirmScreen)
        await pilot.click("#yes")
        await until(pilot, lambda: chat.conversation_id != conv)
    assert not kv.exists() and not list((data / "kv").glob(f"{conv}.*"))


async def test_settings_show_the_disk_use_and_clear_it(tmp_path, tiny_path):
    data = tmp_path / "data"
    app = _app(data, tiny_path)
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        await say(pilot, "the cat")
        _save_now(app)
        await pilot.press("ctrl+s")
        await on_screen(pilot, SettingsScreen)
        shown = str(app.screen.query_one("#kv-disk").render())
        assert shown.startswith("1 conversations, ") and shown.endswith(" of 4.0 GiB")
        app.screen.query_one("#clear-kv").scroll_visible(animate=False)  # below DRY/XTC's rows at this size
        await pilot.pause()
        await pilot.click("#clear-kv")
        await pilot.pause()
        assert str(app.screen.query_one("#kv-disk").render()).startswith("0 conversations, 0.0 MiB")
    assert not list((data / "kv").glob("*.safetensors"))


async def test_a_full_disk_while_saving_keeps_the_chat_and_the_database(tmp_path, tiny_path, monkeypatch):
    import errno

    from engine.kv import file as kv_file

    def enospc(snap, path, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_file, "write", enospc)
    data = tmp_path / "data"
    app = _app(data, tiny_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "the cat")
        _save_now(app)
        assert app.session.client.kv_errors() == [f"KV file {chat.conversation_id}.safetensors not saved: "
                                                  "No space left on device"]
        await say(pilot, "and the dog")  # the chat goes on
        conv = chat.conversation_id
    store = Store(data)
    assert [(m.role, m.status) for m in store.messages(conv)] == [("user", "done"), ("assistant", "done")] * 2
    store.close()
    assert not list((data / "kv").iterdir())
