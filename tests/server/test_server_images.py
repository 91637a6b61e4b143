"""Images through the API on a tiny multimodal Gemma-4 (tests/tiny_vision.py): OpenAI `image_url`
data URLs and Ollama base64 `images` reach the engine as the image's bytes, in their place in the
text, and give what the engine gives for the same image; hostile or oversize images are a 400."""
from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("openai")

from engine import api  # noqa: E402
from server_helpers import LiveServer, with_config  # noqa: E402
from tiny_vision import BUDGET, build_tiny_multimodal, random_image, write_mmproj, write_text_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv-mm")
    build_tiny_multimodal(root / "hf")
    (root / "g").mkdir()
    model = write_text_gguf(root / "hf", root / "g" / "tiny-mm.gguf")
    write_mmproj(root / "hf", root / "g" / "mmproj-tiny-mm.gguf")
    lm = api.open_model(model)
    s = LiveServer(lm, api.EngineOptions(max_running_requests=1), image_tokens=BUDGET)
    yield s, lm
    s.close()


def _png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    random_image(h, w, seed).save(buf, format="PNG")
    return buf.getvalue()


def test_a_data_url_image_gives_the_engines_answer_for_the_same_image(tiny):
    server, lm = tiny
    png = _png(100, 150, 0)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    oa = server.openai()
    r = oa.chat.completions.create(model="tiny-mm", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": " this?"}]}])
    # the engine directly, the image where the part stood (the marker between the two texts)
    ran = api.run_prompt(server.client, lm, f"what is{api.image_marker()} this?",
                         api.GenerationParams(api.SamplingParams(max_tokens=4), image_tokens=BUDGET), images=[png])
    assert r.choices[0].message.content == ran["text"]
    assert r.usage.prompt_tokens == len(ran["prompt_ids"])
    ol = server.ollama().chat(model="tiny-mm", options={"temperature": 0, "num_predict": 4, "top_k": 0, "top_p": 1,
                                                        "repeat_penalty": 1.0},
                              messages=[{"role": "user", "content": "what is this?", "images": [png]}])
    before = api.run_prompt(server.client, lm, "what is this?", api.GenerationParams(
        api.SamplingParams(max_tokens=4), image_tokens=BUDGET), images=[png])  # images first, as Ollama places them
    assert ol.message.content == before["text"]
    assert server.ollama().show("tiny-mm").capabilities == ["completion", "tools", "vision", "thinking"]


def test_hostile_or_oversize_images_are_400s_naming_the_part(tiny):
    server, _ = tiny
    h = server.http()

    def chat(url):
        return h.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]})
    for url, words in (("data:image/png;base64,!!!", "base64"), ("data:image/png,rawbytes", "must be base64"),
                       ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not an image"),
                       ("data:image/png;base64,", "empty")):
        r = chat(url)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "messages.0.content.0.image_url"
    capped = with_config(server, max_image_pixels=100 * 100)
    try:
        big = "data:image/png;base64," + base64.b64encode(_png(120, 120, 1)).decode()
        r = capped.http().post("/v1/chat/completions", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": big}}]}]})
        assert r.status_code == 400 and "120x120" in r.text and "--max-image-pixels" in r.text
    finally:
        capped.bg.stop()
    r = h.post("/api/chat", json={"model": "tiny-mm", "stream": False, "messages": [
        {"role": "user", "content": "x<|image|><|image|>", "images": [base64.b64encode(_png(64, 64, 2)).decode()]}]})
    assert r.status_code == 400 and "markers" in r.json()["error"]  # the engine's one-line refusal


def test_an_image_encoder_failure_is_a_400_in_each_api(tiny, monkeypatch):
    """The engine's bad-input kind, not its message, makes the status (Ollama's shape on /api)."""
    server, _ = tiny

    def fail(items):
        raise RuntimeError("the tower rejects this image")
    monkeypatch.setattr(server.client.engine.vision, "encode", fail)
    h = server.http()
    r = h.post("/api/chat", json={"model": "tiny-mm", "stream": False, "messages": [
        {"role": "user", "content": "what?", "images": [base64.b64encode(_png(40, 40, 11)).decode()]}]})
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    assert r.json()["error"].startswith("image encoder:") and "the tower rejects" in r.json()["error"]
    url = "data:image/png;base64," + base64.b64encode(_png(40, 40, 12)).decode()
    r = h.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_input", r.text
    monkeypatch.undo()
    server.engine(lambda e: e.check())
