"""The MCP server list: `<data dir>/mcp.json`, or the file `--mcp-config` names.

The format is the `mcpServers` object Claude Desktop, Cursor, Cline and oterm read, so a user's
existing file works unchanged:

    {"mcpServers": {
        "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC"}},
        "docs": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer ..."}}}}

An entry with `command` is a stdio server (`args`, `env`, `cwd` optional); one with `url` is a
streamable-HTTP server (`headers` optional), or an SSE one when `"type": "sse"` (Cursor's and
Cline's spelling for the older transport). `"disabled": true` (Cline) keeps an entry without
starting it. Keys we do not use (`autoApprove`, `timeout`, `alwaysAllow`, comments ...) are
ignored. A file that is not JSON or not this shape is one `ConfigError` line naming the file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

CONFIG_NAME = "mcp.json"
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KB; anything bigger is not one
HTTP_TYPES = {"http", "streamable-http", "streamable_http", "streamableHttp"}


class ConfigError(ValueError):
    """A config file that cannot be used, in one line naming it. Bad input by its class (the CLI's
    rule for errors without an engine `kind`: exit status 2); the app shows the line and starts no
    servers."""


@dataclass(frozen=True)
class ServerConfig:
    name: str
    transport: str  # "stdio" | "http" | "sse"
    command: str = ""
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None
    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    disabled: bool = False

    def __post_init__(self):
        assert self.transport in ("stdio", "http", "sse"), self.transport
        assert bool(self.command) == (self.transport == "stdio"), self


@dataclass(frozen=True)
class ToolsConfig:
    path: Optional[Path]  # None: no file (no servers configured)
    servers: tuple[ServerConfig, ...] = ()


def default_config_path(data_dir: Optional[str | Path] = None) -> Path:
    """`<data dir>/mcp.json`: the one folder edgegem keeps its files in (`--data-dir`,
    $EDGEGEM_DATA_DIR, else ~/.local/share/edgegem), as oterm keeps its config in its data dir."""
    from engine.models_dir import data_dir as edgegem_data_dir
    return edgegem_data_dir(data_dir) / CONFIG_NAME


def load_config(path: Optional[str | Path] = None, data_dir: Optional[str | Path] = None) -> ToolsConfig:
    """`path` (--mcp-config) must exist; the default file may be missing (then no servers)."""
    if path is None:
        default = default_config_path(data_dir)
        if not default.exists():
            return ToolsConfig(path=None)
        path = default
    path = Path(path).expanduser()
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size:,} bytes is too big for an MCP config file")
        text = path.read_text(encoding="utf-8-sig")  # editors on Windows write a BOM
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return ToolsConfig(path=path, servers=parse_servers(data, str(path)))


def parse_servers(data: Any, where: str) -> tuple[ServerConfig, ...]:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object with \"mcpServers\"")
    servers = data.get("mcpServers", {})  # a file with other settings only has no servers
    if not isinstance(servers, dict):
        raise ConfigError(f"{where}: \"mcpServers\" must be an object of name: server")
    return tuple(_server(name, entry, where) for name, entry in servers.items())


def _server(name: str, entry: Any, where: str) -> ServerConfig:
    at = f"{where}: server {name!r}"
    if not name.strip():
        raise ConfigError(f"{where}: a server has an empty name")
    if not isinstance(entry, dict):
        raise ConfigError(f"{at}: expected an object with \"command\" or \"url\"")
    kind = entry.get("type", entry.get("transport"))
    disabled = entry.get("disabled", False) is True
    if "command" in entry and kind in (None, "stdio"):
        command = _string(entry["command"], f"{at}: \"command\"")
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
            raise ConfigError(f"{at}: \"args\" must be a list of strings")
        cwd = entry.get("cwd")
        if cwd is not None:
            cwd = str(Path(_string(cwd, f"{at}: \"cwd\"")).expanduser())
        return ServerConfig(name, "stdio", command=command, args=tuple(str(a) for a in args),
                            env=_string_map(entry.get("env"), f"{at}: \"env\""), cwd=cwd, disabled=disabled)
    url = entry.get("url", entry.get("serverUrl"))  # Windsurf writes serverUrl
    if url is not None and (kind is None or kind in HTTP_TYPES or kind == "sse"):
        url = _string(url, f"{at}: \"url\"")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{at}: \"url\" must start with http:// or https://")
        return ServerConfig(name, "sse" if kind == "sse" else "http", url=url,
                            headers=_string_map(entry.get("headers"), f"{at}: \"headers\""), disabled=disabled)
    if kind is not None and kind not in ("stdio", "sse") and kind not in HTTP_TYPES:
        raise ConfigError(f"{at}: unknown \"type\" {kind!r} (stdio, http or sse)")
    raise ConfigError(f"{at}: needs \"command\" (a stdio server) or \"url\" (an HTTP server)")


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{what} must be a non-empty string")
    return value


def _string_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be an object of name: value")
    bad = [k for k, v in value.items() if not isinstance(v, (str, int, float, bool))]
    if bad:
        raise ConfigError(f"{what}: {bad[0]!r} must be a string")
    return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in value.items()}
