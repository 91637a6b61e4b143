"""Tools in the chat app with real MCP servers (tests/mcp_test_server.py over stdio): the real
engine on a tiny Gemma-4 forced to call a tool (tool_choice "required") with each result reaching
the model's next prompt, and, on the scripted model, a hung call's timeout and a server that dies
during a call, each one line in the conversation and the Tools screen."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from gguf import GGUFValueType

from app.app import EdgegemApp
from app.backend import EngineBackend, EngineOptions
from app.store import Store
from app.screens.tools import ToolsScreen
from app.tools.base import ServerState, ServerStatus, ToolResult, ToolSource, ToolSpec
from app.tools.config import ToolsConfig, parse_servers
from app.tools.session import AppTools, ToolOptions
from app.widgets.attachments import MediaChips
from app.widgets.message_view import MessageView
from models.tool_format import response_block
from tests.app.test_app import make_app, on_screen, open_chat, until
from tests.app.test_app_tools import approve, ask, done
from tests.app_fakes import FakeBackend, ToolFakeClient
from tests.tiny_models import TinySpec, write_tiny_gemma4

SERVER = str(Path(__file__).resolve().parents[1] / "mcp_test_server.py")
TEMPLATE = (Path(__file__).parents[1] / "data" / "google-gemma-4-31B-it.jinja").read_text()
# where the random model picks, only the test server's clock stays on (its enum argument ends a
# forced call within a few tokens; a free string or integer can run to max_tokens)
OFF = ["builtin/date_time"] + [f"test/{t}" for t in ("echo", "add", "slow", "fail", "big", "crash", "image",
                                                      "header")]


def mcp_tools(data: Path, call_timeout: float = 60.0, off=()) -> AppTools:
    data.mkdir(parents=True, exist_ok=True)
    (data / "tool-switches.json").write_text(json.dumps({"off": list(off)}))
    config = ToolsConfig(Path("mcp.json"), parse_servers({"mcpServers": {"test": {
        "command": sys.executable, "args": [SERVER]}}}, "test"))
    return AppTools(ToolOptions(config, call_timeout=call_timeout, start_timeout=60.0), data)


async def ready(pilot, tools: AppTools) -> None:
    await until(pilot, lambda: tools.box.statuses()[-1].state is not ServerState.STARTING, timeout=60)
    assert tools.box.statuses()[-1].state is ServerState.READY, tools.box.statuses()[-1].line()


async def test_a_tiny_gemma4_calls_an_mcp_tool_and_each_step_prefills_only_the_result(tmp_path):
    model = write_tiny_gemma4(tmp_path / "tools.gguf", TinySpec(tool_tokens=True, extra={
        "tokenizer.chat_template": (TEMPLATE, GGUFValueType.STRING)}), seed=41)
    tools = mcp_tools(tmp_path / "data", off=OFF)
    app = make_app(tmp_path, EngineBackend(str(model), EngineOptions(), device="cpu"), tools=tools)
    app.default_settings = {"tool_choice": "required", "tool_steps": 2, "temperature": 0.0, "max_tokens": 96}
    async with app.run_test(size=(120, 36)) as pilot:
        await open_chat(pilot)
        await ready(pilot, tools)
        chat = await ask(pilot, "What time is it?")
        await approve(pilot, "c")  # this conversation: the second call runs without asking
        await done(pilot, chat)
        replies = [m for m in chat.messages if m.role == "assistant"]
        assert len(replies) == 2 and all(r.tool["calls"] for r in replies)  # two steps, then the limit
        first_results = chat.messages[2:chat.messages.index(replies[1])]
        assert [r.role for r in first_results] == ["tool"] * len(replies[0].tool["calls"])
        for call, result in zip(replies[0].tool["calls"], first_results):
            # the server ran each call with the arguments the model wrote
            assert call["name"] == "clock" and result.tool["status"] == "ok"
            assert result.content == f"12:34 {call['arguments']['zone']}"
        # the continuation prefilled the result blocks and nothing else
        tok = chat.client.loaded.tokenizer
        blocks = tok.encode("".join(response_block("clock", r.content) for r in first_results), add_bos=False)
        assert replies[1].stats["prefilled_tokens"] in (len(blocks), len(blocks) - 1)  # the opening marker
        stored = app.store.messages(chat.conversation_id)  # may be the model's own end token
        assert [(m.role, m.content) for m in stored] == [(m.role, m.content) for m in chat.messages]


async def test_a_hung_call_times_out_and_a_dying_server_is_one_line(tmp_path):
    tools = mcp_tools(tmp_path / "data", call_timeout=2.0)
    client = ToolFakeClient(replies=[{"pieces": ["Slow."], "calls": [{"name": "slow", "arguments": {"seconds": 30}}]},
                                     {"pieces": ["Look."], "calls": [{"name": "image", "arguments": {}}]},
                                     {"pieces": ["Crash."], "calls": [{"name": "crash", "arguments": {}}]},
                                     {"pieces": ["Again."], "calls": [{"name": "echo", "arguments": {"text": "hi"}}]}])
    tools.policy.yes_tools = True
    app = make_app(tmp_path, FakeBackend(client), tools=tools)
    async with app.run_test(size=(120, 36)) as pilot:
        await open_chat(pilot)
        await ready(pilot, tools)
        chat = await ask(pilot, "Go")
        await done(pilot, chat)
        results = [m for m in chat.messages if m.role == "tool"]
        assert [r.tool["status"] for r in results] == ["error", "ok", "error", "error"]
        assert results[0].content == "error: slow did not answer within 2 s"
        # an image result: a line for the model, a chip on screen, the copy in the data folder
        assert results[1].content.startswith("[image 1: image/png,") and len(results[1].images) == 1
        assert app.store.image_path(results[1].images[0]).read_bytes()[:4] == b"\x89PNG"
        chips = [v for v in chat.query(MessageView) if v.role == "tool"][1].query(MediaChips)
        assert "image-1.png" in str(chips.first().render())
        results = results[:1] + results[2:]
        assert results[1].content == "error: server 'test' exited during the call"
        assert results[2].content == "error: echo: test: failed (exited during a call to crash)"  # the dead server
        assert chat.messages[-1].content == "It is 12:34."  # the model answered after all
        await pilot.press("ctrl+g")
        await on_screen(pilot, ToolsScreen)
        await until(pilot, lambda: any("failed" in str(w.render()) for w in pilot.app.screen.query(".server")))


async def test_a_server_that_fails_to_start_is_one_line_in_the_conversation(tmp_path):
    config = ToolsConfig(Path("mcp.json"), parse_servers({"mcpServers": {
        "gone": {"command": "edgegem-no-such-command"},
        "test": {"command": sys.executable, "args": [SERVER]}}}, "test"))
    tools = AppTools(ToolOptions(config, start_timeout=60.0), tmp_path / "data")
    app = make_app(tmp_path, FakeBackend(ToolFakeClient()), tools=tools)
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await open_chat(pilot)  # the chat opens while the servers start
        await ready(pilot, tools)
        await until(pilot, lambda: chat.query(".tool-failure"))
        lines = [str(w.render()) for w in chat.query(".tool-failure")]
        assert lines == ["Tools: gone: failed (cannot run 'edgegem-no-such-command': no such file or command); "
                         "the chat goes on without its tools (Ctrl+G lists them)."]
        names = [d["function"]["name"] for d in tools.declarations()]
        assert "echo" in names and "date_time" in names  # the other server's tools and the built-ins are there


class EnumClock(ToolSource):
    """`clock(zone: utc|cet)`: an enum argument, so a tiny random model forced to call it ends."""

    name = "clock"

    def status(self) -> ServerStatus:
        return ServerStatus(self.name, ServerState.READY, "builtin", n_tools=1)

    def tools(self) -> list[ToolSpec]:
        zone = {"type": "object", "required": ["zone"], "properties": {"zone": {"type": "string",
                                                                                  "enum": ["utc", "cet"]}}}
        return [ToolSpec("clock", self.name, "clock", "The time in a zone.", zone)]

    def call(self, tool: str, arguments: dict, timeout: float) -> ToolResult:
        return ToolResult(f"12:34 {arguments['zone']}")


async def test_a_conversation_with_a_tool_turn_reopens_from_its_kv_file(tmp_path):
    """E2B/E4B's template form (its generation prompt ends at `<|turn>model\n`): the next turn's
    prompt extends the saved tokens, so the file serves them. (The 26B/31B form's empty thought
    channel is not in its history rendering: the next turn parts from the saved tokens where the
    last answer began, which a KV file with sliding layers cannot serve: docs/kv-files.md.)"""
    e_form = TEMPLATE.replace("{{- '<|channel>thought\\n<channel|>' -}}", "")
    assert e_form != TEMPLATE
    model = write_tiny_gemma4(tmp_path / "tools.gguf", TinySpec(tool_tokens=True, extra={
        "tokenizer.chat_template": (e_form, GGUFValueType.STRING)}), seed=11)  # one that ends its call
    data = tmp_path / "data"
    (data).mkdir()
    (data / "tool-switches.json").write_text(json.dumps({"off": ["builtin/date_time"]}))

    def app_on(choice: str):
        tools = AppTools(ToolOptions(ToolsConfig(None), yes_tools=True, extra_sources=[EnumClock()]), data)
        opts = EngineOptions(kv_save="evict", kv_dir=str(data / "kv"))
        app = EdgegemApp(EngineBackend(str(model), opts, device="cpu"), Store(data), plan_seconds=0.0, tools=tools,
                         default_settings={"tool_choice": choice, "tool_steps": 1, "temperature": 0.0,
                                           "max_tokens": 24})  # answers within the sliding window (below)
        return app

    app = app_on("required")
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await ask(pilot, "What time is it?")
        await done(pilot, chat)
        conv = chat.conversation_id
        assert [m.role for m in chat.messages] == ["user", "assistant", "tool"], chat.messages[-1].stats  # one step, then the limit
        app.store.update_settings(conv, {"tool_choice": "none"})  # the next turn answers in text
        chat.query_one("#input").text = "Thanks."
        chat.query_one("#input").focus()
        await pilot.press("enter")
        await until(pilot, lambda: chat.gen is None and chat.messages[-1].role == "assistant", timeout=60)
        second = chat.messages[-1].stats
        assert chat.messages[-1].role == "assistant" and not second.get("kv_session_error")
        assert second["cached_tokens"] > 0  # the tool turn's KV served the next one
    assert (data / "kv" / f"{conv}.safetensors").exists()

    app = app_on("none")  # a restart: a new engine with empty pools
    async with app.run_test(size=(120, 36)) as pilot:
        chat = await open_chat(pilot)
        assert chat.conversation_id == conv
        chat.query_one("#input").text = "And in Paris?"
        chat.query_one("#input").focus()
        await pilot.press("enter")
        await until(pilot, lambda: chat.gen is None and chat.messages[-1].content != "" and
                    chat.messages[-2].content == "And in Paris?")
        got = chat.messages[-1].stats
        assert got["restored_tokens"] > 0 and got["prefilled_tokens"] < got["prompt_tokens"] // 2, json.dumps(got)
