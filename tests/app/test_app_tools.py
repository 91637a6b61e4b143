"""Tools in the chat app, through Textual's pilot on a scripted model that calls tools: the approval
dialog (once, always, deny, Escape), each call as a block with its result, the result reaching the
model's next prompt, the step limit, the Tools screen's switches, regenerate and edit over a tool
turn."""
from __future__ import annotations

import json
import threading

from app.screens.chat import ChatScreen
from app.screens.tools import ApprovalScreen, ToolsScreen
from app.tools.base import ServerState, ServerStatus, ToolResult, ToolSource, ToolSpec
from app.tools.config import ToolsConfig
from app.tools.session import AppTools, ToolOptions
from app.widgets.message_view import MessageView
from app.widgets.status_panel import StatusPanel
from tests.app.test_app import make_app, on_screen, open_chat, until
from tests.app_fakes import FakeBackend, ToolFakeClient

CLOCK_CALL = {"name": "clock", "arguments": {"zone": "utc"}}


class Clock(ToolSource):
    """A scripted tool source: `clock` answers at once, `stall` waits on a gate (a slow server)."""

    name = "scripted"

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.gate = threading.Event()

    def status(self) -> ServerStatus:
        return ServerStatus(self.name, ServerState.READY, "stdio", n_tools=2)

    def tools(self) -> list[ToolSpec]:
        obj = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
        return [ToolSpec("clock", self.name, "clock", "The time in a zone.", obj),
                ToolSpec("stall", self.name, "stall", "Waits.", {"type": "object", "properties": {}})]

    def call(self, tool: str, arguments: dict, timeout: float) -> ToolResult:
        self.calls.append((tool, arguments))
        if tool == "stall":
            self.gate.wait(10)
        return ToolResult(json.dumps({"zone": arguments.get("zone"), "time": "12:34"}))


def tools_app(tmp_path, replies, yes=False, **kw):
    source = Clock()
    tools = AppTools(ToolOptions(ToolsConfig(None), yes_tools=yes, extra_sources=[source]), tmp_path / "data")
    client = ToolFakeClient(replies=replies, **kw)
    return make_app(tmp_path, FakeBackend(client), tools=tools), client, source


async def ask(pilot, text: str) -> ChatScreen:
    chat = await open_chat(pilot)
    chat.query_one("#input").text = text
    chat.query_one("#input").focus()
    await pilot.press("enter")
    return chat


async def approve(pilot, key: str) -> ApprovalScreen:
    """Answer the dialog by its key binding (run as the key would: pilot.press waits on the
    dialog's widgets, which the answer removes)."""
    await on_screen(pilot, ApprovalScreen)
    screen = pilot.app.screen
    action = next(b[1] for b in ApprovalScreen.BINDINGS if key in b[0].split(","))
    await screen.run_action(action)
    return screen


async def done(pilot, chat, timeout: float = 90.0) -> None:
    """The answer (every step of the loop) is in; the real engine on 2 busy cores takes its time."""
    await until(pilot, lambda: chat.gen is None, timeout)
    await pilot.pause()


def roles(chat) -> list[tuple]:
    return [(m.role, m.status, (m.tool or {}).get("status")) for m in chat.messages]


async def test_an_approved_call_runs_and_its_result_reaches_the_models_next_prompt(tmp_path):
    app, client, source = tools_app(tmp_path, [{"pieces": ["Let me look."], "calls": [CLOCK_CALL]}])
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "What time is it?")
        dialog = await approve(pilot, "y")
        assert json.loads(str(dialog.query_one("#arguments").render())) == {"zone": "utc"}
        await done(pilot, chat)
        assert source.calls == [("clock", {"zone": "utc"})]
        assert roles(chat) == [("user", "done", None), ("assistant", "done", None), ("tool", "done", "ok"),
                               ("assistant", "done", None)]
        reply, result, answer = chat.messages[1:]
        assert reply.content == "Let me look." and reply.tool["calls"][0]["arguments"] == {"zone": "utc"}
        assert json.loads(result.content) == {"zone": "utc", "time": "12:34"} and answer.content == "It is 12:34."
        # the tools went with the request; the continuation is the first prompt, the reply, the result block
        assert [t["function"]["name"] for t in client.submitted[0][1].tools] == ["date_time", "clock", "stall"]
        cont = client.loaded.tokenizer.decode(client.continuations[0])
        assert cont.endswith('<|tool_response>response:clock{time:<|"|>12:34<|"|>,zone:<|"|>utc<|"|>}<tool_response|>')
        assert "Let me look." in cont
        # on screen: the reply with its call block, the result block, the answer; saved as shown
        views = list(chat.query(MessageView))
        assert [v.role for v in views] == ["user", "assistant", "tool", "assistant"]
        assert [c.title for c in views[1].query(".tool-call")] == ["call clock"]
        assert views[2].query_one(".tool-result").title == "result of clock"
        stored = app.store.messages(chat.conversation_id)
        assert [(m.role, m.content) for m in stored] == [(m.role, m.content) for m in chat.messages]


