"""The chat screen's commands besides sending: conversations (search, rename, delete, export,
import), settings, the conversations' KV on disk, kv-check, thinking, copying.

A mixin of `ChatScreen` (app/screens/chat.py), kept apart so that file stays readable; each
action is bound to a key there and listed in the command palette (app/app.py PALETTE).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from app.screens.dialogs import ConfirmScreen, HelpScreen, TextPrompt
from app.screens.kv_check import KVCheckScreen
from app.screens.settings import SettingsResult, SettingsScreen
from app.widgets.message_view import code_blocks
from app.widgets.sidebar import Sidebar


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class ChatCommandsMixin:
    """Needs from the screen: session, store, client, conversation_id, messages, settings,
    load_conversation, _busy, _new, _saved, notify, query_one, app."""

    def action_search(self) -> None:
        self.query_one("#search").focus()

    def action_rename(self) -> None:
        def done(title: Optional[str]) -> None:
            if title:
                self._saved(lambda: self.store.rename(self.conversation_id, title), "the title")
                self.sub_title = self.store.get(self.conversation_id).title
                self.query_one(Sidebar).reload(self.conversation_id)
        self.app.push_screen(TextPrompt("Rename conversation", self.store.get(self.conversation_id).title), done)

    def action_delete(self) -> None:
        if self._busy():
            return
        title = self.store.get(self.conversation_id).title

        def done(yes: bool) -> None:
            if yes:
                cid = self.conversation_id
                if self._saved(lambda: self.store.delete(cid) or True, "the deletion") is None:
                    return
                self._forget_kv(cid)
                convs = self.store.conversations()
                self.load_conversation(convs[0].id if convs else self._new().id)
                self.notify(f"Deleted “{title}”.")
        self.app.push_screen(ConfirmScreen(f"Delete “{title}” and all its messages?", yes="Delete"), done)

    def action_export(self) -> None:
        md, js = self._saved(lambda: self.store.export_to(self.conversation_id, self.app.export_dir),
                             "the export") or (None, None)
        if md is not None:
            kinds = [k for k, n in (("images", sum(len(m.images) for m in self.messages)),
                                    ("audio", sum(len(m.audio) for m in self.messages))) if n]
            files = f" ({' and '.join(f'{k} in {md.stem}-{k}/' for k in kinds)})" if kinds else ""
            self.notify(f"Exported to {md} and {js.name}{files}", timeout=8)

    def action_import(self) -> None:
        """Add a conversation from an exported JSON file (refused in one line when malformed)."""
        def done(path: Optional[str]) -> None:
            if not path or self._busy():
                return
            try:
                conv = self.store.import_file(path, report=lambda line: self.notify(
                    line, title="Attachments missing", severity="warning", timeout=10))
            except (OSError, ValueError) as e:
                self.notify(one_line(e), title="Import failed", severity="error", timeout=10)
                return
            self.load_conversation(conv.id)
            self.notify(f"Imported “{conv.title}”.")
        self.app.push_screen(TextPrompt("Import a conversation: path of an exported .json file"), done)

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())

    def action_settings(self) -> None:
        def done(result: Optional[SettingsResult]) -> None:
            if result is None:
                return
            if self._saved(lambda: self.store.update_settings(self.conversation_id, result.conversation) or True,
                           "the settings") is None:
                return
            if result.engine:
                self.app.confirm_reload(result.engine)
            else:
                self.notify("Settings saved for this conversation.")
        mode = (f"text continuation (a base model: {self.session.info.get('kind_reason') or 'its file says so'})"
                if self.continuation else "")
        self.app.push_screen(SettingsScreen(self.settings, self.app.engine_flags(), self._kv_figures(),
                                            self._kv_disk(), self._clear_kv_disk, mode=mode), done)

    # --- conversations' KV on disk (engine/kv/sessions.py) ---------------------------------------
    def _kv_session(self, conversation_id: int) -> Optional[str]:
        """The KV file of a conversation under <data-dir>/kv/, None when KV files are off."""
        folder = self.session.info.get("kv_dir")
        return str(Path(folder) / f"{conversation_id}.safetensors") if folder else None

    def _forget_kv(self, conversation_id: int) -> None:
        path, forget = self._kv_session(conversation_id), getattr(self.client, "forget_kv", None)
        if path and forget is not None:
            forget(path)

    def _kv_disk(self) -> Optional[dict]:
        usage = getattr(self.client, "kv_disk_usage", None)
        got = usage() if usage is not None and self.session.info.get("kv_dir") else None
        if got is None:
            return None
        return {"files": got[0], "bytes": got[1], "budget": self.session.info.get("kv_disk_budget")}

    def _clear_kv_disk(self) -> Optional[dict]:
        self.client.clear_kv_disk()
        return self._kv_disk()

    def _kv_figures(self) -> Optional[dict]:
        cached = getattr(self.app.backend, "kv_check_cached", None)
        return cached(self.session, self.store.data_dir) if cached else None

    def action_kv_check(self) -> None:
        """Measure the KV formats on this model (modal: the chat waits, app/screens/kv_check.py)."""
        if not self._busy():
            self.app.push_screen(KVCheckScreen(self.app.backend, self.session, self.store.data_dir))

    def action_toggle_thinking(self) -> None:
        on_ = not self.settings["thinking"]
        if self._saved(lambda: self.store.update_settings(self.conversation_id, {"thinking": on_}) or True,
                       "the setting") is None:
            return
        self.notify(f"Thinking {'on' if on_ else 'off'} for this conversation.")

    # --- copying -----------------------------------------------------------------------------
    def _last_answer(self) -> Optional[str]:
        return next((m.content for m in reversed(self.messages) if m.role == "assistant"), None)

    def action_copy_answer(self) -> None:
        text = self._last_answer()
        if text:
            self.app.copy_to_clipboard(text)
            self.notify("Copied the last answer.")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self._last_answer() or "")
        if blocks:
            self.app.copy_to_clipboard(blocks[-1])
            self.notify("Copied the last code block.")
        else:
            self.notify("The last answer has no code block.", severity="warning")

