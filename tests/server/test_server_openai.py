"""The OpenAI API of `edgegem serve` through the real `openai` client, on the demo model (Gemma 3
270M Q4_K_M): chat and completions, plain and streamed, stops, limits, seeds, logprobs, usage with
the prefix cache's cached tokens, tokenize/detokenize, and an error for each bad request."""
from __future__ import annotations

import math

import pytest

openai = pytest.importorskip("openai")

from engine import api  # noqa: E402
from server_helpers import LiveServer  # noqa: E402

MODEL = "gemma-3-270m-q4_k_m"
HELLO = [{"role": "user", "content": "Write a short story about a cat."}]


@pytest.fixture(scope="module")
def lm(gemma3_270m_path):
    return api.open_model(gemma3_270m_path, exact=False)


@pytest.fixture(scope="module")
def server(lm):
    s = LiveServer(lm, api.EngineOptions(max_running_requests=4))
    yield s
    s.close()


@pytest.fixture(scope="module")
def oa(server):
    return server.openai()


def _chat(oa, **kw):
    return oa.chat.completions.create(model=MODEL, **{"messages": HELLO, "max_tokens": 10, "temperature": 0, **kw})


def test_chat_streamed_equals_plain_and_the_engine_run(oa, server, lm):
    plain = _chat(oa)
    stream = _chat(oa, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10  # include_usage: last chunk
    assert chunks[0].choices[0].delta.role == "assistant"
    # the same greedy answer `edgegem run` gives (engine.api.run_prompt on the same client)
    ran = api.run_prompt(server.client, lm, HELLO[0]["content"], api.GenerationParams(api.SamplingParams(max_tokens=10)))
    assert ran["text"] == text
    assert plain.usage.prompt_tokens == len(ran["prompt_ids"])


def test_completions_text_or_token_ids_and_echo(oa, lm):
    prompt = "Once upon a time"
    r = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    ids = lm.tokenizer.encode(prompt, add_bos=True)
    r_ids = oa.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == r_ids.choices[0].text and r.usage.prompt_tokens == len(ids)
    echo = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + r.choices[0].text
    streamed = "".join(c.choices[0].text for c in oa.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_completions_default_to_16_tokens_as_openai(oa):
    r = oa.completions.create(model=MODEL, prompt="The weather today is", temperature=0)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completions_on_a_base_model_take_its_defaults_unless_the_request_sets_them(oa, server, monkeypatch):
    """The demo is a base model: /v1/completions takes the engine's base-model defaults (DRY on, a
    blank-line stop) where the request sets none; OpenAI's own defaults and the fields set stay."""
    seen, submit_ids = [], server.client.submit_ids
    monkeypatch.setattr(server.client, "submit_ids", lambda ids, params, *a, **k: (seen.append(params),
                                                                                   submit_ids(ids, params, *a, **k))[1])
    oa.completions.create(model=MODEL, prompt="The lighthouse", max_tokens=4)
    oa.completions.create(model=MODEL, prompt="The lighthouse", max_tokens=4, temperature=0,
                          extra_body={"dry_multiplier": 0, "dry_sequence_breakers": ["\n"], "stop_at_blank_line": False})
    base, mine = seen
    s = base.sampling
    assert base.stop_at_blank_line and (s.dry_multiplier, s.dry_penalty_last_n) == (0.8, -1)
    assert s.dry_sequence_breakers == (":", "\"", "*") and (s.temperature, s.top_p, s.max_tokens) == (1.0, 1.0, 4)
    assert not mine.stop_at_blank_line and mine.sampling.temperature == 0  # set by the request: as given
    assert (mine.sampling.dry_multiplier, mine.sampling.dry_sequence_breakers) == (0.0, ("\n",))
    assert mine.sampling.dry_penalty_last_n == -1  # the base default the request left alone


def test_stop_strings_end_the_answer_before_them_and_are_never_streamed(oa):
    full = _chat(oa, max_tokens=24).choices[0].message.content
    words = full.split()
    stop = words[len(words) // 2]
    cut = full[:full.index(stop)]
    r = _chat(oa, max_tokens=24, stop=[stop, "zzzz-never"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in _chat(oa, max_tokens=24, stop=stop, stream=True)
                       if c.choices)
    assert streamed == cut and stop not in streamed


def test_max_tokens_and_max_completion_tokens(oa):
    assert _chat(oa, max_tokens=3).usage.completion_tokens == 3
    r = _chat(oa, max_tokens=50, max_completion_tokens=5)  # the newer name wins
    assert r.usage.completion_tokens == 5


def test_seed_makes_sampling_repeatable(oa):
    """Bit for bit with `cache_prompt: false` (llama.cpp's field), and whenever the prefix cache
    serves the prompt the same way; a first run and a cached rerun may part where llama.cpp's Q8
    activations round an attention summed over two slot runs apart from one (engine/client.py)."""
    fresh = dict(temperature=1.0, seed=11, max_tokens=12, extra_body={"cache_prompt": False})
    a = _chat(oa, **fresh).choices[0].message.content
    assert _chat(oa, **fresh).choices[0].message.content == a
    cached = [_chat(oa, temperature=1.0, seed=11, max_tokens=12).choices[0].message.content for _ in range(3)]
    assert cached[1] == cached[2]
    others = {_chat(oa, temperature=1.0, seed=s, max_tokens=12).choices[0].message.content for s in (12, 13, 14)}
    assert others - {a}  # other seeds write something else
    assert _chat(oa, temperature=0, seed=1).choices[0].message.content == _chat(oa, temperature=0, seed=2) \
        .choices[0].message.content  # greedy: the seed changes nothing


def test_logprobs_are_the_models_log_softmax_and_top_ones_rank(gemma3_270m_path):
    """On the float32 model, so runs differ by float32 rounding only (where KV sits in the pool
    changes how the attention rounds; llama.cpp's Q8 activations turn that into up to 0.04 nats
    on this prompt, which would hide a wrong normalizer)."""
    lm = api.open_model(gemma3_270m_path, exact=True)
    server = LiveServer(lm, api.EngineOptions(max_running_requests=4))
    try:
        _logprobs_checks(server.openai(), server, lm)
    finally:
        server.close()


# float32 logits of magnitude ~30 summed in another order (the engine's pooled attention against
# the dense cache, other SIMD widths on AVX2 and AVX-512): ~1e-6 relative, so a few 1e-5 nats on a
# log-probability; 1.1e-4 measured on an AVX2-only EPYC. A wrong normalizer is off by far more.
LOGPROB_TOL = 5e-4


def _logprobs_checks(oa, server, lm):
    import torch
    from models.kv_cache import DenseKVCache

    r = _chat(oa, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    ran = api.run_prompt(server.client, lm, HELLO[0]["content"], api.GenerationParams(api.SamplingParams(max_tokens=6)))
    ids, out = ran["prompt_ids"], ran["ids"]
    # the model's own log-softmax, step by step as the engine runs it: the prompt less its last
    # token in one forward, then one row a step
    cache, rows = DenseKVCache(), []
    lm.model.forward(torch.tensor(ids[:-1]), cache=cache)
    for i, t in enumerate([ids[-1]] + out[:-1]):
        rows.append(lm.model.forward(torch.tensor([t]), pos=torch.tensor([len(ids) - 1 + i]), cache=cache)[-1])
    lsm = torch.log_softmax(torch.stack(rows).double(), -1)
    for k, c in enumerate(content):
        assert c.top_logprobs[0].token == c.token  # greedy picks the most likely
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert math.isclose(c.logprob, float(lsm[k, out[k]]), abs_tol=LOGPROB_TOL)
        assert bytes(c.bytes) == lm.tokenizer.token_bytes(out[k])
    streamed = [lp for ch in _chat(oa, max_tokens=6, logprobs=True, top_logprobs=3, stream=True)
                if ch.choices and ch.choices[0].logprobs for lp in ch.choices[0].logprobs.content]
    # the same tokens and log-probabilities (float32 rounding apart: KV in other slot runs)
    assert [s.token for s in streamed] == [c.token for c in content]
    assert all(math.isclose(s.logprob, c.logprob, abs_tol=LOGPROB_TOL) for s, c in zip(streamed, content))
    # the demo is a base model: its completions stop at a blank line unless the request says not to
    comp = oa.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                 extra_body={"stop_at_blank_line": False})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 == len(lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text and lp.text_offset[0] == 0


def test_dry_and_xtc_by_llama_servers_names_reach_the_sampler(oa, server, monkeypatch):
    """DRY and XTC by llama-server's names (extra_body, as llama-server takes them) arrive in the
    engine's SamplingParams as given, and DRY changes the demo's greedy answer (it loops without).
    (Not compared token for token with a `run_prompt` of the same params: on llama.cpp's kernels
    two fresh prefills whose KV sits in other slot runs can round a near tie apart.)"""
    dry = {"dry_multiplier": 1.5, "dry_base": 2.0, "dry_allowed_length": 1, "dry_penalty_last_n": -1,
           "dry_sequence_breakers": ["\n"]}
    seen = []
    submit = server.client.submit
    monkeypatch.setattr(server.client, "submit", lambda msgs, params, *a, **k: (seen.append(params.sampling),
                                                                                 submit(msgs, params, *a, **k))[1])
    with_dry = _chat(oa, max_tokens=40, extra_body={**dry, "cache_prompt": False}).choices[0].message.content
    without = _chat(oa, max_tokens=40, extra_body={"cache_prompt": False}).choices[0].message.content
    s = seen[0]
    assert (s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_penalty_last_n) == (1.5, 2.0, 1, -1)
    assert tuple(s.dry_sequence_breakers) == ("\n",) and seen[1].dry_multiplier == 0.0
    assert with_dry != without
    # XTC at probability 1, seeded (the seeded repeat itself: tests/engine/test_sampler_dry_xtc.py)
    body = {"xtc_probability": 1.0, "xtc_threshold": 0.05, "cache_prompt": False}
    assert _chat(oa, max_tokens=12, temperature=1.0, seed=5, extra_body=body).choices[0].message.content
    assert (seen[-1].xtc_probability, seen[-1].xtc_threshold, seen[-1].seed) == (1.0, 0.05, 5)


def test_second_turn_reports_the_prefix_cache_in_cached_tokens(oa):
    turn1 = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    r1 = _chat(oa, messages=turn1, max_tokens=8)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And two more?"}]
    r2 = _chat(oa, messages=turn2, max_tokens=4)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens


def test_models_health_tokenize_detokenize(server, oa, lm):
    (m,) = oa.models.list().data
    assert m.id == MODEL and oa.models.retrieve(MODEL).id == MODEL
    h = server.http()
    assert h.get("/health").json() == {"status": "ok"}
    t = h.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [x["id"] for x in t] == lm.tokenizer.encode("Hello world", add_bos=False)
    assert "".join(x["piece"] for x in t) == "Hello world"
    ids = h.post("/tokenize", json={"content": "Hello world", "add_special": True}).json()["tokens"]
    assert ids[0] == lm.tokenizer.bos_id
    assert h.post("/detokenize", json={"tokens": ids[1:]}).json() == {"content": "Hello world"}


BAD = {  # body (on /v1/chat/completions unless a path is given) -> status, words in the message
    "n=2": ({"n": 2}, 400, "n must be 1"),
    "unknown model": ({"model": "llama-70b"}, 404, "not found"),
    "temperature out of range": ({"temperature": 7}, 400, "temperature"),
    "no messages": ({"messages": []}, 400, "messages"),
    "bad role": ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    "stop not strings": ({"stop": [1, 2]}, 400, "stop"),
    "empty stop": ({"stop": [""]}, 400, "stop"),
    # Gemma 3's chat format has no tool syntax (as Ollama refuses tools for such a model)
    "tools": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400,
              "no tool-call syntax"),
    "tool message": ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, 400,
                     "no tool-call syntax"),
    "response_format": ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
                        400, "Invalid type: nope"),
    "remote image": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, 400, "only data: URLs"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, 400, "needs logprobs"),
    "logit_bias": ({"logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    "max_tokens negative": ({"max_tokens": -1}, 400, "max_tokens"),
    "dry_base below 1": ({"dry_base": 0.5}, 400, "dry_base"),
    "no dry_sequence_breakers": ({"dry_sequence_breakers": []}, 400, "dry_sequence_breakers"),
    "dry_sequence_breakers not strings": ({"dry_sequence_breakers": [1]}, 400, "dry_sequence_breakers"),
    "xtc_probability above 1": ({"xtc_probability": 2}, 400, "xtc_probability"),
    "prompt too long": ({"messages": [{"role": "user", "content": "word " * 40000}]}, 400, "context"),
    "several prompts": ({"prompt": ["a", "b"], "_path": "/v1/completions"}, 400, "one prompt"),
    "echo with logprobs": ({"prompt": "a", "echo": True, "logprobs": 1, "_path": "/v1/completions"}, 400, "echo"),
    "token out of range": ({"prompt": [2, 10 ** 9], "_path": "/v1/completions"}, 400, "out of range"),
    "detokenize out of range": ({"tokens": [10 ** 9], "_path": "/detokenize"}, 400, "out of range"),
    "other model card": ({"_path": "/v1/models/llama-70b", "_get": True}, 404, "not found"),
    "unknown route": ({"_path": "/v1/embeddings"}, 404, "no route"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_request_is_an_openai_error_object_with_its_status(server, case):
    body, status, words = BAD[case]
    body = dict(body)
    path = body.pop("_path", "/v1/chat/completions")
    get = body.pop("_get", False)
    if path == "/v1/chat/completions":
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, **body}
    h = server.http()
    r = h.get(path) if get else h.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"] and "\n" not in err["message"]


def test_a_message_without_content_is_a_400_naming_it(server):
    """As OpenAI refuses it: only an assistant message with tool_calls may leave content out (that
    one is served in tests/server/test_server_tools.py)."""
    h = server.http()
    for i, messages in ((0, [{"role": "user"}]), (0, [{"role": "user", "content": None}]),
                        (1, HELLO + [{"role": "assistant"}] + HELLO), (0, [{"role": "system"}] + HELLO)):
        r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == f"messages.{i}.content" and err["code"] == "missing_required_parameter", err
        assert err["type"] == "invalid_request_error" and "required" in err["message"]


def test_the_openai_client_raises_its_own_error_types(oa):
    with pytest.raises(openai.BadRequestError):
        _chat(oa, n=3)
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="nope", messages=HELLO)


def test_while_the_model_loads_every_model_route_is_503(server):
    from server_helpers import with_config
    loading = with_config(server)
    loading.state.set_client(None)
    try:
        h = loading.http()
        for method, path in (("get", "/health"), ("get", "/v1/models"), ("post", "/v1/chat/completions")):
            r = getattr(h, method)(path, **({"json": {"messages": HELLO}} if method == "post" else {}))
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert h.get("/").status_code == 200  # the probe still answers
    finally:
        loading.bg.stop()