async def test_a_denied_call_does_not_run_and_the_model_is_told(tmp_path):
    app, client, source = tools_app(tmp_path, [{"pieces": ["Checking."], "calls": [CLOCK_CALL]}])
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "Time?")
        await approve(pilot, "n")
        await done(pilot, chat)
        assert source.calls == []
        assert roles(chat)[2] == ("tool", "done", "denied")
        assert "declined" in client.loaded.tokenizer.decode(client.continuations[0])
        view = [v for v in chat.query(MessageView) if v.role == "tool"][0]
        assert view.query_one(".tool-result").title == "result of clock (denied)"


async def test_always_is_saved_and_the_next_call_runs_without_asking(tmp_path):
    twice = [{"pieces": ["A."], "calls": [CLOCK_CALL]}, {"pieces": ["B."], "calls": [CLOCK_CALL]}]
    app, client, source = tools_app(tmp_path, twice)
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "Time?")
        await approve(pilot, "a")
        await done(pilot, chat)
        assert len(source.calls) == 2 and not isinstance(pilot.app.screen, ApprovalScreen)
    saved = json.loads((tmp_path / "data" / "tool-approvals.json").read_text())
    assert saved == {"always": {"scripted": ["clock"]}}


async def test_escape_in_the_dialog_stops_the_loop_and_keeps_what_was_done(tmp_path):
    two = [{"pieces": ["Two calls."], "calls": [CLOCK_CALL, {"name": "clock", "arguments": {"zone": "cet"}}]}]
    app, client, source = tools_app(tmp_path, two)
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "Time?")
        await approve(pilot, "escape")
        await done(pilot, chat)
        assert source.calls == [] and client.continuations == []  # nothing ran, nothing was continued
        # the reply and both calls' results are kept (the second: stopped before it ran)
        assert roles(chat) == [("user", "done", None), ("assistant", "done", None), ("tool", "done", "denied"),
                               ("tool", "done", "denied")]
        assert "stopped" in chat.messages[3].content
        assert len(app.store.messages(chat.conversation_id)) == 4
        # Ctrl+R takes the whole tool turn back and answers again (the script's next reply has no calls)
        await pilot.press("ctrl+r")
        await until(pilot, lambda: [m.role for m in chat.messages] == ["user", "assistant"])
        await done(pilot, chat)
        assert [m.role for m in app.store.messages(chat.conversation_id)] == ["user", "assistant"]


async def test_escape_while_a_call_runs_stops_at_once(tmp_path):
    app, client, source = tools_app(tmp_path, [{"pieces": ["Wait."], "calls": [{"name": "stall", "arguments": {}}]}],
                                    yes=True)
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "Go")
        await until(pilot, lambda: source.calls)
        view = [v for v in chat.query(MessageView) if v.role == "tool"][0]
        assert view.status == "running" and "running" in str(view.query_one(".role").render())
        await pilot.press("escape")
        await done(pilot, chat)  # the tool is still running: the loop did not wait for it
        assert not source.gate.is_set() and client.continuations == []
        assert roles(chat)[-1] == ("tool", "done", "error") and "stopped" in chat.messages[-1].content
        assert view.status == "done"
        source.gate.set()


