"""How answers are shaped, on written model output (a tiny random model never thinks): the thought
of a thinking turn becomes `reasoning_content` (OpenAI) / `thinking` (Ollama), streamed deltas add
up to the whole answer's split, the request switches that turn thinking on, and the one helper that
refuses tool calls and structured output until they are wired in."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("fastapi")

from app.server import params as P  # noqa: E402
from app.server.errors import APIError  # noqa: E402
from app.server.output import ReasoningSplitter, split_all  # noqa: E402
from app.server.schemas import ChatCompletionRequest  # noqa: E402
from models.chat import split_thinking  # noqa: E402

WRITTEN = [
    "<|channel>thought\nThe user greets me. I greet back.<channel|>Hello! How can I help?",
    "<|channel>thought\nStep 1: 2+2.\nStep 2: 4.<channel|>\n\n**4**",
    "<|channel>thought\nstill thinking when the limit hit",
    "<|channel>thought\n<channel|>Just the answer.",
    "Plain answer, no thought.",
    "  Indented plain answer\n",
    "Text that mentions <|channel> later is content.",
    "",
]


@pytest.mark.parametrize("text", WRITTEN)
def test_streamed_pieces_add_up_to_the_split_of_the_whole_answer(text):
    reasoning, content = split_all(text)
    thought, answer = split_thinking(text)
    assert (reasoning or None) == thought  # the model format's own parser agrees
    assert content.strip() == answer
    rng = random.Random(len(text))
    for _ in range(25):
        sp, r, c, i = ReasoningSplitter(), "", "", 0
        while i < len(text):
            k = rng.randint(1, 7)
            a, b = sp.push(text[i:i + k])
            r, c, i = r + a, c + b, i + k
        a, b = sp.finish()
        assert (r + a, c + b) == ((reasoning or "") if reasoning is not None else "", content)


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_reasoning_effort_or_the_template_switch_turn_thinking_on():
    assert not P.openai_thinking(_req())
    assert P.openai_thinking(_req(reasoning_effort="high")) and P.openai_thinking(_req(reasoning_effort="low"))
    assert not P.openai_thinking(_req(reasoning_effort="none"))
    assert P.openai_thinking(_req(chat_template_kwargs={"enable_thinking": True}))
    assert not P.openai_thinking(_req(chat_template_kwargs={"enable_thinking": False}))
    with pytest.raises(APIError):
        P.openai_thinking(_req(chat_template_kwargs={"enable_thinking": "yes"}))


def test_the_one_helper_refuses_tools_and_structured_output_and_lets_their_off_values_through():
    P.refuse_unwired()
    P.refuse_unwired(tools=[], tool_choice="none", response_format={"type": "text"})
    for kw, words in (({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": "required"}, "tools"),
                      ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
                      ({"tool_messages": True}, "tools"), ({"response_format": {"type": "json_schema"}}, "response_format"),
                      ({"fmt": "json"}, "format"), ({"fmt": {"type": "object"}}, "format")):
        with pytest.raises(APIError) as e:
            P.refuse_unwired(**kw)
        assert e.value.status == 400 and e.value.message == f"{words} is not supported yet".replace(
            "tools is", "tools are")
