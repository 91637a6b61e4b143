"""Snapshots (pytest-textual-snapshot) of the tool loop on the scripted model: the approval prompt,
and a conversation with a tool call, its blocks collapsed and expanded.

Update after an intended UI change with `pytest tests/app/test_app_tool_snapshots.py --snapshot-update`
and look at the SVGs in tests/app/__snapshots__/ before committing them.
"""
from __future__ import annotations

from textual.widgets import Collapsible

from app.screens.chat import ChatScreen
from app.screens.tools import ApprovalScreen
from app.widgets.chat_input import ChatInput
from tests.app.test_app_snapshots import SIZE, _until
from tests.app.test_app_tools import CLOCK_CALL, tools_app


def _app(tmp_path, yes: bool):
    ChatInput.cursor_blink = False
    app, _client, _source = tools_app(tmp_path, [{"pieces": ["Let me check the clock."], "calls": [CLOCK_CALL]}],
                                      yes=yes)
    return app


async def _ask(pilot) -> ChatScreen:
    await _until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen))
    chat = pilot.app.screen
    chat.query_one("#input").text = "What time is it in UTC?"
    await pilot.press("enter")
    return chat


def test_snapshot_tool_approval_prompt(snap_compare, tmp_path):
    async def run_before(pilot) -> None:
        await _ask(pilot)
        await _until(pilot, lambda: isinstance(pilot.app.screen, ApprovalScreen) and pilot.app.screen.is_mounted)
        await pilot.pause(0.3)

    assert snap_compare(_app(tmp_path, yes=False), terminal_size=SIZE, run_before=run_before)


def _answered(expand: bool):
    async def run_before(pilot) -> None:
        chat = await _ask(pilot)
        await _until(pilot, lambda: chat.gen is None and len(chat.messages) == 4)
        if expand:
            for c in chat.query(Collapsible):
                if "tool-call" in c.classes or "tool-result" in c.classes:
                    c.collapsed = False
        await pilot.pause(0.7)  # the status panel's next refresh
    return run_before


def test_snapshot_tool_call_collapsed(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path, yes=True), terminal_size=SIZE, run_before=_answered(False))


def test_snapshot_tool_call_expanded(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path, yes=True), terminal_size=SIZE, run_before=_answered(True))
