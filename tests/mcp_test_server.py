"""The MCP server the tool tests start (over stdio, or streamable HTTP with `--http PORT`): written
with the SDK's MCPServer (FastMCP in mcp 1.x), one tool per behaviour a client must survive.

`--bad-schema` adds a tool whose input schema is not valid JSON Schema; `--name N` renames it (two
copies give colliding tool names)."""
from __future__ import annotations

import argparse
import asyncio
import base64
import os
from typing import Literal

from mcp.server.mcpserver import Context, Image, MCPServer

# a 1x1 red PNG
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")


def build(name: str, bad_schema: bool) -> MCPServer:
    server = MCPServer(name, log_level="ERROR")

    @server.tool(description="Return the text unchanged.")
    def echo(text: str) -> str:
        return text

    @server.tool(description="Add two integers.")
    def add(a: int, b: int) -> int:
        return a + b

    @server.tool(description="The time in a zone (an enum argument: a tiny random model forced to call it ends).")
    def clock(zone: Literal["utc", "cet"]) -> str:
        return f"12:34 {zone}"

    @server.tool(description="Sleep, then answer.")
    async def slow(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "done"

    @server.tool(description="Always fails.")
    def fail() -> str:
        raise ValueError("this tool always fails")

    @server.tool(description="One megabyte of text.")
    def big() -> str:
        return "x" * (1 << 20)

    @server.tool(description="Kill this server's process.")
    def crash() -> str:
        os._exit(7)

    @server.tool(description="A 1x1 PNG.")
    def image() -> Image:
        return Image(data=PNG, format="png")

    @server.tool(description="An HTTP request header of this call (none over stdio).")
    def header(name: str, ctx: Context) -> str:
        return (ctx.headers or {}).get(name.lower(), "none")

    if bad_schema:
        @server.tool(description="Its schema is broken.")
        def broken(x: int) -> int:
            return x
        server._tool_manager._tools["broken"].parameters = {"type": "object", "properties": {"x": {"type": "bogus"}}}
    return server


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="test")
    p.add_argument("--bad-schema", action="store_true")
    p.add_argument("--http", type=int, metavar="PORT")
    a = p.parse_args()
    if os.environ.get("MCP_TEST_PIDFILE"):  # the config's "env" reached us; the test checks we are gone
        with open(os.environ["MCP_TEST_PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
    server = build(a.name, a.bad_schema)
    if a.http:
        server.run("streamable-http", host="127.0.0.1", port=a.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
