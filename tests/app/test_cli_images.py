"""`edgegem run/tokenize/score --image` (issue 15) on a tiny multimodal GGUF + mmproj written by our
own writer: ids with each marker expanded, logits equal to the model's, one-line refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from tiny_vision import BOI, EOI, IMG, build_tiny_multimodal, random_image, write_mmproj, write_text_gguf  # noqa: E402

from app.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-mm")
    build_tiny_multimodal(root / "hf")
    (root / "g").mkdir()
    model = write_text_gguf(root / "hf", root / "g" / "tiny-mm.gguf")
    write_mmproj(root / "hf", root / "g" / "mmproj-tiny-mm.gguf")
    (root / "t").mkdir()
    text_only = root / "t" / "tiny-text.gguf"
    text_only.write_bytes(model.read_bytes())
    a, b = root / "a.png", root / "b.jpg"
    random_image(100, 150, 0).save(a)
    random_image(96, 96, 1).save(b, quality=95)
    junk = root / "junk.png"
    junk.write_text("not a picture")
    return dict(model=model, text_only=text_only, a=a, b=b, junk=junk, root=root)


def edgegem(capsys, *args):
    code = main([str(x) for x in args])
    out, err = capsys.readouterr()
    return code, out, err


def _blocks(ids):
    """[(start, N)] of each image block."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == BOI:
            j = i + 1
            while ids[j] == IMG:
                j += 1
            assert ids[j] == EOI
            out.append((i, j - i - 1))
            i = j
        i += 1
    return out


def test_tokenize_expands_each_image(tiny, capsys):
    code, out, _ = edgegem(capsys, "tokenize", "--model", tiny["model"], "--text", "hi", "--image", tiny["a"],
                           "--image-tokens", "70")
    ids = json.loads(out)
    assert code == 0 and _blocks(ids) == [(1, 60)] and ids[0] == 2  # bos, then the image, then the text
    code, out, _ = edgegem(capsys, "tokenize", "--model", tiny["model"], "--text", "a<|image|>b<|image|>c",
                           "--image", tiny["a"], "--image", tiny["b"], "--image-tokens", "70")
    ids = json.loads(out)
    assert [n for _, n in _blocks(ids)] == [60, 64] and _blocks(ids)[0][0] > 1


def test_score_with_images_matches_the_model(tiny, capsys, tmp_path):
    from engine import api

    code, out, _ = edgegem(capsys, "tokenize", "--model", tiny["model"], "--text", "hi there",
                           "--image", tiny["a"], "--image-tokens", "70")
    ids = json.loads(out)
    dst = tmp_path / "l.npy"
    code, _, err = edgegem(capsys, "score", "--model", tiny["model"], "--tokens", ",".join(map(str, ids)),
                           "--image", tiny["a"], "--image-tokens", "70", "--out", dst)
    assert code == 0, err
    logits = np.load(dst)
    lm = api.open_model(tiny["model"])
    from models.gemma4_vision import image_rows, load_image
    rows = image_rows(ids, lm.vision.encode([load_image(tiny["a"], 70)]), lm.vision.cfg)
    want = lm.model.forward(torch.tensor(ids), media=rows).numpy()
    assert logits.shape == (len(ids), 512) and np.allclose(logits, want, atol=1e-5)
    # the same ids at another budget: 60 placeholders for a 260-token image
    code, _, err = edgegem(capsys, "score", "--model", tiny["model"], "--tokens", ",".join(map(str, ids)),
                           "--image", tiny["a"], "--out", dst)
    assert code != 0 and err.count("\n") == 1 and "60 image placeholder tokens; the images give 260" in err


