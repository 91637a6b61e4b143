"""MCP servers in the background: one asyncio loop in a thread of its own holds every connection.

`McpServers.start()` returns at once (the chat opens while servers start); each server is a task
that connects (stdio: spawn the command; http/sse: connect to the url), lists its tools and then
holds the connection until `close()`. A server that cannot start, does not answer within
`start_timeout`, writes garbage or dies is one line of status (`ServerStatus.error`); the others go
on. Calls come from any thread (the app's worker, `edgegem chat`'s main thread) and block until the
result or the call's timeout. The SDK is `mcp` 2.x (`mcp.Client`): its transports, version
negotiation and process shutdown (stdin closed, 2 s, SIGTERM, SIGKILL) are used as they are.
"""
from __future__ import annotations

import atexit
import contextvars
import logging
import math
import tempfile
import threading
from collections import deque
from typing import Any, Optional, Sequence

from .base import ServerState, ServerStatus, ToolResult, ToolSource, ToolSpec
from .config import ServerConfig
from .results import from_mcp
from .schema import schema_problem

DEFAULT_START_TIMEOUT = 30.0  # `npx -y pkg` / `uvx pkg` download on first start: seconds, not minutes
LIST_PAGES = 100  # a tools/list that pages for ever cannot hang the start
STDERR_TAIL = 4096  # bytes of a stdio server's stderr read back for its failure line

_current: contextvars.ContextVar[Optional["McpServer"]] = contextvars.ContextVar("edgegem_mcp_server", default=None)


def _leaf(e: BaseException) -> BaseException:
    """The first leaf of an exception group (the SDK's task groups wrap errors; duck-typed: Python
    3.10 has groups only through anyio's backport)."""
    while isinstance(getattr(e, "exceptions", None), (list, tuple)) and e.exceptions:
        e = e.exceptions[0]
    return e


def one_line(e: BaseException) -> str:
    e = _leaf(e)
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"cannot run {e.filename!r}: no such file or command"
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _start_error(e: BaseException) -> str:
    from mcp import MCPError
    from mcp_types import CONNECTION_CLOSED
    e = _leaf(e)
    if isinstance(e, MCPError) and e.code == CONNECTION_CLOSED:
        return "exited before answering"  # fail() adds the last line of its stderr: usually why
    return one_line(e)


class _LogTap(logging.Handler):
    """The SDK logs transport trouble (a line that is not JSON-RPC, a failed read) with
    `logger.exception`: to stderr by default, which would draw over the full-screen app. Kept
    here instead, per server (the server whose task logged, through a context variable)."""

    def __init__(self, lines: deque):
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        server = _current.get()
        self.lines.append(f"{server.name if server else '-'}: {record.getMessage()}")


