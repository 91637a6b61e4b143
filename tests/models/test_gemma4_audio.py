"""Audio input (issue 23; spec shared/design/gemma4-audio.md): the log-mel features, the Conformer
tower and projector, and the merge into the language model, against transformers' float64 model
built by the §9 recipe, through the HF folder and through a GGUF + an mmproj converted by
llama.cpp's own convert_hf_to_gguf.py."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("soundfile")

from tiny_audio import (AUD, BOA, EOA, build_tiny_audio, convert_mmproj, reference, make_clip,  # noqa: E402
                        write_text_gguf_with_audio)
from tiny_vision import cosine, row_min_cosine  # noqa: E402

from models.audio import PIECE_SAMPLES, audio_from_samples, log_mel, n_frames, n_tokens  # noqa: E402
from models.gemma4 import MediaRows  # noqa: E402
from models.loader import load_model  # noqa: E402

GATE = 0.99999
TEXT = [[2, 10, 11], [12, 13, 14], [15, 16, 17]]  # pieces around the audio blocks
SECONDS = (1.53, 0.77)  # two lengths: HF batch-pads the second; 1.53 s is where L // 160 would give 39 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio")
    folder = root / "hf"
    model = build_tiny_audio(folder)
    clips = [make_clip(s, i) for i, s in enumerate(SECONDS)]
    (root / "gguf").mkdir()
    text = write_text_gguf_with_audio(folder, root / "gguf" / "tiny-audio.gguf")
    convert_mmproj(folder, root / "gguf" / "mmproj-tiny-audio-f32.gguf")
    refs = {1: reference(model, clips[:1], TEXT[:2]), 2: reference(model, clips, TEXT)}
    return dict(folder=folder, gguf=text, clips=clips, refs=refs, hf_model=model)


@pytest.fixture(scope="module")
def loaded(tiny):
    return {form: load_model(tiny["folder"] if form == "hf" else tiny["gguf"], dtype=torch.float64)
            for form in ("hf", "gguf")}


FORMS = pytest.mark.parametrize("form", ["hf", "gguf"])


def _inputs(tiny, n=2):
    return [audio_from_samples(c, 16000, name=f"clip{i}") for i, c in enumerate(tiny["clips"][:n])]


# --- features and counts (§2, §4.2) ------------------------------------------------------------
def test_features_match_transformers(tiny):
    ref = tiny["refs"][2]
    for clip, want in zip(tiny["clips"], ref.features):
        ours = log_mel(torch.from_numpy(clip))
        assert ours.shape == want.shape  # the valid frames exactly: floor((L - 1) / 160)
        assert (ours - want).abs().max() < 1e-4, (ours - want).abs().max()  # log(max(mel, 1e-3)) is off by up to 0.59


def test_digital_silence_is_the_log_floor_in_every_bin():
    feats = log_mel(torch.zeros(16000))
    assert feats.shape == (99, 128) and torch.allclose(feats, torch.full_like(feats, math.log(1e-3)))


def _hf_tokens(n_samples):
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    fake = SimpleNamespace(feature_extractor=Gemma4AudioFeatureExtractor(), audio_seq_length=750)
    return Gemma4Processor._compute_audio_num_tokens(fake, np.zeros(n_samples), 16000)


@pytest.mark.parametrize("n, frames, tokens", [
    (160, 0, 0), (161, 1, 1), (640, 3, 1), (641, 4, 1), (642, 4, 1), (8000, 49, 13), (16000, 99, 25),
    (24480, 152, 38), (160000, 999, 250), (480000, 2999, 750)])
def test_frame_and_token_counts_equal_transformers(n, frames, tokens):
    """Pins the frame-validity rule: frame i needs sample 160·i + 160, so one second gives 99
    frames and 25 tokens; the tempting L // 160 gives 153 frames and 39 tokens at 1.53 s."""
    assert n_frames(n) == frames and n_tokens(n) == tokens == _hf_tokens(n)


