"""The chat app's tools for one run: the ToolBox (built-ins and MCP servers, started in the
background with the app, stopped with it), the approval policy, and which tools are switched off
(saved in `<data dir>/tool-switches.json`, so a tool switched off stays off next time). No UI here:
the chat screen and the Tools screen read and drive it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .approval import ApprovalPolicy, write_json
from .base import ServerState
from .config import ToolsConfig
from .toolbox import DEFAULT_CALL_TIMEOUT, ToolBox

SWITCHES_FILE = "tool-switches.json"
DEFAULT_MAX_STEPS = 8


@dataclass
class ToolOptions:
    """What the command line says about tools (app/cli_mcp.add_tool_args)."""

    config: ToolsConfig
    allow_dirs: Sequence[str] = ()
    shell: bool = False
    yes_tools: bool = False
    max_steps: int = DEFAULT_MAX_STEPS
    start_timeout: Optional[float] = None
    call_timeout: float = DEFAULT_CALL_TIMEOUT  # seconds a call may take (its result then says it timed out)
    extra_sources: list = field(default_factory=list)  # more ToolSources (tests: a scripted one)


class AppTools:
    def __init__(self, options: ToolOptions, data_dir: Path):
        self.options = options
        self.switches_path = Path(data_dir) / SWITCHES_FILE
        self.warning = ""  # one line when the switches file could not be read
        self.box = ToolBox.create(options.config, options.allow_dirs, shell=options.shell,
                                  call_timeout=options.call_timeout, start_timeout=options.start_timeout,
                                  disabled=self._load_switches(),
                                  extra=options.extra_sources)
        self._said: set[str] = set()  # failed sources already reported (new_failures)
        self.policy = ApprovalPolicy(Path(data_dir) / "tool-approvals.json", yes_tools=options.yes_tools)

    def start(self) -> None:
        """Servers start in the background: the chat opens at once, their tools come when ready."""
        self.box.start()

    def close(self) -> None:
        self.box.close()

    # -- what the chat offers
    def declarations(self) -> list[dict]:
        return self.box.declarations()

    def summary(self) -> str:
        """The status panel's line: tools on, servers starting or failed."""
        tools = self.box.tools()
        on = sum(t.enabled for t in tools)
        states = [s.state for s in self.box.statuses()]
        extra = [f"{states.count(st)} {st.value}" for st in (ServerState.STARTING, ServerState.FAILED)
                 if states.count(st)]
        return f"{on} of {len(tools)} on" + (f", {', '.join(extra)}" if extra else "")

    def new_failures(self) -> list:
        """Sources that failed (did not start, hung, died) since the last call: each is said once,
        in the conversation, as it happens."""
        failed = [s for s in self.box.statuses() if s.state is ServerState.FAILED and s.name not in self._said]
        self._said.update(s.name for s in failed)
        return failed

    def set_enabled(self, name: str, enabled: bool) -> None:
        self.box.set_enabled(name, enabled)
        self._save_switches()

    # -- the switches file: {"off": ["server/tool", ...]}
    def _load_switches(self) -> set[str]:
        if not self.switches_path.exists():
            return set()
        try:
            off = json.loads(self.switches_path.read_text(encoding="utf-8"))["off"]
            if not isinstance(off, list):
                raise ValueError("\"off\" is not a list")
            return {k for k in off if isinstance(k, str)}
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.warning = f"{self.switches_path}: ignored ({e.__class__.__name__})"
            return set()

    def _save_switches(self) -> None:
        write_json(self.switches_path, {"off": self.box.disabled()})
