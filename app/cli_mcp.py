"""`edgegem mcp list`: start each configured MCP server, print its status and tools, stop them.

The first thing to run after editing mcp.json (docs/tools.md). Exit status 0 whatever the servers
do (a failed one's line says why); 2 with one line for a config file that cannot be read.
`add_tool_args` is the flag set the chat front ends take too (`--mcp-config`, `--allow-dir`,
`--shell-tool`, `--yes-tools`).
"""
from __future__ import annotations

import argparse
import json


def add_tool_args(p, approval: bool = True) -> None:
    g = p.add_argument_group("tools (docs/tools.md)")
    g.add_argument("--mcp-config", metavar="FILE",
                   help="MCP servers in the mcpServers format of Claude Desktop, Cursor and oterm "
                        "(default: <data dir>/mcp.json when it exists)")
    g.add_argument("--allow-dir", action="append", default=[], metavar="DIR",
                   help="a folder the built-in read_file and list_dir tools may read (repeatable; none: no file tools)")
    g.add_argument("--shell-tool", action="store_true",
                   help="offer the built-in shell tool (asks before every call, even with --yes-tools)")
    if approval:
        g.add_argument("--yes-tools", action="store_true", help="run tool calls without asking (not the shell tool)")


def add_command(sub) -> None:
    m = sub.add_parser("mcp", help="MCP servers: `edgegem mcp list` starts them and lists their tools")
    msub = m.add_subparsers(dest="mcp_cmd", metavar="list", required=True)
    ls = msub.add_parser("list", help="start each configured server, print its status and tools, stop them")
    add_tool_args(ls, approval=False)
    ls.add_argument("--data-dir", metavar="DIR", help="where mcp.json is looked for (default: $EDGEGEM_DATA_DIR, "
                                                      "else the platform's user data dir)")
    ls.add_argument("--timeout", type=float, default=30.0, metavar="S",
                    help="seconds each server has to start and list its tools (default 30)")
    ls.add_argument("--json", action="store_true")


def cmd_mcp(a: argparse.Namespace) -> int:
    from .tools import ToolBox, load_config
    from .tools.base import first_line
    from .tools.config import default_config_path
    config = load_config(a.mcp_config, a.data_dir)  # ConfigError: one line, exit status 2
    with ToolBox.create(config, a.allow_dir, shell=a.shell_tool, start_timeout=a.timeout) as box:
        box.wait_started()
        statuses, tools = box.statuses(), box.tools()
    if a.json:
        print(json.dumps(_as_json(config, statuses, tools), indent=1, ensure_ascii=False))
        return 0
    if config.path is None:
        print(f"no MCP servers configured (write {default_config_path(a.data_dir)} or pass --mcp-config FILE)")
    else:
        print(f"{config.path}: {len(config.servers)} server{'s' * (len(config.servers) != 1)}")
    for st in statuses:
        print(st.line())
        for note in st.notes:
            print(f"  ! {note}")
        for t in (t for t in tools if t.server == st.name):
            flags = ("on" if t.enabled else "off") + (", asks every call" if t.always_ask else "")
            print(f"  {t.name} [{flags}]  {first_line(t.description)}")
    return 0


def _as_json(config, statuses, tools) -> dict:
    return {"config": str(config.path) if config.path else None,
            "servers": [{"name": st.name, "transport": st.transport, "state": st.state.value, "error": st.error,
                         "notes": list(st.notes),
                         "tools": [{"name": t.name, "tool": t.tool, "description": t.description,
                                    "enabled": t.enabled, "always_ask": t.always_ask, "read_only": t.read_only,
                                    "input_schema": t.input_schema} for t in tools if t.server == st.name]}
                        for st in statuses]}


COMMANDS = {"mcp": cmd_mcp}
