"""Failpoints (engine/failpoints.py) and recovery: an injected out-of-memory or step error ends the
requests in flight with one line, every KV slot goes back, the prefix cache stays consistent, and
the next request's output equals a run without the failure."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import failpoints
from engine.api import EngineOptions, GenerationParams, SamplingParams, open_model, start_client
from tiny_models import TinySpec, write_tiny_gemma4

pytestmark = pytest.mark.cpu_runtime  # the engine on the CPU runtime's weights (both kernels: make test)

GREEDY = GenerationParams(SamplingParams(max_tokens=10))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("fp") / "tiny.gguf", TinySpec(), seed=7)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return open_model(tiny_path, exact=False)


@pytest.fixture(autouse=True)
def disarm():
    yield
    failpoints.configure(None)


def _ask(client, prompt: str):
    rid = client.submit([{"role": "user", "content": prompt}], GREEDY)
    events = list(client.stream(rid, timeout=120))
    return events[-1], [t for ev in events for t in ev.token_ids]


def _idle_free(client):
    """Free slots per pool once idle, with the prefix cache emptied: the pools' baseline."""
    def look(engine):
        engine.check()
        engine.cache.clear()
        return engine.pools.full.n_free, engine.pools.window.n_free, engine.pools.full.capacity, \
            engine.pools.window.capacity
    full, win, full_cap, win_cap = client.call(look)
    return (full, win) == (full_cap, win_cap)


def test_parse_and_firing_once():
    assert failpoints.parse("forward.oom@3, kv.write@1,forward.oom@5") == {"forward.oom": {3, 5}, "kv.write": {1}}
    for bad in ("forward.oom", "nope@1", "step.error@0", "step.error@x"):
        with pytest.raises(ValueError, match="EDGEGEM_FAILPOINTS: bad entry"):
            failpoints.parse(bad)
    failpoints.configure("step.error@2")
    assert failpoints.ACTIVE and [failpoints.hit("step.error") for _ in range(4)] == [False, True, False, False]
    failpoints.configure(None)
    assert not failpoints.ACTIVE


@pytest.mark.parametrize("spec, words", [
    ("forward.oom@1", "out of memory in a model forward: lower --gpu-memory-budget"),  # prefill
    ("forward.oom@4", "out of memory in a model forward"),  # decode
    ("step.error@3", "RuntimeError: injected failure (failpoint step.error)"),
])
@pytest.mark.parametrize("batched", [False, True])
def test_a_failed_step_ends_the_request_in_one_line_and_leaks_nothing(tiny, spec, words, batched):
    client = start_client(tiny, EngineOptions(max_running_requests=2))
    client.engine.config.batched_decode = batched
    client.call(lambda e: e._build_pools())
    try:
        _, want = _ask(client, "the cat sat")
        assert _idle_free(client)
        failpoints.configure(spec)
        last, _ = _ask(client, "the cat sat")
        assert last.finish_reason == "error" and words in last.error and "\n" not in last.error
        assert failpoints.fired[spec.split("@")[0]] == 1
        assert _idle_free(client)  # every slot back, the cache consistent (engine.check)
        last, got = _ask(client, "the cat sat")
        assert last.finish_reason in ("stop", "length") and got == want
    finally:
        client.close()


def test_a_failed_step_leaves_waiting_requests_to_run(tiny):
    client = start_client(tiny, EngineOptions(max_running_requests=1))
    try:
        _, want_a = _ask(client, "the cat sat")
        _, want_b = _ask(client, "a dog ran")
        failpoints.configure("forward.oom@2")  # request a's first decode forward
        a = client.submit([{"role": "user", "content": "the cat sat"}], GREEDY)
        b = client.submit([{"role": "user", "content": "a dog ran"}], GREEDY)
        ev_a = list(client.stream(a, timeout=120))
        ev_b = list(client.stream(b, timeout=120))
        assert ev_a[-1].finish_reason == "error"
        assert ev_b[-1].finish_reason in ("stop", "length") and [t for e in ev_b for t in e.token_ids] == want_b
        assert _idle_free(client)
    finally:
        client.close()


