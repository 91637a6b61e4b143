"""The app on a base model (issue 24): the text-continuation mode (composer, note, settings'
mode line), its defaults (DRY on, 256 tokens, stop at a blank line) over the chat ones, and DRY /
XTC in the settings screen; a chat model keeps today's defaults. On the scripted FakeClient."""
from __future__ import annotations

from app.screens.chat import BASE_NOTE, CONTINUE_PLACEHOLDER
from app.screens.settings import SettingsScreen
from app.widgets.chat_input import ChatInput
from tests.app_fakes import FakeBackend, FakeClient
from tests.app.test_app import SIZE, make_app, on_screen, open_chat, say, until

BASE = {"kind": "base", "kind_reason": "no chat template in the file"}


async def test_base_model_opens_in_continuation_mode_with_its_defaults(tmp_path):
    app = make_app(tmp_path, FakeBackend(FakeClient(pieces=[" and the sea", " was calm."]), info=BASE))
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        assert chat.query_one(ChatInput).placeholder == CONTINUE_PLACEHOLDER
        notes = [str(n.render()) for n in chat.query(".notice")]
        assert notes == [BASE_NOTE.format(why="no chat template in the file")]
        await say(pilot, "The lighthouse stood on the cliff")
        assert chat.messages[-1].content == " and the sea was calm."  # kept as written, space and all
        await say(pilot, "At night")
        msgs, _ = app.backend.client.submitted[1]
        assert [m["content"] for m in msgs] == ["The lighthouse stood on the cliff", " and the sea was calm.",
                                                "At night"]
        _, params = app.backend.client.submitted[0]
        s = params.sampling
        assert params.continue_text and params.stop_at_blank_line and not params.thinking
        assert (s.dry_multiplier, s.dry_penalty_last_n, s.max_tokens) == (0.8, -1, 256)
        assert (s.dry_base, s.dry_allowed_length, s.temperature) == (1.75, 2, 0.7)  # the rest: the chat defaults
        await pilot.press("ctrl+s")
        await on_screen(pilot, SettingsScreen)
        assert "text continuation" in str(app.screen.query_one("#mode").render())


async def test_chat_model_keeps_its_defaults_dry_and_xtc_off(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        assert chat.query_one(ChatInput).placeholder != CONTINUE_PLACEHOLDER and not chat.query(".notice")
        await say(pilot, "Hello")
        _, params = app.backend.client.submitted[0]
        s = params.sampling
        assert not params.continue_text and not params.stop_at_blank_line
        assert (s.dry_multiplier, s.xtc_probability, s.max_tokens) == (0.0, 0.0, 1024)


async def test_dry_and_xtc_settings_are_saved_and_used_and_bad_breakers_refused(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await pilot.press("ctrl+s")
        await on_screen(pilot, SettingsScreen)
        s = app.screen
        assert s.query_one("#dry_sequence_breakers").value == '["\\n", ":", "\\"", "*"]'
        s.query_one("#dry_multiplier").value = "1.2"
        s.query_one("#dry_penalty_last_n").value = "128"
        s.query_one("#xtc_probability").value = "0.5"
        s.query_one("#xtc_threshold").value = "0.15"
        s.query_one("#dry_sequence_breakers").value = '"\\n"'  # not a list
        s.action_save()
        await pilot.pause()
        assert "DRY breakers" in str(s.query_one("#settings-error").render())  # refused, screen stays
        s.query_one("#dry_sequence_breakers").value = '["\\n", "###"]'
        s.query_one("#stop_at_blank_line").value = True
        s.action_save()
        await until(pilot, lambda: app.screen is chat)
        await say(pilot, "Hi")
        _, params = app.backend.client.submitted[0]
        p = params.sampling
        assert (p.dry_multiplier, p.dry_penalty_last_n, p.xtc_probability, p.xtc_threshold) == (1.2, 128, 0.5, 0.15)
        assert p.dry_sequence_breakers == ("\n", "###") and params.stop_at_blank_line
        assert not params.continue_text  # the mode follows the model, not a setting
