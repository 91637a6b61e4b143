"""Write the README screenshot: the app on the demo model after its first answer, at the app's
defaults for it (a base model: text continuation, DRY on, stop at a blank line), seeded.

    .venv/bin/python packaging/screenshot.py packaging/screenshot.svg

Runs headless (Textual's pilot) with a throwaway data directory. The same scenario, with the
speeds (which vary by machine) blanked, is the snapshot test
tests/app/test_app_snapshots.py::test_snapshot_demo_first_answer.
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from app.app import EdgegemApp
from app.backend import EngineBackend, EngineOptions
from app.screens.chat import ChatScreen
from app.store import Store
from app.widgets.chat_input import ChatInput

PROMPT = "Write one sentence about lighthouses."  # issue 24's first message
SEED = 3  # the only setting away from the defaults: the answer is the same on every run
SIZE = (130, 36)
# a fixed budget: without one the CPU plan reads the host's free memory, so the status panel's
# budget line would differ from machine to machine
BUDGET = "2GiB"


def demo_app(data_dir: Path) -> EdgegemApp:
    ChatInput.cursor_blink = False  # a blinking cursor would make the pictures flaky
    return EdgegemApp(EngineBackend(options=EngineOptions(gpu_memory_budget=BUDGET)), Store(data_dir),
                      plan_seconds=0.0, default_settings={"seed": SEED})


async def first_answer(pilot, blank_speeds: bool = False, timeout: float = 300.0) -> None:
    """Load, send PROMPT, wait for the answer; `blank_speeds`: the status panel's tok/s as 0."""
    app = pilot.app
    end = asyncio.get_running_loop().time() + timeout
    while not isinstance(app.screen, ChatScreen):
        if asyncio.get_running_loop().time() > end:
            raise TimeoutError("the demo model did not load")
        await pilot.pause(0.1)
    chat = app.screen
    # the screen focuses its input at the end of its mount: text or Enter before that can be lost
    while not (chat.query("#input") and chat.query_one("#input").has_focus):
        if asyncio.get_running_loop().time() > end:
            raise TimeoutError(f"the chat input never took the focus ({app.focused!r} has it)")
        await pilot.pause(0.05)
    box = chat.query_one("#input")
    box.text = PROMPT
    await pilot.press("enter")
    while chat.gen is not None or len(chat.messages) < 2:
        if asyncio.get_running_loop().time() > end:
            raise TimeoutError(f"no answer in {timeout:.0f} s ({len(chat.messages)} messages; "
                               f"{'no generation' if chat.gen is None else f'{chat.gen.tokens} tokens streamed'})")
        await pilot.pause(0.1)
    answer = chat.messages[-1]
    if answer.status != "done":  # a failed generation says why instead of timing out
        raise RuntimeError(f"the demo's answer ended {answer.status}: {answer.stats.get('error')}")
    # the screen sets last_stats after the answer's view is finished: wait for that too
    while chat.last_stats is None:
        if asyncio.get_running_loop().time() > end:
            raise TimeoutError("no status after the answer")
        await pilot.pause(0.1)
    if blank_speeds:
        chat.last_stats = {**chat.last_stats, "prefill_tok_s": 0.0, "decode_tok_s": 0.0}
        chat.refresh_status()
    await pilot.pause(0.6)  # the status panel's next refresh


async def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        app = demo_app(Path(d))
        async with app.run_test(size=SIZE) as pilot:
            await first_answer(pilot)
            app.save_screenshot(filename=out.name, path=str(out.parent))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "packaging/screenshot.svg")))
