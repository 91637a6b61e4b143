"""Every tool the chat can offer, from every source, under one interface: list, switch, call.

Names: a tool keeps its own name unless another source has a tool of that name; then each of them
is `<server>__<tool>` (oterm and Claude Desktop prefix the same way). A prefixed name is always
accepted by `call`, so a model that learnt `time__get_current_time` keeps working, and since servers
come up in the background the bare name of a tool can become prefixed when a later server brings the
same name. Names are made of letters, digits, `_`, `-` and `.` (what the engine's tool template
takes); other characters become `_`.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterable, Optional, Sequence

from .base import ServerState, ServerStatus, ToolResult, ToolSource, ToolSpec
from .schema import argument_problem

DEFAULT_CALL_TIMEOUT = 60.0
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def safe_name(name: str) -> str:
    return _UNSAFE.sub("_", name) or "_"


class ToolBox:
    def __init__(self, sources: Sequence[ToolSource], call_timeout: float = DEFAULT_CALL_TIMEOUT,
                 servers: Any = None, disabled: Iterable[str] = ()):
        self.sources = list(sources)
        self.call_timeout = call_timeout
        self._servers = servers  # the McpServers whose tasks hold the connections (started, closed here)
        self._disabled = set(disabled)  # keys (server/tool) switched off

    @classmethod
    def create(cls, config, allow_dirs: Sequence[str] = (), shell: bool = False,
               call_timeout: float = DEFAULT_CALL_TIMEOUT, start_timeout: Optional[float] = None,
               disabled: Iterable[str] = (), extra: Sequence[ToolSource] = ()) -> "ToolBox":
        """The built-ins, `config`'s servers (not started: `start()`) and `extra` sources."""
        from .builtin import BuiltinTools
        from .servers import DEFAULT_START_TIMEOUT, McpServers
        servers = McpServers(config.servers, start_timeout or DEFAULT_START_TIMEOUT)
        return cls([BuiltinTools(allow_dirs, shell=shell), *servers.servers, *extra], call_timeout, servers, disabled)

    def start(self) -> None:
        if self._servers is not None:
            self._servers.start()

    def wait_started(self, timeout: Optional[float] = None) -> bool:
        return self._servers.wait_started(timeout) if self._servers is not None else True

    def close(self) -> None:
        if self._servers is not None:
            self._servers.close()

    def __enter__(self) -> "ToolBox":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- listing
    def statuses(self) -> list[ServerStatus]:
        return [s.status() for s in self.sources]

    def tools(self) -> list[ToolSpec]:
        """Every tool of every ready source, with the name the model sees and its on/off flag."""
        listed = [(src, t) for src in self.sources for t in src.tools()]
        counts: dict[str, int] = {}
        for _, t in listed:
            counts[safe_name(t.tool)] = counts.get(safe_name(t.tool), 0) + 1
        out = []
        for src, t in listed:
            name = safe_name(t.tool)
            if counts[name] > 1:
                name = f"{safe_name(src.name)}__{name}"
            out.append(ToolSpec(name=name, server=t.server, tool=t.tool, description=t.description,
                                input_schema=t.input_schema, enabled=t.key not in self._disabled,
                                always_ask=t.always_ask, read_only=t.read_only))
        return out

    def declarations(self) -> list[dict]:
        """The enabled tools as the engine takes them (OpenAI-style function declarations)."""
        return [t.declaration() for t in self.tools() if t.enabled]

    def set_enabled(self, name: str, enabled: bool) -> None:
        """By the model-facing name or the `server/tool` key; remembered across renames."""
        spec = self.find(name)
        key = spec.key if spec is not None else name
        (self._disabled.discard if enabled else self._disabled.add)(key)

    def disabled(self) -> list[str]:
        """The `server/tool` keys switched off."""
        return sorted(self._disabled)

    def find(self, name: str) -> Optional[ToolSpec]:
        tools = self.tools()
        for t in tools:
            if name in (t.name, t.key):
                return t
        for t in tools:  # the prefixed form of a tool whose name is unique now
            if name == f"{safe_name(t.server)}__{safe_name(t.tool)}":
                return t
        return None

    # -- calling
    def call(self, name: str, arguments: Any, timeout: Optional[float] = None) -> ToolResult:
        """Run a tool the model asked for. Every failure (unknown or switched-off tool, arguments
        that fail the schema, the server's error or timeout) is an error result for the model to
        read, never an exception; arguments that fail the schema run nothing."""
        spec = self.find(name)
        if spec is None:
            for src in self.sources:  # a tool of a server that failed (or is still starting)
                status = src.status()
                if status.state is ServerState.READY:
                    continue
                prefix = f"{safe_name(src.name)}__"
                if name.startswith(prefix) or any(name in (safe_name(t.tool), prefix + safe_name(t.tool))
                                                  for t in src.listed_tools()):
                    return ToolResult.error(f"{name}: {status.line()}")
            near = [t.name for t in self.tools() if t.name.endswith(f"__{name}")]
            return ToolResult.error(f"unknown tool {name!r}" + (f" (did you mean {' or '.join(near)}?)" if near else ""))
        if not spec.enabled:
            return ToolResult.error(f"the tool {spec.name!r} is switched off")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return ToolResult.error(f"the arguments to {spec.name} are not JSON ({e.msg}); nothing was run")
        if arguments is None:
            arguments = {}
        problem = argument_problem(spec.input_schema, arguments)
        if problem:
            return ToolResult.error(f"the arguments do not match {spec.name}'s schema: {problem}; nothing was run")
        source = next(s for s in self.sources if s.name == spec.server)
        return source.call(spec.tool, arguments, timeout or self.call_timeout)

    # -- the engine's tool loop (engine/tool_loop.py) gives calls as the engine parsed them:
    # {"id", "type": "function", "function": {"name", "arguments"}}
    def spec_for_call(self, call: dict) -> Optional[ToolSpec]:
        """The tool a call names (for the approval question), or None for an unknown one."""
        return self.find(call.get("function", {}).get("name", ""))

    def call_parsed(self, call: dict, timeout: Optional[float] = None) -> ToolResult:
        """`call()` for a call as the engine parsed it (the app keeps the result's images)."""
        fn = call.get("function", {})
        return self.call(fn.get("name", ""), fn.get("arguments"), timeout)

    def call_for_loop(self, call: dict, timeout: Optional[float] = None) -> tuple[str, bool]:
        """`run_tool_loop`'s `call_tool`: (result text, is_error)."""
        r = self.call_parsed(call, timeout)
        return r.text, r.is_error
