"""The tool loop (engine/tool_loop.py) on a tiny Gemma-4 with the real 31B template, forced to call
tools by tool_choice: each continuation prefills only the result blocks' tokens, results and refusals reach the model's next prompt, the step limit and Escape stop it."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGUFValueType

from engine.client import GenerationParams, LocalClient
from engine.sampler import SamplingParams
from engine.scheduler import EngineConfig
from engine.tool_loop import run_tool_loop
from models.loader import load_model
from models.tool_format import response_block
from tiny_models import TinySpec, write_tiny_gemma4

TEMPLATE = (Path(__file__).parents[1] / "data" / "google-gemma-4-31B-it.jinja").read_text()
SPEC = TinySpec(tool_tokens=True, extra={"tokenizer.chat_template": (TEMPLATE, GGUFValueType.STRING)})
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time",
         "parameters": {"type": "object", "required": ["zone"], "properties": {
             "zone": {"type": "string", "enum": ["utc", "cet"]}}}}}
ASK = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    lm = load_model(write_tiny_gemma4(tmp_path_factory.mktemp("loop") / "tools.gguf", SPEC, seed=41))
    c = LocalClient(lm, EngineConfig(full_tokens=4096, max_running_requests=2))
    yield c
    c.close()


def _params(choice="required", max_tokens=96):
    return GenerationParams(SamplingParams(temperature=0.0, max_tokens=max_tokens), tools=[CLOCK],
                            tool_choice=choice)


def _clock(call):
    zone = call["function"]["arguments"]
    zone = json.loads(zone)["zone"] if isinstance(zone, str) else zone["zone"]
    return json.dumps({"zone": zone, "time": "12:34"}), False


def test_each_step_prefills_only_the_result_blocks(client):
    tok = client.loaded.tokenizer
    out = run_tool_loop(client, ASK, _params(), _clock, max_steps=3)
    assert out.stopped == "step_limit" and len(out.steps) == 3
    first = out.steps[0]
    assert first.prefilled_tokens > 20 and first.outcomes[0].call["function"]["name"] == "clock"
    for before, step in zip(out.steps, out.steps[1:]):
        assert step.prefilled_tokens == len(tok.encode(_blocks(before), add_bos=False))


def _blocks(step):
    return "".join(response_block("clock", o.result) for o in step.outcomes)


def test_results_and_refusals_reach_the_next_prompt(client):
    asked = []
    out = run_tool_loop(client, ASK, _params(), _clock, approve=lambda call: bool(asked.append(call)) or len(asked) > 1,
                        max_steps=3)
    first, second, third = out.steps
    assert [o.denied for s in out.steps for o in s.outcomes] == [True] + [False] * (len(asked) - 1)
    assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
    told = second.prompt_ids[len(first.prompt_ids):]
    assert told == first.token_ids + client.loaded.tokenizer.encode(_blocks(first), add_bos=False)
    assert client.detokenize(told[len(first.token_ids):]).startswith(
        '<|tool_response>response:clock{value:<|"|>the user declined this call; it did not run<|"|>}<tool_response|>')
    assert client.detokenize(third.prompt_ids).endswith(_blocks(second))
    assert '"time": "12:34"' in second.outcomes[0].result


def test_an_answer_ends_the_loop_and_escape_stops_it_between_calls(client):
    calls = []
    out = run_tool_loop(client, ASK, _params(), lambda c: (calls.append(c) or ("ok", False)),
                        should_stop=lambda: len(calls) >= 1, max_steps=5)
    assert out.stopped == "stopped" and len(out.steps) == 1 and len(calls) == 1
    answered = run_tool_loop(client, ASK, _params(choice="none", max_tokens=6), _clock)
    assert answered.stopped is None and not answered.steps[0].outcomes and answered.answer == answered.steps[0].text
    with pytest.raises(ValueError):
        run_tool_loop(client, ASK, replace(_params()), _clock, max_steps=0)
