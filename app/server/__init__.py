"""A local API server on the engine's client: OpenAI's chat/completions API and Ollama's, so
editors, Open WebUI, oterm and scripts get edgegem's context per GB, prefix cache and KV files.

`create_app(state)` builds the ASGI app (FastAPI: pydantic request models, one security
middleware, errors in each API's shape); `app/server/run.py` runs it with uvicorn, from
`edgegem serve` or inside the TUI (`edgegem --serve`). This package file imports nothing heavy:
the CLI reads `config` without loading FastAPI.
"""
from __future__ import annotations


def create_app(state):
    from fastapi import FastAPI

    from . import errors, ollama_routes, openai_routes
    from .security import SecurityMiddleware

    app = FastAPI(title="edgegem", docs_url=None, redoc_url=None, openapi_url=None)  # no pages to attack
    errors.install(app)
    app.include_router(openai_routes.router(state))
    app.include_router(ollama_routes.router(state))
    app.add_middleware(SecurityMiddleware, config=state.config)
    app.state.edgegem = state
    return app
