"""Structured output and tool_choice through the engine (engine/constraints.py, tool_grammar.py,
structured.py): the token mask forces valid output even from a tiny random Gemma-4, and gives the
same greedy tokens with the prefix cache, batched decode and the assistant draft.

The tiny model has the Gemma-4 tool markers as tokens and the real chat template (tests/data/).
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from gguf import GGUFValueType

import engine.scheduler as scheduler
from engine.client import GenerationParams, LocalClient
from engine.constraints import (ConstraintError, GrammarState, from_ollama_format, from_response_format,
                                grammar_constraint, json_object_constraint, json_schema_constraint)
from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig
from engine.speculative import SpecConfig
from engine.tool_grammar import tool_call_constraint
from models.gemma4_assistant import load_gemma4_assistant
from models.gguf import GGUFFile
from models.loader import load_model
from models.tool_calls import parse_tool_calls
from tiny_models import TOOL_TOKENS, TinySpec, write_tiny_assistant, write_tiny_gemma4

TEMPLATE = (Path(__file__).parents[1] / "data" / "google-gemma-4-31B-it.jinja").read_text()
SPEC = TinySpec(tool_tokens=True, extra={"tokenizer.chat_template": (TEMPLATE, GGUFValueType.STRING)})

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "required": ["city", "days"], "properties": {
               "city": {"type": "string", "maxLength": 6},
               "days": {"type": "integer", "minimum": 1, "maximum": 7},
               "unit": {"type": "string", "enum": ["c", "f"]}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("constraints")
    return load_model(write_tiny_gemma4(d / "tools.gguf", SPEC, seed=41)), d


@pytest.fixture(scope="module")
def client(tiny):
    c = LocalClient(tiny[0], EngineConfig(full_tokens=4096, max_running_requests=4, batched_decode=True))
    yield c
    c.close()


def _run(client, messages, gen):
    rid = client.submit(messages, gen)
    events = list(client.stream(rid))
    return "".join(e.text for e in events), events


def _sampled(seed, max_tokens=64):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens)


# --- the output is valid --------------------------------------------------------------------------

def test_json_schema_output_validates_on_20_seeds(client):
    """Sampled at temperature 1 from a random model: only the mask makes this JSON (20 requests
    queued at once: 4 run together). The schema bounds every part, so its longest output is ~80
    tokens of the tiny vocab (6 four-byte characters of byte tokens are 24): 128 always finish."""
    con = json_schema_constraint(PERSON, strict=True)
    rids = [client.submit(ASK, GenerationParams(_sampled(seed, 128), constraint=con)) for seed in range(20)]
    for seed, rid in enumerate(rids):
        events = list(client.stream(rid))
        text = "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("make", [json_object_constraint, lambda: from_ollama_format("json"),
                                  lambda: from_response_format({"type": "json_object"})],
                         ids=["json_object", "ollama-json", "response_format"])
def test_any_json_object(client, make):
    text, events = _run(client, ASK, GenerationParams(_sampled(3, 400), constraint=make()))
    if events[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:   # a free-form object may run out of tokens; what was written is still a JSON prefix
        assert events[-1].finish_reason == "length" and text.startswith("{")


def test_ollama_schema_and_openai_json_schema_forms(client):
    for con in (from_ollama_format(PERSON),
                from_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                             "strict": True}})):
        text, events = _run(client, ASK, GenerationParams(_sampled(5), constraint=con))
        jsonschema.validate(json.loads(text), PERSON)
    assert from_response_format({"type": "text"}) is None and from_ollama_format("") is None


@pytest.mark.parametrize("grammar, allowed", [('start: "yes" | "no" | "maybe"', {"yes", "no", "maybe"}),
                                              ('root ::= ("ab" | "cd") [0-9]', None)], ids=["lark", "gbnf"])
def test_grammar_file_forms(client, grammar, allowed):
    for seed in range(4):
        text, _ = _run(client, ASK, GenerationParams(_sampled(seed), constraint=grammar_constraint(grammar)))
        assert text in allowed if allowed else (text[:2] in ("ab", "cd") and text[2:].isdigit() and len(text) == 3)


def test_named_function_call_parses_and_validates(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        text, events = _run(client, ASK, GenerationParams(_sampled(seed, 96), tools=[WEATHER, NOW], tool_choice=choice))
        last = events[-1]
        assert last.finish_reason == "tool_calls" and text == ""
        assert len(last.tool_calls) == 1 and last.tool_calls[0]["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(last.tool_calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])
        deltas = [d for e in events for d in (e.tool_call_deltas or [])]
        assert [{k: v for k, v in d.items() if k != "index"} for d in deltas] == last.tool_calls


def test_required_calls_offered_functions(client):
    for seed in range(3):
        _, events = _run(client, ASK, GenerationParams(_sampled(seed, 96), tools=[WEATHER, NOW], tool_choice="required"))
        calls = events[-1].tool_calls
        assert events[-1].finish_reason == "tool_calls" and calls
        assert {c["function"]["name"] for c in calls} <= {"get_weather", "now"}


def test_auto_with_json_allows_json_or_calls(client):
    con = json_schema_constraint(PERSON, strict=True)
    for seed in range(4):
        text, events = _run(client, ASK, GenerationParams(_sampled(seed), constraint=con, tools=[NOW]))
        if events[-1].finish_reason == "tool_calls":
            assert text == "" and events[-1].tool_calls[0]["function"]["name"] == "now"
        else:
            jsonschema.validate(json.loads(text), PERSON)


def test_tool_choice_none_never_emits_the_call_token(client, tiny):
    open_id = next(i for i, t in TOOL_TOKENS.items() if t == "<|tool_call>")
    for seed in range(3):
        _, events = _run(client, ASK, GenerationParams(_sampled(seed, 48), tools=[WEATHER], tool_choice="none"))
        assert open_id not in [t for e in events for t in e.token_ids]
        assert events[-1].tool_calls is None


def test_tools_are_rendered_through_the_model_template(client):
    client.submit(ASK, GenerationParams(SamplingParams(max_tokens=1), tools=[WEATHER]))
    rid = client.submit(ASK, GenerationParams(SamplingParams(max_tokens=1), tools=[WEATHER]))
    list(client.stream(rid))
    text = client.loaded.tokenizer.decode(client.last_prompt_ids(rid))
    assert '<|tool>declaration:get_weather{description:<|"|>Weather for a city<|"|>' in text


# --- refused in one line ------------------------------------------------------------------------------

@pytest.mark.parametrize("make, msg", [
    (lambda: json_schema_constraint({"type": "nope"}), "Invalid type: nope"),
    (lambda: json_schema_constraint("{not json"), "not JSON"),
    (lambda: json_schema_constraint([1, 2]), "must be an object"),
    (lambda: json_schema_constraint({"type": "string", "format": "uuidx"}, strict=True), "Unknown format"),
    (lambda: json_schema_constraint({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
    (lambda: grammar_constraint('start: "a" | b'), 'unknown name: "b"'),
    (lambda: grammar_constraint('root ::= "a" | b'), "Rule 'b' not found"),
    (lambda: grammar_constraint("start: x", syntax="peg"), "lark, gbnf or auto"),
    (lambda: from_response_format({"type": "xml"}), "json_schema"),
    (lambda: from_response_format({"type": "json_schema"}), "json_schema.schema"),
    (lambda: from_ollama_format(5), '"json" or a JSON schema'),
    (lambda: tool_call_constraint([WEATHER], {"type": "function", "function": {"name": "nope"}}), "not in tools"),
    (lambda: tool_call_constraint([WEATHER], "sometimes"), "tool_choice must be"),
    (lambda: tool_call_constraint([{"type": "function", "function": {"name": "a b"}}], "required"), "name"),
    (lambda: tool_call_constraint([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "date"}}}}}], "required"), "unknown type 'date'"),
    (lambda: tool_call_constraint(None, "required"), "needs tools"),
])
def test_bad_schemas_and_grammars_are_refused_in_one_line(make, msg):
    with pytest.raises(ConstraintError, match=msg) as e:
        make()
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize("tools, choice, msg", [
    ({"type": "function"}, None, "tools must be a list"),
    ([{"type": "function"}], None, r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "auto", "parameters must be"),
    ([WEATHER], {"type": "function", "function": {"name": "now"}}, "not in tools"),
    (None, "required", "needs tools"),
])
def test_submit_refuses_bad_tools_in_one_line(client, tools, choice, msg):
    with pytest.raises(ConstraintError, match=msg) as e:
        client.submit(ASK, GenerationParams(tools=tools, tool_choice=choice))
    assert "\n" not in str(e.value)


def test_ollama_tool_calls_carry_argument_objects():
    from engine.structured import ollama_tool_calls
    calls = parse_tool_calls('<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|>').tool_calls
    assert ollama_tool_calls(calls) == [{"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]


def test_submit_refuses_a_grammar_with_an_unknown_token(client):
    with pytest.raises(ConstraintError, match="invalid grammar") as e:
        client.submit(ASK, GenerationParams(constraint=grammar_constraint("start: <|no_such_token|>")))
    assert "\n" not in str(e.value)


# --- the mask with prefix cache, batched decode and the draft ------------------------------------------

def _prompt(n, seed):
    return [2] + np.random.default_rng(seed).integers(11, 360, size=n - 1).tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=128)   # both constraints below end within it


def _constrained(tiny_lm, prompts, con, draft=None, engine=None, **cfg):
    spec = SpecConfig(draft, tokens=3, adaptive=False) if draft is not None else None
    eng = engine or Engine(tiny_lm.model, tiny_lm.tokenizer, EngineConfig(full_tokens=2048, **cfg), spec=spec)
    reqs = [eng.add(p, GREEDY, grammar=GrammarState(con, tiny_lm.tokenizer)) for p in prompts]
    eng.run_to_completion()
    return [r.output_ids for r in reqs], eng


@pytest.fixture(scope="module")
def draft(tiny):
    return load_gemma4_assistant(GGUFFile(write_tiny_assistant(tiny[1] / "a.gguf", SPEC, seed=42)))


SMALL = {"type": "object", "additionalProperties": False, "required": ["n", "k", "t"],
         "properties": {"n": {"type": "string", "maxLength": 3}, "k": {"type": "integer", "minimum": 0, "maximum": 9},
                        "t": {"type": "boolean"}}}
CONSTRAINTS = {"json": lambda tok: json_schema_constraint(SMALL, strict=True),
               "tool-call": lambda tok: tool_call_constraint([WEATHER, NOW], {"type": "function",
                                                                              "function": {"name": "get_weather"}}, tok)}


PROMPTS = [_prompt(21, 1), _prompt(13, 2)]
_PLAIN: dict = {}


def _plain(lm, kind):
    """The plain constrained path: each prompt alone, one forward per token, no draft, cold cache."""
    if kind not in _PLAIN:
        _PLAIN[kind] = [_constrained(lm, [p], CONSTRAINTS[kind](lm.tokenizer), batched_decode=False)[0][0] for p in PROMPTS]
    return _PLAIN[kind]


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("mode", ["prefix-cache", "batched", "draft", "draft+batched"])
def test_mask_gives_the_plain_constrained_greedy_tokens(tiny, draft, kind, mode):
    lm = tiny[0]
    con = CONSTRAINTS[kind](lm.tokenizer)
    prompts, plain = PROMPTS, _plain(tiny[0], kind)
    if mode == "prefix-cache":   # the same prompts again on a warm engine: served from the cache
        _, eng = _constrained(lm, prompts, con, batched_decode=False)
        again, eng = _constrained(lm, prompts, con, engine=eng)
        assert again == plain and eng.cache.cached_tokens() > 0
    else:
        out, _ = _constrained(lm, prompts, con, draft=draft if "draft" in mode else None,
                              batched_decode="batched" in mode)
        assert out == plain
    for ids in plain:
        text = lm.tokenizer.decode(ids)
        if kind == "json":
            jsonschema.validate(json.loads(text), SMALL)
        else:
            assert parse_tool_calls(text).tool_calls


def test_drafts_are_cut_to_what_the_grammar_allows(tiny, draft, monkeypatch):
    """Perfect drafts (the plain run's own next tokens) with a forbidden token after them: the
    verify sees only the valid prefix, so every drafted token is accepted; the output is unchanged."""
    lm = tiny[0]
    con = CONSTRAINTS["json"](lm.tokenizer)
    prompt = _prompt(17, 4)
    plain = _constrained(lm, [prompt], con)[0][0]
    full = prompt + plain
    bad = lm.tokenizer.piece_to_id("<|turn>")   # a control token: never valid in JSON
    monkeypatch.setattr(scheduler, "draft_tokens",
                        lambda spec, model, kv, last, h, pos, k: (full[pos + 1:pos + k] + [bad])[:k])
    out, eng = _constrained(lm, [prompt], con, draft=draft)
    st = eng.status()["speculative"]
    assert out[0] == plain
    assert st["drafted"] == st["accepted"] > 0   # the forbidden drafts never reached the verify


def test_matcher_valid_prefix_and_rollback(tiny):
    tok = tiny[0].tokenizer
    state = GrammarState(grammar_constraint('start: "abc" "def"'), tok)
    ids = tok.encode("abcdef", add_bos=False)
    assert state.valid_prefix(ids + ids) == len(ids) and state.valid_prefix([]) == 0
    before = state.allowed().clone()
    for t in ids[:3]:
        state.consume(t)
    state.rollback(3)
    assert bool((state.allowed() == before).all())
    for t in ids:
        state.consume(t)
    assert state.is_accepting() and state.error is None
    assert set(state.allowed().nonzero().flatten().tolist()) == set(tok.eog_ids)   # only the end is left


def test_tool_call_grammar_without_marker_tokens_spells_them(tiny):
    """A vocabulary without the markers as tokens: the grammar writes them as text, and text that
    spells a special token is handed to llguidance as its bytes (never the special token)."""
    tok = tiny[0].tokenizer
    con = tool_call_constraint([NOW], "required")   # no tokenizer: the markers are text literals
    state = GrammarState(con, tok)
    text = '<|tool_call>call:now{}<tool_call|>'
    for ch in text:   # each character as its plain token, or its byte token where it has none
        cands = [t for t in (tok.piece_to_id(ch), tok.piece_to_id(f"<0x{ord(ch):02X}>")) if t is not None]
        allowed = [t for t in cands if state.allowed()[t]]
        assert allowed, ch
        state.consume(allowed[0])
    assert state.is_accepting() and state.error is None
    assert parse_tool_calls(text).tool_calls[0]["function"]["name"] == "now"


def test_cli_run_json_schema_and_grammar(tiny, tmp_path, capsys):
    from app.cli import main
    model = str(next(tiny[1].glob("tools.gguf")))
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert main(["run", "--model", model, "--prompt", "hi", "--json-schema", str(schema), "--max-tokens", "128",
                 "--temperature", "1", "--seed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    jsonschema.validate(json.loads(out["text"]), PERSON)
    grammar = tmp_path / "yn.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    assert main(["run", "--model", model, "--prompt", "hi", "--grammar", str(grammar), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] in ("yes", "no")


@pytest.mark.parametrize("name, text, msg", [("bad.json", '{"type": "nope"}', "bad.json: invalid json schema"),
                                             ("bad.gbnf", 'root ::= "a" | b', "bad.gbnf: bad GBNF grammar")])
def test_cli_run_refuses_a_bad_file_in_one_line_before_loading(tmp_path, capsys, name, text, msg):
    from app.cli import main
    path = tmp_path / name
    path.write_text(text)
    flag = "--json-schema" if name.endswith(".json") else "--grammar"
    assert main(["run", "--model", str(tmp_path / "absent.gguf"), "--prompt", "hi", flag, str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"edgegem: error: {msg}") and "\n" not in err   # the model was never opened


def test_warm_up_builds_the_tokenizer_once(tiny):
    from engine.constraints import ll_tokenizer, warm_up
    tok = tiny[0].tokenizer
    warm_up(tok).join(timeout=60)
    assert ll_tokenizer(tok) is ll_tokenizer(tok) and ll_tokenizer(tok).vocab_size == tok.vocab_size
