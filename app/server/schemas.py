"""Request bodies of the OpenAI-style endpoints (and llama-server's tokenize/detokenize), validated
by pydantic: a body that does not fit is a 400 naming the field. Unknown top-level fields are
ignored, as OpenAI-compatible servers do (clients send vendor extras); known ones we cannot honour
are refused by name (app/server/params.py)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from .dry_xtc import AntiRepeatFields

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Part):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Part):
    url: StrictStr
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Part):
    data: StrictStr  # base64 of the file's bytes
    format: Optional[StrictStr] = None  # "wav" | "mp3" (OpenAI's two; flac and ogg decode too)


class AudioPart(_Part):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[Union[TextPart, ImagePart, AudioPart], Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[ContentPart], None] = None
    name: Optional[StrictStr] = None
    reasoning_content: Optional[StrictStr] = None
    # tool-call shapes are accepted as OpenAI sends them; app/server/params.py decides on them
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[StrictStr] = None


class StreamOptions(_Part):
    include_usage: StrictBool = False


Stop = Union[StrictStr, Annotated[list[StrictStr], Field(max_length=MAX_STOPS)], None]


class _Sampling(AntiRepeatFields, _Body):  # DRY/XTC: llama-server's fields
    model: Optional[StrictStr] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    seed: Optional[int] = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    stop: Stop = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10)
    n: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[StrictStr] = None
    # llama.cpp server's extension: false = no prefix-cache reuse, so a seeded request repeats bit
    # for bit whatever ran before (reused KV sits in other slot runs, which rounds differently)
    cache_prompt: StrictBool = True


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # tool calls and structured output: checked and mapped in app/server/params.py (the engine's
    # checks give the one-line 400s: a tool that is not a function, a schema llguidance refuses)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[StrictBool] = None  # accepted, not enforced (docs/server.md)
    response_format: Optional[dict[str, Any]] = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, TokenIds, list[StrictStr], list[TokenIds]]
    echo: StrictBool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: Optional[StrictStr] = None
    best_of: Optional[int] = None
    # end at the first blank line after some text (not set: on for a base model, engine/request_params.py)
    stop_at_blank_line: Optional[StrictBool] = None


class TokenizeRequest(_Body):
    content: StrictStr
    add_special: StrictBool = False
    parse_special: StrictBool = True
    with_pieces: StrictBool = False


class DetokenizeRequest(_Body):
    tokens: list[int]
