"""Conversations whose KV lives on disk between runs (engine/kv/file.py does the bytes).

A request may name a KV file (`kv_session`). Before it is admitted, the file's KV for the prompt's
common prefix goes into the prefix cache, so the normal prefix match serves it and only the new
tokens are prefilled. When it finishes, the KV of prompt + answer is saved:
- policy "answer" (`edgegem run/chat --kv-session`): right after the answer;
- policy "evict" (the app): the conversation is marked dirty and saved when its KV is about to
  leave the prefix cache (eviction, a pool rebuild) or when the engine closes.
Snapshots are taken on the engine thread; files are written by one writer thread (off the decode
path). A managed folder (`KVDisk`) keeps its files under a byte budget, least recently used first.
Failures never reach the chat: a file that cannot be used is one line on the request
(`kv_session_error`), a failed write one line in `errors` (and the log).
A request with `kv_auto` names no file: the managed folder's index (engine/kv/index.py) finds the
one whose tokens its prompt extends, and its KV is saved there right after the answer.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Optional

from . import file as kv_file
from .file import KVFileError

log = logging.getLogger("edgegem")

POLICIES = ("answer", "evict")
_live: "weakref.WeakSet[KVSessions]" = weakref.WeakSet()


# Set by a SIGTERM/SIGINT handler: closing engines wait at most this long for their KV files (an
# unfinished one stays a temporary file, removed at the next start), so the process ends promptly.
EXIT_TIMEOUT: Optional[float] = None


@atexit.register
def _flush_all() -> None:
    """An interpreter exiting without engine.close() still finishes the files being written (the
    writer is a daemon thread: killed mid-write it would leave only a temporary file)."""
    for s in list(_live):
        s.flush(EXIT_TIMEOUT)


class KVDisk:
    """A folder of KV files capped at `budget` bytes: after each write the least recently used
    files (mtime: written or restored) are deleted until the folder fits."""

    def __init__(self, folder, budget: int):
        self.folder, self.budget = Path(folder), int(budget)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".*.tmp-*"):  # a save killed before its rename
            stale.unlink(missing_ok=True)

    def files(self) -> list[Path]:
        return [p for p in self.folder.glob("*.safetensors") if p.is_file()]

    def usage(self) -> tuple[int, int]:
        """(files, bytes) in the folder."""
        files = self.files()
        return len(files), sum(_size(p) for p in files)

    def enforce(self) -> list[Path]:
        """Delete least recently used files until the folder fits the budget; returns them."""
        files = sorted(self.files(), key=_mtime)
        total, gone = sum(_size(p) for p in files), []
        for p in files:
            if total <= self.budget:
                break
            total -= _size(p)
            p.unlink(missing_ok=True)
            gone.append(p)
        return gone

    def clear(self) -> int:
        n = 0
        for p in self.files():
            p.unlink(missing_ok=True)
            n += 1
        return n


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


class KVSessions:
    def __init__(self, engine, policy: str = "answer", disk: Optional[KVDisk] = None, model_id: str = ""):
        if policy not in POLICIES:
            raise ValueError(f"unknown KV save policy {policy!r} ({', '.join(POLICIES)})")
        self.engine, self.policy, self.disk, self.model_id = engine, policy, disk, model_id
        self.dirty: dict[str, list[int]] = {}  # path -> tokens not saved yet (policy "evict")
        self.errors: deque[str] = deque(maxlen=32)  # failed writes, one line each
        self.saved = 0  # files written
        self._index = None  # engine.kv.index.KVIndex of the managed folder, built at first use
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        _live.add(self)

    # --- the engine thread -----------------------------------------------------------------------
    def layout(self) -> dict:
        e = self.engine
        return kv_file.pool_layout(e.pools, e.window, type(e.model).__name__)

    @property
    def index(self):
        if self._index is None and self.disk is not None:
            from .index import KVIndex
            self._index = KVIndex(self.disk.folder, self.model_id)
        return self._index

    def restore(self, req) -> None:
        """Before admission: put the file's KV for `req`'s prompt into the prefix cache."""
        if getattr(req, "kv_auto", False) and not req.kv_session and self.index is not None:
            found = self.index.find(req.key_ids[:req.n_prompt])
            req.kv_session = str(found) if found is not None else None
        path = req.kv_session
        if not path or not os.path.exists(path):
            return
        e = self.engine
        try:
            req.restored_len = kv_file.restore(e.pools, e.cache, path, req.key_ids[:req.n_prompt], self.model_id,
                                               self.layout())
        except KVFileError as err:
            req.kv_error = str(err)  # the caller says it (stderr, the status panel)

    def finished(self, req, n: int) -> None:
        """`req` ended with its first n tokens handed to the prefix cache."""
        if getattr(req, "kv_auto", False) and n and self.index is not None:
            tokens = req.key_ids[:n]
            self.save(str(self.index.path_for(tokens)), tokens, n_prompt=req.n_prompt, replaces=req.kv_session)
            return
        if not req.kv_session or n == 0:
            return
        tokens = req.key_ids[:n]  # image positions carry their images' content keys
        if self.policy == "answer":
            self.save(req.kv_session, tokens)
        else:
            self.dirty[req.kv_session] = tokens

    def save(self, path: str, tokens: list[int], n_prompt: Optional[int] = None,
             replaces: Optional[str] = None) -> bool:
        """Snapshot the cached KV of `tokens` now; the writer thread writes it. `n_prompt`: an
        indexed (kv_auto) file, `replaces`: the file its request was served from."""
        e = self.engine
        snap = kv_file.snapshot(e.pools, e.cache, e.window, tokens, self.model_id, type(e.model).__name__,
                                e.config.window_margin)
        if snap is None:
            return False
        after = None
        if n_prompt is not None:
            snap.metadata["n_prompt"] = str(n_prompt)
            index, kept = self.index, snap.tokens
            after = lambda: index.added(Path(path), kept, n_prompt, replaces)  # noqa: E731
        self._start()
        self._queue.put((snap, path, after))
        return True

    def save_dirty(self) -> int:
        """Save every conversation whose KV is not on disk yet (before the cache lets it go)."""
        n = 0
        while self.dirty:
            path, tokens = self.dirty.popitem()
            n += self.save(path, tokens)
        return n

    def forget(self, path: str, delete: bool = True) -> None:
        """A deleted conversation: no save is pending for it and its file goes."""
        self.dirty.pop(path, None)
        self.flush()
        if delete:
            Path(path).unlink(missing_ok=True)

    # --- the writer thread -----------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._write_loop, name="edgegem-kv-writer", daemon=True)
            self._thread.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                snap, path, after = item
                try:
                    kv_file.write(snap, path)
                    self.saved += 1
                    if after is not None:
                        after()
                    if self.disk is not None:
                        gone = self.disk.enforce()
                        if self._index is not None and gone:
                            self._index.removed(gone)
                except Exception as err:  # noqa: BLE001 - a full disk must not end the chat
                    msg = f"KV file {Path(path).name} not saved: {getattr(err, 'strerror', None) or err}"
                    self.errors.append(msg)  # the caller says it; no stderr under a full-screen app
                    log.info(msg)
            finally:
                self._queue.task_done()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued file is written (or failed), at most `timeout` seconds; True if
        nothing is left."""
        if self._thread is None:
            return True
        if timeout is None:
            self._queue.join()
            return True
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        """Save what is dirty, write everything queued, stop the writer."""
        self.save_dirty()
        if not self.flush(EXIT_TIMEOUT):
            return  # exiting on a signal: the daemon writer goes with the process
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)
        self._thread = None
