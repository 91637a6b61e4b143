"""The Ollama API of `edgegem serve` through the real `ollama` client: chat and generate (NDJSON
streams and `"stream": false`), options, raw prompts and `context`, tags/show/ps/version and the
`/` probe, errors in Ollama's shape; the demo model and a tiny Gemma-4 (thinking capability)."""
from __future__ import annotations

import json

import pytest

ollama = pytest.importorskip("ollama")

from engine import api, failpoints  # noqa: E402
from server_helpers import LiveServer  # noqa: E402
from tiny_models import TinySpec, write_tiny_gemma4  # noqa: E402

MODEL = "gemma-3-270m-q4_k_m"
GREEDY = {"temperature": 0, "num_predict": 10}
ASK = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server(gemma3_270m_path):
    s = LiveServer(api.open_model(gemma3_270m_path, exact=False))
    yield s
    s.close()


@pytest.fixture(scope="module")
def ol(server):
    return server.ollama()


def test_chat_streamed_equals_not_streamed_and_the_openai_api(ol, server):
    whole = ol.chat(model=MODEL, messages=ASK, options=GREEDY, stream=False)
    parts = list(ol.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content and whole.message.content
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert whole.done_reason == "length" and whole.eval_count == 10 and whole.prompt_eval_count > 5
    assert whole.total_duration > 0 and whole.eval_duration > 0
    oa = server.openai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0)
    assert oa.choices[0].message.content == whole.message.content  # one engine, one answer


