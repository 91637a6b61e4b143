"""Audio requests through the engine (issue 23): greedy output equal across fast prefill on/off,
chunked prefill that splits the audio block and both cache types; the prefix cache and KV files
key audio positions on the clip's content (the media path images use: same clip, reuse; another
clip with the same ids, none); an image and a clip in one request; one-line refusals."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("soundfile")

from tiny_audio import AUD, BOA, EOA, build_tiny_audio, make_clip  # noqa: E402

from engine.media import MediaRequestError, media_key, media_kinds, prompt_media  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import ContextOverflowError, Engine, EngineConfig  # noqa: E402
from models.audio import audio_from_samples  # noqa: E402
from models.loader import load_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("aud-engine") / "hf"
    build_tiny_audio(folder)
    lm = load_model(folder)
    a, b = (audio_from_samples(make_clip(1.0, s), 16000, name=f"c{s}") for s in (0, 2))  # 25 tokens each
    c = audio_from_samples(make_clip(1.53, 1), 16000, name="c1")  # 38 tokens
    return dict(lm=lm, a=a, b=b, c=c)


def _prompt(*clips, head=(2, 10, 11), tail=(12, 13, 14, 15)):
    ids = list(head)
    for clip in clips:
        ids += [BOA] + [AUD] * clip.n_tokens + [EOA] + [20, 21]
    return ids + list(tail)


def _engine(lm, **kw):
    cfg = dict(full_tokens=1024, window_tokens=1024, kv_cache_dtype="fp32", swa_kv_cache_dtype="fp32")
    cfg.update(kw)
    return Engine(lm.model, None, EngineConfig(**cfg), vision=lm.vision, audio=lm.audio, model_id="m")


def _ask(eng, ids, audio, kv=None, images=()):
    req = eng.add(ids, GREEDY, audio=audio, images=images, kv_session=str(kv) if kv else None)
    eng.run_to_completion()
    eng.sessions.flush()
    assert req.finish_reason in ("stop", "length"), (req.finish_reason, req.events.queue[-1].error)
    return req


def _reference(lm, ids, audio, n=8, images=()):
    """Greedy continuation by whole-sequence forwards (no KV cache, no engine)."""
    kinds = media_kinds(lm.vision, lm.audio)
    out = []
    for _ in range(n):
        seq = ids + out
        pm = prompt_media(seq, {"audio": audio, "image": list(images)}, kinds)
        pm.encode()
        out.append(int(lm.model.forward(torch.tensor(seq), media=pm.chunk(0, len(seq)))[-1].argmax()))
    return out


@pytest.mark.parametrize("kw", [dict(), dict(fast_prefill=False), dict(prefill_chunk=20), dict(prefill_chunk=7),
                                dict(cache_type="naive", prefill_chunk=20)],
                         ids=["default", "no-fast-prefill", "chunk20", "chunk7", "naive-chunk20"])
def test_greedy_output_equal_across_modes(tiny, kw):
    lm, clips = tiny["lm"], [tiny["c"], tiny["a"]]  # two lengths; chunks of 7 and 20 split both blocks
    ids = _prompt(*clips)
    assert _ask(_engine(lm, **kw), ids, clips).output_ids == _reference(lm, ids, clips)


def test_same_clip_twice_reuses_its_kv(tiny):
    lm, a = tiny["lm"], tiny["a"]
    eng = _engine(lm)
    first = _ask(eng, _prompt(a), [a])
    ids2 = first.all_ids[:-1] + [30, 31] + [BOA] + [AUD] * a.n_tokens + [EOA] + [33]
    second = _ask(eng, ids2, [a, a])
    assert second.cached_len > len(_prompt(a))  # the whole first turn, the clip included
    assert second.output_ids == _ask(_engine(lm), ids2, [a, a]).output_ids


def test_a_different_clip_with_the_same_ids_never_reuses(tiny):
    lm, a, b = tiny["lm"], tiny["a"], tiny["b"]
    assert a.n_tokens == b.n_tokens and a.digest != b.digest
    eng = _engine(lm)
    _ask(eng, _prompt(a), [a])
    ids = _prompt(b)
    assert ids == _prompt(a)  # the very same token ids
    warm = _ask(eng, ids, [b])
    assert warm.cached_len <= ids.index(AUD)  # at most the text before the first placeholder
    assert warm.output_ids == _ask(_engine(lm), ids, [b]).output_ids == _reference(lm, ids, [b])


def test_kv_files_carry_the_clip_keys(tiny, tmp_path):
    from engine.kv import file as kv_file

    lm, a, b = tiny["lm"], tiny["a"], tiny["b"]
    f = tmp_path / "conv.safetensors"
    ids = _prompt(a)
    _ask(_engine(lm), ids, [a], kv=f)
    tokens, _ = kv_file.load(f, "m", _engine(lm).sessions.layout())
    assert media_key(a.digest) in tokens and AUD not in tokens
    g = tmp_path / "copy.safetensors"
    g.write_bytes(f.read_bytes())
    other = _ask(_engine(lm), ids, [b], kv=g)  # same ids, another clip: the file serves only the text
    assert other.restored_len <= ids.index(AUD)
    assert _ask(_engine(lm), ids, [a], kv=f).restored_len > ids.index(EOA)


def test_an_image_and_a_clip_in_one_request(tiny):
    from tiny_vision import BOI, EOI, IMG, random_image

    from models.gemma4_vision import preprocess

    lm, a = tiny["lm"], tiny["a"]
    im = preprocess(random_image(100, 150, 0), 70)
    ids = [2, 10] + [BOI] + [IMG] * im.n_tokens + [EOI] + _prompt(a, head=(11,))
    req = _ask(_engine(lm, prefill_chunk=30), ids, [a], images=[im])
    assert req.output_ids == _reference(lm, ids, [a], images=[im])
    assert req.stats()["image_tokens"] == im.n_tokens and req.stats()["audio_tokens"] == a.n_tokens


def test_audio_refusals_are_one_line_and_change_nothing(tiny):
    lm, a = tiny["lm"], tiny["a"]
    eng = _engine(lm)
    with pytest.raises(MediaRequestError, match="26 audio placeholder tokens; the audio clips give 25"):
        eng.add(_prompt(a) + [AUD], GREEDY, audio=[a])
    deaf = Engine(lm.model, None, EngineConfig(full_tokens=256, window_tokens=256), vision=lm.vision)
    with pytest.raises(MediaRequestError, match="no audio encoder"):
        deaf.add(_prompt(a), GREEDY, audio=[a])
    small = _engine(lm, full_tokens=60, window_tokens=256)
    with pytest.raises(ContextOverflowError) as e:  # more audio than the context holds
        small.add(_prompt(a, a), GREEDY, audio=[a, a])
    assert "50 of them for 2 audio clips" in str(e.value) and "\n" not in str(e.value)
    assert not eng.has_work and not deaf.has_work and not small.has_work
