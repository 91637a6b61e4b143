"""Constrained decoding: JSON schema, any JSON object, a Lark/GBNF grammar, or a tool call, enforced by
a per-step token mask (llguidance: docs/structured-output.md#why-llguidance-and-not-xgrammar says
why, docs/benchmarks.md#structured-output-the-token-mask-llguidance-against-xgrammar has the
measurement that picked it over xgrammar).

A `Constraint` is a checked grammar (llguidance's Lark dialect, JSON schemas inline as `%json`); `GrammarState` is one
request's matcher: `mask(logits)` sets every token the grammar forbids to -inf before sampling,
`consume(token)` advances it, `valid_prefix(drafts)` says how many drafted tokens the grammar
allows (the speculative round drafts only those; the matcher consumes only committed tokens, so
a rejected draft leaves nothing to roll back). `ConstrainedSampler` wraps a request's sampler with
both, so every sampling site (single forward, batched decode, verify rows) is masked the same way.
End-of-generation tokens are allowed exactly when the grammar is complete.

The tokenizer llguidance needs is built from ours (models/tokenizer.py): piece bytes per id, special
tokens (CONTROL, UNKNOWN, and `<...>` USER_DEFINED ones such as `<|tool_call>`) marked with the
0xFF prefix llguidance uses for tokens text can never produce, so a grammar names them as
`<|tool_call>` or `<[48]>` and no JSON string can contain one. ~1 s for the 262,144-token Gemma-4
vocabulary, once per tokenizer (cached).
"""
from __future__ import annotations

import copy
import json
import logging
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch

__all__ = ["Constraint", "ConstraintError", "ConstrainedSampler", "GrammarState", "json_schema_constraint",
           "json_object_constraint", "grammar_constraint", "from_response_format", "from_ollama_format",
           "ll_tokenizer", "warm_up", "checked"]

# JSON output layout: `{"a": 1, "b": [2, 3]}` (json.dumps' separators). No free whitespace: a
# random (or distracted) model could otherwise spend its whole budget on spaces between tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A schema or grammar the library refuses (one line; an API maps it to a 400)."""


def _one_line(prefix: str, msg: str) -> ConstraintError:
    """llguidance's message, first line (its later lines quote the grammar), without its location."""
    lines = str(msg).strip().splitlines()
    text = re.sub(r"^at \d+\(\d+\): ", "", " ".join(lines[0].split()) if lines else "")
    return ConstraintError(f"{prefix}: {text[:300]}" if text else prefix)


@dataclass(frozen=True)
class Constraint:
    kind: str      # "json_schema" | "json_object" | "grammar" | "tool_call"
    lark: str      # the grammar in llguidance's Lark dialect (JSON parts inline as %json {...})
    name: str = ""

    def with_thinking(self) -> "Constraint":
        """The same constraint after an optional `<|channel>...<channel|>` thought (thinking turns)."""
        body = re.sub(r"^start\s*:", "constrained_body:", self.lark, count=1, flags=re.M)
        return Constraint(self.kind, "start: thought? constrained_body\nthought: <|channel> THOUGHT <channel|>\n"
                          "THOUGHT: /(?s:.*)/\n" + body, self.name)


# --- building constraints ---------------------------------------------------------------------------

def _closed(schema: Any) -> Any:
    """strict: objects without `additionalProperties` get `false` (OpenAI's strict mode semantics)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema_constraint(schema: Mapping | str | bool, strict: bool = False, name: str = "") -> Constraint:
    """Output must be JSON valid under `schema`. strict: unknown keywords are an error and objects
    are closed; otherwise unknown keywords are ignored (what is supported is still enforced)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _one_line("the JSON schema is not JSON", str(e)) from None
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"a JSON schema must be an object, not {type(schema).__name__}")
    s = _closed(copy.deepcopy(dict(schema))) if strict else copy.deepcopy(dict(schema))
    s["x-guidance"] = {**_JSON_OPTIONS, "lenient": not strict, **(s.get("x-guidance") or {})}
    return checked(Constraint("json_schema", "start: %json " + json.dumps(s, ensure_ascii=False), name))


