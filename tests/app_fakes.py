"""A scripted engine client and backend for the app's pilot, snapshot and crash tests.

`FakeClient` streams a fixed reply piece by piece from its own thread-safe queue-free loop, honours
abort, and can hold the stream open at a gate (to stop "mid-stream" deterministically).
"""
from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from app.backend import Session
from engine.api import EngineOptions
from engine.media import ImageRequestError, MediaRequestError, as_audio_input, as_image_input
from engine.request import StreamEvent


@dataclass
class FakeClient:
    pieces: list = field(default_factory=lambda: ["Hello", " **world**", ".\n\n```py\nprint(1)\n```\n", "Done."])
    delay: float = 0.0
    gate_after: Optional[int] = None  # hold the stream after this many pieces until aborted/opened
    error: Optional[str] = None  # finish with this error instead of the last piece
    prompt_tokens: int = 17
    images: bool = True  # status()["images"]: the model has a vision encoder
    audio: bool = True  # status()["audio"]: and an audio encoder
    submit_error: Optional[Exception] = None  # submit raises this (e.g. the engine's context refusal)
    speculative: Optional[dict] = field(default_factory=lambda: {
        "rounds": 10, "drafted": 20, "accepted": 13, "acceptance_rate": 0.65, "mean_accepted_length": 1.3,
        "tokens_per_target_forward": 2.3})

    def __post_init__(self):
        self._ids = itertools.count(1)
        self.gate = threading.Event()
        self.aborted: set[int] = set()
        self.submitted: list[tuple] = []  # (messages, GenerationParams)
        self.image_tokens = 0  # of the last submitted prompt, counted as the engine does
        self.audio_tokens = 0
        self.closed = False
        self.cached = 0

    def submit(self, messages, params) -> int:
        """Records the messages; their images and clips are opened and counted like the real client
        does (a missing or broken file raises its one-line error), so tests see what the engine gets."""
        self.submitted.append(([dict(m) for m in messages], params))
        if self.submit_error is not None:
            raise self.submit_error
        images = [im for m in messages for im in m.get("images", ())]
        if images and not self.images:
            raise ImageRequestError("this model has no image encoder")
        self.image_tokens = sum(as_image_input(im, params.image_tokens).n_tokens for im in images)
        clips = [c for m in messages for c in m.get("audio", ())]
        if clips and not self.audio:
            raise MediaRequestError("this model has no audio encoder")
        self.audio_tokens = sum(as_audio_input(c).n_tokens for c in clips)
        return next(self._ids)

    def last_prompt_ids(self, rid: int) -> list[int]:
        return list(range(self.prompt_tokens))

    def stream(self, rid: int, timeout=None):
        n = 0
        for i, piece in enumerate(self.pieces):
            if self.gate_after is not None and i == self.gate_after:
                end = time.monotonic() + 10  # never hang a failing test
                while rid not in self.aborted and not self.gate.wait(0.01) and time.monotonic() < end:
                    pass
            if rid in self.aborted:
                yield StreamEvent(rid, [], "", True, "abort", None, self._stats(n))
                return
            time.sleep(self.delay)
            n += 1
            yield StreamEvent(rid, [i], piece)
        if self.error:
            yield StreamEvent(rid, [], "", True, "error", self.error, self._stats(n))
        else:
            self.cached = self.prompt_tokens + n
            yield StreamEvent(rid, [], "", True, "stop", None, self._stats(n))

    def _stats(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": 5, "prefilled_tokens": self.prompt_tokens - 5,
                "output_tokens": n, "prefill_s": 0.1, "decode_s": 0.5, "prefill_tok_s": 120.0,
                "decode_tok_s": 42.5, "image_tokens": self.image_tokens, "audio_tokens": self.audio_tokens}

    def abort(self, rid: int) -> None:
        self.aborted.add(rid)

    def status(self) -> dict:
        return {"pools": {"full": {"format": "int8_per_token_head", "capacity": 4096, "used": 300, "free": 3796,
                                   "unit_bytes": 1024, "slabs": 4},
                          "window": {"format": "bf16", "capacity": 1024, "used": 64, "free": 960,
                                     "unit_bytes": 2048, "slabs": 8}, "share_kv": True},
                "cache_type": "radix", "attention_backend": "torch", "cached_prefix_tokens": self.cached,
                "running": 0, "waiting": 0, "context_limit": 4096, "images": self.images, "audio": self.audio,
                "speculative": self.speculative}

    def close(self) -> None:
        self.closed = True


INFO = {"model": "Fake Gemma 4", "file": "fake-q4_k_m.gguf", "path": "/models/fake-q4_k_m.gguf", "arch": "gemma4",
        "demo": False, "device": "cpu", "context_limit": 4096, "draft": "/models/fake-assistant.gguf",
        "budget_bytes": 8 << 30,
        "plan": ["budget 8.00 GiB on cpu", "  KV full pool: 4096 tokens × 4 layers, int8_per_token_head, 4 MiB",
                 "max context: 4096 tokens"]}


