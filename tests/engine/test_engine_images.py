"""Image requests through the engine (issue 15): greedy output equal across fast prefill, chunked
prefill that splits the image block and both cache types; the prefix cache and KV files key image
positions on the image's content (same image: reuse; a different one with the same ids: none)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from tiny_vision import BOI, BUDGET, EOI, IMG, build_tiny_multimodal, random_image  # noqa: E402

from engine.media import ImageRequestError, image_key  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import ContextOverflowError, Engine, EngineConfig  # noqa: E402
from models.gemma4_vision import preprocess  # noqa: E402
from models.loader import load_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=10)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mme") / "hf"
    build_tiny_multimodal(folder)
    lm = load_model(folder)
    a, b = (preprocess(random_image(100, 150, s), BUDGET) for s in (0, 3))
    return dict(lm=lm, a=a, b=b)


def _prompt(*images, head=(2, 10, 11), tail=(12, 13, 14, 15)):
    ids = list(head)
    for im in images:
        ids += [BOI] + [IMG] * im.n_tokens + [EOI] + [20, 21]
    return ids + list(tail)


def _engine(lm, **kw):
    cfg = dict(full_tokens=1024, window_tokens=1024, kv_cache_dtype="fp32", swa_kv_cache_dtype="fp32")
    cfg.update(kw)
    return Engine(lm.model, None, EngineConfig(**cfg), vision=lm.vision, model_id=kw.pop("model_id", "m"))


def _ask(eng, ids, images, kv=None):
    req = eng.add(ids, GREEDY, images=images, kv_session=str(kv) if kv else None)
    eng.run_to_completion()
    eng.sessions.flush()
    assert req.finish_reason in ("stop", "length"), (req.finish_reason, req.events.queue[-1].error)
    return req


def _reference(lm, ids, images, n=10):
    """Greedy continuation by whole-sequence forwards (no KV cache, no engine)."""
    from models.gemma4_vision import image_rows

    embeds = lm.vision.encode(images)
    out = []
    for _ in range(n):
        seq = ids + out
        rows = image_rows(seq, embeds, lm.vision.cfg)
        out.append(int(lm.model.forward(torch.tensor(seq), media=rows)[-1].argmax()))
    return out


@pytest.mark.parametrize("kw", [dict(), dict(fast_prefill=False), dict(prefill_chunk=25), dict(prefill_chunk=7),
                                dict(cache_type="naive"), dict(cache_type="naive", prefill_chunk=25)],
                         ids=["default", "no-fast-prefill", "chunk25", "chunk7", "naive", "naive-chunk25"])
def test_greedy_output_equal_across_modes(tiny, kw):
    lm = tiny["lm"]
    ids = _prompt(tiny["a"], tiny["b"])
    want = _reference(lm, ids, [tiny["a"], tiny["b"]])
    got = _ask(_engine(lm, **kw), ids, [tiny["a"], tiny["b"]]).output_ids
    assert got == want


def test_same_image_twice_reuses_its_kv(tiny):
    lm, a = tiny["lm"], tiny["a"]
    eng = _engine(lm)
    first = _ask(eng, _prompt(a), [a])
    ids2 = first.all_ids[:-1] + [30, 31, 32] + [BOI] + [IMG] * a.n_tokens + [EOI] + [33]
    second = _ask(eng, ids2, [a, a])
    assert second.cached_len > len(_prompt(a))  # the whole first turn, image included
    cold = _ask(_engine(lm), ids2, [a, a])
    assert second.output_ids == cold.output_ids


def test_a_different_image_with_the_same_ids_never_reuses(tiny):
    lm, a, b = tiny["lm"], tiny["a"], tiny["b"]
    assert a.n_tokens == b.n_tokens and a.digest != b.digest
    eng = _engine(lm)
    _ask(eng, _prompt(a), [a])
    ids = _prompt(b)
    assert ids == _prompt(a)  # the very same token ids
    warm = _ask(eng, ids, [b])
    assert warm.cached_len <= ids.index(IMG)  # at most the text before the first placeholder
    cold = _ask(_engine(lm), ids, [b])
    assert warm.output_ids == cold.output_ids
    assert warm.output_ids == _reference(lm, ids, [b])


def test_kv_files_carry_the_image_keys(tiny, tmp_path):
    lm, a, b = tiny["lm"], tiny["a"], tiny["b"]
    f = tmp_path / "conv.safetensors"
    ids = _prompt(a)
    _ask(_engine(lm), ids, [a], kv=f)
    from engine.kv import file as kv_file
    tokens, _ = kv_file.load(f, "m", _engine(lm).sessions.layout())
    assert image_key(a.digest) in tokens and IMG not in tokens
    g = tmp_path / "copy.safetensors"  # asking with a file saves over it: ask B with a copy
    g.write_bytes(f.read_bytes())
    other = _ask(_engine(lm), ids, [b], kv=g)  # same ids, another image: the file serves only the text
    assert other.restored_len <= ids.index(IMG)
    assert other.output_ids == _ask(_engine(lm), ids, [b]).output_ids
    same = _ask(_engine(lm), ids, [a], kv=f)
    assert same.restored_len > ids.index(EOI)


def test_image_refusals_are_one_line(tiny):
    lm, a = tiny["lm"], tiny["a"]
    eng = _engine(lm)
    with pytest.raises(ImageRequestError, match="61 image placeholder tokens; the images give 60"):
        eng.add(_prompt(a) + [IMG], GREEDY, images=[a])
    text_only = Engine(lm.model, None, EngineConfig(full_tokens=256, window_tokens=256))
    with pytest.raises(ImageRequestError, match="no image encoder"):
        text_only.add(_prompt(a), GREEDY, images=[a])
    small = _engine(lm, full_tokens=100, window_tokens=256)
    with pytest.raises(ContextOverflowError) as e:
        small.add(_prompt(a, a), GREEDY, images=[a, a])
    assert "120 of them for 2 images" in str(e.value) and "\n" not in str(e.value)
    assert not eng.has_work and not small.has_work