async def test_the_step_limit_stops_a_model_that_keeps_calling(tmp_path):
    calls = [{"pieces": [f"Step {i}."], "calls": [CLOCK_CALL]} for i in range(5)]
    app, client, source = tools_app(tmp_path, calls, yes=True)
    app.default_settings = {"tool_steps": 2}
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "Loop")
        await done(pilot, chat)
        assert len(source.calls) == 2 and len(client.continuations) == 1
        assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "assistant", "tool"]


async def test_the_tools_screen_switches_a_tool_off_and_it_stays_off(tmp_path):
    app, client, source = tools_app(tmp_path, [])
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await open_chat(pilot)
        await pilot.press("ctrl+g")
        await on_screen(pilot, ToolsScreen)
        await until(pilot, lambda: len(pilot.app.screen.query("Switch")) == 3)  # date_time, clock, stall
        screen = pilot.app.screen
        sid = next(k for k, v in screen._switch_tool.items() if v == "clock")
        await pilot.click(f"#{sid}")
        await until(pilot, lambda: "clock" not in [d["function"]["name"] for d in app.tools.declarations()])
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen))
        chat.refresh_status()
        assert "tools   2 of 3 on" in chat.query_one(StatusPanel).lines
    again = AppTools(ToolOptions(ToolsConfig(None), extra_sources=[Clock()]), tmp_path / "data")
    assert "clock" not in [d["function"]["name"] for d in again.declarations()]
    assert json.loads((tmp_path / "data" / "tool-switches.json").read_text()) == {"off": ["scripted/clock"]}


async def test_no_tools_go_to_a_model_without_the_gemma4_template(tmp_path):
    app, client, source = tools_app(tmp_path, [{"pieces": ["x"], "calls": [CLOCK_CALL]}])
    app.backend.info["arch"] = "gemma3"
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "Time?")
        await done(pilot, chat)
        assert client.submitted[0][1].tools is None and source.calls == []


async def test_long_arguments_scroll_and_the_answers_stay_on_screen(tmp_path):
    long = {"text": "x" * 4000, "lines": [f"line {i}" for i in range(80)]}
    app, client, source = tools_app(tmp_path, [{"pieces": ["Long."], "calls": [{"name": "clock", "arguments": long}]}])
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(pilot, "Go")
        await on_screen(pilot, ApprovalScreen)
        screen = pilot.app.screen
        for answer in ("once", "conversation", "always", "deny"):
            region = screen.query_one(f"#{answer}").region
            assert region.height and region.bottom <= 30, (answer, region)
        await approve(pilot, "n")


async def test_thinking_stays_in_its_pane_around_tool_calls(tmp_path):
    thought = ["<|channel>thought\n", "The user wants the time; ", "call the clock.", "<channel|>", "Checking."]
    app, client, source = tools_app(tmp_path, [{"pieces": thought, "calls": [CLOCK_CALL]}], yes=True)
    client.final = ["<|channel>thought\nIt said 12:34.<channel|>", "It is 12:34."]
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "Time?")
        await done(pilot, chat)
        reply, result, answer = chat.messages[1:]
        assert (reply.thinking, reply.content) == ("The user wants the time; call the clock.", "Checking.")
        assert reply.tool["calls"][0]["arguments"] == {"zone": "utc"}  # the thought is not in the arguments
        assert (answer.thinking, answer.content) == ("It said 12:34.", "It is 12:34.")
        views = [v for v in chat.query(MessageView) if v.role == "assistant"]
        assert [v.thinking for v in views] == [reply.thinking, answer.thinking]
        assert all("<|channel>" not in v.content and "thought" not in v.content for v in views)


async def test_quitting_while_the_dialog_waits_ends_the_loop_quietly(tmp_path):
    app, client, source = tools_app(tmp_path, [{"pieces": ["Wait."], "calls": [CLOCK_CALL, CLOCK_CALL]}])
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "Time?")
        await on_screen(pilot, ApprovalScreen)
        threads = {t.name for t in threading.enumerate()}
        app.exit()  # Ctrl+Q: the dialog goes, the waiting worker sees it and stops
    for _ in range(100):  # the worker's thread ends within its 0.1 s poll
        if not [t for t in threading.enumerate() if t.name not in threads and t.is_alive()]:
            break
        threading.Event().wait(0.05)
    assert source.calls == [] and client.continuations == [] and chat.gen is None
