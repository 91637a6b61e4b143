"""A local server is reachable by every web page the user opens: remote binds need a key, keys are
checked, foreign Host headers (DNS rebinding) and foreign origins are refused, a cross-site
`text/plain` POST never generates, bodies are capped, nothing names a file; and a hypothesis fuzz
of the JSON handlers (>= 2,000 cases, tools / tool_choice / tool messages / response_format /
format / input_audio shapes among them) gets only 4xx error objects, never a 5xx, and the server
keeps answering. Tiny Gemma-4 on the CPU (no audio tower: hostile clip bytes are fuzzed on the
audio model in tests/server/test_server_audio.py); only 127.0.0.1 is contacted."""
from __future__ import annotations

import base64
import json

import pytest

pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from app.server.config import ServerConfig, ServerConfigError  # noqa: E402
from engine import api  # noqa: E402
from server_helpers import LiveServer, with_config  # noqa: E402
from tiny_models import TinySpec, write_tiny_gemma4  # noqa: E402

MODEL = "tiny-gemma4"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_gemma4(tmp_path_factory.mktemp("sec") / "tiny-gemma4.gguf", TinySpec(), seed=5)
    s = LiveServer(api.open_model(path, exact=False), api.EngineOptions(max_running_requests=2),
                   default_max_tokens=2)
    yield s
    s.close()


@pytest.fixture
def submits(server, monkeypatch):
    """Every prompt that reached the engine during a test."""
    seen = []
    real = type(server.client).submit

    def spy(self, messages, params, **kw):
        seen.append(messages)
        return real(self, messages, params, **kw)
    monkeypatch.setattr(type(server.client), "submit", spy)
    return seen


def test_a_non_loopback_bind_needs_a_key_and_a_wildcard_origin_never_goes_with_one():
    for host in ("0.0.0.0", "192.168.1.5", "::"):
        with pytest.raises(ServerConfigError, match="--api-key"):
            ServerConfig(host=host).check()
        ServerConfig(host=host, api_key="k").check()
        ServerConfig(host=host, insecure_no_key=True).check()
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        ServerConfig(host=host).check()
    with pytest.raises(ServerConfigError, match="any web page"):
        ServerConfig(api_key="k", cors_origins=["*"]).check()


def test_missing_or_wrong_key_is_401_and_the_right_one_works(server):
    keyed = with_config(server, api_key="s3cret-key")
    try:
        import openai
        with pytest.raises(openai.AuthenticationError):
            keyed.openai("wrong").chat.completions.create(**CHAT)
        h = keyed.http()
        for headers in ({}, {"authorization": "Bearer s3cret-ke"}, {"authorization": "Basic s3cret-key"},
                        {"authorization": "Bearer s3cret-key-and-more"}):
            r = h.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and "API key" in r.text
        r = h.post("/api/chat", json={**CHAT, "stream": False})
        assert r.status_code == 401 and set(r.json()) == {"error"}  # Ollama's shape on /api
        ok = keyed.openai("s3cret-key").chat.completions.create(**CHAT)
        assert ok.choices[0].finish_reason in ("stop", "length")
        import ollama
        assert ollama.Client(host=keyed.url, headers={"authorization": "Bearer s3cret-key"}).list().models
        assert h.get("/health").status_code == 200 and h.get("/").status_code == 200  # probes stay open
    finally:
        keyed.bg.stop()


def test_a_foreign_host_header_is_refused_ip_literals_and_loopback_names_are_not(server):
    h = server.http()
    for host in ("evil.example", "evil.example:8080", "attacker.localhost.evil.com"):
        r = h.get("/v1/models", headers={"host": host})
        assert r.status_code == 403 and "DNS rebinding" in r.json()["error"]["message"]
    for host in ("127.0.0.1:1234", "localhost:8080", "[::1]:80", "10.1.2.3", "app.localhost"):
        assert h.get("/v1/models", headers={"host": host}).status_code == 200
    named = with_config(server, allowed_hosts=["edgegem.lan"])
    try:
        assert named.http().get("/v1/models", headers={"host": "edgegem.lan:8080"}).status_code == 200
    finally:
        named.bg.stop()


