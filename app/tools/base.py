"""What every tool source (an MCP server, the built-ins) shows the rest of the app: its status,
its tools and a call. The app's Tools screen and `edgegem mcp list` read `ServerStatus` and
`ToolSpec`; the tool loop sends `ToolSpec.declaration()` to the engine and `ToolResult.text` back."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional


def first_line(text: str, limit: int = 100) -> str:
    """A description's first line, cut to `limit` characters with an ellipsis (listings)."""
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"


class ServerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"  # did not start, hung, died or spoke garbage: `error` says which, in one line
    DISABLED = "disabled"  # `"disabled": true` in the config: listed, never started
    STOPPED = "stopped"


@dataclass(frozen=True)
class ToolSpec:
    name: str  # the name the model sees (`server__tool` when two sources share a tool name)
    server: str  # the source's name ("builtin" for the built-ins)
    tool: str  # the tool's own name on its server
    description: str
    input_schema: dict
    enabled: bool = True
    # Ask before every call, whatever was allowed before (and --yes-tools): the shell tool.
    always_ask: bool = False
    read_only: bool = False  # the server's readOnlyHint: shown, never trusted to skip approval

    @property
    def key(self) -> str:
        """`server/tool`: what approvals are remembered under (stable when `name` gets prefixed)."""
        return f"{self.server}/{self.tool}"

    def declaration(self) -> dict:
        """The OpenAI-style function declaration the engine's tool template and grammar take."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.input_schema}}


@dataclass
class ToolResult:
    text: str  # what goes back to the model as the tool message (capped, notes appended)
    is_error: bool = False
    images: list[tuple[bytes, str]] = field(default_factory=list)  # (data, mime type) for the app to show
    truncated: bool = False
    structured: Optional[Any] = None  # the server's structuredContent, when it sent one

    @classmethod
    def error(cls, message: str) -> "ToolResult":
        return cls(text=f"error: {message}", is_error=True)


@dataclass(frozen=True)
class ServerStatus:
    name: str
    state: ServerState
    transport: str  # "stdio", "http", "sse", "builtin"
    error: str = ""  # the last error, one line
    notes: tuple[str, ...] = ()  # one line each: tools refused at listing, stray output
    n_tools: int = 0

    def line(self) -> str:
        detail = self.error or (f"{self.n_tools} tool{'s' * (self.n_tools != 1)}"
                                if self.state is ServerState.READY else "")
        return f"{self.name}: {self.state.value}" + (f" ({detail})" if detail else "")


class ToolSource(ABC):
    """One MCP server or the built-ins: a name, a status, tools and a blocking call."""

    name: str

    @abstractmethod
    def status(self) -> ServerStatus: ...

    @abstractmethod
    def tools(self) -> list[ToolSpec]:
        """This source's tools with their own names (the ToolBox renames on collisions)."""

    def listed_tools(self) -> list[ToolSpec]:
        """The tools this source listed when it was last ready (a failed server's, to say why a
        call to one of them cannot run)."""
        return self.tools()

    @abstractmethod
    def call(self, tool: str, arguments: dict, timeout: float) -> ToolResult:
        """Run `tool` (already validated against its schema); never raises for the tool's failure."""