class McpServer(ToolSource):
    """One configured server: its state, tools and connection (owned by the loop's task)."""

    def __init__(self, config: ServerConfig, owner: "McpServers"):
        self.name = config.name
        self.config = config
        self._owner = owner
        self._lock = threading.Lock()
        self._state = ServerState.DISABLED if config.disabled else ServerState.STARTING
        self._error = ""
        self._notes: list[str] = []
        self._tools: list[ToolSpec] = []
        self._stray_lines = 0  # lines on stdout that were not JSON-RPC
        self.client: Any = None
        self.scope: Any = None  # the anyio CancelScope of the task holding the connection
        self.stopping = False
        self.stderr: Any = None
        self.done = threading.Event()

    # -- read from any thread
    def status(self) -> ServerStatus:
        with self._lock:
            return ServerStatus(self.name, self._state, self.config.transport, self._error, tuple(self._notes),
                                len(self._tools))

    def tools(self) -> list[ToolSpec]:
        with self._lock:
            return list(self._tools) if self._state is ServerState.READY else []

    def listed_tools(self) -> list[ToolSpec]:
        with self._lock:
            return list(self._tools)

    def call(self, tool: str, arguments: dict, timeout: float) -> ToolResult:
        state = self.status()
        if state.state is not ServerState.READY:
            return ToolResult.error(f"server {self.name!r} is {state.state.value}" +
                                    (f": {state.error}" if state.error else ""))
        portal = self._owner.portal
        try:
            if portal is None:
                raise RuntimeError("closed")
            return portal.call(self._call, tool, arguments, timeout)
        except RuntimeError as e:  # the loop is gone: the servers were closed
            return ToolResult.error(f"server {self.name!r} is stopped ({one_line(e)})")

    # -- state changes (loop thread)
    def _set(self, state: ServerState, error: str = "") -> None:
        with self._lock:
            if self._state is ServerState.FAILED and state is ServerState.STOPPED:
                return  # a failed server stays failed, with its reason
            self._state, self._error = state, error or self._error
        self._owner._changed()

    def fail(self, error: str) -> None:
        tail = self.stderr_tail()
        if tail and tail not in error:
            error = f"{error} (stderr: {tail})"
        if self._stray_lines:
            n = self._stray_lines
            error += f" ({n} line{'s were' if n > 1 else ' was'} not JSON-RPC)"
        self._set(ServerState.FAILED, error)

    def stderr_tail(self) -> str:
        if self.stderr is None:
            return ""
        try:
            self.stderr.flush()
            self.stderr.seek(0, 2)
            end = self.stderr.tell()
            self.stderr.seek(max(0, end - STDERR_TAIL))
            lines = [ln.strip() for ln in self.stderr.read().splitlines() if ln.strip()]
        except (OSError, ValueError):
            return ""
        return lines[-1][:200] if lines else ""

    def _accept(self, listed: Sequence[Any]) -> None:
        tools, notes = [], []
        for t in listed:
            problem = schema_problem(t.input_schema)
            if problem:
                notes.append(f"tool {t.name!r} refused: its input schema {problem}")
                continue
            ann = t.annotations
            tools.append(ToolSpec(name=t.name, server=self.name, tool=t.name, description=t.description or "",
                                  input_schema=dict(t.input_schema),
                                  read_only=bool(ann is not None and ann.read_only_hint)))
        with self._lock:
            self._tools, self._notes = tools, notes
        self._set(ServerState.READY, "")

    # -- the loop's tasks
    async def _on_message(self, message: Any) -> None:
        if isinstance(message, Exception):  # a transport fault: typically a stdout line that is not JSON-RPC
            self._stray_lines += 1

    def _client(self):
        from mcp import Client, StdioServerParameters
        c = self.config
        common = dict(message_handler=self._on_message, cache=None)
        if c.transport == "stdio":
            # The server's stderr goes to a file, never to the terminal the app draws on; its last
            # line is the reason shown when the server fails ("missing API key").
            # (mcp.Client takes a transport: any async context manager giving the two streams.)
            from mcp.client.stdio import stdio_client
            self.stderr = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
            params = StdioServerParameters(command=c.command, args=list(c.args), env=c.env or None, cwd=c.cwd)
            return Client(stdio_client(params, errlog=self.stderr), **common)
        if c.transport == "sse":
            from mcp.client.sse import sse_client
            return Client(sse_client(c.url, headers=c.headers or None), **common)
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client
        http = create_mcp_http_client(headers=c.headers or None)
        self._http = http  # closed with the connection (the transport leaves a client it was given open)
        return Client(streamable_http_client(c.url, http_client=http), **common)

    async def serve(self, start_timeout: float) -> None:
        import anyio
        _current.set(self)
        self._http = None
        try:
            if self.stopping:  # closed before this task ran
                return
            # Built (the SDK imported: ~1 s on a busy core) before the start clock runs.
            connection = self._client()
            self.scope = anyio.CancelScope(deadline=anyio.current_time() + start_timeout)
            if self.stopping:  # close() ran while the SDK imported and found no scope to cancel
                self.scope.cancel()
            with self.scope:
                async with connection as client:
                    tools: list[Any] = []
                    cursor = None
                    for _ in range(LIST_PAGES):
                        page = await client.list_tools(cursor=cursor)
                        tools += page.tools
                        cursor = page.next_cursor
                        if not cursor:
                            break
                    self.client = client
                    self._accept(tools)
                    self.scope.deadline = math.inf
                    await anyio.sleep_forever()
            if self.scope.cancelled_caught and not self.stopping:
                self.fail(f"did not answer within {start_timeout:g} s")
        except Exception as e:  # noqa: BLE001 - whatever a server does, it is its status line, never the app's
            if not self.stopping:
                self.fail(_start_error(e))
        finally:
            self.client = None
            if self._http is not None:
                await self._http.aclose()
            self._set(ServerState.STOPPED)
            if self.stderr is not None:
                self.stderr.close()
                self.stderr = None
            self.done.set()

    async def _call(self, tool: str, arguments: dict, timeout: float) -> ToolResult:
        import anyio
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED
        _current.set(self)
        client = self.client
        if client is None:
            return ToolResult.error(f"server {self.name!r} is not connected")
        try:
            with anyio.fail_after(timeout):
                r = await client.call_tool(tool, arguments)
        except TimeoutError:
            return ToolResult.error(f"{tool} did not answer within {timeout:g} s")
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:  # the server died under the call: its tools go with it
                self.fail(f"exited during a call to {tool}")
                return ToolResult.error(f"server {self.name!r} exited during the call")
            return ToolResult.error(f"{tool}: {one_line(e)}")
        except Exception as e:  # noqa: BLE001 - a malformed or refused answer is this call's error, not the app's
            return ToolResult.error(f"{tool}: {one_line(e)}")
        return from_mcp(r.content, bool(r.is_error), r.structured_content)


