"""The narrow interface the app uses: submit / stream / abort / status / close.

`LocalClient` runs an `Engine` in one background thread (the only thread that touches it);
callers post commands and read per-request event queues, so a UI thread never blocks on the model.
Conversations become prompts in engine/prompt.py (the model's chat format, or a base model's text);
with `--context-overflow truncate` the oldest whole turns after the system prompt are dropped until
the prompt fits.
Front ends that wait in an event loop (app/server/) pass `on_event`, called on the engine thread
after each event is queued, and drain with `poll`; `queue_limit` bounds the engine's wait queue.
"""
from __future__ import annotations

import abc
import atexit
import queue
import threading
import weakref
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from .media import as_audio_input, as_image_input
from .prompt import prompt_ids
from .request import ErrorKind, StreamEvent
from .request_params import GenerationParams, model_kind
from .scheduler import Engine, EngineConfig
from .structured import request_grammar, tool_events_for


KEEP_PROMPTS = 1024  # last_prompt_ids answers for this many recent requests (a server makes many)


class QueueFullError(RuntimeError):
    """The engine's wait queue is at the caller's `queue_limit` (a server answers 429)."""


class GenerationError(RuntimeError):
    """A request the engine ended with an error, raised by callers that wait for a whole answer
    (engine.api.run_prompt); `kind` (ErrorKind) says whose fault, the message is one line."""

    def __init__(self, message: str, kind: ErrorKind):
        super().__init__(message)
        self.kind = kind


class _NotifyingQueue(queue.Queue):
    """A request's event queue that calls `notify()` (on the engine thread) after each put."""

    def __init__(self, notify):
        super().__init__()
        self._notify = notify

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        try:
            self._notify()
        except Exception:  # noqa: BLE001 - a front end's wake-up (its loop gone) must not break a step
            pass


