"""Write the README screenshot: the app on the demo model after one real exchange.

    .venv/bin/python packaging/screenshot.py packaging/screenshot.svg

Runs headless (Textual's pilot) with a throwaway data directory; the answer is whatever the demo
model writes at temperature 0 (a small base model, so it rambles: the picture shows that too).
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from app.app import EdgegemApp
from app.backend import EngineBackend
from app.screens.chat import ChatScreen
from app.store import Store
from app.widgets.chat_input import ChatInput


async def main(out: Path) -> None:
    ChatInput.cursor_blink = False
    with tempfile.TemporaryDirectory() as d:
        app = EdgegemApp(EngineBackend(), Store(Path(d)), plan_seconds=0.0,
                         default_settings={"temperature": 0.0, "max_tokens": 60})
        async with app.run_test(size=(130, 36)) as pilot:
            while not isinstance(app.screen, ChatScreen):
                await pilot.pause(0.1)
            chat = app.screen
            chat.query_one("#input").text = "The three primary colors are"
            await pilot.press("enter")
            while chat.gen is not None or len(chat.messages) < 2:
                await pilot.pause(0.1)
            await pilot.pause(0.5)
            app.save_screenshot(filename=out.name, path=str(out.parent))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "packaging/screenshot.svg")))
