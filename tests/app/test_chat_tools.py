"""Tools in `edgegem chat` (app/cli_chat_tools.py): the built-ins offered to a tiny Gemma-4 with the
31B template, the tool loop through the command line (calls shown, results given back, the step
limit), and the y/c/a/n question."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType

from app.cli_chat_tools import asker
from app.tools import ApprovalPolicy, ToolBox, ToolsConfig
from tiny_models import TinySpec, write_tiny_gemma4

TEMPLATE = (Path(__file__).parents[1] / "data" / "google-gemma-4-31B-it.jinja").read_text()
SPEC = TinySpec(tool_tokens=True, extra={"tokenizer.chat_template": (TEMPLATE, GGUFValueType.STRING)})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("chat-tools") / "tools.gguf", SPEC, seed=41)


def test_chat_runs_the_tool_loop_shows_calls_and_stops_at_the_step_limit(tiny, tmp_path):
    """An mcp.json without servers: the built-in date_time is the one tool (the file tools need
    --allow-dir); the random model, made to call a tool every reply, calls it twice and stops."""
    config = tmp_path / "mcp.json"
    config.write_text('{"mcpServers": {}}')
    env = {**os.environ, "EDGEGEM_DATA_DIR": str(tmp_path / "data")}
    r = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--model", str(tiny), "--device", "cpu",
                        "--mcp-config", str(config), "--yes-tools", "--tool-choice", "required",
                        "--max-tool-steps", "2", "--temperature", "0", "--max-tokens", "200"],
                       input="What time is it?\n\n", capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    shown = [line for line in r.stdout.splitlines() if line.startswith("[date_time ")]
    assert len(shown) == 2 and all(line.startswith("[date_time result: 20") for line in shown), r.stdout
    assert "stopped after 2 tool steps" in r.stderr


def test_the_prompt_asks_until_it_understands_and_remembers_a_conversation_answer(tmp_path):
    box = ToolBox.create(ToolsConfig(path=None), [str(tmp_path)])
    policy = ApprovalPolicy(tmp_path / "approvals.json")
    answers = iter(["maybe", "c", "n"])
    asked = []

    def read(prompt):
        asked.append(prompt)
        return next(answers)

    approve = asker(box, policy, "conv-1", read)
    call = {"id": "c1", "type": "function", "function": {"name": "list_dir", "arguments": {"path": str(tmp_path)}}}
    assert approve(call) is True and len(asked) == 2  # "maybe" is asked again
    assert approve(call) is True and len(asked) == 2  # this conversation: not asked again
    other = asker(box, policy, "conv-2", read)
    assert other(call) is False and len(asked) == 3  # another conversation asks; "n" refuses
    assert asker(box, policy, "conv-1", read)({"function": {"name": "nope", "arguments": {}}}) is False