class EngineClient(abc.ABC):
    @abc.abstractmethod
    def submit(self, messages: Sequence[dict], params: GenerationParams) -> int: ...

    @abc.abstractmethod
    def last_prompt_ids(self, request_id: int) -> list[int]:
        """The token ids a request was submitted with (after chat rendering and truncation)."""

    @abc.abstractmethod
    def stream(self, request_id: int, timeout: Optional[float] = None) -> Iterator[StreamEvent]: ...

    @abc.abstractmethod
    def abort(self, request_id: int) -> None: ...

    @abc.abstractmethod
    def status(self) -> dict: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class LocalClient(EngineClient):
    def __init__(self, loaded, config: Optional[EngineConfig] = None, context_overflow: str = "error",
                 spec=None, model_id: Optional[str] = None):
        if context_overflow not in ("error", "truncate"):
            raise ValueError(f"--context-overflow must be error or truncate, not {context_overflow!r}")
        self.loaded, self.context_overflow = loaded, context_overflow
        if model_id is None:  # what a KV file must have been written for
            from .kv.file import model_identity
            path = getattr(loaded, "path", None)
            model_id = model_identity(path) if path is not None and Path(path).exists() else ""
        self.engine = Engine(loaded.model, loaded.tokenizer, config, spec=spec, model_id=model_id,
                             vision=getattr(loaded, "vision", None), audio=getattr(loaded, "audio", None))
        self._commands: "queue.Queue[tuple]" = queue.Queue()
        self._events: dict[int, queue.Queue] = {}
        self._prompts: dict[int, list[int]] = {}
        self._tool_events: dict = {}   # request id -> engine.structured.ToolEvents (requests with tools)
        self._status: dict = self.engine.status()
        self._closed = threading.Event()
        if loaded.model.device.type == "cpu":  # the engine thread computes from now on: this thread's
            from .cpu_runtime import release_idle_openmp_threads  # OpenMP team (it loaded the model) goes
            release_idle_openmp_threads()
        self._thread = threading.Thread(target=self._loop, name="edgegem-engine", daemon=True)
        self._thread.start()
        _open_clients.add(self)

    # --- prompt building ---------------------------------------------------------------------
    def _prompt_ids(self, messages: Sequence[dict], thinking: bool, image_tokens: int = 280, tools=None,
                    continue_text: bool = False) -> tuple[list[int], dict]:
        """(ids, media) of a conversation (engine/prompt.py), truncated to the context as configured."""
        return prompt_ids(self.loaded, messages, self.engine.media_kinds, thinking, image_tokens, tools,
                          continue_text, self.engine.context_limit, self.context_overflow == "truncate")

    # --- the interface ---------------------------------------------------------------------
    def submit(self, messages: Sequence[dict], params: GenerationParams = GenerationParams(),
               on_event=None, queue_limit: Optional[int] = None) -> int:
        """messages: [{"role", "content", optional "images": [ImageInput | path | bytes, ...],
        optional "audio": [AudioInput | path | bytes, ...]}]. `on_event()`: called on the engine
        thread after each event of this request is queued; `queue_limit`: QueueFullError when that
        many requests already wait."""
        grammar = request_grammar(params, self.loaded.tokenizer)   # ConstraintError: bad schema/tools
        ids, media = self._prompt_ids(messages, params.thinking, params.image_tokens, params.tools,
                                      params.continue_text)
        return self._add(ids, params, media, grammar, on_event, queue_limit)

    def submit_ids(self, prompt_ids: list[int], params: GenerationParams = GenerationParams(),
                   images: Sequence = (), audio: Sequence = (), on_event=None,
                   queue_limit: Optional[int] = None) -> int:
        """Already expanded ids: each image's / clip's N placeholders in order (`images`:
        ImageInput, `audio`: AudioInput, or paths or bytes of either, in prompt order)."""
        media = {"image": [as_image_input(im, params.image_tokens) for im in images],
                 "audio": [as_audio_input(clip) for clip in audio]}
        grammar = request_grammar(params, self.loaded.tokenizer)
        return self._add(list(prompt_ids), params, media, grammar, on_event, queue_limit)

    def _add(self, ids, params, media, grammar, on_event, queue_limit) -> int:
        reply: "queue.Queue[Any]" = queue.Queue()
        self._commands.put(("add", ids, params, reply, media, grammar, on_event, queue_limit))
        out = reply.get()
        if isinstance(out, Exception):
            raise out
        return out

    def poll(self, request_id: int) -> list[StreamEvent]:
        """The events queued for a request so far, without waiting (the last one `finished`)."""
        q, out = self._events.get(request_id), []
        tools = self._tool_events.get(request_id)
        while q is not None:
            try:
                ev = q.get_nowait()
            except queue.Empty:
                break
            if tools is not None:
                ev = tools.apply(ev)   # content only in `text`, calls in tool_call_deltas / tool_calls
            out.append(ev)
            if ev.finished:
                self._events.pop(request_id, None)
                self._tool_events.pop(request_id, None)
                break
        return out

    # --- the model's vocabulary and identity (read-only: safe from any thread) ------------------
    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; `add_special`: with BOS; `parse_special`: control-token texts such
        as `<|turn>` become their ids (else their characters are tokenized as text)."""
        return self.loaded.tokenizer.encode(text, add_bos=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids (a one-line ValueError for an id out of range)."""
        return self.loaded.tokenizer.decode(ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.loaded.tokenizer.token_bytes(token_id)

    def chat_prompt_ids(self, messages: Sequence[dict], thinking: bool = False, continue_text: bool = False
                        ) -> list[int]:
        """The ids `submit` would send for a text conversation (rendered, truncation as configured;
        `continue_text`: a base model's, the contents joined)."""
        return self._prompt_ids(messages, thinking, continue_text=continue_text)[0]

    def model_info(self) -> dict:
        """What a server says about the model: names, file, family, sizes, context, capabilities, and
        whether it is a base model (engine/request_params.py: the rule a base model's requests get)."""
        lm = self.loaded
        src = lm.source
        meta = getattr(src, "metadata", {}) or {}
        path = Path(getattr(lm, "path", "") or "")
        tensors = getattr(src, "tensors", None)
        params = sum(t.n_elements for t in tensors.values()) if isinstance(tensors, dict) else None
        quant = None
        if isinstance(meta.get("general.file_type"), int):
            try:
                from gguf import LlamaFileType
                quant = LlamaFileType(meta["general.file_type"]).name.removeprefix("MOSTLY_").removeprefix("ALL_")
            except ValueError:
                pass
        kind, kind_reason = model_kind(lm)
        return {"name": meta.get("general.name") or path.stem, "file": path.name, "path": str(path),
                "arch": lm.arch, "chat_family": getattr(lm.chat, "family", None),
                "chat_template": getattr(lm.chat, "template", None),
                "size_bytes": path.stat().st_size if path.is_file() else None, "parameters": params,
                "quantization": quant, "context_length": self.engine.context_limit,
                "vocab_size": lm.config.vocab_size, "vision": self.engine.vision is not None,
                "audio": self.engine.audio is not None,
                "kind": kind, "kind_reason": kind_reason,  # "base": completions continue the text
                # the runtime chosen at load (models/runtime.py): doctor, info and the app print it
                "runtime": lm.runtime.value, "runtime_detail": lm.runtime.detail}

    def warm_up_constraints(self):
        """Build the tokenizer the constrained decoder needs in a background thread (seconds for the
        262,144-token Gemma-4 vocabulary), so the first structured request does not wait for it."""
        from .constraints import warm_up
        return warm_up(self.loaded.tokenizer) if self.loaded.tokenizer is not None else None

    def last_prompt_ids(self, request_id: int) -> list[int]:
        """The token ids a request was submitted with (after chat rendering and truncation)."""
        return list(self._prompts.get(request_id, []))

    def stream(self, request_id: int, timeout: Optional[float] = None) -> Iterator[StreamEvent]:
        q = self._events[request_id]
        tools = self._tool_events.get(request_id)
        while True:
            ev = q.get(timeout=timeout)
            if tools is not None:
                ev = tools.apply(ev)   # content only in `text`, calls in tool_call_deltas / tool_calls
            yield ev
            if ev.finished:
                self._events.pop(request_id, None)
                self._tool_events.pop(request_id, None)
                return

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))

    def status(self) -> dict:
        return dict(self._status)

    def rebuild(self, **changes) -> None:
        """Resize the KV pools or change their format at runtime (only while idle; raises otherwise)."""
        reply: "queue.Queue[Any]" = queue.Queue()
        self._commands.put(("rebuild", changes, reply))
        out = reply.get()
        if isinstance(out, Exception):
            raise out

    def call(self, fn):
        """Run fn(engine) on the engine thread and return its result (or raise its error)."""
        reply: "queue.Queue[Any]" = queue.Queue()
        self._commands.put(("call", fn, reply))
        ok, out = reply.get()
        if not ok:
            raise out
        return out

    def kv_disk_usage(self) -> Optional[tuple[int, int]]:
        """(files, bytes) of the managed KV folder, None without one."""
        disk = self.engine.sessions.disk
        return disk.usage() if disk is not None else None

    def clear_kv_disk(self) -> int:
        """Delete every file of the managed KV folder (pending saves first); returns how many."""
        def clear(engine):
            engine.sessions.dirty.clear()
            engine.sessions.flush()
            return engine.sessions.disk.clear() if engine.sessions.disk is not None else 0
        return self.call(clear)

    def kv_errors(self) -> list[str]:
        """KV files that could not be written since the last call (one line each)."""
        errors = self.engine.sessions.errors
        out = []
        while errors:
            out.append(errors.popleft())
        return out

    def forget_kv(self, path: str) -> None:
        """A deleted conversation: drop its pending save and delete its KV file."""
        self.call(lambda engine: engine.sessions.forget(path))

    def close(self) -> None:
        self._closed.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=30)
        _open_clients.discard(self)

    # --- the engine thread -----------------------------------------------------------------
    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, ids, params, reply, media, grammar, on_event, queue_limit = cmd
            try:
                e = self.engine
                free = max(0, e.config.max_running_requests - len(e.running))  # admitted at the next step
                if queue_limit is not None and len(e.waiting) + 1 - free > queue_limit:
                    raise QueueFullError(f"{len(e.waiting)} requests are waiting already "
                                         f"(--max-queued-requests {queue_limit}); try again later")
                req = self.engine.add(ids, params.sampling, params.stop_strings, kv_session=params.kv_session,
                                      images=media["image"], audio=media["audio"], grammar=grammar,
                                      kv_auto=params.kv_auto, cache_prompt=params.cache_prompt,
                                      stop_at_blank_line=params.stop_at_blank_line)
                if on_event is not None:  # before any event: the engine only queues it so far
                    req.events = _NotifyingQueue(on_event)
                self._events[req.id] = req.events
                tools = tool_events_for(params)
                if tools is not None:
                    self._tool_events[req.id] = tools
                self._prompts[req.id] = req.prompt_ids
                while len(self._prompts) > KEEP_PROMPTS:  # oldest first (dicts keep insertion order)
                    self._prompts.pop(next(iter(self._prompts)))
                reply.put(req.id)
            except Exception as e:  # noqa: BLE001 - handed to the caller's thread
                reply.put(e)
        elif kind == "abort":
            self.engine.abort(cmd[1])
        elif kind == "call":
            try:
                cmd[2].put((True, cmd[1](self.engine)))
            except Exception as e:  # noqa: BLE001 - raised again in the caller's thread (`call`)
                cmd[2].put((False, e))
        elif kind == "rebuild":
            try:
                self.engine.rebuild(**cmd[1])
                cmd[2].put(None)
            except Exception as e:  # noqa: BLE001 - raised again in the caller's thread (`rebuild`)
                cmd[2].put(e)

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                cmd = self._commands.get(timeout=None if not self.engine.has_work else 0)
                self._handle(cmd)
                while not self._commands.empty():
                    self._handle(self._commands.get_nowait())
            except queue.Empty:
                pass
            if self.engine.has_work:
                try:
                    self.engine.step()
                except Exception as e:  # noqa: BLE001 - one bad step must not kill the app
                    self.engine.recover(e)
            self._status = self.engine.status()
        for req in list(self.engine.running) + list(self.engine.waiting):
            self.engine._finish(req, "abort")
        self.engine.close()  # conversations' KV still only in the cache go to disk


# Clients still open when the interpreter exits are closed first: an engine thread still inside a
# step while Python finalizes aborted the process (libstdc++'s "terminate called without an
# active exception", exit status 134) for a script that never called close().
_open_clients: "weakref.WeakSet[LocalClient]" = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    for client in list(_open_clients):
        client.close()