def test_run_with_images(tiny, capsys):
    code, out, err = edgegem(capsys, "run", "--model", tiny["model"], "--prompt", "what is it?", "--image", tiny["a"],
                             "--image", tiny["b"], "--image-tokens", "70", "--max-tokens", "4", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert [n for _, n in _blocks(res["prompt_ids"])] == [60, 64]
    assert len(res["ids"]) == 4


@pytest.mark.parametrize("case", ["junk", "missing", "text_only", "bad_budget"])
def test_refusals_are_one_line(tiny, capsys, case):
    args = {"junk": ["--model", tiny["model"], "--image", tiny["junk"]],
            "missing": ["--model", tiny["model"], "--image", tiny["root"] / "nope.png"],
            "text_only": ["--model", tiny["text_only"], "--image", tiny["a"]]}.get(case)
    if case == "bad_budget":
        with pytest.raises(SystemExit):
            main(["run", "--model", str(tiny["model"]), "--prompt", "x", "--image", str(tiny["a"]),
                  "--image-tokens", "100"])
        return
    for cmd in (["run", "--prompt", "x", "--max-tokens", "2"], ["tokenize", "--text", "x"]):
        code, out, err = edgegem(capsys, *cmd, *args)
        assert code != 0 and out == "" and err.count("\n") == 1 and err.startswith("edgegem: error:"), err


def test_info_counts_the_image_encoder(tiny, capsys):
    from engine.memory_plan import vision_bytes
    from models.gguf import GGUFFile

    code, out, err = edgegem(capsys, "info", tiny["model"], "--device", "cpu", "--json")
    assert code == 0, err
    comp = {c["name"]: c for c in json.loads(out)["plan"]["components"]}["image encoder (mmproj)"]
    weights, peak = vision_bytes(tiny["model"].parent / "mmproj-tiny-mm.gguf", "cpu")
    n = sum(t.n_elements for t in GGUFFile(tiny["model"].parent / "mmproj-tiny-mm.gguf"))
    assert weights == 4 * n and comp["device_bytes"] == weights + peak
    assert peak == 4 * 10080 * (6 * 48 + 3 * 96 + 3 * 256)  # 9·1120 patches, D 48, FF 96, 3 heads
    code, out, _ = edgegem(capsys, "info", tiny["text_only"], "--device", "cpu", "--json")
    assert "image encoder (mmproj)" not in out


def test_client_messages_carry_images_and_the_next_turn_reuses_their_kv(tiny):
    """The app's API: a user message's `images` (paths here; bytes or ImageInput work too)."""
    from engine import api

    lm = api.open_model(tiny["model"])
    client = api.start_client(lm, api.EngineOptions(max_running_requests=1))
    gen = api.GenerationParams(api.SamplingParams(max_tokens=3), image_tokens=70)
    try:
        turn1 = [{"role": "user", "content": "what is this?", "images": [str(tiny["a"])]}]
        rid = client.submit(turn1, gen)
        evs = list(client.stream(rid, timeout=60))
        ids1 = client.last_prompt_ids(rid)
        assert _blocks(ids1) == [(_blocks(ids1)[0][0], 60)] and evs[-1].finish_reason in ("stop", "length")
        answer = "".join(e.text for e in evs)
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and?"}]
        rid = client.submit(turn2, gen)
        stats = list(client.stream(rid, timeout=60))[-1].stats
        assert stats["cached_tokens"] > ids1.index(EOI)  # the image's KV is reused, not recomputed
        assert stats["image_tokens"] == 60 and client.status()["images"]
        other = [{"role": "user", "content": "what is this?", "images": [tiny["b"].read_bytes()]}]
        rid = client.submit(other, gen)
        stats = list(client.stream(rid, timeout=60))[-1].stats
        assert stats["cached_tokens"] <= ids1.index(IMG)
    finally:
        client.close()


def _spy_submits(monkeypatch) -> list:
    """Every conversation LocalClient.submit gets (the messages as the chat or app built them)."""
    from engine.client import LocalClient

    seen, submit = [], LocalClient.submit

    def spy(self, messages, params=None):
        seen.append(([dict(m) for m in messages], params))
        return submit(self, messages, params) if params is not None else submit(self, messages)
    monkeypatch.setattr(LocalClient, "submit", spy)
    return seen


def test_chat_image_lines_attach_to_the_next_message(tiny, capsys, monkeypatch):
    """`edgegem chat --mmproj`: the text-only copy of the model takes images through the flag; a
    line `/image PATH` goes with the next message and stays in the history; bad ones are one line."""
    lines = iter([f"/image {tiny['junk']}", f"/image {tiny['root'] / 'nope.png'}", f"/image '{tiny['a']}'",
                  "what is it?", "and now?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    seen = _spy_submits(monkeypatch)
    code, out, err = edgegem(capsys, "chat", "--model", tiny["text_only"], "--mmproj",
                             tiny["model"].parent / "mmproj-tiny-mm.gguf", "--image-tokens", "70",
                             "--max-tokens", "2", "--temperature", "0", "--device", "cpu")
    assert code == 0, err
    refusals = [ln for ln in err.splitlines() if ln.startswith("edgegem: ")]
    assert refusals[0] == "edgegem: junk.png: not an image (or a format Pillow cannot read)"
    assert refusals[1] == "edgegem: nope.png: no such file" and len(refusals) == 2
    assert "[a.png: 60 image tokens, sent with your next message]" in out
    first, second = seen[0][0], seen[1][0]
    assert [im.n_tokens for im in first[-1]["images"]] == [60] and first[-1]["content"] == "what is it?"
    assert "images" in second[0] and "images" not in second[-1]  # earlier images stay in context
    assert seen[0][1].image_tokens == 70


def test_chat_image_on_a_model_without_an_encoder_is_one_line(tiny, capsys, monkeypatch):
    lines = iter([f"/image {tiny['a']}", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    code, out, err = edgegem(capsys, "chat", "--model", tiny["text_only"], "--device", "cpu")
    assert code == 0 and err.count("has no image encoder") == 1, err
    assert len([ln for ln in err.splitlines() if "image encoder" in ln]) == 1


async def test_the_app_on_the_real_engine_sends_an_image_and_counts_its_tokens(tiny, tmp_path):
    """`edgegem app --mmproj`: EngineBackend loads the encoder from the flag; the chip's count is
    the engine's, the answer streams, and the status panel shows the request's image tokens."""
    from app.app import EdgegemApp
    from app.backend import EngineBackend
    from app.store import Store
    from app.widgets.attachments import AttachmentBar
    from app.widgets.status_panel import StatusPanel
    from engine.api import EngineOptions
    from tests.app.test_app import until

    backend = EngineBackend(str(tiny["text_only"]), EngineOptions(max_running_requests=1), "cpu",
                            mmproj=str(tiny["model"].parent / "mmproj-tiny-mm.gguf"))
    app = EdgegemApp(backend, Store(tmp_path / "data"), plan_seconds=0.0,
                     default_settings={"image_tokens": 70, "max_tokens": 3, "temperature": 0.0})
    async with app.run_test(size=(120, 36)) as pilot:
        from app.screens.chat import ChatScreen
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.is_mounted, timeout=120)
        chat = app.screen
        box = chat.query_one("#input")
        box.text = f"/image {tiny['a']}"
        await pilot.press("enter")
        await until(pilot, lambda: len(chat.query_one(AttachmentBar).pending) == 1)
        assert chat.query_one(AttachmentBar).pending[0].n_tokens == 60
        box.text = "what is it?"
        await pilot.press("enter")
        await until(pilot, lambda: chat.gen is None and len(chat.messages) == 2, timeout=120)
        answer = chat.messages[1]
        assert answer.status == "done" and answer.stats["image_tokens"] == 60, answer.stats
        await pilot.pause(0.6)
        panel = str(chat.query_one(StatusPanel).render())
        assert "images  yes" in panel and "last prompt 60 image tokens" in panel
