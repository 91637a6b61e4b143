"""Many clients at once, through the scheduler: 16 parallel streaming clients on the demo model each
get the greedy text they get alone; clients that disconnect halfway abort their requests and every
KV slot comes back; a pool too small for the running requests preempts and still gives solo
outputs; a full wait queue is a 429."""
from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("openai")

from engine import api  # noqa: E402
from server_helpers import LiveServer  # noqa: E402

MODEL = "gemma-3-270m-q4_k_m"
TOPICS = ["the sea", "a red fox", "winter", "bread", "a lighthouse", "trains", "honey bees", "the moon",
          "a violin", "rain", "mountains", "a library", "coffee", "owls", "the desert", "bicycles"]
N_TOKENS = 12


@pytest.fixture(scope="module")
def lm(gemma3_270m_path):
    # float32 weights: runs of one prompt then differ only by float32 rounding where their KV sits in
    # the pool, so greedy text is the same alone or among 16 (llama.cpp's Q8 activations can turn that
    # rounding into another token at a near tie: it did in CI)
    return api.open_model(gemma3_270m_path, exact=True)


@pytest.fixture(scope="module")
def server(lm):
    s = LiveServer(lm, api.EngineOptions(max_running_requests=4))
    yield s
    s.close()


def _msgs(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


def _stream_text(oa, topic: str, n: int = N_TOKENS) -> str:
    out = oa.chat.completions.create(model=MODEL, messages=_msgs(topic), max_tokens=n, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices)


def _stream_and_leave(server, topic: str, after: int) -> int:
    """Read `after` text chunks of a long stream (a counting continuation: no end of turn before
    its 300 tokens), then drop the connection."""
    got = 0
    body = {"model": MODEL, "prompt": f"{topic}: 1, 2, 3, 4, 5, 6,", "stream": True, "max_tokens": 300,
            "temperature": 0}
    with server.http() as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    got += 1
                    if got >= after:
                        break
    return got


def _idle(server, timeout: float = 60.0) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        st = server.client.status()
        if not st["running"] and not st["waiting"] and server.state.in_flight == 0:
            break
        time.sleep(0.05)

    def look(e):
        assert not e.running and not e.waiting
        e.check()
        n = {"free": e.pools.full.n_free, "cached": e.cache.cached_tokens(), "cap": e.pools.full.capacity}
        e.cache.clear()
        n["free_after_clear"] = e.pools.full.n_free
        return n
    return server.engine(look)


def test_sixteen_parallel_streams_equal_solo_runs_and_four_that_leave_give_their_kv_back(server):
    start = _idle(server)
    assert start["free_after_clear"] == start["cap"]
    oa = server.openai()
    results: dict[str, str] = {}
    left: dict[str, int] = {}
    leavers = set(TOPICS[::4])  # 4 of the 16 disconnect halfway

    def client(topic):
        if topic in leavers:
            left[topic] = _stream_and_leave(server, topic, after=N_TOKENS // 2)
        else:
            results[topic] = _stream_text(oa, topic)
    aborted0 = server.state.aborted
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(t,)) for t in TOPICS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    took = time.perf_counter() - t0
    assert len(results) == 12 and len(left) == 4
    # the server sees a disconnect when it next writes or polls, maybe after the client thread ended:
    # wait until nothing is in flight (a request's abort is counted before it leaves the count)
    end = _idle(server)
    assert server.state.aborted - aborted0 == 4  # each disconnect aborted its request
    assert end["free"] + end["cached"] == end["cap"]  # every slot free or in the (evictable) prefix cache
    assert end["free_after_clear"] == start["free_after_clear"]  # the pool's free slots are back
    for topic, text in results.items():
        assert text == _stream_text(oa, topic), topic  # the same request alone
    print(f"\n16 streaming clients (4 left halfway) in {took:.1f} s")


def test_a_pool_too_small_for_the_running_requests_preempts_and_outputs_equal_solo_runs(server):
    oa = server.openai()
    topics = TOPICS[:4]
    solo = {t: _stream_text(oa, t, n=30) for t in topics}
    _idle(server)
    full = server.engine(lambda e: e.config.full_tokens)
    server.client.rebuild(full_tokens=110)  # 4 x (~20 prompt + 30 answer) tokens do not fit
    try:
        results, preempted = {}, []
        real = server.client.engine._preempt

        def spy(req):
            preempted.append(req.id)
            real(req)
        server.client.engine._preempt = spy
        threads = [threading.Thread(target=lambda t=t: results.__setitem__(t, _stream_text(oa, t, n=30)))
                   for t in topics]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert results == solo
        assert preempted, "the pool was meant to be too small: no request was preempted"
    finally:
        del server.client.engine._preempt
        _idle(server)
        server.client.rebuild(full_tokens=full)


def test_a_full_wait_queue_is_429_and_the_next_request_after_it_works(lm):
    s = LiveServer(lm, api.EngineOptions(max_running_requests=1), max_queued_requests=1)
    try:
        h = s.http()
        # a counting continuation: runs its 300 tokens (no end of turn) while the others arrive
        long = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 300, "temperature": 0, "stream": True}
        chat = {"model": MODEL, "messages": _msgs("the sea"), "max_tokens": 4, "temperature": 0, "stream": False}
        with h.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()
            next(lines)  # admitted and writing
            with s.http().stream("POST", "/v1/completions", json=long) as waiting:
                r = s.http().post("/v1/chat/completions", json=chat)
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
                r = s.http().post("/api/chat", json=chat)
                assert r.status_code == 429 and "waiting" in r.json()["error"]
                assert waiting.status_code == 200
            assert "[DONE]" not in next(lines)  # the first one was still writing all along
        _idle(s)
        assert h.post("/v1/chat/completions", json=chat).status_code == 200
    finally:
        s.close()
