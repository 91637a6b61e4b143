"""Tool calls and structured output through both APIs of `edgegem serve` (the real `openai` and
`ollama` clients), on a tiny random Gemma-4 with the tool markers as tokens and the real Gemma-4
chat template (tests/data/): a named `tool_choice` is a constrained call that parses and whose
arguments validate against the function's schema, streamed deltas reassemble to it, the served
call equals the engine's for the same request, tool messages are rendered in the prompt, JSON
schemas validate on every one of 20 seeds in each API, and bad schemas and tool lists are 400s in
each API's error shape.

The model is random, so it never calls a tool of its own accord: the call paths are driven by
`tool_choice` (Ollama has none, so its answer shape is pinned with the same constrained request)."""
from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
jsonschema = pytest.importorskip("jsonschema")

from gguf import GGUFValueType  # noqa: E402

from app.server import params as P  # noqa: E402
from engine import api  # noqa: E402
from engine.client import GenerationParams, LocalClient  # noqa: E402
from engine.constraints import from_response_format  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import EngineConfig  # noqa: E402
from server_helpers import LiveServer  # noqa: E402
from tiny_models import TinySpec, write_tiny_gemma4  # noqa: E402

TEMPLATE = (Path(__file__).parents[1] / "data" / "google-gemma-4-31B-it.jinja").read_text()
SPEC = TinySpec(tool_tokens=True, extra={"tokenizer.chat_template": (TEMPLATE, GGUFValueType.STRING)})
MODEL = "tiny-tools"

# small bounded schemas: a random model's reply is as long as they allow (a 4-byte character of
# the tiny vocabulary is 4 byte tokens), and 40 replies are decoded here
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 3},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}   # at most 51 tokens: {"name": "..."} byte by byte
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "required": ["city", "days"], "properties": {
               "city": {"type": "string", "maxLength": 3},
               "days": {"type": "integer", "minimum": 1, "maximum": 7},
               "unit": {"type": "string", "enum": ["c", "f"]}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOW]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_gemma4(tmp_path_factory.mktemp("srv-tools") / f"{MODEL}.gguf", SPEC, seed=41)
    # the exact model (float32, torch): two runs of one request agree whatever the cache served;
    # batched decode (one forward for the running requests) as tests/engine/test_constraints.py runs it
    client = LocalClient(api.open_model(path, exact=True),
                         EngineConfig(full_tokens=4096, max_running_requests=4, batched_decode=True))
    s = LiveServer(None, client=client)
    yield s
    s.close()
    client.close()


@pytest.fixture
def submitted(server, monkeypatch):
    """(messages, params, request id) of every chat request that reached the engine in a test."""
    seen = []
    real = type(server.client).submit

    def spy(self, messages, params, **kw):
        rid = real(self, messages, params, **kw)
        seen.append((messages, params, rid))
        return rid
    monkeypatch.setattr(type(server.client), "submit", spy)
    return seen


def _named_call(oa, seed: int, stream: bool = False):
    return oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1.0,
                                      seed=seed, max_tokens=96, stream=stream)


