"""Conversation list with a search box: titles newest first; typing filters by title and text."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView


class ConversationItem(ListItem):
    def __init__(self, conversation_id: int, title: str, snippet: str = "") -> None:
        super().__init__(Label(title, classes="title", markup=False),
                         *([Label(snippet, classes="snippet", markup=False)] if snippet else []))
        self.conversation_id, self.title = conversation_id, title


class Sidebar(Vertical):
    class Selected(Message):
        def __init__(self, conversation_id: int) -> None:
            super().__init__()
            self.conversation_id = conversation_id

    def __init__(self, store, **kw) -> None:
        super().__init__(**kw)
        self.store = store
        self.current: int | None = None

    def compose(self) -> ComposeResult:
        yield Label("Conversations", classes="heading")
        yield Input(placeholder="Search (Ctrl+F)", id="search")
        yield ListView(id="conversations")

    def reload(self, current: int | None = None) -> None:
        """Rebuild the list (after new/rename/delete/new message), keeping `current` highlighted."""
        if current is not None:
            self.current = current
        query = self.query_one("#search", Input).value.strip()
        if query:
            rows = [(c.id, c.title, snip) for c, snip in self.store.search(query)]
        else:
            rows = [(c.id, c.title, "") for c in self.store.conversations()]
        lv = self.query_one("#conversations", ListView)
        lv.clear()
        lv.extend(ConversationItem(cid, title, snip) for cid, title, snip in rows)
        ids = [r[0] for r in rows]
        if self.current in ids:
            lv.index = ids.index(self.current)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.reload()

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        item = event.item
        if isinstance(item, ConversationItem) and item.conversation_id != self.current:
            self.current = item.conversation_id
            self.post_message(self.Selected(item.conversation_id))