def test_cors_is_granted_to_loopback_origins_and_never_to_a_foreign_one(server, submits):
    h = server.http()
    evil = {"origin": "https://evil.example"}
    r = h.post("/v1/chat/completions", json=CHAT, headers=evil)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    pre = h.options("/v1/chat/completions", headers={**evil, "access-control-request-method": "POST",
                                                      "access-control-request-headers": "content-type"})
    assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    assert not submits
    for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "http://[::1]:5173", "vscode-webview://abc"):
        pre = h.options("/v1/chat/completions", headers={"origin": origin, "access-control-request-method": "POST",
                                                          "access-control-request-headers": "content-type, authorization"})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == origin
        assert "authorization" in pre.headers["access-control-allow-headers"]
        r = h.get("/v1/models", headers={"origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert h.get("/v1/models", headers={"origin": "null"}).status_code == 403  # sandboxed frames, file:// pages
    opened = with_config(server, cors_origins=["https://chat.example"])
    try:
        r = opened.http().get("/v1/models", headers={"origin": "https://chat.example"})
        assert r.headers["access-control-allow-origin"] == "https://chat.example"
    finally:
        opened.bg.stop()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_json_is_refused_before_anything_generates(server, submits, content_type):
    # A page can POST these cross-site without a preflight; with no Origin (a page that strips it,
    # or an older browser) the content type still stops it.
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/v1/chat/completions", "/api/chat", "/api/generate", "/v1/completions"):
        r = server.http().post(path, content=json.dumps(CHAT).encode(), headers=headers)
        assert r.status_code == 415 and "JSON" in r.text
    assert not submits


def test_an_oversize_body_is_413_with_or_without_a_content_length(server, submits):
    small = with_config(server, max_body=4096)
    try:
        h = small.http()
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = h.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and "--max-body" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the body arrives chunked
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]
        r = h.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert not submits
        assert h.post("/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        small.bg.stop()


def test_nothing_in_a_request_reads_a_file_on_the_server(server, tmp_path, submits):
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"\x89PNG not really")
    h = server.http()
    for url in (f"file://{secret}", str(secret), "http://127.0.0.1/x.png"):
        body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "only data: URLs" in r.text
    r = h.post("/api/chat", json={"model": MODEL, "stream": False,
                                  "messages": [{"role": "user", "content": "x", "images": [str(secret)]}]})
    assert r.status_code == 400
    r = h.post("/api/generate", json={"model": str(secret), "prompt": "x", "stream": False})
    assert r.status_code == 404  # a model name is a name, never a path
    assert not submits


# --- the fuzz -------------------------------------------------------------------------------------

ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/api/chat",
             "/api/generate", "/api/show"]
FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logprobs", "top_logprobs", "n", "echo", "reasoning_effort", "chat_template_kwargs",
          "tools", "tool_choice", "response_format", "options", "format", "images", "think", "raw", "context",
          "content", "tokens", "add_special", "with_pieces", "role", "system", "keep_alive", "suffix", "name"]
scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True)
           | st.text(max_size=40) | st.sampled_from([MODEL, "user", "assistant", "tool", "text", "image_url",
                                                     "json", "data:image/png;base64,AAAA", "", "<|image|>", "-1"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(FIELDS + ["type", "text", "url", "image_url", "num_predict",
                                                                  "include_usage", "role", "content"]),
                                        inner, max_size=5), max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"])},
                                optional={"content": values, "images": values})
bodies = (values
          | st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)
          | st.builds(lambda extra, msgs: {"model": MODEL, "messages": msgs, "max_tokens": 2, **extra},
                      st.dictionaries(st.sampled_from(FIELDS), values, max_size=3), st.lists(message, max_size=3)))
