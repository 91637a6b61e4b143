"""Request bodies of the Ollama endpoints (`/api/...`), as the `ollama` client and Ollama's docs
send them. `options` are Ollama's sampler names; unknown options are ignored (Ollama warns and
ignores them too), known ones are type-checked."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from .dry_xtc import AntiRepeatFields


class Options(AntiRepeatFields):  # DRY/XTC by llama.cpp's names (Ollama has none of its own)
    model_config = ConfigDict(extra="ignore")
    num_predict: Optional[int] = Field(None, ge=-2)  # -1: to the context, -2: fill the context
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_k: Optional[int] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    seed: Optional[int] = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    stop: Optional[list[StrictStr]] = Field(None, max_length=16)
    repeat_penalty: Optional[float] = Field(None, gt=0, le=10)
    repeat_last_n: Optional[int] = Field(None, ge=-1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    num_ctx: Optional[int] = Field(None, ge=0)  # the context is the engine's (its KV pool): ignored
    # end at the first blank line after some text (not set: on for a base model's /api/generate)
    stop_at_blank_line: Optional[StrictBool] = None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[StrictStr] = None
    stream: StrictBool = True
    options: Optional[Options] = None
    format: Union[Literal["", "json"], dict[str, Any], None] = None
    keep_alive: Union[StrictStr, int, float, None] = None  # the model stays loaded: ignored
    think: Union[StrictBool, Literal["low", "medium", "high"], None] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr = ""
    images: Optional[list[StrictStr]] = None  # base64 (Ollama's form); never a path
    thinking: Optional[StrictStr] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_name: Optional[StrictStr] = None


class ChatRequest(_Body):
    messages: list[Message] = Field(default_factory=list)
    tools: Optional[list[dict[str, Any]]] = None


class GenerateRequest(_Body):
    prompt: StrictStr = ""
    suffix: Optional[StrictStr] = None
    system: Optional[StrictStr] = None
    template: Optional[StrictStr] = None
    context: Optional[list[int]] = None
    raw: StrictBool = False
    images: Optional[list[StrictStr]] = None


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[StrictStr] = None
    name: Optional[StrictStr] = None  # the older field name
    verbose: StrictBool = False