def _reassembled(chunks) -> tuple[list[dict], str, str]:
    """(calls by index: name + arguments, content, finish_reason) of a streamed chat answer."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = ch.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


# --- tool calls: OpenAI -------------------------------------------------------------------------------

def test_a_named_tool_choice_gives_a_parsed_call_whose_arguments_fit_the_schema(server, submitted):
    oa = server.openai()
    for seed in range(3):
        r = _named_call(oa, seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    msgs, params, _ = submitted[-1]
    assert params.tools == TOOLS and params.tool_choice == NAMED and msgs == ASK


def test_streamed_tool_call_deltas_reassemble_to_the_plain_call_and_the_engines(server):
    oa = server.openai()
    plain = _named_call(oa, 7).choices[0].message.tool_calls[0]
    calls, content, finish = _reassembled(_named_call(oa, 7, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", plain.function.arguments)]
    assert calls[0]["id"].startswith("call_")
    # the engine directly, with what the request maps to
    rid = server.client.submit(ASK, GenerationParams(SamplingParams(temperature=1.0, seed=7, max_tokens=96),
                                                     tools=TOOLS, tool_choice=NAMED))
    last = list(server.client.stream(rid))[-1]
    assert [c["function"]["arguments"] for c in last.tool_calls] == [plain.function.arguments]


def test_a_call_cut_off_by_max_tokens_is_never_shown_as_text(server, monkeypatch):
    """The reply ends inside the call (a length finish): no call, and none of its markup in the
    content, plain or streamed, in either API; finish_reason stays "length"."""
    oa = server.openai()
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=3, max_tokens=6)
    ch = oa.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "length" and not ch.message.tool_calls and ch.message.content == "", ch
    calls, content, finish = _reassembled(oa.chat.completions.create(**kw, stream=True))
    assert (calls, content, finish) == ([], "", "length")
    real = P.ollama_chat   # Ollama has no tool_choice: forced as in the Ollama test below

    def forced(*a, **kw):
        msgs, gp = real(*a, **kw)
        return msgs, dataclasses.replace(gp, tool_choice=NAMED)
    monkeypatch.setattr(P, "ollama_chat", forced)
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "stream": False,
            "options": {"seed": 3, "num_predict": 6, "temperature": 1.0}}
    r = server.http().post("/api/chat", json=body).json()
    assert r["done_reason"] == "length" and r["message"]["content"] == "" and "tool_calls" not in r["message"], r
    lines = [json.loads(ln) for ln in server.http().post("/api/chat", json={**body, "stream": True}).text.splitlines()]
    assert "".join(ln["message"]["content"] for ln in lines) == "" and lines[-1]["done_reason"] == "length"
    assert not any("tool_calls" in ln["message"] for ln in lines)


def test_tool_choice_required_and_none(server):
    oa = server.openai()
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=1,
                                   temperature=1.0, max_tokens=96)
    assert r.choices[0].finish_reason == "tool_calls"
    assert {c.function.name for c in r.choices[0].message.tool_calls} <= {"get_weather", "now"}
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", seed=1,
                                   temperature=1.0, max_tokens=12)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert "<|tool_call>" not in (r.choices[0].message.content or "")


def test_assistant_tool_calls_and_tool_messages_are_rendered_in_the_prompt(server, submitted):
    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps({"city": "Paris", "days": 2})}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"sky": "clear", "temp": 21})},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
    r = server.openai().chat.completions.create(model=MODEL, messages=convo, tools=TOOLS, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    _, _, rid = submitted[-1]
    text = server.client.detokenize(server.client.last_prompt_ids(rid))
    assert '<|tool>declaration:get_weather{description:<|"|>Weather for a city<|"|>' in text
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>' in text
    assert '<|tool_response>response:get_weather{sky:<|"|>clear<|"|>,temp:21}<tool_response|>' in text
    assert '<|tool_response>response:now{value:<|"|>12:00<|"|>}<tool_response|>' in text
    # the same prompt as the engine renders for the conversation written in its own terms (text
    # content, the calls' arguments still JSON strings: models/chat.py parses them)
    lm = server.client.loaded
    engine_convo = [{**m, "content": m["content"] or ""} for m in convo]
    want = lm.tokenizer.encode(lm.chat.render(engine_convo, tools=TOOLS), add_bos=not lm.chat.bos_in_template)
    assert server.client.last_prompt_ids(rid) == want


# --- tool calls: Ollama -------------------------------------------------------------------------------

def test_ollama_tool_messages_render_and_calls_come_back_as_objects(server, submitted, monkeypatch):
    convo = ASK + [{"role": "assistant", "content": "", "tool_calls": [
                       {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
                   {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    ol = server.ollama()
    ol.chat(model=MODEL, messages=convo, tools=TOOLS, options={"num_predict": 2})
    _, params, rid = submitted[-1]
    # (the ollama client's Tool model keeps only type/description/enum of each property)
    assert [t["function"]["name"] for t in params.tools] == ["get_weather", "now"]
    assert params.tool_choice is None  # Ollama: the model decides
    text = server.client.detokenize(server.client.last_prompt_ids(rid))
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>' in text
    assert '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>' in text

    # Ollama has no tool_choice and a random model never calls on its own: force the call through
    # the params mapping so the answer's shape (message.tool_calls, arguments as objects) is pinned
    real = P.ollama_chat

    def forced(*a, **kw):
        msgs, gp = real(*a, **kw)
        return msgs, dataclasses.replace(gp, tool_choice=NAMED)
    monkeypatch.setattr(P, "ollama_chat", forced)
    # (raw HTTP: the schema's bounds must reach the server, see above)
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "stream": False,
            "options": {"seed": 3, "num_predict": 96, "temperature": 1.0, "top_k": 0, "top_p": 1.0}}
    r = server.http().post("/api/chat", json=body).json()
    (call,) = r["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and r["done_reason"] == "stop" and r["message"]["content"] == ""
    jsonschema.validate(call["function"]["arguments"], WEATHER["function"]["parameters"])  # an object, not a string
    with server.http().stream("POST", "/api/chat", json={**body, "stream": True}) as s:
        lines = [json.loads(line) for line in s.iter_lines() if line]
    streamed = [c for x in lines for c in x.get("message", {}).get("tool_calls", ())]
    assert streamed == [call] and lines[-1]["done"]


# --- structured output ----------------------------------------------------------------------------------

def test_json_schema_response_format_validates_on_20_seeds(server):
    """Sampled at temperature 1 from a random model: only the mask makes this JSON. The schema bounds
    every part, so 64 tokens always finish."""
    oa = server.openai()
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(seed):
        return oa.chat.completions.create(model=MODEL, messages=ASK, response_format=rf, temperature=1.0, seed=seed,
                                          max_tokens=64).choices[0]
    with ThreadPoolExecutor(4) as pool:
        for seed, ch in enumerate(pool.map(one, range(20))):
            assert ch.finish_reason == "stop", (seed, ch.message.content)
            jsonschema.validate(json.loads(ch.message.content), PERSON)


def test_ollama_format_schema_validates_on_20_seeds_and_json_gives_an_object(server):
    ol = server.ollama()

    def one(seed):
        return ol.chat(model=MODEL, messages=ASK, format=PERSON,
                       options={"seed": seed, "num_predict": 64, "temperature": 1.0})
    with ThreadPoolExecutor(4) as pool:
        for seed, r in enumerate(pool.map(one, range(20))):
            assert r.done_reason == "stop", (seed, r.message.content)
            jsonschema.validate(json.loads(r.message.content), PERSON)
    g = ol.generate(model=MODEL, prompt="a person", format=PERSON, options={"seed": 1, "num_predict": 64})
    jsonschema.validate(json.loads(g.response), PERSON)
    streamed = "".join(p.message.content for p in ol.chat(model=MODEL, messages=ASK, format=PERSON, stream=True,
                                                        options={"seed": 2, "num_predict": 64}))
    jsonschema.validate(json.loads(streamed), PERSON)


def test_the_served_json_equals_the_engines_for_the_same_request(server):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    served = server.openai().chat.completions.create(model=MODEL, messages=ASK, response_format=rf, temperature=1.0,
                                                     seed=11, max_tokens=64).choices[0].message.content
    rid = server.client.submit(ASK, GenerationParams(SamplingParams(temperature=1.0, seed=11, max_tokens=64),
                                                     constraint=from_response_format(rf)))
    assert "".join(e.text for e in server.client.stream(rid)) == served


# --- refused -----------------------------------------------------------------------------------------------

BAD_OPENAI = {  # extra body -> status, param, words in the message
    "tool not a function": ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    "tool name with a space": ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
    "parameters not a schema": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
                                "tools", "parameters must be"),
    "unsupported argument type": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "date"}}}}}], "tool_choice": "required"}, "tools", "date"),
    "tool_choice names no tool": ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
        "name": "now"}}}, "tool_choice", "not in tools"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    "tool message without a call": ({"messages": [{"role": "user", "content": "x"},
                                                  {"role": "tool", "tool_call_id": "c", "content": "y"}]},
                                    None, "must follow an assistant message"),
    "call arguments not JSON": ({"messages": [{"role": "user", "content": "x"}, {
        "role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                             "function": {"name": "now", "arguments": "{oops"}}]}]},
        None, "not JSON"),
    "bad schema type": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nope"}}}}, "response_format", "Invalid type: nope"),
    "strict unknown format": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "format": "uuidx"}}}}, "response_format",
        "Unknown format"),
    "json_schema without schema": ({"response_format": {"type": "json_schema"}}, "response_format",
                                   "json_schema.schema"),
    "response_format type": ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
}


@pytest.mark.parametrize("case", list(BAD_OPENAI))
def test_bad_tools_and_schemas_are_openai_400s_naming_the_field(server, case):
    extra, param, words = BAD_OPENAI[case]
    r = server.http().post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    assert "\n" not in err["message"] and err["param"] == param


@pytest.mark.parametrize("body, words", [
    ({"format": {"type": "nope"}}, "Invalid type: nope"),
    ({"format": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "missing"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0] must be"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "must follow an assistant message"),
], ids=["bad-type", "missing-ref", "empty-name", "not-a-function", "orphan-tool-message"])
def test_bad_tools_and_schemas_are_ollama_400s(server, body, words):
    for path, base in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "x"})):
        if path == "/api/generate" and "format" not in body:
            continue   # generate has no tools or messages
        r = server.http().post(path, json={"model": MODEL, "stream": False, **base, **body})
        assert r.status_code == 400 and set(r.json()) == {"error"} and words in r.json()["error"], (path, r.text)


def test_show_says_tools(server):
    assert "tools" in server.ollama().show(MODEL).capabilities
