"""A front end's request as the engine's parameters, built in one place with one rule for base models.

A base model (`model_kind` "base": the demo, Gemma 3 270M pretrained) has no chat turns: its
messages are one text to continue (engine.prompt.continuation_text), the answer ends at the first
blank line after a paragraph (engine/paragraph_stop.py), and its sampling defaults turn DRY on.
Every front end (`edgegem run` and `chat`, the app, the server's completion endpoints) builds its
parameters with `generation_params`, so they all apply the same rule. Values, lowest first:
SamplingParams' own defaults, the front end's (`defaults`: the app's chat settings, the CLI's
temperature, an API's documented defaults), the base-model defaults, then what the user set (a
flag, a setting, an API field; None: not set).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from .constraints import Constraint
from .sampler import SamplingParams


@dataclass(frozen=True)
class GenerationParams:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    thinking: bool = False
    stop_strings: tuple[str, ...] = ()
    kv_session: Optional[str] = None  # a KV file: serves the prompt's common prefix, saved after
    image_tokens: int = 280  # soft-token budget of images given as paths/bytes: 70|140|280|560|1120
    # structured output (engine/constraints.py: json_schema_constraint, from_response_format, ...)
    constraint: Optional[Constraint] = None
    # OpenAI function tools, rendered by the chat template; tool_choice: "auto" | "none" |
    # "required" | {"type": "function", "function": {"name": ...}} (engine/structured.py)
    tools: Optional[Sequence[dict]] = None
    tool_choice: Any = None
    kv_auto: bool = False  # the engine's kv_dir: the file the prompt extends serves it, saved there after
    # False: the prefix cache serves none of the prompt (it is computed afresh, so a seeded request
    # repeats exactly: reused KV sits in other slot runs, and attention summed over two runs
    # rounds differently from one, which llama.cpp's Q8 activations can turn into another token)
    cache_prompt: bool = True
    # A base model (model_kind below): the messages are one text to continue, their contents
    # joined (engine.prompt.continuation_text), no chat template; and, usually with it, the
    # answer ends at the first blank line after a paragraph (engine/paragraph_stop.py).
    continue_text: bool = False
    stop_at_blank_line: bool = False


# A base model's defaults: DRY on at the multiplier koboldcpp and SillyTavern suggest, over the
# whole text (a paragraph-long loop escapes a 64-token window), and without the newline breaker:
# with it the demo looped on short lines ("--\n--\n...": a match never reaches past a newline, so
# a one-token line is never penalized; 28 repeats of one 8-gram in 200 tokens at seed 0, none over
# 1 without it, 10 seeds); a continuation of a paragraph or so, ending at a blank line. Without
# DRY, `edgegem run` on the demo repeated one 8-token sequence 19 times in 200 greedy tokens.
BASE_MODEL_DEFAULTS = {"dry_multiplier": 0.8, "dry_penalty_last_n": -1, "dry_sequence_breakers": (":", "\"", "*"),
                       "max_tokens": 256, "stop_at_blank_line": True}


def model_kind(lm) -> tuple[str, str]:
    """("base" | "chat", why) of a loaded model (models.loader.LoadedModel): a base model continues
    text, a chat model answers turns (models/model_kind.py has the rule and its reasons)."""
    from models.model_kind import model_kind as kind

    meta = getattr(lm.source, "metadata", None)
    return kind(meta if isinstance(meta, dict) else {}, getattr(lm.chat, "template", None))


def generation_params(fields: Mapping, base_model: bool = False, defaults: Optional[Mapping] = None,
                      **request) -> GenerationParams:
    """GenerationParams for one request. `fields`: the sampling values and `stop_at_blank_line`
    the user set (None or absent: not set; other keys are ignored, so a settings dict may hold
    more); `defaults`: the front end's own for those; `base_model`: BASE_MODEL_DEFAULTS over
    `defaults`, the messages continued as one text, no thinking. `request`: the other
    GenerationParams fields (stop strings, KV session, constraint, ...)."""
    merged = {**(defaults or {}), **(BASE_MODEL_DEFAULTS if base_model else {}),
              **{k: v for k, v in fields.items() if v is not None}}
    stop_at_blank_line = bool(merged.get("stop_at_blank_line", False))
    thinking = bool(request.pop("thinking", False)) and not base_model
    return GenerationParams(SamplingParams.from_request(merged), thinking=thinking, continue_text=base_model,
                            stop_at_blank_line=stop_at_blank_line, **request)
