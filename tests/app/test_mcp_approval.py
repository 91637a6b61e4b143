"""The approval policy: once, this conversation, always (saved), deny; --yes-tools; the shell tool."""
from __future__ import annotations

import json

from app.tools import ApprovalPolicy, Decision, ToolSpec

TIME = ToolSpec("get_current_time", "time", "get_current_time", "", {"type": "object"})
ECHO = ToolSpec("test__echo", "test", "echo", "", {"type": "object"})
SHELL = ToolSpec("shell", "builtin", "shell", "", {"type": "object"}, always_ask=True)


def test_once_asks_again_and_deny_does_not_run(tmp_path):
    p = ApprovalPolicy(tmp_path / "a.json")
    assert p.needs_asking(TIME, "c1")
    assert p.decide(TIME, Decision.ALLOW_ONCE, "c1") is True
    assert p.needs_asking(TIME, "c1")
    assert p.decide(TIME, Decision.DENY, "c1") is False
    assert p.needs_asking(TIME, "c1") and not (tmp_path / "a.json").exists()


def test_this_conversation_only(tmp_path):
    p = ApprovalPolicy(tmp_path / "a.json")
    assert p.decide(TIME, Decision.ALLOW_CONVERSATION, "c1")
    assert not p.needs_asking(TIME, "c1")
    assert p.needs_asking(TIME, "c2") and p.needs_asking(ECHO, "c1")
    p.end_conversation("c1")
    assert p.needs_asking(TIME, "c1")
    assert not (tmp_path / "a.json").exists()


def test_always_is_saved_per_server_and_tool_and_survives_a_restart(tmp_path):
    path = tmp_path / "sub" / "tool-approvals.json"
    p = ApprovalPolicy(path)
    assert p.decide(TIME, Decision.ALWAYS, "c1")
    assert json.loads(path.read_text()) == {"always": {"time": ["get_current_time"]}}
    again = ApprovalPolicy(path)
    assert not again.needs_asking(TIME, "any conversation")
    # the same tool name on another server is another tool; a renamed (prefixed) one is the same
    assert again.needs_asking(ToolSpec("get_current_time", "clock", "get_current_time", "", {}))
    assert not again.needs_asking(ToolSpec("time__get_current_time", "time", "get_current_time", "", {}))
    assert again.always_allowed() == [("time", "get_current_time")]
    again.forget("time", "get_current_time")
    assert ApprovalPolicy(path).needs_asking(TIME)
    assert [f.name for f in path.parent.iterdir()] == ["tool-approvals.json"]  # no temporary file left


def test_yes_tools_skips_asking_except_for_the_shell_tool(tmp_path):
    p = ApprovalPolicy(tmp_path / "a.json", yes_tools=True)
    assert not p.needs_asking(TIME) and not p.needs_asking(ECHO)
    assert p.needs_asking(SHELL)


def test_the_shell_tool_asks_every_time_whatever_was_chosen(tmp_path):
    path = tmp_path / "a.json"
    p = ApprovalPolicy(path)
    for decision in (Decision.ALWAYS, Decision.ALLOW_CONVERSATION, Decision.ALLOW_ONCE):
        assert p.decide(SHELL, decision, "c1") is True
        assert p.needs_asking(SHELL, "c1")
    assert p.decide(SHELL, Decision.DENY, "c1") is False
    assert not path.exists()


def test_a_damaged_file_is_ignored_with_a_warning_and_rewritten(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("{not json")
    p = ApprovalPolicy(path)
    assert p.warning.startswith(f"{path}: ignored") and "\n" not in p.warning
    assert p.needs_asking(TIME)
    p.decide(TIME, Decision.ALWAYS)
    assert json.loads(path.read_text()) == {"always": {"time": ["get_current_time"]}}
    path.write_text('{"always": ["time/get_current_time"]}')
    assert ApprovalPolicy(path).warning


def test_no_file_keeps_always_for_this_run_only():
    p = ApprovalPolicy(None)
    p.decide(TIME, Decision.ALWAYS)
    assert not p.needs_asking(TIME) and ApprovalPolicy(None).needs_asking(TIME)


def test_answers_at_the_line_prompt():
    assert [Decision.from_answer(a) for a in ("y", " YES ", "c", "a", "n", "", "maybe")] == [
        Decision.ALLOW_ONCE, Decision.ALLOW_ONCE, Decision.ALLOW_CONVERSATION, Decision.ALWAYS, Decision.DENY,
        None, None]


def test_in_data_dir_uses_the_data_dir(tmp_path):
    assert ApprovalPolicy.in_data_dir(tmp_path).path == tmp_path / "tool-approvals.json"
