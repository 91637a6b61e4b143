"""The checks every request passes before a handler sees it (one ASGI middleware, in this order):

1. Host header: an IP literal, a loopback name, the bind address or --allowed-hosts; a foreign
   name (DNS rebinding: evil.example resolving to 127.0.0.1) is a 403.
2. Origin (browsers send it on cross-site requests): a loopback origin, a local app scheme or a
   --cors-origin is granted CORS (preflights answered, Access-Control-Allow-Origin echoed); any
   other origin is a 403, so a page can neither read answers nor make the model write.
3. `Authorization: Bearer KEY` when a key is set, compared in constant time (401 otherwise); `/`
   and `/health` stay open (clients probe them, they say nothing).
4. Bodies: JSON only (a cross-site `text/plain` or form POST, which a browser sends without a
   preflight, is a 415 before anything runs) and at most --max-body bytes (413), read once.
"""
from __future__ import annotations

import hmac
import json

from .config import ServerConfig
from .errors import APIError, error_body

OPEN_PATHS = ("/", "/health")
BODY_METHODS = (b"POST", b"PUT", b"PATCH")


def _headers(scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in scope.get("headers", ()):
        out.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
    return out


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class SecurityMiddleware:
    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope.get("method", "GET").encode()
        h = _headers(scope)
        origin = h.get("origin")
        cfg = self.config

        async def refuse(status: int, message: str, extra: tuple = ()):
            body = json.dumps(error_body(APIError(status, message), path)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       *extra]
            if origin and cfg.origin_allowed(origin):
                headers += _cors(origin)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body if method != b"HEAD" else b""})

        if not cfg.host_allowed(h.get("host", "")):
            return await refuse(403, f"Host {h.get('host', '')!r} is not this server's (DNS rebinding?): "
                                     f"use the address it listens on, or start it with --allowed-hosts NAME")
        if origin is not None and not cfg.origin_allowed(origin):
            return await refuse(403, f"origin {origin!r} may not call this server (start it with --cors-origin "
                                     f"ORIGIN to allow it)")
        if method == b"OPTIONS" and origin is not None and "access-control-request-method" in h:
            headers = _cors(origin) + [
                (b"access-control-allow-methods", b"GET, POST, HEAD, OPTIONS"),
                (b"access-control-allow-headers",
                 h.get("access-control-request-headers", "authorization, content-type").encode("latin-1")),
                (b"access-control-max-age", b"600"), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            return await send({"type": "http.response.body", "body": b""})
        if cfg.api_key and path not in OPEN_PATHS:
            auth = h.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), cfg.api_key.encode())
            if not ok:
                return await refuse(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                    ((b"www-authenticate", b"Bearer"),))
        if method in BODY_METHODS:
            if not _is_json(h.get("content-type", "")):
                return await refuse(415, f"send the body as JSON (Content-Type: application/json), not "
                                         f"{h.get('content-type') or 'no content type'!r}")
            length = h.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > cfg.max_body):
                return await refuse(413, f"request body over the {cfg.max_body}-byte limit (--max-body)")
            chunks, size = [], 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                chunks.append(msg.get("body", b""))
                size += len(chunks[-1])
                if size > cfg.max_body:
                    return await refuse(413, f"request body over the {cfg.max_body}-byte limit (--max-body)")
                if not msg.get("more_body"):
                    break
            receive = _replay(b"".join(chunks), receive)
        if origin is not None:
            send = _with_cors(send, origin)
        return await self.app(scope, receive, send)


def _cors(origin: str) -> list:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


def _replay(body: bytes, receive):
    """The body read once, then the real channel (so disconnects are still seen)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _with_cors(send, origin: str):
    async def wrapped(msg):
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": list(msg.get("headers", ())) + _cors(origin)}
        await send(msg)
    return wrapped
