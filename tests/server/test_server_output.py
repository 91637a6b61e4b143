"""How answers are shaped, on written model output (a tiny random model never thinks): the thought
of a thinking turn becomes `reasoning_content` (OpenAI) / `thinking` (Ollama), streamed deltas add
up to the whole answer's split, the request switches that turn thinking on, and tools, tool
messages and response formats map to the engine's params (bad ones: a 400 naming the field)."""
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


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}
GEMMA4 = {"chat_family": "gemma4", "arch": "gemma4", "audio": False}


def test_tools_tool_messages_and_response_format_map_to_the_engines_params():
    from app.server.config import ServerConfig
    from app.server.ollama_schemas import ChatRequest

    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": None, "tool_calls": calls},
                                          {"role": "tool", "tool_call_id": "c1", "content": "2"}],
                                tools=[TOOL], tool_choice="required", response_format={"type": "json_object"})
    msgs, gp = P.openai_chat(req, 100, ServerConfig(), GEMMA4)
    assert gp.tools == [TOOL] and gp.tool_choice == "required" and gp.constraint.kind == "json_object"
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": calls}  # JSON-string arguments: models/chat.py
    assert msgs[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    msgs, gp = P.openai_chat(_req(tools=[], response_format={"type": "text"}), 100, ServerConfig(), GEMMA4)
    assert gp.tools is None and gp.constraint is None
    oreq = ChatRequest(messages=[{"role": "user", "content": "hi"},
                                 {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
                                 {"role": "tool", "tool_name": "f", "content": "2"}], tools=[TOOL], format="json")
    msgs, gp = P.ollama_chat(oreq, 100, ServerConfig(), GEMMA4)
    assert gp.tools == [TOOL] and gp.tool_choice is None and gp.constraint.kind == "json_object"
    assert msgs[2] == {"role": "tool", "content": "2", "name": "f"}


@pytest.mark.parametrize("kw, param, words", [
    (dict(tools=[{"type": "function"}]), "tools", "tools[0] must be"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice", "not in tools"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}), "response_format",
     "response_format: invalid json schema"),
], ids=["tool", "choice-without-tools", "choice-not-offered", "schema"])
def test_bad_tools_and_schemas_are_400s_naming_the_field(kw, param, words):
    from app.server.config import ServerConfig
    with pytest.raises(APIError) as e:
        P.openai_chat(_req(**kw), 100, ServerConfig(), GEMMA4)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_a_model_without_tool_syntax_refuses_tools_and_tool_messages():
    from app.server.config import ServerConfig
    gemma3 = {"chat_family": "gemma3", "arch": "gemma3"}
    for req in (_req(tools=[TOOL]), ChatCompletionRequest(messages=[
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}])):
        with pytest.raises(APIError) as e:
            P.openai_chat(req, 100, ServerConfig(), gemma3)
        assert e.value.param == "tools" and "no tool-call syntax" in e.value.message
