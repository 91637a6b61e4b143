"""Pilot tests of the Textual app: streaming, stop, conversations, settings, export, status.

Most run against `FakeClient` (tests/app_fakes.py); two run the real engine on a tiny Gemma-4.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from app.app import EdgegemApp
from app.backend import EngineBackend
from app.cli import _with_default_command
from app.screens.chat import ChatScreen
from app.screens.dialogs import ConfirmScreen, HelpScreen, LoadErrorScreen, TextPrompt
from app.screens.settings import SettingsScreen
from app.store import Store
from app.widgets.message_view import MessageView, code_blocks
from app.widgets.sidebar import ConversationItem
from app.widgets.status_panel import StatusPanel
from engine.api import (EngineOptions, ErrorKind, GenerationParams, SamplingParams, open_model, run_prompt,
                        split_thinking, start_client)
from engine.memory_plan import BudgetTooSmall
from models.gguf import GGUFError
from tests.app_fakes import FakeBackend, FakeClient
from tests.tiny_models import TinySpec, write_tiny_assistant, write_tiny_gemma4

SIZE = (120, 36)


async def until(pilot, cond, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


async def on_screen(pilot, cls) -> None:
    """Wait until a screen of type `cls` is on top and mounted (its widgets composed)."""
    await until(pilot, lambda: isinstance(pilot.app.screen, cls) and pilot.app.screen.is_mounted)
    await pilot.pause()


def make_app(tmp_path: Path, backend=None, **kw) -> EdgegemApp:
    return EdgegemApp(backend or FakeBackend(), Store(tmp_path / "data"), plan_seconds=0.0, **kw)


async def open_chat(pilot) -> ChatScreen:
    await on_screen(pilot, ChatScreen)
    return pilot.app.screen


async def say(pilot, text: str) -> None:
    chat = pilot.app.screen
    chat.query_one("#input").text = text
    chat.query_one("#input").focus()
    await pilot.press("enter")
    await until(pilot, lambda: chat.gen is None and chat.messages and chat.messages[-1].role == "assistant")


async def test_send_streams_markdown_answer_and_commits_both_messages(tmp_path):
    app = make_app(tmp_path, FakeBackend(FakeClient(delay=0.01)))
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "Say hello")
        views = list(chat.query(MessageView))
        assert [v.role for v in views] == ["user", "assistant"]
        assert views[1].content == "Hello **world**.\n\n```py\nprint(1)\n```\nDone."
        assert views[1].status == "done"
        stored = app.store.messages(chat.conversation_id)
        assert [(m.role, m.status) for m in stored] == [("user", "done"), ("assistant", "done")]
        assert stored[1].stats["decode_tok_s"] == 42.5
        # the first message names the conversation; the sampling settings reached the client
        assert app.store.get(chat.conversation_id).title == "Say hello"
        msgs, params = app.backend.client.submitted[0]
        assert msgs == [{"role": "user", "content": "Say hello"}]
        assert params.sampling.temperature == 0.7 and params.sampling.max_tokens == 1024


@pytest.mark.parametrize("render_cost, fewest, most", [(0.0, 5, 30), (0.5, 1, 2)])
async def test_streaming_updates_are_paced_by_the_rendering_cost(tmp_path, monkeypatch, render_cost, fewest, most):
    """Markdown rendering holds the GIL the engine needs: updates come at most 10 a second and
    at most ~10% of the time goes to rendering them (a 0.5 s render: one update in a 1 s stream)."""
    monkeypatch.setattr(MessageView, "render_cost_s", property(lambda self: render_cost))
    shows = []
    real_show = MessageView.show

    async def counting_show(self, thought, answer):
        shows.append(answer)
        await real_show(self, thought, answer)
    monkeypatch.setattr(MessageView, "show", counting_show)
    app = make_app(tmp_path, FakeBackend(FakeClient(pieces=[f"w{i} " for i in range(20)], delay=0.05)))
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        await say(pilot, "pace")
    streamed = len(shows) - 1  # the last call is finish()'s
    assert fewest <= streamed <= most, streamed
    assert shows[-1] == " ".join(f"w{i}" for i in range(20))


async def test_escape_stops_mid_stream_and_the_partial_answer_is_stored(tmp_path):
    client = FakeClient(gate_after=2)
    app = make_app(tmp_path, FakeBackend(client))
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        chat.query_one("#input").text = "Go"
        await pilot.press("enter")
        await until(pilot, lambda: chat.gen is not None and chat.gen.view.content == "Hello **world**")
        await pilot.press("escape")
        await until(pilot, lambda: chat.gen is None)
        last = app.store.messages(chat.conversation_id)[-1]
        assert (last.role, last.content, last.status) == ("assistant", "Hello **world**", "stopped")
        assert chat.query(MessageView).last().status == "stopped"
        # the stopped answer stays in the history the next prompt is built from
        client.gate_after = None
        await say(pilot, "More")
        assert client.submitted[1][0][1] == {"role": "assistant", "content": "Hello **world**"}


async def test_thinking_goes_to_its_own_pane_and_ctrl_t_toggles_it(tmp_path):
    client = FakeClient(pieces=["<|channel>thought\n", "Let me see.", "<channel|>", "Forty-two."])
    app = make_app(tmp_path, FakeBackend(client))
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        chat.query_one("#input").focus()
        await pilot.press("ctrl+t")
        assert chat.settings["thinking"] is True
        await say(pilot, "Question?")
        assert client.submitted[0][1].thinking is True
        m = app.store.messages(chat.conversation_id)[-1]
        assert (m.thinking, m.content) == ("Let me see.", "Forty-two.")
        view = chat.query(MessageView).last()
        assert view.query_one(".thought").display and view.content == "Forty-two."


async def test_switching_conversations_restores_their_messages(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "first conversation")
        first = chat.conversation_id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert chat.conversation_id != first and not list(chat.query(MessageView))
        await say(pilot, "second conversation")
        items = list(chat.query(ConversationItem))
        assert [i.title for i in items] == ["second conversation", "first conversation"]
        await pilot.click(items[1])
        await until(pilot, lambda: chat.conversation_id == first)
        await pilot.pause()
        assert [v.content for v in chat.query(MessageView)][0] == "first conversation"
        # the whole history goes to the engine, so the prefix cache can serve it
        await say(pilot, "again")
        msgs = app.backend.client.submitted[-1][0]
        assert [m["content"] for m in msgs][:1] == ["first conversation"] and len(msgs) == 3


async def test_rename_and_delete_with_confirmation(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "hello")
        cid = chat.conversation_id
        await pilot.press("f2")
        await on_screen(pilot, TextPrompt)
        app.screen.query_one("Input").value = "Renamed chat"
        await pilot.press("enter")
        await until(pilot, lambda: app.store.get(cid).title == "Renamed chat")
        await pilot.press("f8")
        await on_screen(pilot, ConfirmScreen)
        await pilot.press("escape")  # cancel keeps it
        await until(pilot, lambda: app.screen is chat)
        assert [c.id for c in app.store.conversations()] == [cid]
        await pilot.press("f8")
        await on_screen(pilot, ConfirmScreen)
        await pilot.click("#yes")
        await until(pilot, lambda: chat.conversation_id != cid)
        assert cid not in [c.id for c in app.store.conversations()]
        assert not list(chat.query(MessageView))


async def test_settings_are_saved_per_conversation_and_used_for_generation(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        cid = chat.conversation_id
        await pilot.press("ctrl+s")
        await on_screen(pilot, SettingsScreen)
        s = app.screen
        s.query_one("#temperature").value = "0.2"
        s.query_one("#top_k").value = "5"
        s.query_one("#system").text = "Answer in French."
        s.query_one("#max_tokens").value = "-3"
        s.action_save()
        await pilot.pause()
        assert "Max tokens" in str(s.query_one("#settings-error").render())  # refused, screen stays
        s.query_one("#max_tokens").value = "64"
        s.action_save()
        await until(pilot, lambda: app.screen is chat)
        await say(pilot, "Bonjour")
        msgs, params = app.backend.client.submitted[0]
        assert msgs[0] == {"role": "system", "content": "Answer in French."}
        assert (params.sampling.temperature, params.sampling.top_k, params.sampling.max_tokens) == (0.2, 5, 64)
        await pilot.press("ctrl+n")  # a new conversation starts from the defaults
        await pilot.pause()
        assert chat.settings["temperature"] == 0.7
    store = Store(tmp_path / "data")  # persisted
    try:
        assert store.get(cid).settings["temperature"] == 0.2 and store.get(cid).settings["top_k"] == 5
    finally:
        store.close()


async def test_engine_flag_change_reloads_the_model_after_confirmation(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        old_client = app.session.client
        await pilot.press("ctrl+s")
        await on_screen(pilot, SettingsScreen)
        app.screen.query_one("#kv_cache_dtype").value = "int8_per_token_head"
        app.screen.action_save()
        await on_screen(pilot, ConfirmScreen)
        await pilot.click("#yes")
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen is not chat)
        assert old_client.closed and app.backend.options.kv_cache_dtype == "int8_per_token_head"
        assert app.screen.conversation_id == chat.conversation_id


async def test_regenerate_and_edit_last_message(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "tell me")
        first_answer = chat.messages[-1].id
        await pilot.press("ctrl+r")
        await until(pilot, lambda: chat.gen is None and chat.messages[-1].id != first_answer)
        assert [m.role for m in app.store.messages(chat.conversation_id)] == ["user", "assistant"]
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert chat.query_one("#input").text == "tell me" and app.store.messages(chat.conversation_id) == []
        chat.query_one("#input").text = "tell me more"
        await pilot.press("enter")
        await until(pilot, lambda: chat.gen is None and len(chat.messages) == 2)
        assert app.store.messages(chat.conversation_id)[0].content == "tell me more"


async def test_copy_answer_and_code_block(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        await say(pilot, "code please")
        await pilot.press("ctrl+b")
        assert app.clipboard == "print(1)\n"
        await pilot.press("ctrl+o")
        assert app.clipboard.startswith("Hello **world**")
    assert code_blocks("a\n```\nx = 1\n```\nb\n```sh\nls") == ["x = 1\n", "ls"]


async def test_export_writes_markdown_and_json(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        await say(pilot, "export me")
        await pilot.press("f4")
        await pilot.pause()
    md = list((tmp_path / "data" / "exports").glob("*.md"))
    js = list((tmp_path / "data" / "exports").glob("*.json"))
    assert len(md) == 1 and len(js) == 1
    assert "export me" in md[0].read_text() and "Hello **world**" in md[0].read_text()
    data = json.loads(js[0].read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]


async def test_import_from_the_palette_adds_the_conversation_and_refuses_bad_files(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "to be exported")
        md, js = app.store.export_to(chat.conversation_id, tmp_path / "out")
        bad = tmp_path / "bad.json"
        bad.write_text('{"format": "edgegem.conversation", "version": 1, "messages": [{"role": "root"}]}')
        for path in (bad, js):
            chat.action_import()
            await on_screen(pilot, TextPrompt)
            app.screen.query_one("Input").value = str(path)
            await pilot.press("enter")
            await until(pilot, lambda: app.screen is chat)
            await pilot.pause()
        convs = app.store.conversations()
        assert len(convs) == 2 and chat.conversation_id == convs[0].id
        assert [m.content for m in app.store.messages(convs[0].id)][0] == "to be exported"


async def test_help_and_command_palette(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await pilot.press("f1")
        await on_screen(pilot, HelpScreen)
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is chat)
        titles = [c.title for c in app.get_system_commands(chat)]
        assert {"New conversation", "Regenerate", "Export conversation", "Settings"} <= set(titles)


async def test_generation_error_is_shown_and_stored_not_raised(tmp_path):
    app = make_app(tmp_path, FakeBackend(FakeClient(pieces=["par"], error="ContextOverflowError: too long")))
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "x")
        m = app.store.messages(chat.conversation_id)[-1]
        assert (m.status, m.stats["error"]) == ("error", "ContextOverflowError: too long")
        assert chat.prompt_messages() == [{"role": "user", "content": "x"}]  # failed answers are not replayed


async def test_load_error_shows_a_readable_screen(tmp_path):
    err = GGUFError(Path("/m/bad.gguf"), "truncated: tensor data ends at byte 10 of 5")
    app = make_app(tmp_path, FakeBackend(error=err))
    async with app.run_test(size=SIZE) as pilot:
        await on_screen(pilot, LoadErrorScreen)
        text = str(app.screen.query_one("#error-text").render())
        assert "truncated" in text and "Traceback" not in text and "\n" not in text.strip()
        assert app.screen.kind is ErrorKind.BAD_INPUT


@pytest.mark.parametrize("error, kind", [
    (GGUFError(Path("/m/x.gguf"), "unsupported architecture 'llama'"), ErrorKind.BAD_INPUT),
    (FileNotFoundError("/m/gone.gguf"), ErrorKind.BAD_INPUT),
    (BudgetTooSmall("budget 1.0 GiB is 2.0 GiB short", 3 << 30, 1 << 30, []), ErrorKind.CAPACITY),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), ErrorKind.OUT_OF_MEMORY),
    (RuntimeError("budget: an internal error whose text mentions a budget"), ErrorKind.INTERNAL),
], ids=["architecture", "missing", "budget", "oom", "internal"])
async def test_load_error_hint_follows_the_error_kind_not_the_text(tmp_path, error, kind):
    """The advice under a load error is picked by the engine's ErrorKind of the exception
    (engine.api.load_error_kind), never by words in its message."""
    app = make_app(tmp_path, FakeBackend(error=error))
    async with app.run_test(size=SIZE) as pilot:
        await on_screen(pilot, LoadErrorScreen)
        hint = str(app.screen.query_one(".hint").render())
        assert app.screen.kind is kind
        assert ("--gpu-memory-budget" in hint) == (kind in (ErrorKind.CAPACITY, ErrorKind.OUT_OF_MEMORY))
        assert ("--model path" in hint) == (kind is ErrorKind.BAD_INPUT)
        assert ("fault in edgegem" in hint) == (kind is ErrorKind.INTERNAL)


@pytest.mark.parametrize("case", ["not-a-gguf", "truncated", "budget-too-small"])
async def test_real_load_failures_end_on_the_error_screen(tmp_path, tiny_path, case):
    opts = EngineOptions()
    if case == "not-a-gguf":
        model = tmp_path / "notes.gguf"
        model.write_text("hello, I am not a model")
    elif case == "truncated":
        model = tmp_path / "cut.gguf"
        model.write_bytes(tiny_path.read_bytes()[:5000])
    else:
        model, opts = tiny_path, EngineOptions(gpu_memory_budget="1MiB")
    app = make_app(tmp_path, EngineBackend(str(model), opts, device="cpu"))
    async with app.run_test(size=SIZE) as pilot:
        await on_screen(pilot, LoadErrorScreen)
        text = str(app.screen.query_one("#error-text").render())
        assert text.strip() and "Traceback" not in text and "\n" not in text.strip()
        assert {"not-a-gguf": "GGUF", "truncated": "truncated", "budget-too-small": "budget"}[case] in text
        assert app.screen.kind is (ErrorKind.CAPACITY if case == "budget-too-small" else ErrorKind.BAD_INPUT)


async def test_draft_off_is_said_out_loud_for_gemma4(tmp_path):
    app = make_app(tmp_path, FakeBackend(FakeClient(speculative=None), info={"draft": None}))
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        assert any("Speculative decoding is off" in str(n.message) for n in app._notifications)
        chat.refresh_status()
        assert "draft   off (no assistant model)" in chat.query_one(StatusPanel).lines


def test_the_app_truncates_old_turns_by_default_and_run_does_not():
    from app.cli import _parser
    assert _parser().parse_args(["app"]).context_overflow == "truncate"
    assert _parser().parse_args(["app", "--context-overflow", "error"]).context_overflow == "error"
    assert _parser().parse_args(["run", "--prompt", "x"]).context_overflow == "error"


def test_bare_edgegem_means_the_app():
    assert _with_default_command([]) == ["app"]
    assert _with_default_command(["--debug", "--model", "x.gguf"]) == ["--debug", "app", "--model", "x.gguf"]
    assert _with_default_command(["run", "--prompt", "hi"]) == ["run", "--prompt", "hi"]
    assert _with_default_command(["--version"]) == ["--version"]


# --- the real engine on a tiny Gemma-4 -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("app") / "tiny.gguf", TinySpec(), seed=3)


@pytest.mark.cpu_runtime
async def test_real_engine_answer_equals_edgegem_run_and_status_comes_from_the_engine(tmp_path, tiny_path):
    backend = EngineBackend(str(tiny_path), EngineOptions(kv_cache_dtype="int8_per_token_head"), device="cpu")
    app = make_app(tmp_path, backend, default_settings={"temperature": 0.0, "max_tokens": 12})
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "the cat")
        answer = app.store.messages(chat.conversation_id)[-1]
        status = app.session.client.status()
        chat.refresh_status()
        lines = chat.query_one(StatusPanel).lines
        full = status["pools"]["full"]
        i = next(i for i, ln in enumerate(lines) if f"{full['used']}/{full['capacity']}" in ln)
        assert lines[i + 1].strip() == "int8_per_token_head"
        n = answer.stats["prompt_tokens"] + answer.stats["output_tokens"]
        assert any(ln.startswith("context ") and ln.endswith(f" {n}/{status['context_limit']}") for ln in lines)
        assert answer.stats["output_tokens"] == 12 or answer.stats["finish_reason"] == "stop"
    # the same prompt through `edgegem run`'s path gives the same text
    lm = open_model(tiny_path, exact=False)
    client = start_client(lm, EngineOptions(kv_cache_dtype="int8_per_token_head"))
    try:
        out = run_prompt(client, lm, "the cat", GenerationParams(SamplingParams(temperature=0.0, max_tokens=12)))
    finally:
        client.close()
    assert split_thinking(out["text"])[1] == answer.content  # the app stores the answer trimmed


async def test_real_engine_reuses_the_cached_prefix_on_the_next_turn_and_after_switching_back(
        tmp_path, tiny_path):
    backend = EngineBackend(str(tiny_path), EngineOptions(), device="cpu")
    app = make_app(tmp_path, backend, default_settings={"temperature": 0.0, "max_tokens": 6})
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "one")
        await say(pilot, "two")
        first = chat.conversation_id
        second = app.store.messages(first)[-1].stats
        assert second["cached_tokens"] > 0 and second["prefilled_tokens"] < second["prompt_tokens"]
        await pilot.press("ctrl+n")
        await pilot.pause()
        await say(pilot, "another conversation")
        chat.load_conversation(first)
        await pilot.pause()
        await say(pilot, "three")
        back = app.store.messages(first)[-1].stats
        # the previous turn's whole prompt was still resident (the random tiny model's answer tokens
        # need not re-tokenize to the same ids, so the match may stop where the answer starts)
        assert back["cached_tokens"] >= second["prompt_tokens"]


async def test_real_engine_with_the_assistant_draft_shows_acceptance(tmp_path, tiny_path):
    draft = write_tiny_assistant(tmp_path / "assistant.gguf", TinySpec(), seed=32)
    backend = EngineBackend(str(tiny_path), EngineOptions(spec_draft_model=str(draft), spec_tokens=2), device="cpu")
    app = make_app(tmp_path, backend, default_settings={"temperature": 0.0, "max_tokens": 8})
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        assert not any("Speculative decoding is off" in str(n.message) for n in app._notifications)
        await say(pilot, "the cat")
        spec = app.session.client.status()["speculative"]
        chat.refresh_status()
        assert spec["rounds"] > 0
        assert f"draft   {100 * spec['acceptance_rate']:.0f}% accepted" in "\n".join(chat.query_one(StatusPanel).lines)