def test_kv_write_failpoint_loses_only_the_file(tiny, tmp_path):
    client = start_client(tiny)
    f = tmp_path / "s.safetensors"
    try:
        failpoints.configure("kv.write@1")
        rid = client.submit([{"role": "user", "content": "the cat"}],
                            GenerationParams(SamplingParams(max_tokens=4), kv_session=str(f)))
        assert list(client.stream(rid, timeout=120))[-1].finish_reason in ("stop", "length")
        client.call(lambda e: e.sessions.flush())
        assert client.kv_errors() == ["KV file s.safetensors not saved: No space left on device"]
        assert not f.exists() and not list(tmp_path.iterdir())
        rid = client.submit([{"role": "user", "content": "the cat"}],
                            GenerationParams(SamplingParams(max_tokens=4), kv_session=str(f)))
        list(client.stream(rid, timeout=120))
        client.call(lambda e: e.sessions.flush())
        assert f.exists()
    finally:
        client.close()


def _chat(tiny_path, lines: str, failpoints: str = ""):
    env = {**os.environ, "EDGEGEM_FAILPOINTS": failpoints}
    return subprocess.run([sys.executable, "-m", "app.cli", "chat", "--model", str(tiny_path), "--temperature", "0",
                           "--max-tokens", "6", "--device", "cpu"], input=lines, capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def dog_alone(tiny_path):
    """The greedy answer to "a dog" as the first message of a chat."""
    r = _chat(tiny_path, "a dog\n")
    assert r.returncode == 0, r.stderr
    return r.stdout.split("model> ")[1]


@pytest.mark.parametrize("spec, error, advice", [
    ("forward.oom@3", "[error: out of memory in a model forward", "edgegem: the device ran out of memory during "
     "this answer, which can pass: send the message again"),
    ("step.error@3", "[error: RuntimeError: ", "edgegem: a fault in edgegem, not in your message: please report it"),
], ids=["oom", "internal"])
def test_chat_prints_the_error_and_answers_the_next_prompt(tiny_path, dog_alone, spec, error, advice):
    """`edgegem chat` with two prompts on stdin and a failpoint: the first answer ends in the
    error line and the line saying what its kind means, the second is a normal answer (the same as
    with the failed turn never sent: it left the history), exit status 0."""
    r = _chat(tiny_path, "the cat\na dog\n", spec)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(error) == 1
    assert r.stderr.count(advice) == 1 and r.stderr.index(error) < r.stderr.index(advice), r.stderr
    answers = r.stdout.split("model> ")[1:]
    assert len(answers) == 2 and answers[1].strip() and answers[1] == dog_alone


def test_chat_advice_names_every_error_kind():
    """Each ErrorKind the engine sends has its own line in `edgegem chat`, and an error without a
    kind reads as internal (as the API server treats it)."""
    from app.cli_chat import error_advice
    from engine.api import ErrorKind

    lines = {kind: error_advice(kind) for kind in ErrorKind}
    assert len(set(lines.values())) == len(ErrorKind)
    assert "fix it and send it again" in lines[ErrorKind.BAD_INPUT]
    assert "--context-overflow truncate" in lines[ErrorKind.CAPACITY]
    assert "send the message again" in lines[ErrorKind.OUT_OF_MEMORY]
    assert "a fault in edgegem" in lines[ErrorKind.INTERNAL] and error_advice(None) == lines[ErrorKind.INTERNAL]


@pytest.mark.parametrize("spec, code", [("forward.oom@1", 1), ("step.error@2", 1)], ids=["oom", "internal"])
def test_run_exits_by_the_error_kind(tiny_path, spec, code):
    """`edgegem run`: an answer the engine ended for its own failure exits 1 (bad input is 2), in
    one line."""
    env = {**os.environ, "EDGEGEM_FAILPOINTS": spec}
    r = subprocess.run([sys.executable, "-m", "app.cli", "run", "--model", str(tiny_path), "--prompt", "the cat",
                        "--max-tokens", "4", "--device", "cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == code and r.stderr.startswith("edgegem: error: "), r.stderr
    assert r.stderr.count("\n") == 1


def test_a_malformed_failpoint_spec_is_one_line(tiny_path):
    env = {**os.environ, "EDGEGEM_FAILPOINTS": "forward.oom"}
    r = subprocess.run([sys.executable, "-m", "app.cli", "tokenize", "--model", str(tiny_path), "--text", "x"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("edgegem: error: EDGEGEM_FAILPOINTS: bad entry")
    assert r.stderr.count("\n") == 1


# --- the app ---------------------------------------------------------------------------------------
async def test_app_out_of_memory_shows_the_error_on_the_message_and_goes_on(tmp_path, tiny_path):
    from app.app import EdgegemApp
    from app.backend import EngineBackend
    from app.store import Store
    from app.widgets.message_view import MessageView
    from tests.app.test_app import SIZE, open_chat, say

    app = EdgegemApp(EngineBackend(str(tiny_path), EngineOptions(), device="cpu"), Store(tmp_path / "d"),
                     plan_seconds=0.0, default_settings={"temperature": 0.0, "max_tokens": 6})
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "the cat")
        failpoints.configure("forward.oom@2")
        await say(pilot, "a dog")
        views = list(chat.query(MessageView))
        assert views[-1].status == "error" and views[-1].error.startswith("out of memory in a model forward")
        assert "out of memory" in str(views[-1].query_one(".role").render())
        await say(pilot, "a bird")  # the next message works
        stored = app.store.messages(chat.conversation_id)
        assert [(m.role, m.status) for m in stored] == [("user", "done"), ("assistant", "done"),
                                                         ("user", "done"), ("assistant", "error"),
                                                         ("user", "done"), ("assistant", "done")]
        assert stored[3].stats["error"].startswith("out of memory") and stored[3].stats["error_kind"] == "out_of_memory"
        assert app.session.client.call(lambda e: e.check()) is None


async def test_app_store_write_failure_keeps_the_conversation(tmp_path):
    from app.app import EdgegemApp
    from app.store import Store
    from app.widgets.message_view import MessageView
    from tests.app_fakes import FakeBackend, FakeClient
    from tests.app.test_app import SIZE, open_chat, say, until

    app = EdgegemApp(FakeBackend(FakeClient()), Store(tmp_path / "d"), plan_seconds=0.0)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await say(pilot, "first")
        # the next write is the second user message: refused, the text stays in the input
        failpoints.configure("store.write@1")  # counting from now
        chat.query_one("#input").text = "second"
        await pilot.press("enter")
        await until(pilot, lambda: failpoints.fired["store.write"] == 1)
        await pilot.pause()
        assert chat.query_one("#input").text == "second" and chat.gen is None
        # now the answer's write fails: shown with the reason, kept for this session
        failpoints.configure("store.write@2")  # the user message is write 1
        await pilot.press("enter")
        await until(pilot, lambda: chat.gen is None and chat.messages[-1].role == "assistant")
        last = list(chat.query(MessageView))[-1]
        assert last.error == "not saved: the conversation database could not be written"
        await say(pilot, "third")  # and the next message works
        stored = app.store.messages(chat.conversation_id)
        assert [m.content for m in stored if m.role == "user"] == ["first", "second", "third"]
        assert sum(m.role == "assistant" for m in stored) == 2
        msgs, _ = app.backend.client.submitted[-1]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]


def test_cuda_out_of_memory_is_retried_once_after_emptying_the_cache(tiny, monkeypatch):
    """On CUDA the engine gives the allocator's cached blocks back and runs the forward again once
    (after undoing the slots the failed one took); a second failure reaches the caller."""
    import torch

    from engine.scheduler import Engine

    eng = Engine(tiny.model)
    monkeypatch.setattr(eng, "model", type("M", (), {"device": torch.device("cuda")})())
    emptied, undone, calls = [], [], []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))

    def flaky(fail_times):
        def forward():
            calls.append(1)
            if len(calls) <= fail_times:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return "logits"
        return forward

    assert eng._retry_oom(flaky(1), lambda: undone.append(1)) == "logits"
    assert (len(calls), len(emptied), len(undone)) == (2, 1, 1)
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):
        eng._retry_oom(flaky(2))
    assert len(calls) == 2
    monkeypatch.setattr(eng, "model", tiny.model)  # the CPU: no retry
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):
        eng._retry_oom(flaky(1))
    assert len(calls) == 1
