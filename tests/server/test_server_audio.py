"""Audio through the OpenAI API on a tiny Gemma-4 with an audio tower (tests/tiny_audio.py: a GGUF and
an mmproj from llama.cpp's converter): `input_audio` parts (base64 WAV / MP3) reach the engine as
the clip, in their place in the text, and give what the engine gives for the same clip; bad
base64, bytes that are not audio, a format we do not read and audio for a model without an audio
tower are one-line 400s naming the part; the model says `audio` where clients look."""
from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("openai")
pytest.importorskip("transformers")
sf = pytest.importorskip("soundfile")

from engine import api  # noqa: E402
from server_helpers import LiveServer  # noqa: E402
from tiny_audio import build_tiny_audio, convert_mmproj, make_clip, write_text_gguf_with_audio  # noqa: E402

MODEL = "tiny-audio"


def _encoded(samples, fmt="WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format=fmt, **({"subtype": "PCM_16"} if fmt == "WAV" else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv-audio")
    build_tiny_audio(root / "hf")
    (root / "g").mkdir()
    model = write_text_gguf_with_audio(root / "hf", root / "g" / f"{MODEL}.gguf")
    convert_mmproj(root / "hf", root / "g" / f"mmproj-{MODEL}.gguf")
    (root / "t").mkdir()
    text_only = root / "t" / "tiny-text.gguf"  # no mmproj beside it: no audio tower
    text_only.write_bytes(model.read_bytes())
    lm = api.open_model(model)
    s = LiveServer(lm, api.EngineOptions(max_running_requests=1))
    yield dict(server=s, lm=lm, text_only=text_only)
    s.close()


def _part(raw: bytes, fmt="wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": fmt}}


def test_an_input_audio_part_gives_the_engines_answer_for_the_same_clip(tiny):
    server, lm = tiny["server"], tiny["lm"]
    wav = _encoded(make_clip(1.0, 0))  # 25 audio tokens
    r = server.openai().chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is"}, _part(wav),
                                     {"type": "text", "text": " this?"}]}])
    gen = api.GenerationParams(api.SamplingParams(max_tokens=4))
    ran = api.run_prompt(server.client, lm, f"what is{api.audio_marker()} this?", gen, audio=[wav])
    assert r.choices[0].message.content == ran["text"]
    assert r.usage.prompt_tokens == len(ran["prompt_ids"])
    # streamed, and an MP3 of another clip before the text (no marker in the text: clips go first)
    mp3 = _encoded(make_clip(1.5, 2), "MP3")
    chunks = server.openai().chat.completions.create(model=MODEL, max_tokens=4, temperature=0, stream=True, messages=[
        {"role": "user", "content": [_part(mp3, "mp3"), {"type": "text", "text": "and this?"}]}])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == api.run_prompt(server.client, lm, "and this?", gen, audio=[mp3])["text"]


def test_the_model_says_it_hears(tiny):
    server = tiny["server"]
    assert "audio" in server.ollama().show(MODEL).capabilities
    assert server.http().get("/v1/models").json()["data"][0]["meta"]["audio"] is True


@pytest.mark.parametrize("data, fmt, words", [
    ("!!!not base64", "wav", "not valid base64"),
    (base64.b64encode(b"not a recording at all").decode(), "wav", "input_audio"),
    ("", "wav", "non-empty"),
    (None, "aac", "is not one of"),
], ids=["bad-base64", "not-audio", "empty", "unknown-format"])
def test_bad_audio_is_a_400_naming_the_part(tiny, data, fmt, words):
    server = tiny["server"]
    data = base64.b64encode(_encoded(make_clip(0.5, 1))).decode() if data is None else data
    r = server.http().post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}]}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and "\n" not in err["message"]
    assert err["param"] == "messages.0.content.1.input_audio"


def test_audio_for_a_model_without_an_audio_tower_is_a_400(tiny):
    s = LiveServer(api.open_model(tiny["text_only"]), api.EngineOptions(max_running_requests=1))
    try:
        r = s.http().post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
            {"role": "user", "content": [_part(_encoded(make_clip(0.5, 1)))]}]})
        assert r.status_code == 400 and "no audio encoder" in r.json()["error"]["message"], r.text
        assert "audio" not in s.ollama().show("tiny-text").capabilities
    finally:
        s.close()


def test_fuzzed_audio_parts_are_400s_never_a_5xx(tiny):
    """Hostile clip bytes (random, truncated real files, wrong declared formats) on the audio model."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    server = tiny["server"]
    real = [_encoded(make_clip(0.3, 3)), _encoded(make_clip(0.3, 4), "MP3"), _encoded(make_clip(0.3, 5), "FLAC")]
    clips = st.binary(max_size=300) | st.builds(lambda raw, n: raw[:n], st.sampled_from(real), st.integers(0, 400))
    h = server.http()
    statuses: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(raw=clips, fmt=st.sampled_from(["wav", "mp3", "flac", "ogg", None]))
    def one(raw, fmt):
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": fmt}}
        r = h.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": [part]}]})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            assert "\n" not in r.json()["error"]["message"]
    one()
    assert server.http().post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [_part(real[0])]}]}).status_code == 200
    server.engine(lambda e: e.check())  # no slot leaked
    print(f"\naudio fuzz: statuses {dict(sorted(statuses.items()))}")


@pytest.mark.parametrize("failure, status, kind", [
    (RuntimeError("the tower rejects this clip"), 400, "bad_input"),
    (None, 503, "out_of_memory"),  # torch.OutOfMemoryError: it may pass, try again
], ids=["encoder-error", "encoder-oom"])
def test_an_audio_encoder_failure_is_the_status_of_its_kind(tiny, monkeypatch, failure, status, kind):
    """The engine ends the request with an error kind; the API maps the kind (never the message's
    words: it names the audio encoder, where a prefix match once looked for the image one)."""
    import json

    import torch

    server = tiny["server"]
    failure = failure if failure is not None else torch.OutOfMemoryError("CUDA out of memory (test)")

    def fail(items):
        raise failure
    monkeypatch.setattr(server.client.engine.audio, "encode", fail)
    h = server.http()
    for i, stream in enumerate((False, True)):  # a clip of its own each time: no cached prefix skips the encoder
        clip = _encoded(make_clip(0.4, 20 + i + 2 * status))
        r = h.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "stream": stream, "messages": [
            {"role": "user", "content": [_part(clip), {"type": "text", "text": "hi"}]}]})
        if not stream:
            assert r.status_code == status, r.text
            err = r.json()["error"]
        else:  # the status went out with the first chunk: the error is the stream's last event
            assert r.status_code == 200
            events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
            err = events[-1]["error"]
        assert err["code"] == kind and err["message"].startswith("audio encoder: "), err
        assert err["type"] == ("invalid_request_error" if status == 400 else "unavailable_error")
    monkeypatch.undo()
    server.engine(lambda e: e.check())  # no slot leaked
    assert h.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [_part(_encoded(make_clip(0.4, 50)))]}]}).status_code == 200
