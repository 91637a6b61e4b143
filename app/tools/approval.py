"""Whether a tool call may run: the user's decisions and what is remembered of them. No UI here:
the app's dialog and `edgegem chat`'s y/n/a prompt ask, this decides and remembers.

- allow once: this call only;
- allow for this conversation: this tool, until the conversation ends (kept in memory);
- always: this tool of this server, saved in `<data dir>/tool-approvals.json`;
- deny: this call does not run (the model is told so).

`--yes-tools` skips asking, except for tools marked `always_ask` (the shell tool), which ask before
every call whatever was chosen before.
"""
from __future__ import annotations

import enum
import json
import os
import tempfile
from pathlib import Path
from typing import Hashable, Optional

from .base import ToolSpec

FILE_NAME = "tool-approvals.json"


class Decision(enum.Enum):
    ALLOW_ONCE = "once"
    ALLOW_CONVERSATION = "conversation"
    ALWAYS = "always"
    DENY = "deny"

    @classmethod
    def from_answer(cls, answer: str) -> Optional["Decision"]:
        """A line typed at `edgegem chat`'s prompt: y(es), c(onversation), a(lways), n(o); else None."""
        return {"y": cls.ALLOW_ONCE, "yes": cls.ALLOW_ONCE, "c": cls.ALLOW_CONVERSATION, "a": cls.ALWAYS,
                "always": cls.ALWAYS, "n": cls.DENY, "no": cls.DENY}.get(answer.strip().lower())


class ApprovalPolicy:
    def __init__(self, path: Optional[str | Path], yes_tools: bool = False):
        self.path = Path(path) if path is not None else None  # None: "always" is kept for this run only
        self.yes_tools = yes_tools
        self.warning = ""  # one line when the saved file could not be read (it is then rewritten)
        self._always: dict[str, set[str]] = {}  # server -> tools
        self._conversation: dict[Hashable, set[tuple[str, str]]] = {}
        self._load()

    @classmethod
    def in_data_dir(cls, data_dir: Optional[str | Path] = None, yes_tools: bool = False) -> "ApprovalPolicy":
        from engine.models_dir import data_dir as edgegem_data_dir
        return cls(edgegem_data_dir(data_dir) / FILE_NAME, yes_tools)

    def needs_asking(self, tool: ToolSpec, conversation: Hashable = None) -> bool:
        if tool.always_ask:
            return True
        if self.yes_tools:
            return False
        return not (tool.tool in self._always.get(tool.server, ()) or
                    (tool.server, tool.tool) in self._conversation.get(conversation, ()))

    def decide(self, tool: ToolSpec, decision: Decision, conversation: Hashable = None) -> bool:
        """Record the user's answer; True when this call may run."""
        if decision is Decision.DENY:
            return False
        if tool.always_ask:  # allowed this once, whatever the answer said about later calls
            return True
        if decision is Decision.ALLOW_CONVERSATION:
            self._conversation.setdefault(conversation, set()).add((tool.server, tool.tool))
        elif decision is Decision.ALWAYS:
            self._always.setdefault(tool.server, set()).add(tool.tool)
            self._save()
        return True

    def end_conversation(self, conversation: Hashable) -> None:
        self._conversation.pop(conversation, None)

    def always_allowed(self) -> list[tuple[str, str]]:
        return sorted((s, t) for s, tools in self._always.items() for t in tools)

    def forget(self, server: str, tool: str) -> None:
        """Ask again for this tool (the Tools screen's undo of "always")."""
        self._always.get(server, set()).discard(tool)
        self._save()

    # -- the file: {"always": {"server": ["tool", ...]}}
    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            always = data["always"]
            if not isinstance(always, dict) or not all(isinstance(v, list) for v in always.values()):
                raise ValueError("\"always\" is not an object of server: [tools]")
            self._always = {s: {t for t in tools if isinstance(t, str)} for s, tools in always.items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.warning = f"{self.path}: ignored ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})"

    def _save(self) -> None:
        if self.path is None:
            return
        write_json(self.path, {"always": {s: sorted(t) for s, t in sorted(self._always.items()) if t}})


def write_json(path: Path, data) -> None:
    """`data` as JSON at `path`, written whole to a temporary file, then renamed over: a crash
    leaves the old file or the new one (the tools' saved choices)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
