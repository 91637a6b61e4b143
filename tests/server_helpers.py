"""A live `edgegem serve` inside the test process: the real engine client, the real ASGI app and
uvicorn on a free loopback port (app/server/run.BackgroundServer), so the real `openai` and
`ollama` clients talk HTTP to it. Only 127.0.0.1 is ever contacted."""
from __future__ import annotations

from dataclasses import replace

from app.server.config import ServerConfig
from app.server.run import BackgroundServer
from app.server.state import ServerState
from engine.api import EngineOptions, start_client


class LiveServer:
    def __init__(self, lm, opts: EngineOptions = EngineOptions(), client=None, **config):
        self.client = client if client is not None else start_client(lm, opts)
        cfg = ServerConfig(port=0, **config)
        self.state = ServerState(cfg, self.client)
        self.bg = BackgroundServer(self.state, cfg).start()
        self.url = self.bg.url
        self.owns_client = client is None

    def openai(self, key: str = "none", **kw):
        import openai
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=300, **kw)

    def ollama(self, **kw):
        import ollama
        return ollama.Client(host=self.url, timeout=300, **kw)

    def http(self, **kw):
        import httpx
        return httpx.Client(base_url=self.url, timeout=300, **kw)

    def engine(self, fn):
        """Run fn(engine) on the engine thread."""
        return self.client.call(fn)

    def close(self) -> None:
        self.bg.stop()
        if self.owns_client:
            self.client.close()


def with_config(server: LiveServer, **changes) -> LiveServer:
    """A second server on the same client with other settings (keys, hosts, limits)."""
    return LiveServer(None, client=server.client, **{**_fields(server.state.config), **changes})


def _fields(cfg: ServerConfig) -> dict:
    d = dict(vars(replace(cfg)))
    d.pop("port", None)
    return d
