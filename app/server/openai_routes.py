"""OpenAI's chat and completions API (and llama-server's tokenize/detokenize/health), streaming
as server-sent events ending with `data: [DONE]`."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from . import params as P
from .errors import APIError, engine_error, error_body
from .output import ReasoningSplitter, TokenText, chat_logprobs, completion_logprobs, split_all
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .state import EngineStream, ServerState

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


def usage(stats: dict | None, completion_tokens: int) -> dict:
    stats = stats or {}
    prompt = int(stats.get("prompt_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_tokens", 0))}}


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def router(state: ServerState) -> APIRouter:
    r = APIRouter()
    cfg = state.config

    @r.get("/health")
    @r.get("/v1/health")
    async def health():
        state.client()  # 503 while loading
        return {"status": "ok"}

    @r.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_card(state)]}

    @r.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        state.check_model(model_id)
        return _card(state)

    @r.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        client = state.client()  # a long text is tokenized off the event loop
        ids = await run_in_threadpool(client.tokenize, req.content, req.add_special, req.parse_special)
        if not req.with_pieces:
            return {"tokens": ids}
        text = TokenText(client)
        return {"tokens": [{"id": i, "piece": text(i)[0]} for i in ids]}

    @r.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        try:
            return {"content": state.client().detokenize(req.tokens)}
        except ValueError as e:
            raise APIError(400, f"tokens: {e}", "tokens") from None

    @r.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        model_id = state.check_model(req.model)
        info = state.info()
        # off the event loop: audio clips are decoded and schemas checked here, and a constrained
        # submit compiles its grammar (state.start runs submit in a worker thread too)
        msgs, gen_params = await run_in_threadpool(P.openai_chat, req, info["context_length"], cfg, info)
        gen = await state.start(lambda c, on, ql: c.submit(msgs, gen_params, on_event=on, queue_limit=ql))
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_id}
        text = TokenText(gen.client)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EngineStream(_chat_stream(gen, meta, text, include_usage), gen, media_type="text/event-stream",
                                headers=SSE_HEADERS)
        raw, picked, last = await _collect(gen, request)
        if last is None:
            return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
        reasoning, content = split_all(raw)
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if last.tool_calls:  # parsed by the engine (engine/structured.py); content is what is left
            message["tool_calls"] = last.tool_calls
            message["content"] = content or None
        n_out = (last.stats or {}).get("output_tokens", 0)
        return {**meta, "object": "chat.completion",
                "choices": [{"index": 0, "message": message,
                             "logprobs": {"content": chat_logprobs(picked, text)} if req.logprobs else None,
                             "finish_reason": FINISH.get(last.finish_reason, "stop")}],
                "usage": usage(last.stats, n_out)}

    @r.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        model_id = state.check_model(req.model)
        client = state.client()
        info = state.info()
        # a base model's completion takes its defaults (engine/request_params.py) where the request sets none
        gen_params = P.openai_completion(req, info["context_length"], cfg, info.get("kind") == "base")
        prompt = P.completion_prompt(req)
        if isinstance(prompt, str):
            ids = await run_in_threadpool(client.tokenize, prompt, True)
            prompt_text = prompt
        else:
            vocab = state.info()["vocab_size"]
            if max(prompt) >= vocab:
                raise APIError(400, f"prompt: token id {max(prompt)} out of range (vocab size {vocab})", "prompt")
            ids, prompt_text = list(prompt), client.detokenize(prompt) if req.echo else ""
        gen = await state.start(lambda c, on, ql: c.submit_ids(ids, gen_params, on_event=on, queue_limit=ql))
        meta = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_id}
        text = TokenText(gen.client)
        echo = prompt_text if req.echo else ""
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EngineStream(_completion_stream(gen, meta, text, echo, req.logprobs is not None, include_usage),
                                gen, media_type="text/event-stream", headers=SSE_HEADERS)
        out, picked, last = await _collect(gen, request)
        if last is None:
            return JSONResponse({}, status_code=499)
        lp = completion_logprobs(picked, text, len(echo)) if req.logprobs is not None else None
        return {**meta, "object": "text_completion",
                "choices": [{"index": 0, "text": echo + out, "logprobs": lp,
                             "finish_reason": FINISH.get(last.finish_reason, "stop")}],
                "usage": usage(last.stats, (last.stats or {}).get("output_tokens", 0))}

    return r


async def _collect(gen, request: Request):
    """A non-streamed answer: (text, picked logprobs, final event), the final event None when the
    client left before the end; an engine error or abort raises its APIError."""
    text, picked, last = "", [], None
    async for ev in gen.events(request.is_disconnected):
        text += ev.text
        picked += ev.logprobs or []
        last = ev
    if last is None or not last.finished:
        return text, picked, None
    if last.error or last.finish_reason == "abort":
        raise engine_error(last)
    return text, picked, last


def _card(state: ServerState) -> dict:
    info = state.info()
    return {"id": state.model_id, "object": "model", "created": int(state.started), "owned_by": "edgegem",
            "meta": {"file": info["file"], "arch": info["arch"], "context_length": info["context_length"],
                     "vocab_size": info["vocab_size"], "parameters": info["parameters"],
                     "size": info["size_bytes"], "vision": info["vision"], "audio": info.get("audio", False)}}


async def _chat_stream(gen, meta: dict, text: TokenText, include_usage: bool):
    chunk = {**meta, "object": "chat.completion.chunk"}

    def choice(delta: dict, finish=None, logprobs=None) -> bytes:
        return sse({**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish}]})

    split, n_out = ReasoningSplitter(), 0
    try:
        yield choice({"role": "assistant", "content": ""})
        async for ev in gen.events():
            n_out += len(ev.token_ids)
            reasoning, content = split.push(ev.text)
            if ev.finished:
                r2, c2 = split.finish()
                reasoning, content = reasoning + r2, content + c2
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            if ev.tool_call_deltas:  # each call whole when its <tool_call|> arrived (OpenAI's delta shape)
                delta["tool_calls"] = ev.tool_call_deltas
            lp = {"content": chat_logprobs(ev.logprobs, text)} if ev.logprobs else None
            if delta or lp:
                yield choice(delta, logprobs=lp)
            if ev.finished:
                if ev.error or ev.finish_reason == "abort":
                    yield sse(error_body(engine_error(ev), "/v1"))
                else:
                    yield choice({}, FINISH.get(ev.finish_reason, "stop"))
                    if include_usage:
                        yield sse({**chunk, "choices": [], "usage": usage(ev.stats, n_out)})
        yield b"data: [DONE]\n\n"
    finally:
        gen.close()


async def _completion_stream(gen, meta: dict, text: TokenText, echo: str, logprobs: bool, include_usage: bool):
    chunk = {**meta, "object": "text_completion"}

    def choice(piece: str, finish=None, lp=None) -> bytes:
        return sse({**chunk, "choices": [{"index": 0, "text": piece, "logprobs": lp, "finish_reason": finish}]})

    offset, n_out = len(echo), 0
    try:
        if echo:
            yield choice(echo)
        async for ev in gen.events():
            n_out += len(ev.token_ids)
            lp = completion_logprobs(ev.logprobs, text, offset) if logprobs and ev.logprobs else None
            offset += len(ev.text)
            if ev.text or lp:
                yield choice(ev.text, lp=lp)
            if ev.finished:
                if ev.error or ev.finish_reason == "abort":
                    yield sse(error_body(engine_error(ev), "/v1"))
                else:
                    yield choice("", FINISH.get(ev.finish_reason, "stop"))
                    if include_usage:
                        yield sse({**chunk, "choices": [], "usage": usage(ev.stats, n_out)})
        yield b"data: [DONE]\n\n"
    finally:
        gen.close()
