"""Errors as each API shapes them, with the right status; never a traceback, never a 500 for a
request a client got wrong.

OpenAI (and llama-server) paths: `{"error": {"message", "type", "param", "code"}}`; Ollama paths
(`/api/...`): `{"error": "message"}`.
"""
from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.backend import ErrorKind

log = logging.getLogger("edgegem.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, _one_line(message), param, code
        self.type = type_ or TYPES.get(status, "invalid_request_error")


# A request the engine ended with an error, by its kind: the request's fault (its media, more tokens
# than the KV pool holds) is a 400, device memory running out a 503 (it may pass: try again), a
# failed forward a 500.
KIND_STATUS = {ErrorKind.BAD_INPUT: 400, ErrorKind.CAPACITY: 400, ErrorKind.OUT_OF_MEMORY: 503,
               ErrorKind.INTERNAL: 500}


def engine_error(ev) -> APIError:
    """The APIError of a final StreamEvent without an answer: its error kind's status, the kind as
    the OpenAI `code`; an abort is the server stopping (503)."""
    if ev.finish_reason == "abort":
        return APIError(503, "the request was stopped (the server is shutting down)")
    kind = ev.error_kind or ErrorKind.INTERNAL
    status = KIND_STATUS[kind]
    return APIError(status, ev.error or "generation failed", code=kind.value,
                    type_="server_error" if status == 500 else None)


def _one_line(msg: str) -> str:
    msg = str(msg).strip()
    return msg.splitlines()[0] if msg else "error"


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def error_body(err: APIError, path: str) -> dict:
    if is_ollama_path(path):
        return {"error": err.message}
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(err: APIError, path: str, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(err, path), status_code=err.status, headers=headers)


def _loc(loc) -> str:
    """pydantic's error location as a dotted path without the 'body' root: messages.0.content."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts)


def validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    where = _loc(e.get("loc", ()))
    if e.get("type") == "json_invalid":
        return "the body is not valid JSON", None
    if e.get("type") == "missing" and not where:
        return "the body must be a JSON object", None
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), (where or None)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return error_response(APIError(400, msg, param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return error_response(APIError(exc.status_code, msg), request.url.path, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {_one_line(str(exc))}"),
                              request.url.path)