def test_options_stop_seed_and_model_name_stems(ol):
    base = ol.chat(model=MODEL, messages=ASK, options={**GREEDY, "num_predict": 20}, stream=False).message.content
    stop = base.split()[len(base.split()) // 2]
    cut = ol.chat(model="gemma-3-270m", messages=ASK, options={**GREEDY, "num_predict": 20, "stop": [stop]},
                  stream=False)  # a stem of our name works, as does ":latest"
    assert cut.message.content == base[:base.index(stop)] and cut.done_reason == "stop"
    seeded = [ol.chat(model=f"{MODEL}:latest", messages=ASK, options={"seed": 5, "num_predict": 8}).message.content
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_generate_continued_raw_and_context_continuation(ol, server):
    g = ol.generate(model=MODEL, prompt="Tell me about the sea.", options=GREEDY)
    # the demo is a base model: its prompt is continued as text, no chat turns around it (the chat
    # template on a chat model: test_generate_on_a_chat_model_goes_through_the_chat_template)
    prompt = server.client.tokenize("Tell me about the sea.", add_special=True)
    assert list(g.context[:len(prompt)]) == prompt and g.prompt_eval_count == len(prompt)
    streamed = "".join(p.response for p in ol.generate(model=MODEL, prompt="Tell me about the sea.",
                                                        options=GREEDY, stream=True))
    assert streamed == g.response
    raw = ol.generate(model=MODEL, prompt="The sea is", raw=True, options=GREEDY)
    comp = server.openai().completions.create(model=MODEL, prompt="The sea is", max_tokens=10, temperature=0)
    assert raw.response == comp.choices[0].text
    # `context`: the previous prompt + answer ids; the next prompt continues from them
    nxt = ol.generate(model=MODEL, prompt="And the sky?", context=g.context, options=GREEDY)
    assert len(nxt.context) > len(g.context) and nxt.context[:len(g.context)] == list(g.context)
    assert nxt.prompt_eval_count > len(g.context)
    loaded = ol.generate(model=MODEL, prompt="")  # an empty prompt only "loads" the model
    assert loaded.done and loaded.response == ""


def test_tags_show_ps_version_and_the_root_probe(ol, server):
    (m,) = ol.list().models
    assert m.model == MODEL and m.details.family == "gemma3" and m.details.quantization_level == "Q4_K_M"
    shown = ol.show(MODEL)
    assert shown.capabilities == ["completion"] and shown.modelinfo["general.architecture"] == "gemma3"
    (p,) = ol.ps().models
    assert p.model == MODEL and p.context_length == server.client.status()["context_limit"]
    h = server.http()
    assert h.get("/api/version").json()["version"]
    assert h.get("/").text == "Ollama is running" and h.head("/").status_code == 200


def test_unknown_model_and_bad_requests_are_errors_in_ollamas_shape(ol, server):
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="llama3:8b", messages=ASK)
    assert e.value.status_code == 404 and "not found" in e.value.error
    h = server.http()
    for body, path, words in (({"model": MODEL, "messages": ASK, "format": {"type": "nope"}}, "/api/chat",
                               "format: invalid json schema"),
                              ({"model": MODEL, "messages": ASK, "tools": [{"type": "function"}]}, "/api/chat",
                               "no tool-call syntax"),
                              ({"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["%%"]}]},
                               "/api/chat", "base64"),
                              ({"model": MODEL, "messages": ASK, "options": {"temperature": "hot"}}, "/api/chat",
                               "temperature"),
                              ({"model": MODEL, "prompt": "x", "template": "{{ .Prompt }}"}, "/api/generate",
                               "template"),
                              ({"model": MODEL, "prompt": "x", "context": [-4]}, "/api/generate", "context"),
                              ({"model": "nope"}, "/api/show", "not found")):
        r = h.post(path, json={"stream": False, **body})
        assert r.status_code in (400, 404) and set(r.json()) == {"error"} and words in r.json()["error"], r.text


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    path = write_tiny_gemma4(tmp_path_factory.mktemp("ol4") / "tiny-gemma4.gguf", TinySpec(), seed=3)
    s = LiveServer(api.open_model(path, exact=False), api.EngineOptions(max_running_requests=2))
    yield s
    s.close()


def test_generate_on_a_chat_model_goes_through_the_chat_template(tiny_server):
    ol = tiny_server.ollama()
    greedy = {"temperature": 0, "num_predict": 6}
    g = ol.generate(model="tiny-gemma4", prompt="Tell me about the sea.", options=greedy)
    chat = ol.chat(model="tiny-gemma4", messages=ASK, options=greedy)
    assert g.response == chat.message.content and g.prompt_eval_count == chat.prompt_eval_count


def _spy_submits(monkeypatch, client, name):
    """The GenerationParams of each `client.<name>` call (submit or submit_ids), in order."""
    seen, real = [], getattr(client, name)
    monkeypatch.setattr(client, name, lambda first, params, *a, **k: (seen.append(params), real(first, params, *a,
                                                                                                   **k))[1])
    return seen


def test_generate_on_a_base_model_takes_its_defaults_unless_the_options_set_them(server, tiny_server, monkeypatch):
    h = server.http()
    seen = _spy_submits(monkeypatch, server.client, "submit")
    body = {"model": MODEL, "prompt": "The lighthouse", "stream": False}
    h.post("/api/generate", json={**body, "options": {"num_predict": 4}}).raise_for_status()
    h.post("/api/generate", json={**body, "options": {"num_predict": 4, "dry_multiplier": 0, "temperature": 0,
                                                      "stop_at_blank_line": False}}).raise_for_status()
    base, mine = seen
    assert base.continue_text and base.stop_at_blank_line and not base.thinking
    s = base.sampling
    assert (s.dry_multiplier, s.dry_penalty_last_n, s.dry_sequence_breakers) == (0.8, -1, (":", "\"", "*"))
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.max_tokens) == (0.8, 40, 0.9, 1.1, 4)  # Ollama's
    assert mine.continue_text and not mine.stop_at_blank_line  # what the options set wins
    assert (mine.sampling.dry_multiplier, mine.sampling.temperature, mine.sampling.dry_penalty_last_n) == (0, 0, -1)
    chat_model = _spy_submits(monkeypatch, tiny_server.client, "submit")
    tiny_server.http().post("/api/generate", json={"model": "tiny-gemma4", "prompt": "x", "stream": False,
                                                   "options": {"num_predict": 2}}).raise_for_status()
    (p,) = chat_model
    assert not p.continue_text and not p.stop_at_blank_line and p.sampling.dry_multiplier == 0.0


def test_a_gemma4_model_shows_thinking_and_think_reaches_the_template(tiny_server):
    ol = tiny_server.ollama()
    assert ol.show("tiny-gemma4").capabilities == ["completion", "tools", "thinking"]
    seen = []
    real = tiny_server.client.submit

    def spy(messages, params, **kw):
        seen.append(tiny_server.client.chat_prompt_ids(messages, params.thinking))
        return real(messages, params, **kw)
    tiny_server.client.submit = spy
    try:
        ol.chat(model="tiny-gemma4", messages=ASK, think=True, options={"num_predict": 2})
        ol.chat(model="tiny-gemma4", messages=ASK, options={"num_predict": 2})
    finally:
        del tiny_server.client.submit
    think_id = tiny_server.client.tokenize("<|think|>")[0]
    assert think_id in seen[0] and think_id not in seen[1]


@pytest.mark.parametrize("path, body", [("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "hi"})])
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_without_a_model_is_ollamas_400(tiny_server, path, body, stream):
    """Ollama's words and shape; before, it was answered with no token limit (num_predict's
    default), so a plain request waited until the context was full."""
    for model in ({}, {"model": ""}):
        r = tiny_server.http().post(path, json={**body, **model, "stream": stream})
        assert r.status_code == 400 and r.json() == {"error": "model is required"}, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_the_load_probe_is_answered_done_with_reason_load(tiny_server, stream):
    """What clients send to preload a model: chat with no messages, generate with no prompt."""
    h = tiny_server.http()
    r = h.post("/api/chat", json={"model": "tiny-gemma4", "messages": [], "stream": stream})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got.pop("created_at").endswith("Z")
    assert got == {"model": "tiny-gemma4", "message": {"role": "assistant", "content": ""}, "done": True,
                   "done_reason": "load"}
    for body in ({}, {"prompt": ""}):
        r = h.post("/api/generate", json={"model": "tiny-gemma4", "stream": stream, **body})
        assert r.status_code == 200 and r.json()["done_reason"] == "load" and r.json()["done"] is True, r.text
    done = tiny_server.ollama().chat(model="tiny-gemma4", messages=[])
    assert done.done and done.done_reason == "load" and done.message.content == ""


# step.error@2: the first step raises before it admits the request (a waiting one stays queued)
@pytest.mark.parametrize("spec, status", [("forward.oom@1", 503), ("step.error@2", 500)], ids=["oom", "internal"])
def test_an_engine_failure_is_the_status_of_its_kind(tiny_server, spec, status):
    """Out of memory (it may pass: try again) is a 503, a failed step a 500, streamed or not; the
    request's own faults are 400s (tests/server/test_server_audio.py, tests/server/test_server_images.py)."""
    h = tiny_server.http()
    try:
        for path, body in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "hi"})):
            failpoints.configure(spec)
            r = h.post(path, json={"model": "tiny-gemma4", "stream": False, "options": {"num_predict": 3}, **body})
            assert r.status_code == status and set(r.json()) == {"error"}, r.text
            failpoints.configure(spec)
            r = h.post(path, json={"model": "tiny-gemma4", "options": {"num_predict": 3}, **body})
            assert r.status_code == 200 and set(json.loads(r.text.splitlines()[-1])) == {"error"}, r.text
    finally:
        failpoints.configure(None)
    tiny_server.engine(lambda e: e.check())
