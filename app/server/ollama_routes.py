"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`,
and `GET`/`HEAD /`), streaming NDJSON by default as Ollama does; oterm, Open WebUI and the
`ollama` client speak it."""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from . import params as P
from .config import OLLAMA_VERSION
from .errors import APIError, engine_error
from .ollama_schemas import ChatRequest, GenerateRequest, ShowRequest
from app.backend import ollama_tool_calls

from .output import ReasoningSplitter, TokenText, ollama_logprobs, split_all
from .state import EngineStream, ServerState


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ndjson(obj) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def _done(model: str, ev, t0: float, extra: dict) -> dict:
    """The final object: durations in nanoseconds, as Ollama reports them."""
    st = ev.stats or {}
    return {"model": model, "created_at": _now(), **extra, "done": True,
            "done_reason": {"length": "length"}.get(ev.finish_reason, "stop"),
            "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
            "prompt_eval_count": int(st.get("prompt_tokens", 0)),
            "prompt_eval_duration": int(st.get("prefill_s", 0.0) * 1e9),
            "eval_count": int(st.get("output_tokens", 0)), "eval_duration": int(st.get("decode_s", 0.0) * 1e9)}


def capabilities(info: dict) -> list[str]:
    """What oterm and Open WebUI switch features on by (Ollama's /api/show `capabilities`)."""
    caps = ["completion"]
    if info.get("chat_family") == "gemma4":  # its chat format renders tools (models/tool_format.py)
        caps.append("tools")
    if info.get("vision"):
        caps.append("vision")
    if info.get("audio"):  # through the OpenAI API's input_audio parts (Ollama's API has no audio field)
        caps.append("audio")
    if info.get("chat_family") == "gemma4":
        caps.append("thinking")
    return caps


def router(state: ServerState) -> APIRouter:
    r = APIRouter()
    cfg = state.config

    @r.get("/")
    async def root():
        return PlainTextResponse("Ollama is running")  # what clients probe for

    @r.head("/")
    async def root_head():
        return Response(status_code=200)

    @r.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION}

    @r.get("/api/tags")
    async def tags():
        return {"models": [_entry(state)]}

    @r.get("/api/ps")
    async def ps():
        e = _entry(state)
        return {"models": [{**e, "expires_at": "2999-01-01T00:00:00Z", "size_vram": 0,
                            "context_length": state.info()["context_length"]}]}

    @r.post("/api/show")
    async def show(req: ShowRequest):
        name = state.check_model(req.model or req.name)
        info = state.info()
        return {"modelfile": f"# edgegem serves {info['file']}\nFROM {name}\n",
                "parameters": "temperature 0.8\ntop_k 40\ntop_p 0.9\nrepeat_penalty 1.1",
                "template": info.get("chat_template") or "", "details": _details(info),
                "model_info": {"general.architecture": info["arch"], "general.name": info["name"],
                               "general.parameter_count": info["parameters"],
                               f"{info['arch']}.context_length": info["context_length"],
                               f"{info['arch']}.vocab_size": info["vocab_size"]},
                "capabilities": capabilities(info), "modified_at": _modified(state)}

    @r.post("/api/chat")
    async def chat(req: ChatRequest, request: Request):
        model = _model(state, req.model)
        if not req.messages:  # Ollama's load probe (clients send it to preload a model): answered at once
            return {"model": model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                    "done": True, "done_reason": "load"}
        info = state.info()
        msgs, gen_params = await run_in_threadpool(P.ollama_chat, req, info["context_length"], cfg, info)
        t0 = time.perf_counter()
        gen = await state.start(lambda c, on, ql: c.submit(msgs, gen_params, on_event=on, queue_limit=ql))
        text = TokenText(gen.client)
        if req.stream:
            return EngineStream(_stream(gen, model, t0, text, chat=True), gen, media_type="application/x-ndjson")
        raw, picked, _, last = await _collect(gen, request)
        if last is None:
            return JSONResponse({}, status_code=499)
        thinking, content = split_all(raw)
        message = {"role": "assistant", "content": content, **({"thinking": thinking} if thinking else {}),
                   **({"tool_calls": ollama_tool_calls(last.tool_calls)} if last.tool_calls else {})}
        extra = {"message": message, **({"logprobs": ollama_logprobs(picked, text)} if req.logprobs else {})}
        return _done(model, last, t0, extra)

    @r.post("/api/generate")
    async def generate(req: GenerateRequest, request: Request):
        model = _model(state, req.model)
        client = state.client()
        if not req.prompt and not req.images and not req.context:  # Ollama: load the model, answer done
            return {"model": model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
        info = state.info()
        # a base model: the prompt (and system) continued as one text, with its defaults where the options
        # set none (engine/request_params.py); the chat template otherwise
        msgs, images, gen_params = await run_in_threadpool(P.ollama_generate, req, info["context_length"], cfg,
                                                           info.get("kind") == "base")
        ids = await run_in_threadpool(_generate_ids, client, state, req, msgs, gen_params)
        t0 = time.perf_counter()
        if ids is None:
            gen = await state.start(lambda c, on, ql: c.submit(msgs, gen_params, on_event=on, queue_limit=ql))
        else:
            gen = await state.start(lambda c, on, ql: c.submit_ids(ids, gen_params, images, on_event=on,
                                                                   queue_limit=ql))
        text = TokenText(gen.client)
        split = not req.raw
        if req.stream:
            return EngineStream(_stream(gen, model, t0, text, chat=False, split=split), gen,
                                media_type="application/x-ndjson")
        raw, picked, out_ids, last = await _collect(gen, request)
        if last is None:
            return JSONResponse({}, status_code=499)
        thinking, response = split_all(raw) if split else (None, raw)
        extra = {"response": response, **({"thinking": thinking} if thinking else {}),
                 "context": gen.client.last_prompt_ids(gen.rid) + out_ids,
                 **({"logprobs": ollama_logprobs(picked, text)} if req.logprobs else {})}
        return _done(model, last, t0, extra)

    return r


def _model(state: ServerState, name) -> str:
    """Our model's id for a chat or generate request, which must name one: Ollama refuses one
    without (a 400 in these words), where the OpenAI routes take none to mean ours."""
    if not name:
        raise APIError(400, "model is required", "model")
    return state.check_model(name)


def _generate_ids(client, state: ServerState, req: GenerateRequest, msgs, gen_params):
    """Token ids for a raw prompt or one continuing an earlier answer's `context`; None: submit
    the templated messages as they are."""
    if not req.raw and not req.context:
        return None
    vocab = state.info()["vocab_size"]
    context = list(req.context or ())
    if context and not all(0 <= t < vocab for t in context):
        raise APIError(400, f"context: token ids must be 0..{vocab - 1}", "context")
    if req.raw:
        new = client.tokenize(req.prompt, add_special=not context)
    else:  # the templated turn (a base model's: the text), without the BOS the context already has
        new = client.chat_prompt_ids(msgs, gen_params.thinking, continue_text=gen_params.continue_text)
        bos = client.tokenize("", add_special=True)
        if bos and new[:len(bos)] == bos:
            new = new[len(bos):]
    return context + new


async def _collect(gen, request):
    """(text, logprobs, token ids, last event) of a whole answer; last is None: the client left."""
    raw, picked, ids, last = "", [], [], None
    async for ev in gen.events(request.is_disconnected):
        raw += ev.text
        picked += ev.logprobs or []
        ids += ev.token_ids
        last = ev
    if last is None or not last.finished:
        return raw, picked, ids, None
    if last.error or last.finish_reason == "abort":
        raise engine_error(last)
    return raw, picked, ids, last


async def _stream(gen, model: str, t0: float, text: TokenText, chat: bool, split: bool = True):
    sp, ids = ReasoningSplitter(), []

    def part(thinking: str, content: str, calls=None) -> dict:
        if chat:
            return {"message": {"role": "assistant", "content": content, **({"thinking": thinking} if thinking else {}),
                                **({"tool_calls": ollama_tool_calls(calls)} if calls else {})}}
        return {"response": content, **({"thinking": thinking} if thinking else {})}

    try:
        async for ev in gen.events():
            ids += ev.token_ids
            thinking, content = sp.push(ev.text) if split else ("", ev.text)
            if ev.finished and split:
                t2, c2 = sp.finish()
                thinking, content = thinking + t2, content + c2
            lp = {"logprobs": ollama_logprobs(ev.logprobs, text)} if ev.logprobs else {}
            calls = ev.tool_call_deltas  # each call whole, in the chunk where it completed (as Ollama streams them)
            if thinking or content or lp or calls:
                yield _ndjson({"model": model, "created_at": _now(), **part(thinking, content, calls), **lp,
                               "done": False})
            if ev.finished:
                if ev.error or ev.finish_reason == "abort":
                    yield _ndjson({"error": engine_error(ev).message})
                else:
                    extra = part("", "") if chat else {"response": "",
                                                       "context": gen.client.last_prompt_ids(gen.rid) + ids}
                    yield _ndjson(_done(model, ev, t0, extra))
    finally:
        gen.close()


def _details(info: dict) -> dict:
    n = info.get("parameters")
    size = f"{n / 1e9:.1f}B" if n and n >= 1e9 else (f"{n / 1e6:.0f}M" if n else "")
    family = info["arch"]
    return {"parent_model": "", "format": "gguf" if info["file"].endswith(".gguf") else "safetensors",
            "family": family, "families": [family], "parameter_size": size,
            "quantization_level": info.get("quantization") or ""}


def _modified(state: ServerState) -> str:
    return datetime.fromtimestamp(state.started, timezone.utc).isoformat().replace("+00:00", "Z")


def _entry(state: ServerState) -> dict:
    info = state.info()
    return {"name": state.model_id, "model": state.model_id, "modified_at": _modified(state),
            "size": info["size_bytes"] or 0, "digest": "", "details": _details(info)}
