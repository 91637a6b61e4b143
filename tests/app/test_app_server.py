"""`edgegem --serve`: the API server runs inside the TUI on the TUI's own engine (one model, one KV
pool, one prefix cache); the status panel shows its address and the API requests in flight; the
app's chat keeps answering while an API client streams; 503 while a model (re)loads."""
from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("uvicorn")

from app.backend import EngineBackend  # noqa: E402
from app.server.config import ServerConfig  # noqa: E402
from app.server.run import BackgroundServer  # noqa: E402
from app.server.state import ServerState  # noqa: E402
from app.widgets.status_panel import StatusPanel  # noqa: E402
from engine.api import EngineOptions  # noqa: E402
from tests.app.test_app import SIZE, make_app, open_chat, say, until  # noqa: E402
from tests.tiny_models import TinySpec, write_tiny_gemma4  # noqa: E402


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("app-srv") / "tiny-gemma4.gguf", TinySpec(), seed=3)


async def test_the_app_serves_its_own_engine_and_shows_the_address_and_requests_in_flight(tmp_path, tiny_path):
    import httpx

    cfg = ServerConfig(port=0)
    server = BackgroundServer(ServerState(cfg), cfg)
    backend = EngineBackend(str(tiny_path), EngineOptions(max_running_requests=2), device="cpu")
    app = make_app(tmp_path, backend, default_settings={"temperature": 0.0, "max_tokens": 8}, server=server)
    streamed: dict = {}

    def api_client():
        body = {"messages": [{"role": "user", "content": "the dog ran"}], "max_tokens": 400, "stream": True,
                "temperature": 0}
        with httpx.Client(base_url=server.url, timeout=120) as h, h.stream("POST", "/v1/chat/completions",
                                                                           json=body) as r:
            streamed["status"] = r.status_code
            streamed["lines"] = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        assert server.state.client() is app.session.client  # the TUI's engine, not a second one
        t = threading.Thread(target=api_client)
        t.start()
        await until(pilot, lambda: server.in_flight == 1, timeout=60)
        chat.refresh_status()
        lines = chat.query_one(StatusPanel).lines
        assert f"serving {server.url}" in lines and "  API requests in flight 1" in lines
        await say(pilot, "the cat")  # the app's own chat answers while the API client streams
        assert app.store.messages(chat.conversation_id)[-1].status == "done"
        await asyncio.get_running_loop().run_in_executor(None, t.join, 120)
        assert streamed["status"] == 200 and streamed["lines"][-1] == "data: [DONE]"
        chat.refresh_status()
        assert "  API requests in flight 0" in chat.query_one(StatusPanel).lines
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
        assert models[0]["id"] == "tiny-gemma4"
        server.state.set_client(None)  # as during a reload: the API answers 503 until the model is back
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 503
        server.state.set_client(app.session.client)
    assert server.sock.fileno() == -1  # the app stopped its server on the way out
