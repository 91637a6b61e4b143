"""Kill the app with SIGKILL while it writes an answer: every earlier message is in the database,
which opens cleanly (WAL: a commit is in the log file before add_message returns)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from app.store import Store

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import asyncio, sys
    from app.app import EdgegemApp
    from app.screens.chat import ChatScreen
    from app.store import Store
    from tests.app_fakes import FakeBackend, FakeClient

    async def main(data_dir):
        client = FakeClient(delay=0.005)
        app = EdgegemApp(FakeBackend(client), Store(data_dir), plan_seconds=0.0)
        async with app.run_test(size=(100, 30)) as pilot:
            while not isinstance(app.screen, ChatScreen):
                await pilot.pause(0.02)
            chat = app.screen
            for i in range(3):
                chat.query_one("#input").text = f"question {i}"
                await pilot.press("enter")
                while chat.gen is not None or len(chat.messages) < 2 * (i + 1):
                    await pilot.pause(0.01)
                for m in chat.messages[-2:]:
                    print("SAVED", m.id, m.content.replace(chr(10), " ")[:20], flush=True)
            client.gate_after = 2      # the fourth answer stalls mid-stream
            chat.query_one("#input").text = "question in flight"
            await pilot.press("enter")
            while chat.gen is None or not chat.gen.text:
                await pilot.pause(0.01)
            print("GENERATING", flush=True)
            await asyncio.sleep(60)    # killed here

    asyncio.run(main(sys.argv[1]))
""")


def test_sigkill_during_generation_loses_only_the_answer_in_flight(tmp_path):
    data = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(data)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    saved = []
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:
            if line.startswith("SAVED"):
                saved.append(int(line.split()[1]))
            if line.startswith("GENERATING") or time.monotonic() > deadline:
                break
        assert len(saved) == 6, proc.stderr.read() if proc.poll() is not None else saved
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    store = Store(data)
    try:
        assert store.integrity_check() == "ok"
        (conv,) = store.conversations()
        msgs = store.messages(conv.id)
        # the six finished messages and the in-flight question; the half-written answer is the only loss
        assert [m.id for m in msgs][:6] == saved
        assert [m.role for m in msgs] == ["user", "assistant"] * 3 + ["user"]
        assert msgs[-1].content == "question in flight"
        assert all(m.status == "done" for m in msgs)
    finally:
        store.close()