def test_clips_over_30_s_are_30_s_pieces_in_one_block():
    """llama.cpp's rule (§7.4): 61 s -> 30 s + 30 s + 1 s = 750 + 750 + 25 tokens; a tail under
    161 samples adds nothing."""
    assert n_tokens(2 * PIECE_SAMPLES + 16000) == 1525
    assert n_tokens(PIECE_SAMPLES + 100) == 750 and n_tokens(PIECE_SAMPLES + 161) == 751
    clip = audio_from_samples(np.zeros(PIECE_SAMPLES + 100, np.float32), 16000)
    assert clip.n_tokens == 750 and len(clip.pieces()) == 1


# --- tower and projector (§3, §4.1) ------------------------------------------------------------
@FORMS
def test_tower_and_projected_rows_equal_transformers(tiny, loaded, form):
    audio, ref = loaded[form].audio, tiny["refs"][2]
    towers = []
    ours = audio.encode(_inputs(tiny), trace=lambda name, i, t: towers.extend(t) if name == "tower_out" else None)
    # one trace per clip, in order
    for o, t, r, rt in zip(ours, towers, ref.embeds, ref.tower):
        assert o.shape == r.shape and t.shape == rt.shape
        assert row_min_cosine(t, rt) >= GATE, row_min_cosine(t, rt)
        assert row_min_cosine(o, r) >= GATE, row_min_cosine(o, r)
    alone = audio.encode(_inputs(tiny)[1:])[0]  # one clip alone == the same clip beside another
    assert torch.allclose(alone, ours[1], atol=1e-12)


def test_sscp_output_equals_transformers(tiny, loaded):
    """A trace point for bisecting (§7.5 names): the subsampling's output against HF's module."""
    model, clip = tiny["hf_model"], tiny["clips"][0]
    feats = log_mel(torch.from_numpy(clip))[None].double()
    with torch.no_grad():
        want, _ = model.model.audio_tower.subsample_conv_projection(feats, torch.ones(feats.shape[:2], dtype=torch.bool))
    got = []
    loaded["hf"].audio.encode_features(feats, trace=lambda name, i, t: got.append(t) if name == "sscp" else None)
    assert row_min_cosine(got[0][0], want[0]) >= 1 - 1e-10


def test_a_long_clip_is_encoded_piece_by_piece(tiny, loaded):
    """31 s: each 30 s piece alone; the first equals HF's output (HF keeps only the first 30 s)."""
    audio = loaded["hf"].audio
    long = np.concatenate([make_clip(30.0, 3), make_clip(1.0, 5)])
    rows = audio.encode([audio_from_samples(long, 16000)])[0]
    assert rows.shape[0] == 775
    first = audio.encode([audio_from_samples(long[:PIECE_SAMPLES], 16000)])[0]
    tail = audio.encode([audio_from_samples(long[PIECE_SAMPLES:], 16000)])[0]
    assert torch.allclose(rows[:750], first, atol=1e-12) and torch.allclose(rows[750:], tail, atol=1e-12)
    ref = reference(tiny["hf_model"], [long[:PIECE_SAMPLES]], [[2], [3]])
    assert row_min_cosine(first, ref.embeds[0]) >= GATE


def test_bf16_tower_stays_close(tiny):
    """The CUDA runtime dtype (bf16 activations; norms and attention in fp32 as HF)."""
    from models.gemma4_audio import load_audio_hf

    audio = load_audio_hf(tiny["folder"], dtype=torch.bfloat16)
    ours = audio.encode(_inputs(tiny, 1))[0]
    assert ours.dtype == torch.bfloat16
    assert cosine(ours, tiny["refs"][1].embeds[0]) > 0.99


# --- the language model (§5) -------------------------------------------------------------------
def _our_logits(lm, tiny, ids, n, scale=1.0, pad_id=None):
    from engine.media import media_kinds, prompt_media

    pm = prompt_media(ids.tolist(), {"audio": _inputs(tiny, n)}, media_kinds(None, lm.audio))
    pm.encode()
    rows = pm.chunk(0, len(ids))
    rows = MediaRows(rows.mask, rows.rows * scale, rows.pad_id if pad_id is None else pad_id)
    return lm.model.forward(ids, media=rows)


