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
    want = lm.model.forward(torch.tensor(ids), images=rows).numpy()
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