def json_object_constraint() -> Constraint:
    """Any JSON object (OpenAI `json_object`, Ollama `format: "json"`)."""
    return Constraint("json_object", json_schema_constraint({"type": "object"}).lark, "json_object")


def grammar_constraint(text: str, syntax: str = "auto") -> Constraint:
    """A grammar file: llguidance's Lark dialect (`start: ...`) or llama.cpp's GBNF (`root ::= ...`);
    `auto` takes GBNF when the text has a `::=` rule."""
    if syntax == "auto":
        syntax = "gbnf" if "::=" in text else "lark"
    if syntax == "gbnf":
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            text = any_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter raises assorted errors on bad input
            raise _one_line("bad GBNF grammar", str(e) or type(e).__name__) from None
    elif syntax != "lark":
        raise ConstraintError(f"grammar syntax must be lark, gbnf or auto, not {syntax!r}")
    return checked(Constraint("grammar", text, "grammar"))


def from_response_format(rf: Optional[Mapping]) -> Optional[Constraint]:
    """OpenAI `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}} -> a Constraint (None for text)."""
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise ConstraintError("response_format must be an object")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_constraint()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping) or "schema" not in js:
            raise ConstraintError("response_format json_schema needs json_schema.schema")
        return json_schema_constraint(js["schema"], bool(js.get("strict")), str(js.get("name") or ""))
    raise ConstraintError(f"response_format type must be text, json_object or json_schema, not {kind!r}")


def from_ollama_format(fmt: Any) -> Optional[Constraint]:
    """Ollama `format`: "json" (any JSON object), a JSON schema object, or ""/None (free text)."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return json_object_constraint()
    if isinstance(fmt, Mapping):
        return json_schema_constraint(fmt)
    raise ConstraintError('format must be "json" or a JSON schema object')


def checked(c: Constraint) -> Constraint:
    """Refuse what llguidance rejects without a tokenizer (grammar syntax, schemas). Special tokens
    are checked when a request compiles it against the model's tokenizer (GrammarState)."""
    import llguidance as llg
    is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(llg.LLMatcher.grammar_from_lark(c.lark))
    if is_error:
        raise _one_line(f"invalid {c.kind.replace('_', ' ')}", msgs[0] if msgs else "rejected")
    return c


# --- the llguidance tokenizer, built once per tokenizer -----------------------------------------------

_LL_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


class _Vocab:
    """What llguidance.TokenizerWrapper reads: piece bytes per id (0xFF-prefixed specials), ids, encode."""

    def __init__(self, tok):
        self._tok = tok
        self.eos_token_id, self.bos_token_id = tok.eos_id, tok.bos_id
        special = set(tok.special_ids())
        self.special_token_ids = sorted(special)
        self.tokens = [b"\xff" + tok.token_bytes(i) if i in special else tok.token_bytes(i)
                       for i in range(tok.vocab_size)]
        # text that spells a special token (USER_DEFINED ones match even without parse_special)
        # tokenizes to its bytes here: llguidance's tokens must decode to the text they came from
        byte_ids = [tok.piece_to_id(f"<0x{b:02X}>") for b in range(256)]
        self._spelled = {i: [byte_ids[b] for b in tok.token_bytes(i)] for i in special
                         if all(byte_ids[b] is not None for b in tok.token_bytes(i))}

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self._tok.encode(text, add_bos=False, parse_special=False)
        return [b for i in ids for b in self._spelled.get(i, (i,))]


def ll_tokenizer(tok):
    """llguidance.LLTokenizer for one of our Tokenizers (end tokens: its end-of-generation ids)."""
    with _LL_LOCK:
        llt = _LL_TOKENIZERS.get(tok)
        if llt is None:
            import llguidance as llg
            llt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok)), eos_token=sorted(tok.eog_ids))
            _LL_TOKENIZERS[tok] = llt
        return llt


