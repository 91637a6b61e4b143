"""`edgegem run/tokenize/score --audio` and `chat /audio` (issue 23) on the tiny audio GGUF + an
mmproj from llama.cpp's converter: ids with each clip's block expanded (mixed with --image),
logits equal to the model's, the plan's audio encoder, one-line refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("soundfile")

from tiny_audio import AUD, BOA, EOA, build_tiny_audio, convert_mmproj, make_clip, wav_file  # noqa: E402
from tiny_audio import write_text_gguf_with_audio  # noqa: E402
from tiny_vision import BOI, IMG, random_image  # noqa: E402

from app.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-audio")
    build_tiny_audio(root / "hf")
    (root / "g").mkdir()
    model = write_text_gguf_with_audio(root / "hf", root / "g" / "tiny-audio.gguf")
    mmproj = convert_mmproj(root / "hf", root / "g" / "mmproj-tiny-audio.gguf")
    (root / "t").mkdir()
    text_only = root / "t" / "tiny-text.gguf"
    text_only.write_bytes(model.read_bytes())
    one = wav_file(root / "one.wav", make_clip(1.0, 0))  # 25 tokens
    short = wav_file(root / "short.flac", make_clip(0.5, 1), subtype="PCM_16")  # 13 tokens
    picture = root / "p.png"
    random_image(100, 150, 0).save(picture)
    junk = root / "junk.wav"
    junk.write_text("not a recording")
    return dict(model=model, mmproj=mmproj, text_only=text_only, one=one, short=short, picture=picture, junk=junk,
                root=root)


def edgegem(capsys, *args):
    code = main([str(x) for x in args])
    out, err = capsys.readouterr()
    return code, out, err


def _blocks(ids, begin=BOA, mark=AUD):
    """[(start, N)] of each block of one kind."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == begin:
            j = i + 1
            while ids[j] == mark:
                j += 1
            out.append((i, j - i - 1))
            i = j
        i += 1
    return out


def test_tokenize_expands_each_clip_and_mixes_with_images(tiny, capsys):
    code, out, err = edgegem(capsys, "tokenize", "--model", tiny["model"], "--text", "hi", "--audio", tiny["one"])
    ids = json.loads(out)
    assert code == 0, err
    assert ids[0] == 2 and _blocks(ids) == [(1, 25)] and ids[27] == EOA  # bos, the clip, then the text
    code, out, _ = edgegem(capsys, "tokenize", "--model", tiny["model"], "--text", "a<|audio|>b<|audio|>c",
                           "--audio", tiny["one"], "--audio", tiny["short"], "--image", tiny["picture"],
                           "--image-tokens", "70")
    ids = json.loads(out)
    assert [n for _, n in _blocks(ids)] == [25, 13] and _blocks(ids)[0][0] > _blocks(ids, BOI, IMG)[0][0]
    assert [n for _, n in _blocks(ids, BOI, IMG)] == [60]


def test_score_with_audio_matches_the_model(tiny, capsys, tmp_path):
    from engine import api
    from engine.media import media_kinds, prompt_media

    _, out, _ = edgegem(capsys, "tokenize", "--model", tiny["model"], "--text", "hi there", "--audio", tiny["one"])
    ids = json.loads(out)
    dst = tmp_path / "l.npy"
    code, _, err = edgegem(capsys, "score", "--model", tiny["model"], "--tokens", ",".join(map(str, ids)),
                           "--audio", tiny["one"], "--out", dst)
    assert code == 0, err
    lm = api.open_model(tiny["model"])
    pm = prompt_media(ids, {"audio": api.load_audio(lm, [str(tiny["one"])])}, media_kinds(lm.vision, lm.audio))
    pm.encode()
    want = lm.model.forward(torch.tensor(ids), media=pm.chunk(0, len(ids))).numpy()
    assert np.allclose(np.load(dst), want, atol=1e-5)
    # the same ids with another clip's count, and with no clip at all: one line each
    for extra in (["--audio", tiny["short"]], []):
        code, _, err = edgegem(capsys, "score", "--model", tiny["model"], "--tokens", ",".join(map(str, ids)),
                               *extra, "--out", dst)
        assert code != 0 and err.count("\n") == 1 and "25 audio placeholder tokens" in err, err


