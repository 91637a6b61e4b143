"""The chat screen: conversation sidebar, message list, input, status panel.

Generation runs in a worker thread that talks to the engine client (submit, stream, abort): it
only appends to `Generation.text` and posts one `GenerationDone`. A UI timer renders the text at
most 10 times a second, paced by the Markdown render cost (coalesced, so a fast decode never
floods the UI, and a stalled stream still shows everything it has). The UI thread alone renders and writes the store; every finished
or stopped answer is committed the moment it ends.
"""
from __future__ import annotations

import sqlite3
import time
from dataclasses import replace
from typing import Optional

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from app.backend import ErrorKind, GenerationParams, generation_params, split_thinking
from app.messages import GenerationDone
from app.conversation_format import prompt_message
from app.screens.chat_commands import ChatCommandsMixin, one_line
from app.screens.chat_media import MediaInputMixin
from app.screens.chat_record import RecordMixin
from app.screens.chat_tools import ChatToolsMixin
from app.screens.generation import Generation
from app.screens.settings import BASE_SETTINGS, DEFAULT_SETTINGS
from app.store import DEFAULT_TITLE, Message
from app.widgets.attachments import AttachmentBar
from app.widgets.chat_input import ChatInput
from app.widgets.message_view import MessageView
from app.widgets.sidebar import Sidebar
from app.widgets.status_panel import StatusPanel

CHUNK_INTERVAL_S = 0.1  # at most 10 UI updates a second, however fast the decode
UI_SHARE = 0.1  # and at most ~10% of the time spent rendering them
# the notice's title by the engine's ErrorKind: whether to change the message, the settings or nothing
FAILED_TITLE = {ErrorKind.BAD_INPUT: "An attachment was refused", ErrorKind.CAPACITY: "Too long for the KV cache",
                ErrorKind.OUT_OF_MEMORY: "Out of memory", ErrorKind.INTERNAL: "Generation failed"}


def sampling_params(s: dict, continue_text: bool = False) -> GenerationParams:
    """A conversation's settings -> the request's parameters (the engine's generation_params, over
    the chat defaults); `continue_text`: a base model (the messages are one text the model
    continues, engine.prompt.continuation_text; its defaults where `s` sets nothing)."""
    s = {**DEFAULT_SETTINGS, **s}
    return generation_params(s, base_model=continue_text, defaults=DEFAULT_SETTINGS, thinking=bool(s["thinking"]),
                             image_tokens=int(s["image_tokens"]))


