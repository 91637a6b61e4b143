"""A generation request and its state machine: WAITING -> PREFILL -> DECODE -> FINISHED.

Preemption (engine/scheduler.py) sends a running request back to WAITING with its KV given up and
its output kept; re-admitted, it prefills prompt + output so far (`prefill_end`) and decodes on.
"""
from __future__ import annotations

import enum
import itertools
import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from .sampler import Sampler, SamplingParams

if TYPE_CHECKING:
    from .constraints import GrammarState
    from .media import PromptMedia

_ids = itertools.count(1)


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, no KV yet
    PREFILL = "prefill"  # prompt being computed, chunk by chunk
    DECODE = "decode"  # one token per step
    FINISHED = "finished"


class ErrorKind(enum.Enum):
    """Why the engine ended a request with an error, for front ends to map to a status (an HTTP
    code, an exit code) without reading the message, which is for people."""
    BAD_INPUT = "bad_input"  # the request's own content: an image or clip its encoder cannot take
    CAPACITY = "capacity"  # does not fit: more tokens than the KV pool holds
    OUT_OF_MEMORY = "out_of_memory"  # device memory ran out in a forward: may pass, try again
    INTERNAL = "internal"  # a forward or step failed: the engine's fault


@dataclass
class StreamEvent:
    """What a client reads from `stream(id)`: new token ids and text; `finished` on the last one."""

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    error: Optional[str] = None  # one line, with finish_reason "error"
    stats: Optional[dict] = None
    error_kind: Optional[ErrorKind] = None  # set with `error`
    # requests with tools (engine/structured.py): calls completed in this event, OpenAI stream
    # deltas {"index", "id", "type", "function": {"name", "arguments"}}; on the final event
    # `tool_calls` is every call of the reply ({"id", "type", "function"})
    tool_call_deltas: Optional[list] = None
    tool_calls: Optional[list] = None
    logprobs: Optional[list] = None  # engine.sampler.TokenLogprob per token of token_ids, when asked


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...] = ()
    id: int = field(default_factory=lambda: next(_ids))
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    cached_len: int = 0  # prompt tokens served from the prefix cache
    computed_len: int = 0  # tokens whose KV is in the pools
    finish_reason: Optional[str] = None
    kv: object = None  # SequenceKV once admitted
    locked: list = field(default_factory=list)  # prefix-cache nodes this request holds
    events: "queue.Queue[StreamEvent]" = field(default_factory=queue.Queue)
    sampler: Optional[Sampler] = None
    detok: object = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: Optional[float] = None
    t_done: Optional[float] = None
    abort_requested: bool = False
    h: object = None  # speculative decoding: the target's post-norm state at the last KV position
    kv_session: Optional[str] = None  # a KV file (engine/kv/sessions.py): restored before, saved after
    restored_len: int = 0  # prompt tokens whose KV came from that file
    kv_error: Optional[str] = None  # why the file was not used (one line)
    kv_checked: bool = False
    media: Optional["PromptMedia"] = None  # image and audio inputs of the prompt (engine/media.py)
    grammar: Optional["GrammarState"] = None  # structured output: masks every sampled token
    kv_auto: bool = False  # KV file found by the prompt's prefix in the engine's kv_dir, saved there after
    cache_prompt: bool = True  # False: the prefix cache serves none of it (engine.client.GenerationParams)
    first_cached: Optional[int] = None  # prompt tokens the cache served at the first admission
    preemptions: int = 0  # times its KV was given up for older requests (recomputed after)
    resume_after: int = 0  # preempted: re-admitted once the engine has finished more requests than this
    dry_breakers: Optional[dict] = None  # DRY's sequence breakers as tokens (engine.dry.breaker_table)
    stop_at_blank_line: bool = False  # finish at the first blank line after some text (paragraph_stop.py)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("empty prompt")
        self.sampler = Sampler(self.params, self.dry_breakers)
        if self.grammar is not None:
            from .constraints import ConstrainedSampler
            self.sampler = ConstrainedSampler(self.sampler, self.grammar)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def key_ids(self) -> list[int]:
        """The prefix cache's and KV files' key of every token: its id, except at media positions,
        where it is the item's content key (engine/media.py), so a different image or clip never
        reuses KV."""
        if self.media is None:
            return self.all_ids
        return self.media.key_prompt + self.output_ids

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_end(self) -> int:
        """Tokens to compute before decoding: the prompt, or after a preemption prompt + output
        less the last sampled token (the next decode step feeds it)."""
        return len(self.all_ids) - 1 if self.output_ids else self.n_prompt

    def check(self) -> None:
        assert 0 <= self.cached_len <= self.computed_len <= len(self.all_ids), (self.cached_len, self.computed_len)

    def stats(self) -> dict:
        prefill_s = (self.t_first or time.perf_counter()) - self.t_submit
        decode_s = (self.t_done or time.perf_counter()) - (self.t_first or self.t_submit)
        n_out = len(self.output_ids)
        cached = self.cached_len if self.first_cached is None else self.first_cached
        return {"prompt_tokens": self.n_prompt, "cached_tokens": cached,
                "restored_tokens": self.restored_len, "kv_session_error": self.kv_error,
                "prefilled_tokens": self.n_prompt - cached, "output_tokens": n_out,
                "preemptions": self.preemptions,
                "image_tokens": self.media.counts.get("image", 0) if self.media is not None else 0,
                "audio_tokens": self.media.counts.get("audio", 0) if self.media is not None else 0,
                "prefill_s": prefill_s, "decode_s": decode_s,
                "prefill_tok_s": (self.n_prompt - self.cached_len) / prefill_s if prefill_s > 0 else 0.0,
                "decode_tok_s": (n_out - 1) / decode_s if decode_s > 0 and n_out > 1 else 0.0}