def test_run_with_a_clip_and_an_image(tiny, capsys):
    code, out, err = edgegem(capsys, "run", "--model", tiny["model"], "--prompt", "what do you hear?",
                             "--audio", tiny["one"], "--image", tiny["picture"], "--image-tokens", "70",
                             "--max-tokens", "4", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert _blocks(res["prompt_ids"])[0][1] == 25 and [n for _, n in _blocks(res["prompt_ids"], BOI, IMG)] == [60]
    assert len(res["ids"]) == 4 and res["timings"]["audio_tokens"] == 25


@pytest.mark.parametrize("case", ["junk", "missing", "text_only"])
def test_refusals_are_one_line(tiny, capsys, case):
    args = {"junk": ["--model", tiny["model"], "--audio", tiny["junk"]],
            "missing": ["--model", tiny["model"], "--audio", tiny["root"] / "nope.wav"],
            "text_only": ["--model", tiny["text_only"], "--audio", tiny["one"]]}[case]
    for cmd in (["run", "--prompt", "x", "--max-tokens", "2"], ["tokenize", "--text", "x"]):
        code, out, err = edgegem(capsys, *cmd, *args)
        assert code != 0 and out == "" and err.count("\n") == 1 and err.startswith("edgegem: error:"), err
        assert {"junk": "not audio", "missing": "nope.wav", "text_only": "no audio encoder"}[case] in err


def test_info_counts_the_audio_encoder(tiny, capsys):
    from engine.memory_plan import audio_bytes, vision_bytes
    from models.gemma4_audio import Gemma4AudioConfig, activation_bytes
    from models.gguf import GGUFFile

    code, out, err = edgegem(capsys, "info", tiny["model"], "--device", "cpu", "--json")
    assert code == 0, err
    comps = {c["name"]: c for c in json.loads(out)["plan"]["components"]}
    f = GGUFFile(tiny["mmproj"])
    weights, peak = audio_bytes(f, "cpu")
    assert weights == 4 * sum(t.n_elements for t in f if t.name.startswith(("a.", "mm.a.")))
    assert peak == activation_bytes(Gemma4AudioConfig.from_gguf(f), 2999, 4) > 0
    assert comps["audio encoder (mmproj)"]["device_bytes"] == weights + peak
    vw, va = vision_bytes(f, "cpu")  # the image encoder's share no longer counts the audio tensors
    assert comps["image encoder (mmproj)"]["device_bytes"] == vw + va
    assert vw + weights == 4 * sum(t.n_elements for t in f)


def test_chat_audio_lines_attach_to_the_next_message(tiny, capsys, monkeypatch):
    """`edgegem chat --mmproj`: `/audio PATH` goes with the next message and stays in the history
    (with `/image` beside it); bad ones are one line and change nothing."""
    from engine.client import LocalClient

    lines = iter([f"/audio {tiny['junk']}", f"/audio {tiny['root'] / 'nope.wav'}", f"/audio '{tiny['one']}'",
                  f"/image {tiny['picture']}", "what is it?", "and now?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    seen, submit = [], LocalClient.submit
    monkeypatch.setattr(LocalClient, "submit", lambda self, m, p: seen.append([dict(x) for x in m]) or submit(self, m, p))
    code, out, err = edgegem(capsys, "chat", "--model", tiny["text_only"], "--mmproj", tiny["mmproj"],
                             "--image-tokens", "70", "--max-tokens", "2", "--temperature", "0", "--device", "cpu")
    assert code == 0, err
    refusals = [ln for ln in err.splitlines() if ln.startswith("edgegem: ")]
    assert refusals[0].startswith("edgegem: junk.wav: not audio") and refusals[1] == "edgegem: nope.wav: no such file"
    assert len(refusals) == 2
    assert "[one.wav: 1.0 s, 25 audio tokens, sent with your next message]" in out
    first, second = seen
    assert [c.n_tokens for c in first[-1]["audio"]] == [25] and [i.n_tokens for i in first[-1]["images"]] == [60]
    assert "audio" in second[0] and "audio" not in second[-1]  # the clip stays in context


def test_client_messages_carry_audio_and_the_next_turn_reuses_its_kv(tiny):
    from engine import api

    lm = api.open_model(tiny["model"])
    client = api.start_client(lm, api.EngineOptions(max_running_requests=1))
    gen = api.GenerationParams(api.SamplingParams(max_tokens=3))
    try:
        turn1 = [{"role": "user", "content": "what is this?", "audio": [str(tiny["one"])]}]
        rid = client.submit(turn1, gen)
        evs = list(client.stream(rid, timeout=60))
        ids1 = client.last_prompt_ids(rid)
        assert [n for _, n in _blocks(ids1)] == [25] and evs[-1].stats["audio_tokens"] == 25
        turn2 = turn1 + [{"role": "assistant", "content": "".join(e.text for e in evs)},
                         {"role": "user", "content": "and?"}]
        stats = list(client.stream(client.submit(turn2, gen), timeout=60))[-1].stats
        assert stats["cached_tokens"] > ids1.index(EOA) and client.status()["audio"]
        other = [{"role": "user", "content": "what is this?", "audio": [tiny["short"].read_bytes()]}]
        stats = list(client.stream(client.submit(other, gen), timeout=60))[-1].stats
        assert stats["cached_tokens"] <= ids1.index(AUD) and stats["audio_tokens"] == 13
    finally:
        client.close()


async def test_the_app_on_the_real_engine_sends_a_clip_and_counts_its_tokens(tiny, tmp_path):
    """`edgegem app --mmproj`: EngineBackend loads the audio tower from the flag; the chip's count
    is the engine's, the answer streams, and the status panel shows the request's audio tokens."""
    from app.app import EdgegemApp
    from app.backend import EngineBackend
    from app.screens.chat import ChatScreen
    from app.store import Store
    from app.widgets.attachments import AttachmentBar
    from app.widgets.status_panel import StatusPanel
    from engine.api import EngineOptions
    from tests.app.test_app import until

    backend = EngineBackend(str(tiny["text_only"]), EngineOptions(max_running_requests=1), "cpu",
                            mmproj=str(tiny["mmproj"]))
    app = EdgegemApp(backend, Store(tmp_path / "data"), plan_seconds=0.0,
                     default_settings={"max_tokens": 3, "temperature": 0.0})
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.is_mounted, timeout=120)
        chat = app.screen
        box = chat.query_one("#input")
        box.text = f"/audio {tiny['one']}"
        await pilot.press("enter")
        await until(pilot, lambda: len(chat.query_one(AttachmentBar).pending) == 1)
        assert chat.query_one(AttachmentBar).pending[0].n_tokens == 25
        box.text = "what do you hear?"
        await pilot.press("enter")
        await until(pilot, lambda: chat.gen is None and len(chat.messages) == 2, timeout=120)
        answer = chat.messages[1]
        assert answer.status == "done" and answer.stats["audio_tokens"] == 25, answer.stats
        await pilot.pause(0.6)
        panel = str(chat.query_one(StatusPanel).render())
        assert "audio   yes" in panel and "last prompt 25 audio tokens" in panel


def test_bench_audio_times_each_clip_length(tiny, capsys):
    """`edgegem bench --audio --mmproj`: one row per length with its token count (timings are
    measured, never asserted)."""
    code, out, err = edgegem(capsys, "bench", "--audio", "--mmproj", tiny["mmproj"], "--audio-seconds", "0.5,1",
                             "--json")
    assert code == 0, err
    res = json.loads(out)
    assert [(r["seconds"], r["tokens"]) for r in res["rows"]] == [(0.5, 13), (1.0, 25)]
    assert all(r["tower_s"] > 0 for r in res["rows"]) and "| 1 s | 25 |" in res["table"]
    code, _, err = edgegem(capsys, "bench", "--audio", "--audio-seconds", "x")
    assert code != 0 and err.count("\n") == 1
