"""Failpoints: `EDGEGEM_FAILPOINTS="NAME@N[,NAME@N...]"` makes the N-th hit of a named point fail,
once. For tests, and for users reproducing a report. The variable is read by kernels/env.py with
the others; its grammar and the point names are this module's.

Points:
  forward.oom   torch.OutOfMemoryError inside a model forward (prefill, decode, verify)
  step.error    RuntimeError in an engine step
  store.write   sqlite3.OperationalError "database or disk is full" in a store write
  kv.write      OSError ENOSPC while writing a KV file

Unset, a call site costs one attribute read: `if failpoints.ACTIVE and failpoints.hit("x"): ...`.
"""
from __future__ import annotations

import errno
import threading
from collections import Counter

from kernels.env import ConfigError, env

POINTS = ("forward.oom", "step.error", "store.write", "kv.write")

_lock = threading.Lock()
_armed: dict[str, set[int]] = {}
_hits: Counter = Counter()
fired: Counter = Counter()  # how often each point has fired (tests, the soak's report)
ACTIVE = False


def parse(spec: str) -> dict[str, set[int]]:
    """"forward.oom@3,kv.write@1" -> {"forward.oom": {3}, "kv.write": {1}}; a bad entry is a one-line
    ValueError naming the known points."""
    out: dict[str, set[int]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, n = item.partition("@")
        if name not in POINTS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"EDGEGEM_FAILPOINTS: bad entry {item!r} (NAME@N, N >= 1; names: {', '.join(POINTS)})")
        out.setdefault(name, set()).add(int(n))
    return out


def configure(spec: str | None) -> None:
    """Arm the points of `spec` (None or "": disarm all) and reset the hit counts."""
    global ACTIVE
    with _lock:
        _armed.clear()
        _armed.update(parse(spec or ""))
        _hits.clear()
        fired.clear()
        ACTIVE = bool(_armed)


def hit(name: str) -> bool:
    """Count a hit of `name`; True when this hit is one that should fail."""
    with _lock:
        _hits[name] += 1
        if _hits[name] in _armed.get(name, ()):
            fired[name] += 1
            return True
    return False


def maybe_fail(name: str) -> None:
    """Raise the point's error if this hit is armed (call only when ACTIVE)."""
    if not hit(name):
        return
    if name == "forward.oom":
        import torch
        raise torch.OutOfMemoryError(f"CUDA out of memory (failpoint {name})")
    if name == "store.write":
        import sqlite3
        raise sqlite3.OperationalError("database or disk is full")
    if name == "kv.write":
        raise OSError(errno.ENOSPC, "No space left on device")
    raise RuntimeError(f"injected failure (failpoint {name})")


CONFIG_ERROR: str | None = None  # a malformed EDGEGEM_FAILPOINTS: the CLI says it in one line
try:
    configure(env().failpoints)
except ConfigError:
    pass  # another variable is bad: the CLI's env() check at start says which, none is armed
except ValueError as e:
    CONFIG_ERROR = str(e)
