"""`EdgegemApp`: loads the model in a worker (progress, memory plan), then opens the chat.

The app holds the backend (how to load), the session (loaded client + info) and the store; the
screens do the rest. Load errors (bad file, budget too small, CUDA out of memory) end on a
readable screen, never a traceback.
"""
from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Iterable, Optional

from textual.app import App, SystemCommand
from textual.screen import Screen

from app.backend import exiting_on_signal, load_error_kind
from app.messages import LoadFailed, Loaded, LoadProgress
from app.screens.chat import ChatScreen, one_line
from app.screens.dialogs import ConfirmScreen, LoadErrorScreen
from app.screens.loading import LoadingScreen
from app.store import Store

DEMO_LOADING_NOTE = ("Demo model: Gemma 3 270M, a small base model (it continues text rather than "
                     "answering). Load a Gemma-4 GGUF with: edgegem --model PATH")


class EdgegemApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "edgegem"

    def __init__(self, backend, store: Optional[Store] = None, data_dir: Optional[Path] = None,
                 default_settings: Optional[dict] = None, plan_seconds: float = 1.0, server=None,
                 tools=None) -> None:
        super().__init__()
        self.backend = backend
        # `edgegem --serve`: app/server/run.BackgroundServer, bound already; it serves this app's
        # engine (one model, one KV pool, one prefix cache) and answers 503 while a model loads.
        self.server = server
        self.store = store or Store(data_dir)
        self.export_dir = self.store.data_dir / "exports"
        self.default_settings = default_settings or {}
        self.plan_seconds = plan_seconds  # how long the memory plan stays up before the chat opens
        self.session = None
        # app/tools/session.AppTools: MCP servers and built-ins, started with the app (in the
        # background), stopped with it; None when this run has no tools
        self.tools = tools

    # --- loading -------------------------------------------------------------------------------
    def on_mount(self) -> None:
        self._signals = []
        try:  # SIGTERM / SIGINT (kill, not a key): close like Ctrl+Q, exit 143 / 130
            loop = asyncio.get_running_loop()
            for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
                loop.add_signal_handler(sig, self._on_signal, code)
                self._signals.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or a platform without loop signal handlers
        if self.server is not None:
            self.server.start()
        if self.tools is not None:
            self.tools.start()
        self.start_load()

    def _on_signal(self, code: int) -> None:
        exiting_on_signal()  # end within ~2 s (a KV file still being written is dropped)
        self.exit(return_code=code)

    def start_load(self, conversation_id: Optional[int] = None) -> None:
        self._resume = conversation_id
        demo = getattr(self.backend, "model", "x") is None
        self.push_screen(LoadingScreen(f"Loading {self._model_label()}", DEMO_LOADING_NOTE if demo else ""))
        self.run_worker(self._load, thread=True, exclusive=True, group="load")

    def _model_label(self) -> str:
        model = getattr(self.backend, "model", None)
        return Path(model).name if model else "the demo model"

    def _load(self) -> None:
        try:
            session = self.backend.load(lambda frac, text: self.post_message(LoadProgress(frac, text)))
        except Exception as e:  # noqa: BLE001 - every load failure becomes the error screen
            self.post_message(LoadFailed(one_line(e), load_error_kind(e)))
        else:
            self.post_message(Loaded(session))

    def on_load_progress(self, msg: LoadProgress) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.screen.on_load_progress(msg)

    def on_loaded(self, msg: Loaded) -> None:
        self.session = msg.session
        if self.server is not None:
            self.server.state.set_client(msg.session.client)
        self.sub_title = msg.session.info.get("model", "")
        if isinstance(self.screen, LoadingScreen):
            self.screen.show_plan(msg.session.info.get("plan", []))
        if self.plan_seconds > 0:
            self.set_timer(self.plan_seconds, self._open_chat)
        else:
            self._open_chat()

    def _open_chat(self) -> None:
        self.switch_screen(ChatScreen(self.session, self.store, self._resume))

    def on_load_failed(self, msg: LoadFailed) -> None:
        self.switch_screen(LoadErrorScreen(msg.error, msg.kind))

    # --- reload with other engine flags --------------------------------------------------------
    def engine_flags(self) -> dict:
        o = getattr(self.backend, "options", None)
        return {"kv_cache_dtype": getattr(o, "kv_cache_dtype", "auto"),
                "gpu_memory_budget": getattr(o, "gpu_memory_budget", None),
                "spec_draft_model": getattr(o, "spec_draft_model", None)}

    def confirm_reload(self, changes: dict) -> None:
        what = ", ".join(f"{k} = {v or 'default'}" for k, v in changes.items())

        def done(yes: bool) -> None:
            if yes:
                self.reload(changes)
        self.push_screen(ConfirmScreen(f"Reload the model with {what}? The KV cache starts empty.",
                                       yes="Reload"), done)

    def reload(self, changes: dict) -> None:
        conv = self.screen.conversation_id if isinstance(self.screen, ChatScreen) else None
        if self.server is not None:
            self.server.state.set_client(None)  # 503 until the new model is in
        if self.session is not None:
            self.session.client.close()
            self.session = None
        self.backend = self.backend.with_options(**changes)
        self.switch_screen(LoadingScreen(f"Reloading {self._model_label()}"))
        self._resume = conv
        self.run_worker(self._load, thread=True, exclusive=True, group="load")

    # --- palette and shutdown ------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if isinstance(screen, ChatScreen):
            for title, help_, action in PALETTE:
                yield SystemCommand(title, help_, getattr(screen, f"action_{action}"))

    def on_unmount(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in getattr(self, "_signals", []):
            loop.remove_signal_handler(sig)
        if self.server is not None:
            self.server.state.set_client(None)
            self.server.stop()
        if self.session is not None:
            self.session.client.close()
        if self.tools is not None:
            self.tools.close()
        self.store.close()


PALETTE = [
    ("New conversation", "Start an empty conversation (Ctrl+N)", "new_conversation"),
    ("Regenerate", "Write the last answer again (Ctrl+R)", "regenerate"),
    ("Edit last message", "Put the last message back in the input (Ctrl+L)", "edit_last"),
    ("Stop", "Stop the answer being written (Escape)", "stop"),
    ("Copy answer", "Copy the last answer to the clipboard (Ctrl+O)", "copy_answer"),
    ("Copy code block", "Copy the last code block (Ctrl+B)", "copy_code"),
    ("Thinking on/off", "Let the model think first (Ctrl+T)", "toggle_thinking"),
    ("Attach image", "Attach an image file to the next message (F3, or type /image PATH)", "attach_image"),
    ("Attach audio", "Attach an audio file (WAV, FLAC, OGG, MP3) to the next message (F9, or type /audio PATH)",
     "attach_audio"),
    ("Record audio", "Start or stop recording from the microphone; the clip goes with the next message (F5)",
     "record"),
    ("Remove attachment", "Remove the last image or clip attached to the next message (Shift+F3)",
     "remove_attachment"),
    ("Rename conversation", "F2", "rename"),
    ("Delete conversation", "F8", "delete"),
    ("Export conversation", "Markdown and JSON into the data directory (F4)", "export"),
    ("Import conversation", "Add a conversation from an exported JSON file", "import"),
    ("Search conversations", "Ctrl+F", "search"),
    ("Settings", "Sampling, system prompt, engine flags (Ctrl+S)", "settings"),
    ("Tools", "MCP servers and built-in tools: status, on/off, tools allowed always (Ctrl+G)", "tools"),
    ("Measure KV formats (kv-check)", "What each KV cache format costs on this model: KL divergence, top-1",
     "kv_check"),
    ("Help", "Key bindings (F1)", "help"),
]