# tools, tool_choice, tool messages, response_format / format and input_audio in their API shapes,
# well-formed and not (the engine's checks must turn every bad one into a 400, never a 500)
schemas = st.recursive(
    st.sampled_from([{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0, "maximum": 3},
                     {"type": "boolean"}, {"enum": ["a", 1, None]}, {"type": "nope"}, {}, {"type": "null"},
                     {"$ref": "#/$defs/missing"}, {"type": "string", "format": "uuidx"}, {"type": ["string", "null"]}])
    | values,
    lambda inner: st.builds(lambda props, req, extra: {"type": "object", "properties": props, "required": req, **extra},
                            st.dictionaries(st.sampled_from(["a", "b", "c d", ""]), inner, max_size=3),
                            st.lists(st.sampled_from(["a", "b", "z"]), max_size=2),
                            st.dictionaries(st.sampled_from(["additionalProperties", "description"]), inner,
                                            max_size=1))
    | st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, inner, st.integers(-1, 3)),
    max_leaves=6)
tool = st.builds(lambda kind, name, params, desc: {"type": kind, "function": {"name": name, "parameters": params,
                                                                              "description": desc}},
                 st.sampled_from(["function", "function", "retrieval"]),
                 st.sampled_from(["f", "g", "", "a b"]) | values,
                 schemas, st.text(max_size=8))
tools = st.lists(tool, max_size=3) | values
tool_choice = (st.sampled_from(["auto", "none", "required", "sometimes"])
               | st.builds(lambda n: {"type": "function", "function": {"name": n}}, st.sampled_from(["f", "g", "h"]))
               | values)
response_format = (st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
                                    {"type": "xml"}])
                   | st.builds(lambda sc, strict: {"type": "json_schema", "json_schema": {"name": "x", "schema": sc,
                                                                                          "strict": strict}},
                               schemas, st.booleans() | values)
                   | values)
WAV = base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode()  # a header and nothing after
audio_part = st.builds(lambda d, f: {"type": "input_audio", "input_audio": {"data": d, "format": f}},
                       st.sampled_from([WAV, "!!!", "", "AAAA", "data:audio/wav;base64,AAAA"]) | values,
                       st.sampled_from(["wav", "mp3", "aac", None]) | values)
call = st.builds(lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
                 st.sampled_from(["c1", "c2"]), st.sampled_from(["f", "g", ""]),
                 st.sampled_from(['{"x": 1}', "{oops", "", "[]"]) | values)
tool_messages = st.lists(
    st.sampled_from([{"role": "user", "content": "hi"}]) | st.builds(
        lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls}, st.none() | st.text(max_size=5),
        st.lists(call, max_size=2) | values)
    | st.builds(lambda i, c: {"role": "tool", "tool_call_id": i, "content": c}, st.sampled_from(["c1", "c3"]) | values,
                st.sampled_from(['{"temp": 21}', "12:00", ""]) | values)
    | st.builds(lambda parts: {"role": "user", "content": parts},
                st.lists(audio_part | st.just({"type": "text", "text": "x"}), min_size=1, max_size=2)),
    min_size=1, max_size=4)
structured = (
    st.builds(lambda m, t, c, rf: {"model": MODEL, "messages": m, "max_tokens": 2, "tools": t, "tool_choice": c,
                                   "response_format": rf}, tool_messages, tools, tool_choice, response_format)
    | st.builds(lambda m, t, f: {"model": MODEL, "messages": m, "tools": t, "format": f, "stream": False,
                                 "options": {"num_predict": 2}}, tool_messages, tools, schemas | st.just("json")))
# and well-formed ones, so that many reach the engine (constrained decoding, tool rendering, calls)
leaf = st.sampled_from([{"type": "string", "maxLength": 2}, {"type": "integer", "minimum": 0, "maximum": 9},
                        {"type": "boolean"}, {"enum": ["a", "b"]}, {"type": "number"}, {"type": ["string", "null"]}])
