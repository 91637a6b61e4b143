"""Requests of both APIs -> the engine's messages and GenerationParams, in one place: sampling,
images and audio clips, tools / tool_choice / tool messages, and structured output
(`response_format`, Ollama `format`) as the engine's Constraint.

Defaults follow each API: OpenAI's temperature 1 and top_p 1; Ollama's temperature 0.8, top_k 40,
top_p 0.9, repeat_penalty 1.1 over 64 tokens. A request without a token limit may write up to the
context (or --default-max-tokens)."""
from __future__ import annotations

from typing import Optional

from app.backend import (ConstraintError, GenerationParams, SamplingParams, audio_from_base64, audio_marker,
                         check_tool_request, from_ollama_format, from_response_format, image_marker)

from . import media
from .dry_xtc import anti_repeat
from .errors import APIError
from .ollama_schemas import ChatRequest as OllamaChat, GenerateRequest, Options
from .schemas import ChatCompletionRequest, CompletionRequest


def _constraint(make, value, param: str):
    """response_format / format -> a Constraint (None: free text); a schema the library refuses is a
    400 naming the field."""
    try:
        return make(value)
    except ConstraintError as e:
        raise APIError(400, f"{param}: {e}", param) from None


def _check_tools(tools, tool_choice, info: Optional[dict], has_tool_messages: bool) -> None:
    """A model whose chat format has no tool syntax (Gemma 3) gets no tools, as Ollama refuses them;
    the tools and tool_choice themselves are checked by the engine's rules, naming the field."""
    if (tools or has_tool_messages) and info is not None and info.get("chat_family") != "gemma4":
        raise APIError(400, f"tools: this model ({info.get('arch')}) has no tool-call syntax in its chat format",
                       "tools")
    try:
        check_tool_request(tools, tool_choice)
    except ConstraintError as e:
        msg = str(e)
        raise APIError(400, msg, "tool_choice" if msg.startswith("tool_choice") else "tools") from None


def _stops(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stops):
        raise APIError(400, "stop: stop strings must not be empty", "stop")
    return stops


def _sampling(limit: int, default_max: Optional[int], *, max_tokens=None, temperature, top_p, top_k=0,
              min_p=0.0, seed=None, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
              penalty_last_n=64, logprobs=None, **dry_xtc) -> SamplingParams:
    n = max_tokens if max_tokens is not None else (default_max or limit)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                          max_tokens=min(n, limit), repetition_penalty=repetition_penalty,
                          presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                          penalty_last_n=penalty_last_n, logprobs=logprobs, **dry_xtc)


def _one_choice(n, best_of=None) -> None:
    if n not in (None, 1):
        raise APIError(400, f"n must be 1 (one choice per request), not {n}", "n")
    if best_of not in (None, 1):
        raise APIError(400, f"best_of must be 1, not {best_of}", "best_of")


def _openai_common(req, limit: int, default_max: Optional[int], max_tokens, logprobs) -> SamplingParams:
    _one_choice(req.n, getattr(req, "best_of", None))
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    return _sampling(limit, default_max, max_tokens=max_tokens,
                     temperature=1.0 if req.temperature is None else req.temperature,
                     top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                     seed=req.seed, repetition_penalty=req.repetition_penalty or 1.0,
                     presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                     logprobs=logprobs, **anti_repeat(req))


# --- OpenAI -----------------------------------------------------------------------------------------

def openai_thinking(req: ChatCompletionRequest) -> bool:
    """`reasoning_effort` low|medium|high, or `chat_template_kwargs.enable_thinking`, turn it on."""
    if req.reasoning_effort is not None:
        return req.reasoning_effort not in ("none", "minimal")
    kw = req.chat_template_kwargs or {}
    value = kw.get("enable_thinking", False)
    if not isinstance(value, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be true or false",
                       "chat_template_kwargs.enable_thinking")
    return value


def _input_audio(part, where: str, info: Optional[dict]):
    """An `input_audio` part -> the engine's AudioInput (decoded to 16 kHz mono here, in the handler's
    worker thread); any refusal is a one-line 400 naming the part."""
    if info is not None and not info.get("audio"):
        raise APIError(400, f"{where}: this model has no audio encoder (Gemma 4 E2B/E4B hear; for a GGUF model: "
                            "an mmproj with the audio tower)", where)
    try:
        return audio_from_base64(part.input_audio.data, part.input_audio.format, where)
    except ValueError as e:
        raise APIError(400, str(e), where) from None


def openai_messages(req: ChatCompletionRequest, max_pixels: int, info: Optional[dict] = None) -> list[dict]:
    """OpenAI messages -> the engine's: text, image and audio parts (bytes, AudioInput) with a
    marker where each stood; an assistant's `tool_calls` and a tool message's `tool_call_id` /
    `name` as models/chat.py renders them (JSON-string arguments are parsed there)."""
    out = []
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):  # as OpenAI refuses it
            raise APIError(400, f"messages.{i}.content: required in a {m.role} message"
                                + (" (one without tool_calls)" if m.role == "assistant" else ""),
                           f"messages.{i}.content", "missing_required_parameter")
        images, audio, text = [], [], ""
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                where = f"messages.{i}.content.{j}"
                if part.type == "text":
                    text += part.text
                elif part.type == "image_url":
                    images.append(media.from_data_url(part.image_url.url, max_pixels, f"{where}.image_url"))
                    text += image_marker()
                else:
                    audio.append(_input_audio(part, f"{where}.input_audio", info))
                    text += audio_marker()
        else:
            text = m.content or ""
        msg = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if images:
            msg["images"] = images
        if audio:
            msg["audio"] = audio
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool":
            msg.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v})
        out.append(msg)
    return out


