"""What `edgegem serve` (and `edgegem --serve`) is told: where to listen, who may call, limits.

The server is reachable by every web page the user opens, so the defaults are strict: loopback
only, a non-loopback bind needs an API key, Host headers are checked (DNS rebinding), browsers'
cross-site requests are refused unless their origin is a loopback one or named.
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

DEFAULT_PORT = 8080
DEFAULT_MAX_BODY = 32 << 20  # bytes: a request with a few full-size images fits
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000  # per image (Pillow's bomb cap is 89 M; a 12 MP photo is 12 M)
OLLAMA_VERSION = "0.12.6"  # the Ollama API version we answer /api/version with (clients gate features on it)


class ServerConfigError(ValueError):
    """A server setting that refuses to start (one line)."""


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: Optional[str] = None
    insecure_no_key: bool = False  # a non-loopback bind without a key, on purpose
    allowed_hosts: list[str] = field(default_factory=list)  # extra Host header names ("*": no check)
    cors_origins: list[str] = field(default_factory=list)  # extra browser origins ("*": any, never with a key)
    max_body: int = DEFAULT_MAX_BODY
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_queued_requests: int = 32  # waiting in the engine; past it, 429
    default_max_tokens: Optional[int] = None  # a request without one: None = up to the context
    kv_auto: bool = False  # --kv-dir: each conversation's KV saved, found again by its tokens
    image_tokens: int = 280  # soft-token budget per image (--image-tokens)

    def check(self) -> None:
        """Refuse settings that would expose the model: one line saying why."""
        if not 0 <= self.port <= 65535:
            raise ServerConfigError(f"--port must be 0-65535, not {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ServerConfigError("the API key is empty")
        if not is_loopback(self.host) and not self.api_key and not self.insecure_no_key:
            raise ServerConfigError(
                f"--host {self.host} is reachable from other machines: give --api-key KEY (or --api-key-file F), "
                f"or --insecure-no-key to serve without one")
        if "*" in self.cors_origins and self.api_key:
            raise ServerConfigError("--cors-origin '*' with an API key would let any web page use the key: "
                                    "name the origins instead")
        if self.max_body < 1024:
            raise ServerConfigError("--max-body must be at least 1KiB")

    def host_allowed(self, host_header: str) -> bool:
        """A Host header (name[:port]) we answer: an IP literal (never a rebinding), a loopback name,
        the bind address, this machine's names or one of --allowed-hosts. A foreign name pointed
        at us by DNS (rebinding) is refused."""
        if "*" in self.allowed_hosts:
            return True
        name = _host_name(host_header)
        if not name:
            return False
        if is_ip_literal(name) or is_loopback(name):
            return True
        names = {self.host.lower(), *(h.lower() for h in self.allowed_hosts)}
        if not is_loopback(self.host):
            names |= machine_names()
        return name in names

    def origin_allowed(self, origin: str) -> bool:
        """A browser Origin granted CORS (and allowed to call at all): loopback origins on any port,
        local web-UI and editor schemes, and --cors-origin ones."""
        origin = origin.strip().rstrip("/").lower()
        if "*" in self.cors_origins:
            return True
        if origin in {o.strip().rstrip("/").lower() for o in self.cors_origins}:
            return True
        scheme, sep, rest = origin.partition("://")
        if not sep:
            return False  # "null" (sandboxed frames, file:// pages): never
        if scheme in LOCAL_APP_SCHEMES:
            return True
        return scheme in ("http", "https") and is_loopback(_host_name(rest))


# Desktop and editor web views (Ollama's default list): their pages are local code, not web sites.
LOCAL_APP_SCHEMES = ("app", "tauri", "vscode-webview", "vscode-file")


def _host_name(host: str) -> str:
    """'name:port' / '[v6]:port' / 'name' -> the lowercase name."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host


def machine_names() -> set[str]:
    names = set()
    for n in (socket.gethostname(), socket.getfqdn()):
        if n:
            names.add(n.lower())
    return names


def read_key_file(path: str) -> str:
    """The API key from a file (first line), so it stays out of `ps` and shell history."""
    try:
        key = Path(path).expanduser().read_text().splitlines()
    except OSError as e:
        raise ServerConfigError(f"--api-key-file {path}: {e.strerror or e}") from None
    if not key or not key[0].strip():
        raise ServerConfigError(f"--api-key-file {path}: empty")
    return key[0].strip()
