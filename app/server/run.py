"""Running the server: `serve` (the `edgegem serve` command, in the main thread, until SIGTERM or
Ctrl+C) and `BackgroundServer` (inside the TUI, in a thread of its own, on the app's client).

The socket is bound before uvicorn starts, so a port in use is a one-line error, and port 0 picks
a free one. uvicorn gets 1 s to finish streams on shutdown; what is still running is then
cancelled, which aborts its requests (their KV goes back), and the client closes.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Optional

from .config import ServerConfig
from .state import ServerState

GRACEFUL_S = 1  # seconds streams get to finish when the server stops (exit within 2 s)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (IPv6 for an address with ':'); OSError names the address."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_of(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host.strip('[]')}]" if ":" in host.strip("[]") else host
    return f"http://{shown}:{port}"


def _uvicorn(state: ServerState, quiet: bool, access_log: bool = False):
    import uvicorn

    from . import create_app

    if quiet:  # inside the TUI: no log line may reach the terminal
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "edgegem.server"):
            lg = logging.getLogger(name)
            lg.addHandler(logging.NullHandler())
            lg.propagate = False
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=access_log,
                            log_config=None if quiet else uvicorn.config.LOGGING_CONFIG,
                            timeout_graceful_shutdown=GRACEFUL_S, lifespan="off", server_header=False,
                            proxy_headers=False, ws="none")

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            state.abort_all()  # streams end with "shutting down" and close inside the grace period
            await super().shutdown(sockets)
    return Server(config)


def serve(state: ServerState, sock: socket.socket, access_log: bool = False) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn catches them in the main thread and re-raises them
    once it has stopped, so the caller's handlers still end the process)."""
    server = _uvicorn(state, quiet=False, access_log=access_log)
    server.run(sockets=[sock])


class BackgroundServer:
    """The same server inside another program (the TUI): its own thread and event loop."""

    def __init__(self, state: ServerState, config: ServerConfig):
        self.state, self.config = state, config
        self.sock = bind(config.host, config.port)
        self.url = url_of(config.host, self.sock)
        self._server = _uvicorn(state, quiet=True)
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "BackgroundServer":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name="edgegem-server", daemon=True)
        self._thread.start()
        return self

    @property
    def in_flight(self) -> int:
        return self.state.in_flight

    def stop(self, timeout: float = 3.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()