class McpServers:
    """Every configured server, started in the background, stopped by `close()`."""

    def __init__(self, configs: Sequence[ServerConfig], start_timeout: float = DEFAULT_START_TIMEOUT):
        self.servers = [McpServer(c, self) for c in configs]
        self.start_timeout = start_timeout
        self.log: deque[str] = deque(maxlen=200)  # the SDK's warnings, "server: message"
        self.portal: Any = None
        self._portal_cm: Any = None
        self._cond = threading.Condition()

    def start(self) -> None:
        """Returns at once; each server's status moves from starting to ready or failed."""
        live = [s for s in self.servers if not s.config.disabled]
        if not live:
            return
        from anyio.from_thread import start_blocking_portal
        _tap_sdk_log(self.log)
        self._portal_cm = start_blocking_portal(name="edgegem-mcp")
        self.portal = self._portal_cm.__enter__()
        atexit.register(self.close)  # a front end that ends without close() still stops its servers
        # One task that starts the others: the portal waits for the loop to take each task it is
        # given, and a starting server holds the loop for ~1 s (importing the SDK, spawning).
        self.portal.start_task_soon(self._serve_all, live)

    async def _serve_all(self, live: list[McpServer]) -> None:
        import anyio
        async with anyio.create_task_group() as tg:
            for s in live:
                tg.start_soon(s.serve, self.start_timeout)

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait_started(self, timeout: Optional[float] = None) -> bool:
        """Block until no server is starting (True) or `timeout` passes (False)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: all(s.status().state is not ServerState.STARTING for s in self.servers), timeout)

    def close(self) -> None:
        """Stop every server (the SDK's shutdown: stdin closed, then SIGTERM/SIGKILL; bounded)."""
        if self.portal is None:
            return
        for s in self.servers:
            s.stopping = True
            if s.scope is not None:
                try:
                    self.portal.call(s.scope.cancel)
                except RuntimeError:
                    pass
        atexit.unregister(self.close)
        try:
            self._portal_cm.__exit__(None, None, None)  # waits for every server's task to finish
        finally:
            self.portal = None

    def __enter__(self) -> "McpServers":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tap_sdk_log(lines: deque) -> None:
    log = logging.getLogger("mcp")
    if not any(isinstance(h, _LogTap) for h in log.handlers):
        log.addHandler(_LogTap(lines))
        log.propagate = False
    else:
        next(h for h in log.handlers if isinstance(h, _LogTap)).lines = lines