def warm_up(tok) -> threading.Thread:
    """Build `tok`'s llguidance tokenizer in a background thread (a server calls this at start, so
    the first constrained request does not wait the seconds it takes); returns the thread."""
    def build():
        try:
            ll_tokenizer(tok)
        except Exception as e:  # noqa: BLE001 - no traceback from a background thread: the first
            # constrained request builds it again and gets the error as its own one-line refusal
            logging.getLogger("edgegem.constraints").warning("structured output: tokenizer not built: %s: %s",
                                                             type(e).__name__, (str(e).splitlines() or [""])[0][:200])
    t = threading.Thread(target=build, name="edgegem-llguidance-tokenizer", daemon=True)
    t.start()
    return t


# --- one request's matcher ----------------------------------------------------------------------------

class GrammarState:
    """A Constraint compiled for one request (matcher state: the output tokens consumed so far)."""

    def __init__(self, constraint: Constraint, tokenizer):
        import llguidance as llg
        self.constraint, self.vocab_size = constraint, tokenizer.vocab_size
        self._llt = ll_tokenizer(tokenizer)
        self._eos = sorted(tokenizer.eog_ids)
        grammar = llg.LLMatcher.grammar_from_lark(constraint.lark)
        is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, self._llt)
        if is_error:
            raise _one_line(f"invalid {constraint.kind.replace('_', ' ')}", msgs[0] if msgs else "rejected")
        self._m = llg.LLMatcher(self._llt, grammar, log_level=0)
        if self._m.is_error():
            raise _one_line(f"invalid {constraint.kind.replace('_', ' ')}", self._m.get_error())
        self._bits = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        self.error: Optional[str] = None   # set if the matcher ever fails (one line)
        self.n_consumed = 0
        self.stopped_at: Optional[int] = None   # tokens consumed when the grammar became complete

    def allowed(self) -> torch.Tensor:
        """[V] bool CPU: the tokens the grammar allows next (bit j of word w is token 32w + j)."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size]   # 0/1 uint8
        return torch.from_numpy(bits.view(bool))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] logits with every forbidden token at -inf (a new tensor: logits may be a graph's output)."""
        allowed = self.allowed()
        if not allowed.any():   # a matcher in error allows nothing: end the request instead
            self.error = self.error or " ".join(self._m.get_error().split())[:200] or "the grammar allows no token"
            allowed[self._eos] = True
        if logits.shape[-1] > allowed.shape[0]:   # a head wider than the vocabulary (padding rows)
            allowed = torch.cat([allowed, allowed.new_zeros(logits.shape[-1] - allowed.shape[0])])
        return logits.masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))

    def consume(self, token: int) -> None:
        if not self._m.consume_token(int(token)) and self.error is None:
            self.error = " ".join(self._m.get_error().split())[:200]
        self.n_consumed += 1
        if self.stopped_at is None and self._m.is_stopped():
            self.stopped_at = self.n_consumed

    def complete_after(self, n_tokens: int) -> bool:
        """Whether the first n_tokens consumed already complete the grammar (nothing but the end may
        follow). By count, not the live state: a verify round samples several tokens before the
        scheduler commits them one by one."""
        return self.stopped_at is not None and n_tokens >= self.stopped_at

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts) the grammar accepts from here, without advancing."""
        return self._m.validate_tokens([int(t) for t in tokens]) if tokens else 0

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def is_accepting(self) -> bool:
        return self._m.is_accepting()



class ConstrainedSampler:
    """A request's sampler with the grammar applied: masks the logits, samples, consumes the token.
    Everything else (params, generator, what other code adds to Sampler) is the wrapped sampler's."""

    def __init__(self, sampler, state: GrammarState):
        self._sampler, self.grammar = sampler, state

    def sample(self, logits: torch.Tensor, *args, **kwargs) -> int:
        tok = self._sampler.sample(self.grammar.mask(logits), *args, **kwargs)
        self.grammar.consume(tok)
        return tok

    def __getattr__(self, name: str):
        return getattr(self._sampler, name)
