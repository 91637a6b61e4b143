"""Messages the worker threads post to the UI (Textual's `post_message` is thread-safe).

Streaming text is not posted token by token: the chat screen's timer pulls it (at most 10 times a
second) and the status panel pulls `client.status()`, so a fast decode never floods the UI.
"""
from __future__ import annotations

from typing import Optional

from textual.message import Message


class LoadProgress(Message):
    def __init__(self, fraction: float, text: str) -> None:
        super().__init__()
        self.fraction, self.text = fraction, text


class Loaded(Message):
    def __init__(self, session) -> None:  # app.backend.Session
        super().__init__()
        self.session = session


class LoadFailed(Message):
    """`kind`: the engine's ErrorKind of the failure (engine.api.load_error_kind)."""

    def __init__(self, error: str, kind) -> None:
        super().__init__()
        self.error, self.kind = error, kind


class GenerationDone(Message):
    """`error_kind`: the engine's ErrorKind of an error the engine ended the answer with (None: the
    submit itself failed, or no error)."""

    def __init__(self, gen_id: int, text: str, reason: Optional[str], error: Optional[str],
                 stats: Optional[dict], error_kind=None) -> None:
        super().__init__()
        self.gen_id, self.text, self.reason, self.error, self.stats = gen_id, text, reason, error, stats or {}
        self.error_kind = error_kind


class KVCheckProgress(Message):
    """kv-check's worker: fraction 0..1 of the chunks measured."""

    def __init__(self, fraction: float, text: str) -> None:
        super().__init__()
        self.fraction, self.text = fraction, text


class KVCheckDone(Message):
    """kv-check's worker ended: figures (engine/bench/kv_quality.py's dict), or an error, or cancelled."""

    def __init__(self, result: Optional[dict], error: Optional[str] = None, cancelled: bool = False) -> None:
        super().__init__()
        self.result, self.error, self.cancelled = result, error, cancelled
