"""mcp.json: the mcpServers format other clients write works unchanged; a bad file is one line."""
from __future__ import annotations

import json

import pytest

from app.tools.config import ConfigError, default_config_path, load_config

# Claude Desktop's documented sample (modelcontextprotocol.io "Connect to local MCP servers"; its
# folders under the home folder written ~/ here: tests/repo/test_repo_paths.py)
CLAUDE_DESKTOP = {"mcpServers": {"filesystem": {
    "command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "~/Desktop",
                               "~/Downloads"]}}}


def _write(tmp_path, data, name="mcp.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def test_claude_desktop_sample_is_one_stdio_server(tmp_path):
    cfg = load_config(_write(tmp_path, CLAUDE_DESKTOP))
    (s,) = cfg.servers
    assert (s.name, s.transport, s.command) == ("filesystem", "stdio", "npx")
    assert s.args == ("-y", "@modelcontextprotocol/server-filesystem", "~/Desktop",
                      "~/Downloads")
    assert s.env == {} and not s.disabled


def test_http_sse_env_and_other_clients_keys(tmp_path):
    cfg = load_config(_write(tmp_path, {"mcpServers": {
        "remote": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}},
        "typed": {"type": "http", "url": "http://127.0.0.1:9/mcp"},
        "old": {"type": "sse", "url": "http://127.0.0.1:9/sse"},
        "windsurf": {"serverUrl": "https://example.com/mcp"},
        "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC", "DEBUG": True, "N": 3},
                 "autoApprove": ["get_current_time"], "timeout": 60, "alwaysAllow": []},
        "off": {"command": "x", "disabled": True}},
        "globalShortcut": "Ctrl+Space", "theme": "dark"}))
    by = {s.name: s for s in cfg.servers}
    assert [s.name for s in cfg.servers] == ["remote", "typed", "old", "windsurf", "time", "off"]
    assert by["remote"].transport == "http" and by["remote"].headers == {"Authorization": "Bearer x"}
    assert by["typed"].transport == "http" and by["old"].transport == "sse"
    assert by["windsurf"].url == "https://example.com/mcp"
    assert by["time"].env == {"TZ": "UTC", "DEBUG": "true", "N": "3"}
    assert by["off"].disabled


def test_missing_default_file_means_no_servers(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEGEM_DATA_DIR", str(tmp_path))
    from kernels.env import reload
    reload()
    assert default_config_path() == tmp_path / "mcp.json"
    assert load_config().servers == () and load_config().path is None
    _write(tmp_path, CLAUDE_DESKTOP)
    assert load_config().path == tmp_path / "mcp.json"
    assert load_config(data_dir=tmp_path / "elsewhere").servers == ()


def test_a_file_with_a_bom_and_no_servers_is_fine(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"other": 1}).encode())
    assert load_config(path).servers == ()


@pytest.mark.parametrize("text, needle", [
    ('{"mcpServers": {', "not valid JSON: Expecting property name enclosed in double quotes at line 1"),
    ("[]", 'expected a JSON object with "mcpServers"'),
    ('{"mcpServers": []}', '"mcpServers" must be an object'),
    ('{"mcpServers": {"a": "npx"}}', "server 'a': expected an object"),
    ('{"mcpServers": {"a": {"args": []}}}', "server 'a': needs \"command\""),
    ('{"mcpServers": {"a": {"command": ["npx"]}}}', "server 'a': \"command\" must be a non-empty string"),
    ('{"mcpServers": {"a": {"command": "x", "args": "-y"}}}', "\"args\" must be a list of strings"),
    ('{"mcpServers": {"a": {"command": "x", "env": {"K": null}}}}', "'K' must be a string"),
    ('{"mcpServers": {"a": {"url": "ftp://x"}}}', "must start with http:// or https://"),
    ('{"mcpServers": {"a": {"type": "websocket", "url": "ws://x"}}}', "unknown \"type\" 'websocket'"),
])
def test_a_malformed_file_is_one_line_naming_it(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    line = str(e.value)
    assert "\n" not in line and line.startswith(str(path)) and needle in line, line


def test_a_named_file_that_is_missing_or_not_text_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        load_config(tmp_path / "nope.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path / "bin.json")
