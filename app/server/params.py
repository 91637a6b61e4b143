"""Requests of both APIs -> the engine's messages and GenerationParams, in one place: sampling,
images and audio clips, tools / tool_choice / tool messages, and structured output
(`response_format`, Ollama `format`) as the engine's Constraint.

Defaults follow each API: OpenAI's temperature 1 and top_p 1; Ollama's temperature 0.8, top_k 40,
top_p 0.9, repeat_penalty 1.1 over 64 tokens. A request without a token limit may write up to the
context (or --default-max-tokens). On a base model the completion endpoints (`/v1/completions`,
`/api/generate`) take the engine's base-model rule (engine/request_params.py: the text continued,
DRY on, a stop at the first blank line) where the request sets none of those fields; the token
limit stays the API's (OpenAI's 16 for a completion)."""
from __future__ import annotations

from typing import Optional

from app.backend import (ConstraintError, GenerationParams, audio_from_base64, audio_marker, check_tool_request,
                         from_ollama_format, from_response_format, generation_params, image_marker)

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


def _generation(limit: int, default_max: Optional[int], fields: dict, defaults: dict, base_model: bool = False,
                **request) -> GenerationParams:
    """The request's GenerationParams (engine.api.generation_params): `fields` as the request set
    them (None: not set) over a base model's defaults over the API's `defaults`. The token limit
    is the API's either way: the request's, else --default-max-tokens, else the context."""
    n = fields.pop("max_tokens", None)
    n = n if n is not None else (default_max or limit)
    return generation_params({**fields, "max_tokens": min(n, limit)}, base_model, defaults, **request)


def _one_choice(n, best_of=None) -> None:
    if n not in (None, 1):
        raise APIError(400, f"n must be 1 (one choice per request), not {n}", "n")
    if best_of not in (None, 1):
        raise APIError(400, f"best_of must be 1, not {best_of}", "best_of")


OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


def _openai_fields(req, max_tokens, logprobs) -> dict:
    """The sampling fields an OpenAI request sets (a 0 penalty or min_p: not set, as before)."""
    _one_choice(req.n, getattr(req, "best_of", None))
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    return {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "min_p": req.min_p or None, "seed": req.seed, "repetition_penalty": req.repetition_penalty or None,
            "presence_penalty": req.presence_penalty or None, "frequency_penalty": req.frequency_penalty or None,
            "logprobs": logprobs, "stop_at_blank_line": getattr(req, "stop_at_blank_line", None),
            **anti_repeat(req)}


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
    fields = _openai_fields(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    msgs = openai_messages(req, cfg.max_image_pixels, info)
    return msgs, _generation(limit, cfg.default_max_tokens, fields, OPENAI_DEFAULTS, thinking=openai_thinking(req),
                             stop_strings=_stops(req.stop), kv_auto=cfg.kv_auto and req.cache_prompt,
                             image_tokens=cfg.image_tokens, cache_prompt=req.cache_prompt, constraint=constraint,
                             tools=req.tools or None, tool_choice=req.tool_choice)


def openai_completion(req: CompletionRequest, limit: int, cfg, base_model: bool = False) -> GenerationParams:
    """`base_model`: the model's kind is "base" (client.model_info): the base-model defaults where
    the request sets nothing (the prompt is continued as given either way)."""
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs (the prompt's logprobs) is not supported", "echo")
    # OpenAI's completions default is 16 tokens
    max_tokens = req.max_tokens if req.max_tokens is not None else (cfg.default_max_tokens or 16)
    fields = _openai_fields(req, max_tokens, req.logprobs)
    return _generation(limit, cfg.default_max_tokens, fields, OPENAI_DEFAULTS, base_model,
                       stop_strings=_stops(req.stop), cache_prompt=req.cache_prompt)


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

OLLAMA_DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}


def ollama_fields(options: Optional[Options], limit: int, logprobs: Optional[int]) -> tuple[dict, tuple[str, ...]]:
    """(the sampling fields Ollama `options` set, its stop strings)."""
    o = options or Options()
    n = o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None
    last_n = 64 if o.repeat_last_n is None else (limit if o.repeat_last_n == -1 else o.repeat_last_n)
    fields = {"max_tokens": n, "temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k,
              "min_p": o.min_p or None, "seed": o.seed if o.seed is not None and o.seed >= 0 else None,
              "repetition_penalty": o.repeat_penalty, "presence_penalty": o.presence_penalty or None,
              "frequency_penalty": o.frequency_penalty or None, "penalty_last_n": last_n, "logprobs": logprobs,
              "stop_at_blank_line": o.stop_at_blank_line, **anti_repeat(o)}
    return fields, _stops(o.stop)


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
    fields, stops = ollama_fields(req.options, limit, _ollama_logprobs(req))
    return msgs, _generation(limit, cfg.default_max_tokens, fields, OLLAMA_DEFAULTS, thinking=bool(req.think),
                             stop_strings=stops, kv_auto=cfg.kv_auto, image_tokens=cfg.image_tokens,
                             constraint=constraint, tools=req.tools or None)


def ollama_generate(req: GenerateRequest, limit: int, cfg, base_model: bool = False
                    ) -> tuple[list[dict], list[bytes], GenerationParams]:
    """(messages for a templated prompt, or [] for raw, images, params). `base_model`: the
    base-model rule (the messages continued as one text, its defaults where the options set none)."""
    constraint = _constraint(from_ollama_format, req.format, "format")
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
    if req.template:
        raise APIError(400, "template: a custom prompt template is not supported (the model's own is used)",
                       "template")
    images = ollama_images(req.images, cfg.max_image_pixels, "images")
    fields, stops = ollama_fields(req.options, limit, _ollama_logprobs(req))
    params = _generation(limit, cfg.default_max_tokens, fields, OLLAMA_DEFAULTS, base_model,
                         thinking=bool(req.think), stop_strings=stops, image_tokens=cfg.image_tokens,
                         constraint=constraint)
    if req.raw:
        return [], images, params
    msgs = ([{"role": "system", "content": req.system}] if req.system else [])
    user = {"role": "user", "content": req.prompt}
    if images:
        user["images"] = images
    return msgs + [user], images, params