def openai_chat(req: ChatCompletionRequest, limit: int, cfg, info: Optional[dict] = None
                ) -> tuple[list[dict], GenerationParams]:
    """`cfg`: the ServerConfig (token default, image caps and budget, KV files); `info`: the model's
    (client.model_info: its chat family and encoders). Decodes audio and checks schemas: call it
    off the event loop."""
    _check_tools(req.tools, req.tool_choice, info, any(m.role == "tool" or m.tool_calls for m in req.messages))
    constraint = _constraint(from_response_format, req.response_format, "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = _openai_common(req, limit, cfg.default_max_tokens, max_tokens,
                              (req.top_logprobs or 0) if req.logprobs else None)
    msgs = openai_messages(req, cfg.max_image_pixels, info)
    return msgs, GenerationParams(sampling, thinking=openai_thinking(req), stop_strings=_stops(req.stop),
                                  kv_auto=cfg.kv_auto and req.cache_prompt, image_tokens=cfg.image_tokens,
                                  cache_prompt=req.cache_prompt, constraint=constraint,
                                  tools=req.tools or None, tool_choice=req.tool_choice)


def openai_completion(req: CompletionRequest, limit: int, cfg) -> GenerationParams:
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs (the prompt's logprobs) is not supported", "echo")
    # OpenAI's completions default is 16 tokens
    max_tokens = req.max_tokens if req.max_tokens is not None else (cfg.default_max_tokens or 16)
    sampling = _openai_common(req, limit, cfg.default_max_tokens, max_tokens, req.logprobs)
    return GenerationParams(sampling, stop_strings=_stops(req.stop), cache_prompt=req.cache_prompt)


def completion_prompt(req: CompletionRequest):
    """The one prompt: text or token ids (a list of several prompts is refused)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, f"prompt: one prompt per request, not {len(p)}", "prompt")
        p = p[0]
    if isinstance(p, list) and not p:
        raise APIError(400, "prompt: empty", "prompt")
    return p


# --- Ollama -----------------------------------------------------------------------------------------

def ollama_sampling(options: Optional[Options], limit: int, default_max: Optional[int],
                    logprobs: Optional[int]) -> tuple[SamplingParams, tuple[str, ...]]:
    o = options or Options()
    n = o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None
    last_n = 64 if o.repeat_last_n is None else (limit if o.repeat_last_n == -1 else o.repeat_last_n)
    sampling = _sampling(limit, default_max, max_tokens=n, temperature=0.8 if o.temperature is None else o.temperature,
                         top_p=0.9 if o.top_p is None else o.top_p, top_k=40 if o.top_k is None else o.top_k,
                         min_p=o.min_p or 0.0, seed=o.seed if o.seed is not None and o.seed >= 0 else None,
                         repetition_penalty=1.1 if o.repeat_penalty is None else o.repeat_penalty,
                         presence_penalty=o.presence_penalty or 0.0, frequency_penalty=o.frequency_penalty or 0.0,
                         penalty_last_n=last_n, logprobs=logprobs, **anti_repeat(o))
    return sampling, _stops(o.stop)


def _ollama_logprobs(req) -> Optional[int]:
    return (req.top_logprobs or 0) if req.logprobs else None


def ollama_images(images: Optional[list[str]], max_pixels: int, where: str) -> list[bytes]:
    return [media.from_base64(im, max_pixels, f"{where}.{k}") for k, im in enumerate(images or ())]


def ollama_chat(req: OllamaChat, limit: int, cfg, info: Optional[dict] = None) -> tuple[list[dict], GenerationParams]:
    """As openai_chat. Ollama has no tool_choice (the model decides: auto), its calls' arguments
    are objects and a tool message names its function in `tool_name`; it has no audio field."""
    if not req.messages:
        raise APIError(400, "messages: empty", "messages")
    _check_tools(req.tools, None, info, any(m.role == "tool" or m.tool_calls for m in req.messages))
    constraint = _constraint(from_ollama_format, req.format, "format")
    msgs = []
    for i, m in enumerate(req.messages):
        msg = {"role": m.role, "content": m.content}
        images = ollama_images(m.images, cfg.max_image_pixels, f"messages.{i}.images")
        if images:
            msg["images"] = images
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool" and m.tool_name:
            msg["name"] = m.tool_name
        msgs.append(msg)
    sampling, stops = ollama_sampling(req.options, limit, cfg.default_max_tokens, _ollama_logprobs(req))
    return msgs, GenerationParams(sampling, thinking=bool(req.think), stop_strings=stops, kv_auto=cfg.kv_auto,
                                  image_tokens=cfg.image_tokens, constraint=constraint, tools=req.tools or None)


def ollama_generate(req: GenerateRequest, limit: int, cfg) -> tuple[list[dict], list[bytes], GenerationParams]:
    """(messages for a templated prompt, or [] for raw, images, params)."""
    constraint = _constraint(from_ollama_format, req.format, "format")
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
    if req.template:
        raise APIError(400, "template: a custom prompt template is not supported (the model's own is used)",
                       "template")
    images = ollama_images(req.images, cfg.max_image_pixels, "images")
    sampling, stops = ollama_sampling(req.options, limit, cfg.default_max_tokens, _ollama_logprobs(req))
    params = GenerationParams(sampling, thinking=bool(req.think), stop_strings=stops, image_tokens=cfg.image_tokens,
                              constraint=constraint)
    if req.raw:
        return [], images, params
    msgs = ([{"role": "system", "content": req.system}] if req.system else [])
    user = {"role": "user", "content": req.prompt}
    if images:
        user["images"] = images
    return msgs + [user], images, params