@FORMS
@pytest.mark.parametrize("n_clips", [1, 2])
def test_logits_with_audio_equal_transformers(tiny, loaded, form, n_clips):
    ref = tiny["refs"][n_clips]
    ours = _our_logits(loaded[form], tiny, ref.ids, n_clips)
    assert row_min_cosine(ours, ref.logits) >= GATE, row_min_cosine(ours, ref.logits)
    assert torch.equal(ours.argmax(-1), ref.logits.argmax(-1))
    assert (ref.ids == BOA).sum() == n_clips and (ref.ids == EOA).sum() == n_clips


def test_audio_rows_are_not_scaled_by_sqrt_d(tiny, loaded):
    """Pins the no-√d rule: the same rows ×√d (what token rows get) move the logits off HF's."""
    lm, ref = loaded["hf"], tiny["refs"][1]
    scaled = _our_logits(lm, tiny, ref.ids, 1, scale=math.sqrt(lm.model.cfg.d_model))
    assert row_min_cosine(scaled, ref.logits) < 0.999


def test_ple_reads_the_pad_row_at_audio_positions(tiny, loaded):
    """Pins the PLE rule: the placeholder's own PLE row instead of <pad>'s moves the logits."""
    lm, ref = loaded["hf"], tiny["refs"][1]
    assert lm.audio.cfg.pad_id == 0
    wrong = _our_logits(lm, tiny, ref.ids, 1, pad_id=AUD)
    assert row_min_cosine(wrong, ref.logits) < 0.9999


def test_text_before_the_clip_does_not_see_it(tiny, loaded):
    """Causal attention over audio tokens: logits through <|audio> equal a text-only run."""
    lm, ref = loaded["hf"], tiny["refs"][1]
    ours = _our_logits(lm, tiny, ref.ids, 1)
    k = len(TEXT[0]) + 1
    assert torch.allclose(ours[:k], lm.model.forward(ref.ids[:k]), atol=1e-12)


@FORMS
def test_an_image_and_a_clip_in_one_prompt_equal_transformers(tiny, loaded, form):
    """Both kinds' rows fill their own placeholders in prompt order (one media path)."""
    from tiny_vision import BOI, EOI, IMG, random_image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from engine.media import media_kinds, prompt_media
    from models.gemma4_vision import preprocess

    img, clip = random_image(100, 150, 0), tiny["clips"][1]
    lm, model = loaded[form], tiny["hf_model"]
    fi = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[img], return_tensors="pt")
    n_img = int(fi["num_soft_tokens_per_image"][0])
    ca = audio_from_samples(clip, 16000)
    ids = [2, 10] + [BOI] + [IMG] * n_img + [EOI] + [11, 12] + [BOA] + [AUD] * ca.n_tokens + [EOA] + [13, 14]
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    fa = Gemma4AudioFeatureExtractor()([clip], return_tensors="pt")
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), pixel_values=fi["pixel_values"].double(),
                     image_position_ids=fi["image_position_ids"], input_features=fa["input_features"].double(),
                     input_features_mask=fa["input_features_mask"]).logits[0]
    pm = prompt_media(ids, {"image": [preprocess(img, 70)], "audio": [ca]}, media_kinds(lm.vision, lm.audio))
    pm.encode()
    got = lm.model.forward(torch.tensor(ids), media=pm.chunk(0, len(ids)))
    assert row_min_cosine(got, want) >= GATE and torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_mmproj_beside_the_model_gives_both_encoders(tiny, loaded):
    lm = loaded["gguf"]
    assert lm.audio is not None and lm.vision is not None
    assert (lm.audio.cfg.boa_id, lm.audio.cfg.audio_id, lm.audio.cfg.eoa_id) == (BOA, AUD, EOA)  # from the vocabulary
    assert load_model(tiny["gguf"], vision=False).audio is None
