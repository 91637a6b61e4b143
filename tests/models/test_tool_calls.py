"""Gemma-4 tool calls: rendered as the real chat templates do (models/tool_format.py) and parsed back
from written model output, whole and streamed (models/tool_calls.py).

Templates: llama.cpp's `google-gemma-4-31B-it.jinja` (tests/data/, the newer revision, which the
built-in renderer copies) and the older one embedded in `ggml-vocab-gemma-4.gguf`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.chat import ChatFormat, ChatTemplateError
from models.tool_calls import CLOSE, OPEN, ToolCallStream, parse_arguments, parse_tool_calls
from models.tool_format import QUOTE, format_argument, format_declaration, prepare_tool_messages

DATA = Path(__file__).parents[1] / "data"
EMPTY_CHANNEL = "<|channel>thought\n<channel|>"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer"},
        "opts": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "Zone": {"type": "number", "nullable": True}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}, "filters": {
        "type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}}}}}}
NO_ARGS = {"type": "function", "function": {"name": "now", "description": "The time"}}
TOOLS = [WEATHER, SEARCH, NO_ARGS]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2, "opts": {"x": true}}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "content": "21 and clear, at noon."},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def newer() -> ChatFormat:
    return ChatFormat((DATA / "google-gemma-4-31B-it.jinja").read_text(), family="gemma4")


@pytest.fixture(scope="module")
def older(gemma4_vocab_path) -> ChatFormat:
    from models.gguf import GGUFFile
    return ChatFormat.from_metadata(GGUFFile(gemma4_vocab_path).metadata)


def _builtin_as_newer(builtin: str, gen: bool, newer_text: str) -> str:
    """The built-in is the E-series form: no empty thought channel after the generation prompt."""
    if gen and newer_text.endswith("<|turn>model\n" + EMPTY_CHANNEL):
        return builtin + EMPTY_CHANNEL
    return builtin


# --- rendering ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [2, 3, 5, 6, 7], ids=["user", "pending-calls", "answered", "reply", "next-turn"])
@pytest.mark.parametrize("gen", [True, False])
def test_builtin_renders_tools_as_the_real_template(newer, cut, gen):
    msgs = CONVERSATION[:cut]
    want = newer.render(msgs, add_generation_prompt=gen, tools=TOOLS)
    got = ChatFormat(family="gemma4").render(msgs, add_generation_prompt=gen, tools=TOOLS)
    assert _builtin_as_newer(got, gen, want) == want


def test_conversation_renders_calls_and_responses_in_gemma_syntax(newer):
    text = newer.render(CONVERSATION[:5], tools=TOOLS)
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2,opts:{x:true}}<tool_call|>' in text
    assert "<|tool_call>call:now{}<tool_call|>" in text
    # a JSON-object result is rendered as its mapping, other content as {value:...}
    assert '<|tool_response>response:get_weather{sky:<|"|>clear<|"|>,temp:21}<tool_response|>' in text
    assert '<|tool_response>response:now{value:<|"|>12:00<|"|>}<tool_response|>' in text
    assert text.endswith("<tool_response|>")   # the model goes on in the same turn
    assert text.count("<|tool>") == 3 and "<|tool>declaration:now{description:<|\"|>The time<|\"|>}<tool|>" in text


def test_older_template_renders_the_same_calls_and_responses(older, newer):
    """The older revision knows no `role: tool`: the folded tool_responses make it render them."""
    for text in (older.render(CONVERSATION, tools=TOOLS), newer.render(CONVERSATION, tools=TOOLS)):
        assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2,opts:{x:true}}<tool_call|>' in text
        assert '<|tool_response>response:now{value:<|"|>12:00<|"|>}<tool_response|>' in text
        assert "<|turn>tool" not in text


_names = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=12)
_prop = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean"])},
                          optional={"description": _text, "enum": st.lists(_text, min_size=1, max_size=3),
                                    "nullable": st.booleans()}),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={"description": _text}),
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(_names, inner, max_size=3)},
                              optional={"required": st.lists(_names, max_size=2)})),
    max_leaves=6)
_tool = st.builds(lambda name, desc, props, req: {"type": "function", "function": {
    "name": name, "description": desc,
    "parameters": {"type": "object", "properties": props, "required": req}}},
    _names, _text, st.dictionaries(_names, _prop, min_size=1, max_size=4), st.lists(_names, max_size=2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tools=st.lists(_tool, min_size=1, max_size=3))
def test_declarations_equal_the_real_template_on_random_schemas(newer, tools):
    msgs = [{"role": "user", "content": "hi"}]
    want = newer.render(msgs, tools=tools)
    assert _builtin_as_newer(ChatFormat(family="gemma4").render(msgs, tools=tools), True, want) == want
    assert all(f"<|tool>{format_declaration(t)}<tool|>" in want for t in tools)


@pytest.mark.parametrize("bad, msg", [
    ([{"role": "tool", "content": "x"}], "must follow an assistant message with tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], "not JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "JSON object"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "function.name"),
])
def test_bad_tool_messages_are_one_line_errors(newer, bad, msg):
    for fmt in (newer, ChatFormat(family="gemma4")):
        with pytest.raises(ChatTemplateError, match=msg) as e:
            fmt.render([{"role": "user", "content": "q"}] + bad)
        assert "\n" not in str(e.value)


def test_gemma3_builtin_refuses_tools():
    with pytest.raises(ChatTemplateError, match="no tool syntax"):
        ChatFormat(family="gemma3").render([{"role": "user", "content": "q"}], tools=TOOLS)


def test_prepare_resolves_tool_names_by_call_id_or_single_call():
    out = prepare_tool_messages([
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": [{"type": "text", "text": '{"ok": true}'}]}])
    assert out == [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {"x": 1}}}],
                    "tool_responses": [{"name": "f", "response": {"ok": True}}]}]


# --- parsing written model output -------------------------------------------------------------------

CASES = [
    ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', "", [("get_weather", {"city": "Paris"})]),
    ('Let me look.<|tool_call>call:f{a:1,b:-2.5e1,c:true,d:false,e:null}<tool_call|>', "Let me look.",
     [("f", {"a": 1, "b": -25.0, "c": True, "d": False, "e": None})]),
    ('<|tool_call>call:f{x:None,y:True,z:False}<tool_call|>', "", [("f", {"x": None, "y": True, "z": False})]),
    ('<|tool_call>call:f{s:<|"|>a, "b" {c}: [d]<|"|>,l:[1,[2,<|"|>x<|"|>],{k:<|"|>v<|"|>}]}<tool_call|>', "",
     [("f", {"s": 'a, "b" {c}: [d]', "l": [1, [2, "x"], {"k": "v"}]})]),
    ('<|tool_call>call:f{ a : 1 , b :[ ] , c:{ } }<tool_call|>', "", [("f", {"a": 1, "b": [], "c": {}})]),
    ('<|tool_call>call:f{<|"|>odd key<|"|>:1,"json":"q\\"uote"}<tool_call|>', "", [("f", {"odd key": 1, "json": 'q"uote'})]),
    ('<|tool_call>call:f{}<tool_call|><|tool_call>call:g{n:3}<tool_call|>', "", [("f", {}), ("g", {"n": 3})]),
    ('<|tool_call>call:f{a:1}', "", [("f", {"a": 1})]),   # went straight to <|tool_response> (EOG)
    ('<|tool_call>call:f{a:1}<|tool_call>call:g{}<tool_call|>', "", [("f", {"a": 1}), ("g", {})]),
    ('<|channel>thought\nplan<channel|><|tool_call>call:f{}<tool_call|>', "<|channel>thought\nplan<channel|>", [("f", {})]),
    ("plain answer, no call", "plain answer, no call", []),
    ("a < b and c <|tool", "a < b and c <|tool", []),
    ('<|tool_call>call:f{a:}<tool_call|>', '<|tool_call>call:f{a:}<tool_call|>', None),
    ('<|tool_call>call:f{a:<|"|>open<tool_call|>', '', None),   # the reply ended inside the call: dropped
    ('Let me check.<|tool_call>call:get_weather{city:<|"|>Par', 'Let me check.', None),   # cut off by max_tokens
    ('<|tool_call>cal:f{}<tool_call|> after', '<|tool_call>cal:f{}<tool_call|> after', None),
    ('<|tool_call>call:f{a:1} junk<tool_call|>', '<|tool_call>call:f{a:1} junk<tool_call|>', None),
    ('<|tool_call>call:f{a:01}<tool_call|>', '<|tool_call>call:f{a:01}<tool_call|>', None),
    ('x<|tool_call>call:f{a:1,}<tool_call|><|tool_call>call:g{}<tool_call|>', 'x<|tool_call>call:f{a:1,}<tool_call|>',
     [("g", {})]),
]


def _calls(p):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.tool_calls]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_written_model_output_parses(text, content, calls, caplog):
    with caplog.at_level(logging.WARNING, logger="edgegem.tools"):
        p = parse_tool_calls(text)
    assert p.content == content
    if calls is None:   # malformed: left as text (cut off: dropped), one log line, no call
        assert p.tool_calls == [] and len(p.errors) == 1 and "\n" not in p.errors[0]
        assert [r.getMessage() for r in caplog.records] == p.errors
    else:
        assert _calls(p) == calls and len(p.errors) == p.content.count(OPEN)   # a bad call next to good ones
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in p.tool_calls)


def test_undeclared_function_stays_text():
    p = parse_tool_calls('<|tool_call>call:rm_rf{}<tool_call|>', names={"get_weather"})
    assert p.tool_calls == [] and p.content == '<|tool_call>call:rm_rf{}<tool_call|>' and "rm_rf" in p.errors[0]


@pytest.mark.parametrize("text, content, calls", [c for c in CASES])
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streaming_equals_whole(text, content, calls, step):
    whole = parse_tool_calls(text)
    s = ToolCallStream()
    out, deltas = "", []
    for i in range(0, len(text), step):
        c, d = s.push(text[i:i + step])
        out += c
        deltas += d
        assert OPEN not in c or whole.errors   # only a malformed call is ever streamed as content
    c, d = s.finish()
    out, deltas = out + c, deltas + d
    assert out == whole.content
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
        [(i, n, a) for i, (n, a) in enumerate(_calls(whole))]
    assert [d["id"] for d in deltas] == [c["id"] for c in s.calls]


def test_stream_holds_back_only_a_possible_call_start():
    s = ToolCallStream()
    assert s.push("Hello <|tool") == ("Hello ", [])
    assert s.push("s are fun") == ("<|tools are fun", [])
    assert s.push(" <|tool_call>call:f{a:") == (" ", [])
    c, d = s.push('1}<tool_call|>bye')
    assert c == "bye" and d[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


_key = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)
_str = st.text(max_size=20).filter(lambda s: QUOTE not in s)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | _str |
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_key, inner, max_size=4), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(name=_key, args=st.dictionaries(_key, _json, max_size=5), before=_str, chunk=st.integers(1, 9))
def test_round_trip_rendered_calls_parse_back(name, args, before, chunk):
    """What the template renders for a call (format_argument, bare keys) parses back to the same
    arguments, whole and streamed in any chunking, with the text before it as content."""
    body = ",".join(f"{k}:{format_argument(v, escape_keys=False)}" for k, v in sorted(args.items()))
    assert parse_arguments("{" + body + "}") == args
    text = before.replace(OPEN[:2], "< |") + f"{OPEN}call:{name}{{{body}}}{CLOSE}"
    s = ToolCallStream()
    out, deltas = "", []
    for i in range(0, len(text), chunk):
        c, d = s.push(text[i:i + chunk])
        out, deltas = out + c, deltas + d
    c, d = s.finish()
    assert out + c == before.replace(OPEN[:2], "< |") and len(deltas + d) == 1
    assert json.loads((deltas + d)[0]["function"]["arguments"]) == args


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([OPEN, CLOSE, QUOTE, "call:", "f", "{", "}", "[", "]", ":", ",", "1", "a",
                                 "true", " ", "<", "|", '"', "x"]), max_size=30))
def test_any_text_never_raises_and_loses_nothing(parts):
    text = "".join(parts)
    p = parse_tool_calls(text)
    if not p.tool_calls:   # all of it, but a call the text ends inside
        assert text.startswith(p.content)
        assert p.content == text or text[len(p.content):].startswith(OPEN) and any("dropped" in e for e in p.errors)
