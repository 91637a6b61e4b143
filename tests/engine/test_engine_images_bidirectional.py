"""Prefill chunks on 26B/31B never cut an image (engine/media.py `whole_images_end`): the image's
tokens attend to each other both ways (models/image_attention.py), so a chunk boundary inside
one would hide its later rows from its earlier ones. A tiny 26B-like model (tests/tiny_vision.py)
with chunk sizes that would land inside an image."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere (the triton case)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from tiny_vision import (BIG_VISION, BOI, BUDGET, EOI, IMG, TEXT_26B, build_tiny_multimodal,  # noqa: E402
                         random_image)

from engine.media import PromptMedia, media_kinds  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import Engine, EngineConfig  # noqa: E402
from models.gemma4_vision import image_rows, preprocess  # noqa: E402
from models.loader import load_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("big-engine") / "hf"
    build_tiny_multimodal(folder, TEXT_26B, BIG_VISION)
    lm = load_model(folder)
    a, b = (preprocess(random_image(100, 150, s), BUDGET) for s in (0, 3))
    ids = [2, 10, 11]
    for im in (a, b):
        ids += [BOI] + [IMG] * im.n_tokens + [EOI] + [20, 21]
    ids += [12, 13, 14, 15]
    assert lm.model.cfg.image_bidirectional
    return dict(lm=lm, images=[a, b], ids=ids)


def _inside_an_image(ids, boundary: int) -> bool:
    return 0 < boundary < len(ids) and ids[boundary - 1] == IMG and ids[boundary] == IMG


def _run(lm, ids, images, prefill_chunk, attention_backend="torch", max_tokens=6):
    """Greedy tokens, the prompt's chunks (start, length) and the last prompt row's logits."""
    cfg = EngineConfig(full_tokens=1024, window_tokens=1024, kv_cache_dtype="fp32", swa_kv_cache_dtype="fp32",
                       prefill_chunk=prefill_chunk, attention_backend=attention_backend)
    eng = Engine(lm.model, None, cfg, vision=lm.vision, model_id="m")
    chunks, first_logits, forward = [], [], eng.runner.forward

    def spy(kv, tokens, start, want_logits, *args, **kw):
        out = forward(kv, tokens, start, want_logits, *args, **kw)
        if start < len(ids):
            chunks.append((start, len(tokens)))
            if want_logits and not first_logits:
                first_logits.append(out.clone())
        return out

    eng.runner.forward = spy
    req = eng.add(ids, SamplingParams(max_tokens=max_tokens), images=images)
    eng.run_to_completion()
    assert req.finish_reason in ("stop", "length")
    return req.output_ids, [c for c in chunks if c[0] + c[1] <= len(ids)], first_logits[0]


@pytest.mark.parametrize("prefill_chunk", [7, 25, 40, 100])
def test_chunks_never_end_inside_an_image_and_equal_one_whole_forward(tiny, prefill_chunk):
    lm, ids, images = tiny["lm"], tiny["ids"], tiny["images"]
    assert any(_inside_an_image(ids, k) for k in range(prefill_chunk, len(ids), prefill_chunk))  # it would cut
    out, chunks, logits = _run(lm, ids, images, prefill_chunk)
    ends = [s + n for s, n in chunks]
    assert not any(_inside_an_image(ids, e) for e in ends), chunks
    assert [s for s, _ in chunks] == [0] + ends[:-1] and ends[-1] == len(ids)  # consecutive, whole prompt
    rows = image_rows(ids, lm.vision.encode(images), lm.vision.cfg)
    whole = lm.model.forward(torch.tensor(ids), media=rows)
    assert torch.allclose(logits, whole[-1], atol=1e-4, rtol=0), float((logits - whole[-1]).abs().max())
    assert out[0] == int(whole[-1].argmax())


def test_the_triton_backend_sees_the_whole_image_too(tiny):
    """Its kernels mask on positions alone: a chunk's image rows on a sliding layer take the
    reference attention over the gathered slots (engine/attention_backend.py); the interpreter runs
    the rest on the CPU. Same first-token logits and greedy tokens as the torch backend."""
    pytest.importorskip("triton")
    lm, a = tiny["lm"], tiny["images"][0]
    ids = [2, 10, BOI] + [IMG] * a.n_tokens + [EOI, 12]  # one image: the interpreter is slow
    ref_out, _, ref_logits = _run(lm, ids, [a], 25, max_tokens=2)
    out, _, logits = _run(lm, ids, [a], 25, attention_backend="triton", max_tokens=2)
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=0), float((logits - ref_logits).abs().max())
    assert out == ref_out


def test_a_chunk_cut_inside_an_image_would_change_the_logits(tiny, monkeypatch):
    """Pins why the rule exists: the same chunking without it moves the first token's logits."""
    lm, ids, images = tiny["lm"], tiny["ids"], tiny["images"]
    _, _, kept = _run(lm, ids, images, 25)
    monkeypatch.setattr(PromptMedia, "whole_images_end", lambda self, start, end: end)
    _, chunks, cut = _run(lm, ids, images, 25)
    assert any(_inside_an_image(ids, s + n) for s, n in chunks)
    assert float((cut - kept).abs().max()) > 1e-2


def test_whole_images_end_moves_back_to_the_image_or_on_to_its_end(tiny):
    lm, ids, images = tiny["lm"], tiny["ids"], tiny["images"]
    pm = PromptMedia(ids, {"image": images}, media_kinds(lm.vision))
    first = ids.index(IMG)
    last = first + images[0].n_tokens - 1
    assert pm.whole_images_end(0, first + 5) == first  # back to the image's first token
    assert pm.whole_images_end(first, first + 5) == last + 1  # the chunk starts at it: on to its end
    assert pm.whole_images_end(first + 3, first + 5) == last + 1  # a cached prefix ends inside it
    assert pm.whole_images_end(0, first) == first  # boundaries at the image's edges stay
    assert pm.whole_images_end(0, last + 1) == last + 1
    assert pm.whole_images_end(0, 2) == 2


def test_a_cached_image_serves_the_next_turn_as_a_cold_run(tiny):
    """The prefix cache keeps an image's K/V (computed with the whole image in view); the next turn
    that reuses them and adds the image again answers as a cold engine does."""
    lm, ids, images = tiny["lm"], tiny["ids"], tiny["images"]
    cfg = EngineConfig(full_tokens=2048, window_tokens=2048, kv_cache_dtype="fp32", swa_kv_cache_dtype="fp32",
                       prefill_chunk=25)

    def ask(eng, prompt, imgs):
        req = eng.add(prompt, GREEDY, images=imgs)
        eng.run_to_completion()
        return req

    warm = Engine(lm.model, None, cfg, vision=lm.vision, model_id="m")
    first = ask(warm, ids, images)
    a = images[0]
    ids2 = first.all_ids[:-1] + [30, 31] + [BOI] + [IMG] * a.n_tokens + [EOI] + [33]
    second = ask(warm, ids2, images + [a])
    assert second.cached_len > len(ids)
    cold = ask(Engine(lm.model, None, cfg, vision=lm.vision, model_id="m"), ids2, images + [a])
    assert second.output_ids == cold.output_ids
