"""Tools that need no server: the date and time; a text file and a folder listing, only inside the
folders the user allowed (`--allow-dir`); a shell command, only when `--shell-tool` turns it on and
then asking before every call.

The sandbox: a path is resolved (symlinks followed, `..` folded) before it is checked, so a link
inside an allowed folder that points outside it is refused like the outside path itself. Files are
read up to MAX_READ_BYTES; a file that is not UTF-8 text is described (size, type), never dumped.
"""
from __future__ import annotations

import mimetypes
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Sequence

from .base import ServerState, ServerStatus, ToolResult, ToolSource, ToolSpec
from .results import cap_text

NAME = "builtin"
MAX_READ_BYTES = 256 << 10  # read at most this much of a file; the text is cut at 16,000 characters after
MAX_ENTRIES = 500  # entries of one folder listing
SNIFF_BYTES = 8192  # a NUL in the first 8 KiB makes a file binary (git's and grep's rule)


class Refused(Exception):
    """One line: why this path or call is refused."""


def _schema(props: dict, required: Sequence[str] = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


class BuiltinTools(ToolSource):
    name = NAME

    def __init__(self, allow_dirs: Sequence[str | Path] = (), shell: bool = False):
        self.allow_dirs = []
        for d in allow_dirs:
            p = Path(d).expanduser().resolve()
            if not p.is_dir():
                raise ValueError(f"--allow-dir {d}: not a folder")
            self.allow_dirs.append(p)
        self.shell = shell
        folders = ", ".join(str(d) for d in self.allow_dirs)
        path = {"path": {"type": "string", "description": f"absolute, or relative to {self.allow_dirs[0]}"
                         if self.allow_dirs else ""}}
        self._specs = [ToolSpec("date_time", NAME, "date_time",
                                "The current date, time and day of the week, in the local time zone or a given one.",
                                _schema({"timezone": {"type": "string",
                                                      "description": "IANA name, e.g. Europe/Paris (default: local)"}}),
                                read_only=True)]
        if self.allow_dirs:
            self._specs += [
                ToolSpec("read_file", NAME, "read_file", f"Read a text file inside {folders}.",
                         _schema(path, ["path"]), read_only=True),
                ToolSpec("list_dir", NAME, "list_dir", f"List a folder inside {folders}: sub-folders end in /.",
                         _schema(path), read_only=True)]
        if shell:
            self._specs.append(ToolSpec(
                "shell", NAME, "shell", "Run a shell command and return its exit status and output."
                + (f" It runs in {self.allow_dirs[0]}." if self.allow_dirs else ""),
                _schema({"command": {"type": "string"}}, ["command"]), always_ask=True))

    def status(self) -> ServerStatus:
        return ServerStatus(NAME, ServerState.READY, "builtin", n_tools=len(self._specs))

    def tools(self) -> list[ToolSpec]:
        return list(self._specs)

    def call(self, tool: str, arguments: dict, timeout: float) -> ToolResult:
        try:
            if tool == "date_time":
                return ToolResult(date_time(arguments.get("timezone")))
            if tool == "read_file" and self.allow_dirs:
                return self.read_file(arguments["path"])
            if tool == "list_dir" and self.allow_dirs:
                return ToolResult(self.list_dir(arguments.get("path") or str(self.allow_dirs[0])))
            if tool == "shell" and self.shell:
                return self.run_shell(arguments["command"], timeout)
        except Refused as e:
            return ToolResult.error(str(e))
        except OSError as e:
            return ToolResult.error(f"{e.filename or tool}: {e.strerror or e}")
        return ToolResult.error(f"no built-in tool {tool!r}")

    # -- the sandbox
    def inside(self, raw: str) -> Path:
        """`raw` resolved (symlinks too) and checked to be inside an allowed folder."""
        p = Path(raw).expanduser()
        if not p.is_absolute():
            p = self.allow_dirs[0] / p
        try:
            real = p.resolve(strict=True)
        except FileNotFoundError:
            raise Refused(f"{raw}: no such file or folder") from None
        except (OSError, RuntimeError) as e:  # a symlink loop
            raise Refused(f"{raw}: {getattr(e, 'strerror', None) or e}") from None
        if not any(real == d or real.is_relative_to(d) for d in self.allow_dirs):
            raise Refused(f"{raw}: outside the allowed folders ({', '.join(str(d) for d in self.allow_dirs)})")
        return real

    def read_file(self, raw: str) -> ToolResult:
        path = self.inside(raw)
        if path.is_dir():
            raise Refused(f"{raw}: a folder (list_dir lists it)")
        if not path.is_file():  # a FIFO or a device would block the read or never end
            raise Refused(f"{raw}: not a regular file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            data = f.read(MAX_READ_BYTES)
        if b"\0" in data[:SNIFF_BYTES] or not _is_utf8(data, complete=size <= MAX_READ_BYTES):
            mime = mimetypes.guess_type(path.name)[0] or "unknown type"
            return ToolResult(f"[{raw}: a binary file ({mime}), {size:,} bytes, not shown]")
        text, truncated = cap_text(data.decode("utf-8", errors="ignore"))
        if size > MAX_READ_BYTES and not truncated:
            text += f"\n[truncated: the file is {size:,} bytes; the first {MAX_READ_BYTES:,} are shown]"
            truncated = True
        return ToolResult(text, truncated=truncated)

    def list_dir(self, raw: str) -> str:
        path = self.inside(raw)
        if not path.is_dir():
            raise Refused(f"{raw}: not a folder")
        entries = sorted(path.iterdir(), key=lambda e: (not e.is_dir(), e.name.lower()))
        lines = []
        for e in entries[:MAX_ENTRIES]:
            if e.is_dir():
                lines.append(f"{e.name}/")
            else:
                try:
                    lines.append(f"{e.name}  {e.stat().st_size:,} bytes")
                except OSError:  # a dangling link
                    lines.append(f"{e.name}  (unreadable)")
        if len(entries) > MAX_ENTRIES:
            lines.append(f"[{len(entries) - MAX_ENTRIES:,} more entries not shown]")
        return f"{path}:\n" + ("\n".join(lines) if lines else "(empty)")

    def run_shell(self, command: str, timeout: float) -> ToolResult:
        cwd = self.allow_dirs[0] if self.allow_dirs else None
        posix = sys.platform != "win32"
        proc = subprocess.Popen(command, shell=True, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=posix)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            if posix:  # the whole group: `sleep 100 | cat` leaves children holding the pipe
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            out, _ = proc.communicate()
            return ToolResult.error(f"the command did not finish within {timeout:g} s; it was killed")
        text, truncated = cap_text(out.decode("utf-8", errors="replace"))
        return ToolResult(f"exit status {proc.returncode}\n{text}", is_error=proc.returncode != 0,
                          truncated=truncated)


def date_time(timezone: str | None = None) -> str:
    if timezone:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError
        try:
            now = datetime.now(ZoneInfo(timezone))
        except (ZoneInfoNotFoundError, ValueError):
            raise Refused(f"unknown time zone {timezone!r} (an IANA name such as Europe/Paris)") from None
        zone = timezone
    else:
        now = datetime.now().astimezone()
        zone = now.tzname() or "local"
    return f"{now.isoformat(timespec='seconds')} ({now.strftime('%A')}), time zone {zone}"


def _is_utf8(data: bytes, complete: bool) -> bool:
    """Whether `data` is UTF-8; a read cut inside a character is forgiven its last 3 bytes."""
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        return not complete and e.start >= len(data) - 3
