"""What a generation's events become in an answer: the thought of a thinking turn split from the
content as it streams, and token log-probabilities in each API's shape.

Gemma-4 writes a thought as `<|channel>thought\\n...<channel|>` before the answer (models/chat.py,
`split_thinking`); `ReasoningSplitter` follows that grammar incrementally, so streamed deltas add
up exactly to the non-streamed `reasoning_content` / `content` (both come from it)."""
from __future__ import annotations

from typing import Optional

OPEN, CLOSE = "<|channel>", "<channel|>"


class ReasoningSplitter:
    """push(text) -> (reasoning delta, content delta). Text that does not start with a channel
    is content, untouched; a channel's name line ("thought\\n") is dropped, as is the whitespace
    between the channel's end and the answer."""

    def __init__(self) -> None:
        self.raw = ""
        self.mode = "start"  # start -> thought -> content, or start -> content
        self.thought_at = 0  # where the thought begins in raw
        self.sent = 0  # raw characters of the current part already handed out
        self.answer_started = False

    def push(self, text: str) -> tuple[str, str]:
        self.raw += text
        reasoning = content = ""
        if self.mode == "start":
            s = self.raw.lstrip()
            if not s or (OPEN.startswith(s) and s != OPEN):
                return "", ""  # the marker may still be arriving
            if not s.startswith(OPEN):
                self.mode, self.sent = "content", 0
                self.answer_started = True
            else:
                head = s[len(OPEN):]
                name, nl, _ = head.partition("\n")
                if not nl and (not head or name.isidentifier()):
                    return "", ""  # the channel's name line is still arriving
                skip = len(self.raw) - len(s) + len(OPEN) + (len(name) + 1 if nl and name.isidentifier() else 0)
                self.mode, self.thought_at, self.sent = "thought", skip, skip
        if self.mode == "thought":
            end = self.raw.find(CLOSE, self.thought_at)
            if end < 0:
                hold = next((k for k in range(len(CLOSE) - 1, 0, -1) if self.raw.endswith(CLOSE[:k])), 0)
                upto = len(self.raw) - hold
                reasoning, self.sent = self.raw[self.sent:upto], max(self.sent, upto)
                return reasoning, ""
            reasoning = self.raw[self.sent:end]
            self.mode, self.sent = "content", end + len(CLOSE)
        if self.mode == "content":
            rest = self.raw[self.sent:]
            if not self.answer_started:  # whitespace after the channel belongs to neither part
                stripped = rest.lstrip()
                self.sent += len(rest) - len(stripped)
                rest = stripped
                self.answer_started = bool(rest)
            content, self.sent = rest, len(self.raw)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back at the end (an unfinished marker's characters)."""
        if self.mode == "start":
            s = self.raw.lstrip()
            if s.startswith(OPEN):  # a thought cut off right after its marker (or its name)
                name = s[len(OPEN):]
                self.mode, self.thought_at, self.sent = "content", len(self.raw) - len(s) + len(OPEN), len(self.raw)
                return ("" if name.isidentifier() else name), ""
            self.mode = "content"
            self.answer_started = True
            rest, self.sent = self.raw[self.sent:], len(self.raw)
            return "", rest
        if self.mode == "thought":
            rest, self.sent = self.raw[self.sent:], len(self.raw)
            return rest, ""
        return "", ""


def split_all(text: str) -> tuple[Optional[str], str]:
    """(reasoning or None, content) of a whole answer, exactly what streaming it would give."""
    sp = ReasoningSplitter()
    r1, c1 = sp.push(text)
    r2, c2 = sp.finish()
    reasoning = r1 + r2
    return (reasoning if sp.thought_at else None), c1 + c2


class TokenText:
    """Token id -> (text, bytes) through the client, cached (a server decodes the same ids often)."""

    def __init__(self, client):
        self.client = client
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        got = self._cache.get(token_id)
        if got is None:
            raw = self.client.token_bytes(token_id)
            got = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return got


def chat_logprobs(picked: list, text: TokenText) -> list[dict]:
    """engine.sampler.TokenLogprob list -> OpenAI chat `logprobs.content` entries."""
    out = []
    for p in picked:
        tok, raw = text(p.token_id)
        top = [{"token": text(t)[0], "logprob": lp, "bytes": text(t)[1]} for t, lp in p.top]
        out.append({"token": tok, "logprob": p.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(picked: list, text: TokenText, offset: int) -> dict:
    """The legacy completions `logprobs` object; `offset`: characters of text before these tokens."""
    tokens, lps, tops, offsets = [], [], [], []
    for p in picked:
        tok = text(p.token_id)[0]
        tokens.append(tok)
        lps.append(p.logprob)
        tops.append({text(t)[0]: lp for t, lp in p.top})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def ollama_logprobs(picked: list, text: TokenText) -> list[dict]:
    return [{"token": text(p.token_id)[0], "logprob": p.logprob,
             "top_logprobs": [{"token": text(t)[0], "logprob": lp} for t, lp in p.top]} for p in picked]