class ChatScreen(ChatToolsMixin, MediaInputMixin, RecordMixin, ChatCommandsMixin, Screen[None]):
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+l", "edit_last", "Edit last"),
        Binding("ctrl+o", "copy_answer", "Copy"),
        Binding("ctrl+b", "copy_code", "Copy code", show=False),
        Binding("ctrl+t", "toggle_thinking", "Thinking"),
        Binding("f3", "attach_image", "Image"),
        Binding("f9", "attach_audio", "Audio", show=False),  # F6/F7 are the input's (select line/all)
        Binding("f5", "record", "Rec"),  # short: the footer holds "f1 Help" at 120 columns
        Binding("shift+f3", "remove_attachment", "Remove attachment", show=False),
        Binding("ctrl+n", "new_conversation", "New"),
        Binding("ctrl+f", "search", "Search", show=False),
        Binding("f2", "rename", "Rename", show=False),
        Binding("f8", "delete", "Delete", show=False),
        Binding("f4", "export", "Export", show=False),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+g", "tools", "Tools", show=False),
        Binding("f1", "help", "Help"),
    ]

    def __init__(self, session, store, conversation_id: Optional[int] = None) -> None:
        super().__init__()
        self.session, self.store = session, store
        self.conversation_id = conversation_id
        self.messages: list = []  # app.store.Message of the current conversation, in order
        self.gen: Optional[Generation] = None
        self._next_pump = 0.0
        self.last_stats: Optional[dict] = None

    @property
    def client(self):
        return self.session.client

    @property
    def continuation(self) -> bool:
        """A base model: messages are continued, not answered (app/backend.py's `kind`)."""
        return self.session.info.get("kind") == "base"

    def compose(self) -> ComposeResult:
        with Horizontal():
            yield Sidebar(self.store, id="sidebar")
            with Vertical(id="main"):
                yield VerticalScroll(id="messages")
                yield AttachmentBar(id="attachments")
                yield ChatInput(id="input")
            yield StatusPanel(id="status")
        yield Footer()

    def on_mount(self) -> None:
        convs = self.store.conversations()
        if self.conversation_id is None:
            self.conversation_id = convs[0].id if convs else self._new().id
        self.load_conversation(self.conversation_id)
        self.set_interval(0.5, self.refresh_status)
        self.set_interval(CHUNK_INTERVAL_S, self._pump)
        box = self.query_one(ChatInput)
        if self.continuation:
            box.placeholder = CONTINUE_PLACEHOLDER
        box.focus()
        info = self.session.info
        if info.get("arch") == "gemma4" and not info.get("draft"):
            self.notify("Speculative decoding is off: no assistant draft model. `edgegem pull` fetches the "
                        "matching one; pass it with --spec-draft-model PATH.", title="Draft off",
                        severity="warning", timeout=8)

    # --- conversations -----------------------------------------------------------------------
    def _new(self):
        return self.store.new_conversation(settings=dict(getattr(self.app, "default_settings", {})))

    def load_conversation(self, conversation_id: int) -> None:
        self.conversation_id = conversation_id
        self.messages = self.store.messages(conversation_id)
        box = self.query_one("#messages", VerticalScroll)
        box.remove_children()
        if self.session.info.get("demo"):
            box.mount(Static(DEMO_NOTE, classes="notice", markup=False))
        elif self.continuation:
            box.mount(Static(BASE_NOTE.format(why=self.session.info.get("kind_reason") or "base model"),
                             classes="notice", markup=False))
        box.mount_all([MessageView(m.role, m.content, m.thinking, m.status, m.id, (m.stats or {}).get("error"),
                                   m.images, m.audio, m.tool) for m in self.messages if m.role != "system"])
        box.scroll_end(animate=False)
        last = next((m.stats for m in reversed(self.messages) if m.role == "assistant" and m.stats), None)
        self.last_stats = last
        self.query_one(Sidebar).reload(conversation_id)
        self.sub_title = self.store.get(conversation_id).title
        self.refresh_status()

    @property
    def settings(self) -> dict:
        """This conversation's settings over the app's defaults (command-line flags) over ours
        (a base model's over the chat ones)."""
        return {**DEFAULT_SETTINGS, **(BASE_SETTINGS if self.continuation else {}),
                **getattr(self.app, "default_settings", {}), **self.store.get(self.conversation_id).settings}

    def _busy(self) -> bool:
        if self.gen is not None:
            self.notify("An answer is being written: wait, or press Escape to stop it.", severity="warning")
            return True
        return False

    @on(Sidebar.Selected)
    def switch_conversation(self, event: Sidebar.Selected) -> None:
        if not self._busy():
            self.load_conversation(event.conversation_id)
        else:
            self.query_one(Sidebar).reload(self.conversation_id)

    def action_new_conversation(self) -> None:
        if not self._busy():
            self.load_conversation(self._new().id)
            self.query_one(ChatInput).focus()

    # --- sending, regenerating, editing --------------------------------------------------------
    @on(ChatInput.Submitted)
    async def send(self, event: ChatInput.Submitted) -> None:
        if await self.take_media_input(event.text):  # `/image PATH`, `/audio PATH` or a lone path: attached
            return
        if self.recorder is not None and not await self.stop_recording():  # Enter while recording: stop, attach, send
            return
        pending = self.attachments.pending
        if (not event.text and not pending) or self._busy():
            return
        media = self.keep_pending()
        if media is None:
            return  # text and chips stay: nothing was sent
        conv = self.store.get(self.conversation_id)
        if not self.messages and conv.title == DEFAULT_TITLE:
            title = self.store.title_from(event.text or pending[0].name)
            self._saved(lambda: self.store.rename(conv.id, title), "the title")
            self.sub_title = self.store.get(conv.id).title
        m = self._saved(lambda: self.store.add_message(conv.id, "user", event.text, **media), "your message")
        if m is None:
            return  # the text stays in the input: send it again when the disk has room
        self.messages.append(m)
        self.query_one(ChatInput).clear()
        await self.attachments.clear()
        await self.query_one("#messages", VerticalScroll).mount(
            MessageView("user", m.content, message_id=m.id, images=m.images, audio=m.audio))
        self.query_one(Sidebar).reload(conv.id)
        await self.generate()

    def _drop_last(self, role: str) -> Optional[object]:
        """Remove the last message if it has `role` (store and view); return it."""
        if not self.messages or self.messages[-1].role != role:
            return None
        m = self.messages.pop()
        if m.id:  # 0: an answer the database could not take
            self._saved(lambda: self.store.delete_message(m.id), "the change")
        views = [v for v in self.query(MessageView) if v.message_id == m.id]
        for v in views:
            v.remove()
        return m

    def _drop_answer(self) -> None:
        """The last answer: every reply and tool result after the last user message."""
        while self.messages and self.messages[-1].role in ("assistant", "tool"):
            self._drop_last(self.messages[-1].role)

    async def action_regenerate(self) -> None:
        if self._busy() or not self.messages:
            return
        self._drop_answer()
        if self.messages and self.messages[-1].role == "user":
            await self.generate()

    async def action_edit_last(self) -> None:
        if self._busy():
            return
        self._drop_answer()
        m = self._drop_last("user")
        if m is not None:
            box = self.query_one(ChatInput)
            box.text = m.content
            await self.restore_media(m)  # its images and clips come back as chips, not lost
            box.focus()

    def action_stop(self) -> None:
        g = self.gen
        if g is None:
            return
        g.stop_requested = True
        if g.request_id is not None:
            self.client.abort(g.request_id)

    # --- generation ----------------------------------------------------------------------------
    def prompt_messages(self) -> list[dict]:
        s = self.settings
        msgs = [{"role": "system", "content": s["system"]}] if s["system"].strip() else []
        # Answers that failed carry no text worth conditioning on; stopped ones are kept.
        # A user message's images and clips go with it on every turn (the copies in the data
        # folder): the prefix cache keys them by content, so earlier ones are not encoded again.
        # Tool calls and their results go back as the template's blocks (conversation_format).
        # A tool result's images are shown, not given back: the model reads the result's text (one
        # line per image), the template's tool response has no place for images.
        msgs += [{**prompt_message(m), **(self.message_media(m) if m.role != "tool" else {})} for m in self.messages
                 if m.role in ("user", "assistant", "tool") and m.status != "error"]
        return msgs

    async def generate(self) -> None:
        view = MessageView("assistant", status="streaming")
        await self.query_one("#messages", VerticalScroll).mount(view)
        view.start_stream()
        self.gen = Generation(self.conversation_id, view)
        params = replace(sampling_params(self.settings, self.continuation),
                         kv_session=self._kv_session(self.conversation_id))
        msgs = self.prompt_messages()
        g, work = self.gen, self._work
        if self.tools_on():
            work, params = self._work_tools, self.with_tools(g, params)
        self.run_worker(lambda: work(g, msgs, params), thread=True, group="generate")

    def _work(self, g: Generation, msgs: list[dict], params: GenerationParams) -> None:
        """Worker thread: submit and stream. Never touches widgets or the store."""
        try:
            rid = self.client.submit(msgs, params)
            g.prompt_tokens = len(self.client.last_prompt_ids(rid))
            g.request_id = rid
            if g.stop_requested:
                self.client.abort(rid)
            for ev in self.client.stream(rid):
                g.append(ev.text, len(ev.token_ids))
                if ev.finished:
                    self.post_message(GenerationDone(g.id, g.text, ev.finish_reason, ev.error, ev.stats,
                                                     ev.error_kind))
                    return
        except Exception as e:  # noqa: BLE001 - context overflow, CUDA OOM...: shown, not raised
            self.post_message(GenerationDone(g.id, g.text, "error", one_line(e), None))

    async def _pump(self) -> None:
        """Timer: show what the worker has written since the last tick. Rendering Markdown holds
        the GIL the engine thread needs, so updates are paced to keep the UI's share of the time
        near UI_SHARE: a long answer on a slow CPU refreshes less often instead of decoding slower."""
        g = self.gen
        now = time.perf_counter()
        if g is None or now < self._next_pump:
            return
        step, text = g.live
        if step != g.view_step or g.view_done or text == g.shown:
            return  # a tool loop's next reply: its view is not mounted yet
        g.shown = text
        thought, answer = split_thinking(g.shown)
        await g.view.show(thought, answer)
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)
        cost = time.perf_counter() - now + g.view.render_cost_s
        self._next_pump = now + max(CHUNK_INTERVAL_S, cost / UI_SHARE)

    async def on_generation_done(self, msg: GenerationDone) -> None:
        g = self.gen
        if g is None or msg.gen_id != g.id:
            return
        if msg.tool_end:  # the loop stopped after a reply with calls: that reply is saved already
            await self.finish_tool_loop(g, msg)
            self.gen = None
            self._finished(msg.stats)
            return
        if g.view_done:  # a continuation failed before it wrote anything: its own view
            g.view = MessageView("assistant", status="streaming")
            await self.query_one("#messages", VerticalScroll).mount(g.view)
        # a continuation is kept as written (its leading space joins it to the text it continues)
        thought, answer = (None, msg.text) if self.continuation else split_thinking(msg.text)
        status = "error" if msg.error else "stopped" if msg.reason == "abort" else "done"
        stats = {**msg.stats, "finish_reason": msg.reason, **({"error": msg.error} if msg.error else {}),
                 **({"error_kind": msg.error_kind.value} if msg.error_kind else {})}
        m = self._saved(lambda: self.store.add_message(g.conversation_id, "assistant", answer,
                                                       thinking=thought or "", status=status, stats=stats),
                        "the answer")
        error = msg.error
        if m is None:  # shown and kept for this session's next prompt, but not in the database
            m = Message(0, g.conversation_id, "assistant", answer, thought or "", status, time.time(), stats)
            error = "not saved: the conversation database could not be written"
        self.messages.append(m)
        self.gen = None
        await g.view.finish(thought, answer, status, m.id or None, error)
        if msg.error:
            self.notify(msg.error, title=FAILED_TITLE.get(msg.error_kind, "Generation failed"), severity="error",
                        timeout=10)
        self._finished(msg.stats)

    def _finished(self, stats: Optional[dict]) -> None:
        if stats:
            self.last_stats = stats
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)
        self.query_one(Sidebar).reload(self.conversation_id)
        self.refresh_status()

    def _saved(self, write, what: str):
        """A store write; a failing one (disk full, database locked) is a notice, not a crash."""
        try:
            return write()
        except (sqlite3.Error, OSError) as e:
            self.notify(f"Could not save {what}: {one_line(e)}", title="Not saved", severity="error", timeout=10)
            return None

    # --- status --------------------------------------------------------------------------------
    def context_tokens(self) -> int:
        if self.gen is not None:
            return self.gen.prompt_tokens + self.gen.tokens
        s = self.last_stats or {}
        return int(s.get("prompt_tokens", 0)) + int(s.get("output_tokens", 0))

    def refresh_status(self) -> None:
        self.report_tool_failures()
        bar = self.attachments
        self.query_one(StatusPanel).refresh_from(self.session.info, self.client.status(),
                                                 self.context_tokens(), self.last_stats,
                                                 pending=(len(bar.pending), bar.tokens),
                                                 server=getattr(self.app, "server", None),
                                                 tools=self.app_tools.summary() if self.app_tools else None)

    def on_attachment_bar_changed(self, event: AttachmentBar.Changed) -> None:
        self.refresh_status()


DEMO_NOTE = ("This is the bundled demo model, Gemma 3 270M: a small base model, so your text is continued, "
             "not answered (start a sentence and let it finish the paragraph). For real answers load a "
             "Gemma-4 GGUF: edgegem --model PATH (or edgegem pull unsloth/gemma-4-E2B-it-GGUF:Q4_K_M).")
BASE_NOTE = ("Text continuation: this is a base model ({why}), so your text is continued, not answered; "
             "each continuation ends at a blank line (Settings).")
CONTINUE_PLACEHOLDER = "Text to continue (Enter sends, Shift+Enter or Ctrl+J for a new line)"