# what engine/bench/kv_quality.py returns (the figures of docs/benchmarks.md#the-8-bit-formats-in-the-test)
KV_RESULT = {"reference": "fp32", "reference_bytes_per_token": 6144, "device": "cpu", "tokens": 1024, "chunk": 64,
             "sliding_window": 512, "activations": "float32", "seconds": 95.0, "skipped": {},
             "text": "Pride and Prejudice, ch. I-III (built in)", "measured": "2026-12-01 10:00",
             "model": {"name": "Fake Gemma 4", "file": "fake-q4_k_m.gguf", "path": "/models/fake-q4_k_m.gguf",
                       "size": 1000, "arch": "gemma4"},
             "formats": {"bf16": {"mean_kld": 2.59e-5, "p99_kld": 2.2e-4, "max_kld": 8.08e-4,
                                  "top1_agreement": 0.998, "bytes_per_token": 3072},
                         "int8_per_token_head": {"mean_kld": 4.76e-3, "p99_kld": 3.48e-2, "max_kld": 6.25e-2,
                                                 "top1_agreement": 0.951, "bytes_per_token": 1560}}}


class FakeBackend:
    """Loads instantly (or waits at `hold`), or fails with `error`; counts loads for reload tests.
    `kv_check` plays back KV_RESULT in 4 progress steps (holding after the first at `kv_hold` until
    told to stop) and keeps it per data dir for `kv_check_cached`."""

    def __init__(self, client: Optional[FakeClient] = None, error: Optional[Exception] = None,
                 options: EngineOptions = EngineOptions(), hold: Optional[threading.Event] = None,
                 info: Optional[dict] = None, kv_hold: Optional[threading.Event] = None):
        self.client, self.error, self.options, self.hold = client or FakeClient(), error, options, hold
        self.info = {**INFO, **(info or {})}
        self.model = "fake-q4_k_m.gguf"
        self.loads = 0
        self.kv_hold, self.kv_saved = kv_hold, {}

    def kv_check(self, session, data_dir, progress, should_stop, **kw) -> dict:
        for step in range(4):
            if step == 1 and self.kv_hold is not None:
                end = time.monotonic() + 10  # never hang a failing test
                while not should_stop() and not self.kv_hold.wait(0.01) and time.monotonic() < end:
                    pass
            if should_stop():
                raise RuntimeError("kv-check cancelled")
            progress((step + 1) / 4, f"{256 * (step + 1)}/1024 tokens, 3 KV formats")
        self.kv_saved[str(data_dir)] = dict(KV_RESULT)
        return dict(KV_RESULT)

    def kv_check_cached(self, session, data_dir) -> Optional[dict]:
        return self.kv_saved.get(str(data_dir))

    def with_options(self, **changes) -> "FakeBackend":
        b = FakeBackend(FakeClient(), self.error, replace(self.options, **changes))
        b.loads = self.loads
        return b

    def load(self, progress) -> Session:
        progress(0.5, "tensors 10/20 · 1.00 GiB of 2.00 GiB → cpu")
        if self.hold is not None:
            self.hold.wait(30)
        if self.error is not None:
            raise self.error
        self.loads += 1
        return Session(self.client, dict(self.info))


class CharTokenizer:
    """One token per character (the tool loop encodes its result blocks with the model's tokenizer)."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))


@dataclass
class ToolFakeClient(FakeClient):
    """A scripted model that calls tools: reply i (by submission order) streams `replies[i]["pieces"]`
    and, when it has `calls` ([{"name", "arguments"}]), ends with finish reason `tool_calls`; past
    the script every reply is `final`. `submit_ids` records each continuation's ids (the loop's
    prompt: the previous one, the reply, the result blocks), so tests read what the model was given."""

    replies: list = field(default_factory=list)
    final: list = field(default_factory=lambda: ["It is ", "12:34."])

    def __post_init__(self):
        super().__post_init__()
        self.loaded = type("Loaded", (), {"tokenizer": CharTokenizer()})()
        self.continuations: list[list[int]] = []
        self._reply_of: dict[int, dict] = {}
        self._prompts: dict[int, list[int]] = {}

    def _script(self, rid: int) -> None:
        n = len(self._reply_of)
        self._reply_of[rid] = self.replies[n] if n < len(self.replies) else {"pieces": self.final}

    def submit(self, messages, params) -> int:
        rid = super().submit(messages, params)
        self._script(rid)
        self._prompts[rid] = list(range(self.prompt_tokens))
        return rid

    def submit_ids(self, ids, params) -> int:
        rid = next(self._ids)
        self.submitted.append((None, params))
        self.continuations.append(list(ids))
        self._script(rid)
        self._prompts[rid] = list(ids)
        return rid

    def last_prompt_ids(self, rid: int) -> list[int]:
        return list(self._prompts[rid])

    def stream(self, rid: int, timeout=None):
        reply = self._reply_of[rid]
        pieces, calls = reply["pieces"], reply.get("calls")
        n = 0
        for i, piece in enumerate(pieces):
            if rid in self.aborted:
                yield StreamEvent(rid, [], "", True, "abort", None, self._stats(n))
                return
            time.sleep(self.delay)
            n += 1
            yield StreamEvent(rid, [ord(c) for c in piece], piece)
        if calls:
            full = [{"id": f"call_{rid}_{j}", "type": "function",
                     "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}}
                    for j, c in enumerate(calls)]
            yield StreamEvent(rid, [], "", True, "tool_calls", None, self._stats(n), tool_calls=full)
        else:
            yield StreamEvent(rid, [], "", True, "stop", None, self._stats(n))

    def _stats(self, n: int) -> dict:
        prompt = len(self._prompts.get(max(self._prompts, default=0), ())) or self.prompt_tokens
        return {**super()._stats(n), "prompt_tokens": prompt}