good_schema = st.builds(lambda props, req: {"type": "object", "properties": props, "required": req},
                        st.dictionaries(st.sampled_from(["a", "b"]), leaf, max_size=2),
                        st.lists(st.sampled_from(["a", "b"]), max_size=2, unique=True))
good_tool = st.builds(lambda n, p: {"type": "function", "function": {"name": n, "parameters": p}},
                      st.sampled_from(["f", "g"]), good_schema)
good_format = st.none() | st.just("json") | good_schema  # Ollama's `format`; OpenAI ignores the key
well_formed = st.builds(
    lambda m, t, c, rf, fmt: {"model": MODEL, "messages": m, "max_tokens": 2, "tools": t, "tool_choice": c,
                              "response_format": rf, "format": fmt, "options": {"num_predict": 2}, "stream": False},
    st.just([{"role": "user", "content": "hi"}]) | tool_messages,
    st.lists(good_tool, min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"]),
    st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
    st.none() | st.builds(lambda sc: {"type": "json_schema", "json_schema": {"name": "x", "schema": sc}}, good_schema),
    good_format)
bodies = bodies | structured | well_formed
raw_bodies = st.binary(max_size=64) | st.sampled_from([b"{", b"[]", b"null", b'{"messages": [}', b"\xff\xfe"])
FUZZ_CASES = 2000
TOOL_FUZZ_CASES = 600  # 23-36 of 400 reached the engine with a schema, as the strategies' draws moved


def _fuzz(server, monkeypatch, endpoints, strategy, n) -> tuple[dict, dict]:
    """Post n drawn bodies to the endpoints: each a 4xx error object or a success, never a 5xx; then
    a plain request works and no KV slot leaked. Returns (statuses, how many requests reached the
    engine with tools / with a schema)."""
    from fastapi.testclient import TestClient

    from app.server import create_app

    statuses: dict[int, int] = {}
    reached = {"tools": 0, "constraint": 0}
    real = type(server.client).submit

    def spy(self, messages, params, **kw):
        rid = real(self, messages, params, **kw)
        reached["tools"] += bool(params.tools)
        reached["constraint"] += params.constraint is not None
        return rid
    monkeypatch.setattr(type(server.client), "submit", spy)
    client = TestClient(create_app(server.state), base_url="http://127.0.0.1:8080", raise_server_exceptions=False)

    @settings(max_examples=n, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(endpoints), body=strategy)
    def one(path, body):
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            msg = err if path.startswith("/api/") else err["message"]
            assert isinstance(msg, str) and msg and "Traceback" not in msg and "\n" not in msg
    one()
    assert sum(statuses.values()) >= n
    ok = client.post("/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    server.engine(lambda e: e.check())  # no slot leaked by thousands of refused and finished requests
    return statuses, reached


def test_fuzzed_requests_get_4xx_error_objects_never_a_5xx_and_the_server_keeps_answering(server, monkeypatch):
    statuses, reached = _fuzz(server, monkeypatch, ENDPOINTS, bodies | raw_bodies, FUZZ_CASES)
    print(f"\nfuzz: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}, served with "
          f"tools {reached['tools']}, with a schema {reached['constraint']}")


def test_fuzzed_tool_and_schema_requests_on_the_chat_endpoints_never_get_a_5xx(server, monkeypatch):
    """Tools, tool choices, tool messages, schemas and audio parts, hostile and well-formed, on the two
    chat endpoints only, so that many get past validation into rendering and constrained decoding."""
    statuses, reached = _fuzz(server, monkeypatch, ["/v1/chat/completions", "/api/chat"],
                              structured | well_formed, TOOL_FUZZ_CASES)
    # derandomized, but the draws move when a strategy's inputs do (the API's field lists): >= 5% each
    assert reached["tools"] >= 30 and reached["constraint"] >= 30, reached
    print(f"\ntool fuzz: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}, served "
          f"with tools {reached['tools']}, with a schema {reached['constraint']}")
