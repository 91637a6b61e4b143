"""`edgegem serve --kv-dir D`: each finished API conversation's KV is saved under D, keyed by the
hash of its tokens (engine/kv/index.py); a later request whose prompt extends it restores it
instead of prefilling, also after a server restart, and writes the same answer a cold prefill
does. A conversation keeps one file."""
from __future__ import annotations

import pytest

pytest.importorskip("openai")

from engine import api  # noqa: E402
from engine.kv.index import KVIndex, digest  # noqa: E402
from server_helpers import LiveServer  # noqa: E402
from tiny_models import TinySpec, write_tiny_gemma4  # noqa: E402

MODEL = "tiny-gemma4"
TURN1 = [{"role": "user", "content": "the cat sat on the mat and then the dog ran in the sun"}]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = write_tiny_gemma4(tmp_path_factory.mktemp("kvdir") / "tiny-gemma4.gguf", TinySpec(), seed=12)
    return api.open_model(path, exact=False)


def _server(lm, kv_dir=None) -> LiveServer:
    opts = api.EngineOptions(max_running_requests=1)
    if kv_dir is not None:
        opts = api.EngineOptions(max_running_requests=1, kv_dir=str(kv_dir), kv_save="answer")
    return LiveServer(lm, opts, kv_auto=kv_dir is not None)


def _chat(server, messages, n=6):
    return server.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0)


def _files(folder):
    return sorted(p.name for p in folder.glob("*.safetensors"))


def test_a_conversation_resumes_from_its_kv_file_after_a_restart_with_the_cold_answer(lm, tmp_path):
    kv = tmp_path / "kv"
    a = _server(lm, kv)
    try:
        r1 = _chat(a, TURN1)
        a.engine(lambda e: e.sessions.flush())
    finally:
        a.close()
    (first,) = _files(kv)
    assert first.startswith("api-")
    turn2 = TURN1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "and what did the dog do next"}]
    b = _server(lm, kv)  # a restart: a fresh engine, an empty prefix cache
    cold = _server(lm)
    try:
        r2 = _chat(b, turn2)
        b.engine(lambda e: e.sessions.flush())
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens  # from the file
        c2 = _chat(cold, turn2)
        assert c2.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens // 2
        assert r2.choices[0].message.content == c2.choices[0].message.content
    finally:
        b.close()
        cold.close()
    files = _files(kv)
    assert len(files) == 1 and files != [first]  # the longer conversation replaced its prefix's file


def test_the_index_finds_the_longest_saved_prefix_by_whole_tokens_or_prompt(lm, tmp_path):
    kv = tmp_path / "kv"
    s = _server(lm, kv)
    try:
        _chat(s, TURN1)
        other = [{"role": "user", "content": "blue hills far away"}]
        _chat(s, other)
        s.engine(lambda e: e.sessions.flush())
        model_id = s.engine(lambda e: e.sessions.model_id)
    finally:
        s.close()
    index = KVIndex(kv, model_id)
    assert len(_files(kv)) == 2
    ids = lm.tokenizer.encode(lm.chat.render(TURN1), add_bos=not lm.chat.bos_in_template)
    found = index.find(ids + [5, 6, 7])
    assert found is not None and found.name == f"api-{digest(_tokens(found))[:32]}.safetensors"
    assert _tokens(found)[:len(ids)] == ids  # saved under its prompt too: a regenerate finds it
    assert index.find(ids[:5]) is None  # nothing saved is a prefix of this
    assert KVIndex(kv, "another-model").find(ids + [5]) is None  # files of another model never serve


def _tokens(path):
    from engine.kv.index import file_tokens
    return file_tokens(path)
