"""The server's view of the engine: the client (None while a model loads: 503), the model's names,
and `Generation`, the async side of one request.

Generation stays in the engine's one thread (`LocalClient`); a handler submits from a worker
thread (rendering and tokenizing a long prompt must not stall the event loop), then awaits the
request's events: the engine thread wakes the loop with `call_soon_threadsafe` after each event,
and the handler drains them with `client.poll`. A client that goes away (a closed stream, a
cancelled handler) aborts its request, so its KV goes back at once.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Optional

from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from app.backend import QueueFullError

from .config import ServerConfig
from .errors import APIError

DISCONNECT_POLL_S = 0.5  # a non-streaming request checks this often whether its client went away


class EngineStream(StreamingResponse):
    """A StreamingResponse whose request is aborted however the response ends: finished, the
    client gone (Starlette cancels the response), or the server stopping. (An async generator
    left suspended at a `yield` would only be closed when collected, maybe never.)"""

    def __init__(self, content, gen: "Generation", **kw):
        super().__init__(content, **kw)
        self.gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


class ServerState:
    def __init__(self, config: ServerConfig, client=None):
        self.config = config
        self._client = client
        self._info: Optional[dict] = None
        self._lock = threading.Lock()
        self.in_flight = 0  # API requests generating or waiting (the app's status panel shows it)
        self.served = 0
        self.aborted = 0  # requests whose client went away before the end
        self.live: set = set()  # Generations not finished yet
        self.started = time.time()
        self._warm_up(client)

    # --- the engine -------------------------------------------------------------------------
    def set_client(self, client) -> None:
        """A new model (the app reloaded), or None while one loads."""
        self._client, self._info = client, None
        self._warm_up(client)

    @staticmethod
    def _warm_up(client) -> None:
        """The constrained decoder's tokenizer is built in the background now (seconds for Gemma-4's
        262,144 tokens), not by the first request with a schema or tool_choice."""
        warm = getattr(client, "warm_up_constraints", None)  # test fakes have none
        if warm is not None:
            warm()

    def client(self):
        if self._client is None:
            raise APIError(503, "the model is loading; try again in a moment")
        return self._client

    def info(self) -> dict:
        client = self.client()
        if self._info is None:
            self._info = client.model_info()
        return self._info

    @property
    def model_id(self) -> str:
        """The name clients see: the model file's stem (`gemma-3-270m-q4_k_m`)."""
        info = self.info()
        return info["file"].rsplit(".gguf", 1)[0] if info["file"] else info["name"]

    def check_model(self, name: Optional[str]) -> str:
        """The model a request names must be ours: its id, file name, general.name, or a stem of
        the id ("gemma-3-270m" for gemma-3-270m-q4_k_m); an Ollama tag (":latest") is ignored.
        None (a lenient client) means ours. Anything else is a 404."""
        ours = self.model_id
        if name is None:
            return ours
        want = name.strip().lower()
        if want.endswith(":latest"):
            want = want[:-len(":latest")]
        info = self.info()
        names = {ours.lower(), (info["file"] or "").lower(), str(info["name"] or "").lower()}
        if want and (want in names or (ours.lower().startswith(want) and ours[len(want):len(want) + 1] in "-_.:")):
            return ours
        raise APIError(404, f"model '{name}' not found (this server serves '{ours}')", "model", "model_not_found")

    # --- one request -------------------------------------------------------------------------
    async def start(self, submit: Callable) -> "Generation":
        """`submit(client, on_event, queue_limit) -> request id`, run in a worker thread. A bad
        prompt is a 400 (context overflow, image refused, template error), a full queue a 429."""
        client = self.client()
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def on_event():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the server's loop has closed (shutting down): nobody waits
                pass
        try:
            rid = await run_in_threadpool(submit, client, on_event, self.config.max_queued_requests)
        except QueueFullError as e:
            raise APIError(429, str(e), code="queue_full") from None
        except ValueError as e:  # ContextOverflowError, ImageRequestError, ChatTemplateError, TokenizerError
            raise APIError(400, str(e) or type(e).__name__) from None
        gen = Generation(self, client, rid, wake)
        with self._lock:
            self.in_flight += 1
            self.served += 1
            self.live.add(gen)
        return gen

    def abort_all(self) -> None:
        """The server is stopping: every request in flight ends now (its stream says so), so
        connections close within the shutdown grace instead of being cancelled."""
        with self._lock:
            live = list(self.live)
        for gen in live:
            gen.client.abort(gen.rid)


class Generation:
    def __init__(self, state: ServerState, client, rid: int, wake: asyncio.Event):
        self.state, self.client, self.rid, self.wake = state, client, rid, wake
        self.done = False

    async def events(self, is_disconnected: Optional[Callable] = None):
        """The request's events as they come (the last one `finished`); `is_disconnected`: an
        async check, polled while waiting, that ends (and aborts) the request."""
        try:
            while not self.done:
                self.wake.clear()
                batch = self.client.poll(self.rid)
                for ev in batch:
                    if ev.finished:
                        self._end()
                    yield ev
                    if ev.finished:
                        return
                if batch:
                    continue
                try:
                    await asyncio.wait_for(self.wake.wait(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if is_disconnected is not None and await is_disconnected():
                        return
        finally:
            self.close()

    def _end(self) -> None:
        if not self.done:
            self.done = True
            with self.state._lock:
                self.state.in_flight -= 1
                self.state.live.discard(self)

    def close(self) -> None:
        """The client went away (or the handler ended early): abort what is still running."""
        if not self.done:
            self.client.abort(self.rid)
            with self.state._lock:
                self.state.aborted += 1
            self._end()
