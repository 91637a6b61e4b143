"""The tool screens: the approval asked before a call runs, and the Tools screen (servers, their
tools switched on and off, the tools allowed always)."""
from __future__ import annotations

import json
from typing import Optional

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static, Switch

from app.tools.base import first_line

ANSWERS = {"once": "Allow once", "conversation": "This conversation", "always": "Always", "deny": "Deny"}


class ApprovalScreen(ModalScreen[str]):
    """Allow a call? Dismissed with "once" | "conversation" | "always" | "deny", or "stop" (Escape:
    the tool loop stops, what was done is kept). The arguments are shown as the tool gets them."""

    BINDINGS = [("escape", "dismiss('stop')", "Stop the loop"), ("y", "dismiss('once')", "Allow once"),
                ("c", "dismiss('conversation')", "This conversation"), ("a", "answer_always", "Always"),
                ("n", "dismiss('deny')", "Deny")]

    def __init__(self, spec, arguments) -> None:
        super().__init__()
        self.spec, self.arguments = spec, arguments

    def compose(self) -> ComposeResult:
        s = self.spec
        where = "a built-in tool" if s.server == "builtin" else f"from the MCP server {s.server!r}"
        with Vertical(classes="dialog approval"):
            yield Label(f"The model wants to run {s.name}, {where}", classes="heading", markup=False)
            if s.description:
                yield Static(first_line(s.description, 200), classes="hint", markup=False)
            with VerticalScroll(id="arguments-box"):
                yield Static(json.dumps(self.arguments, ensure_ascii=False, indent=1), id="arguments", markup=False)
            if s.always_ask:
                yield Static("This tool asks before every call.", classes="hint", markup=False)
            with Horizontal(classes="buttons"):
                for answer, label in ANSWERS.items():
                    if answer in ("conversation", "always") and s.always_ask:
                        continue
                    yield Button(label, id=answer, variant="error" if answer == "deny" else
                                 "primary" if answer == "once" else "default", compact=True)
            yield Static("y once · c this conversation · a always · n deny · Escape stops the loop",
                         classes="hint", markup=False)

    def on_mount(self) -> None:
        self.query_one("#once", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)

    def action_answer_always(self) -> None:
        self.dismiss("once" if self.spec.always_ask else "always")


class ToolsScreen(ModalScreen[None]):
    """Every source's status (one line, its last error) and tools, each with an on/off switch
    (saved); the tools allowed always, each with "ask again". Redrawn while servers start."""

    BINDINGS = [("escape,ctrl+g", "dismiss(None)", "Close")]

    def __init__(self, tools) -> None:  # app/tools/session.AppTools
        super().__init__()
        self.tools = tools
        self._shown: Optional[tuple] = None
        self._switch_tool: dict[str, str] = {}  # switch id -> the tool's model-facing name
        self._forget: dict[str, tuple[str, str]] = {}  # button id -> (server, tool)

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog tools"):
            yield Label("Tools", classes="heading")
            yield Vertical(id="tool-list")
            with Horizontal(classes="buttons"):
                yield Button("Close", id="close", compact=True)

    async def on_mount(self) -> None:
        await self._redraw()
        self.set_interval(0.5, self._redraw)

    def _state(self) -> tuple:
        box = self.tools.box
        return (tuple(box.statuses()), tuple(box.tools()), tuple(self.tools.policy.always_allowed()))

    async def _redraw(self) -> None:
        state = self._state()
        if state == self._shown:
            return
        self._shown = state
        statuses, tools, always = state
        rows: list = []
        self._switch_tool, self._forget = {}, {}
        config = self.tools.options.config
        rows.append(Static(f"MCP servers from {config.path}" if config.path else
                           "No MCP servers configured (mcp.json in the data folder, or --mcp-config FILE)",
                           classes="hint", markup=False))
        for st in statuses:
            rows.append(Label(st.line(), classes="server", markup=False))
            rows += [Static(f"  ! {note}", classes="hint", markup=False) for note in st.notes]
            for t in (t for t in tools if t.server == st.name):
                sid = f"tool-{len(self._switch_tool)}"
                self._switch_tool[sid] = t.name
                flags = " · asks every call" if t.always_ask else ""
                rows.append(Horizontal(Switch(t.enabled, id=sid),
                                       Static(f"{t.name}{flags}  {first_line(t.description, 90)}", markup=False),
                                       classes="tool-row"))
        if always:
            rows.append(Label("Allowed always", classes="server"))
            for server, tool in always:
                bid = f"forget-{len(self._forget)}"
                self._forget[bid] = (server, tool)
                rows.append(Horizontal(Button("Ask again", id=bid, compact=True),
                                       Static(f"{server}/{tool}", markup=False), classes="tool-row"))
        if self.tools.warning or self.tools.policy.warning:
            rows.append(Static(self.tools.warning or self.tools.policy.warning, classes="hint", markup=False))
        box = self.query_one("#tool-list", Vertical)
        await box.remove_children()
        await box.mount_all(rows)

    def on_switch_changed(self, event: Switch.Changed) -> None:
        name = self._switch_tool.get(event.switch.id or "")
        if name is not None:
            self.tools.set_enabled(name, event.value)
            self._shown = self._state()  # the switch already shows it: no redraw

    async def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "close":
            self.dismiss(None)
        elif event.button.id in self._forget:
            self.tools.policy.forget(*self._forget[event.button.id])
            await self._redraw()
