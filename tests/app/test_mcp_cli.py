"""`edgegem mcp list`: status and tools of each configured server, exit 0 whatever they do, 2 for
a config file that cannot be read."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from app.cli import main

SERVER = str(Path(__file__).resolve().parents[1] / "mcp_test_server.py")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "test": {"command": sys.executable, "args": [SERVER, "--bad-schema"], "autoApprove": []},
        "gone": {"command": "edgegem-no-such-command"}}}))
    return path


def test_mcp_list_prints_each_server_and_its_tools(config, tmp_path, capsys):
    assert main(["mcp", "list", "--mcp-config", str(config), "--allow-dir", str(tmp_path), "--timeout", "60"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{config}: 2 servers"
    assert out[1] == "builtin: ready (3 tools)"
    assert "  date_time [on]  The current date, time and day of the week, in the local time zone or a given one." in out
    assert "test: ready (9 tools)" in out
    assert "  add [on]  Add two integers." in out and "  echo [on]  Return the text unchanged." in out
    assert any(line.startswith("  ! tool 'broken' refused: its input schema is not valid JSON Schema") for line in out)
    assert out[-1] == "gone: failed (cannot run 'edgegem-no-such-command': no such file or command)"


def test_mcp_list_json(config, capsys):
    assert main(["mcp", "list", "--mcp-config", str(config), "--shell-tool", "--json", "--timeout", "60"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"] == str(config)
    builtin, test, gone = data["servers"]
    assert [t["name"] for t in builtin["tools"]] == ["date_time", "shell"]
    assert builtin["tools"][1]["always_ask"] is True
    assert (test["state"], test["transport"], len(test["tools"])) == ("ready", "stdio", 9)
    add = next(t for t in test["tools"] if t["name"] == "add")
    assert add["enabled"] and add["input_schema"]["required"] == ["a", "b"]
    assert test["notes"][0].startswith("tool 'broken' refused")
    assert (gone["state"], gone["tools"]) == ("failed", []) and "no such file" in gone["error"]


def test_mcp_list_without_a_config_lists_the_builtins(tmp_path, capsys):
    assert main(["mcp", "list", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"no MCP servers configured (write {tmp_path / 'mcp.json'} or pass --mcp-config FILE)"
    assert out[1:] == ["builtin: ready (1 tool)",
                       "  date_time [on]  The current date, time and day of the week, in the local time zone or a "
                       "given one."]


def test_a_malformed_config_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "mcp.json"
    bad.write_text('{"mcpServers": {"x": {"command": 1}}}')
    assert main(["mcp", "list", "--mcp-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == f"edgegem: error: {bad}: server 'x': \"command\" must be a non-empty string\n"
    assert main(["mcp", "list", "--mcp-config", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith(f"edgegem: error: {tmp_path / 'missing.json'}: cannot read it")
