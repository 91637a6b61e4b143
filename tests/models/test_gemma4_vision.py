"""Image input (issue 15; spec shared/design/gemma4-vision.md): preprocessing, the vision tower and
projector, and the merge into the language model, against transformers' float64 model (§7 recipe),
through an HF folder and through our own GGUF + mmproj files."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from tiny_vision import (BOI, BUDGET, EOI, IMG, build_tiny_multimodal, cosine, random_image,  # noqa: E402
                         reference, row_min_cosine, write_mmproj, write_text_gguf)

from models.gemma4 import ImageRows  # noqa: E402
from models.gemma4_vision import (ImageError, image_rows, load_image, open_image, preprocess,  # noqa: E402
                                  resized_size)
from models.loader import load_model  # noqa: E402

GATE = 0.99999
TEXT = [[2, 10, 11], [12, 13, 14], [15, 16, 17]]  # pieces around the image blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm")
    folder = root / "hf"
    model = build_tiny_multimodal(folder)
    images = [random_image(100, 150, 0), random_image(200, 120, 1)]
    ggdir = root / "gguf"
    ggdir.mkdir()
    text = write_text_gguf(folder, ggdir / "tiny-mm.gguf")
    write_mmproj(folder, ggdir / "mmproj-tiny-mm-f32.gguf")
    refs = {1: reference(model, images[:1], TEXT[:2]), 2: reference(model, images, TEXT)}
    return dict(folder=folder, gguf=text, images=images, refs=refs, hf_model=model)


def _load(tiny, form):
    return load_model(tiny["folder"] if form == "hf" else tiny["gguf"], dtype=torch.float64)


FORMS = pytest.mark.parametrize("form", ["hf", "gguf"])


def test_preprocessing_matches_transformers(tiny):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    for img in tiny["images"]:
        f = Gemma4ImageProcessorPil(max_soft_tokens=BUDGET)(images=[img], return_tensors="pt")
        ours = preprocess(img, BUDGET)
        n = ours.patches.shape[0]
        assert ours.n_tokens == int(f["num_soft_tokens_per_image"][0])
        assert (ours.patches - f["pixel_values"][0, :n]).abs().max() <= 3e-8
        assert torch.equal(ours.positions, f["image_position_ids"][0, :n])
        assert (f["image_position_ids"][0, n:] == -1).all()  # the rest is HF's batching pad only


@pytest.mark.parametrize("hw, budget, out, n", [
    ((1000, 1000), 280, (768, 768), 256), ((224, 224), 280, (768, 768), 256), ((480, 640), 280, (672, 912), 266),
    ((1080, 1920), 280, (576, 1056), 264), ((100, 150), 280, (624, 960), 260), ((500, 500), 70, (384, 384), 64),
    ((500, 500), 140, (528, 528), 121), ((500, 500), 560, (1104, 1104), 529), ((500, 500), 1120, (1584, 1584), 1089),
])
def test_resize_fills_the_budget(hw, budget, out, n):
    assert resized_size(*hw, budget) == out
    assert (out[0] // 48) * (out[1] // 48) == n


def test_a_budget_outside_the_five_is_refused():
    with pytest.raises(ImageError, match="budget 100"):
        resized_size(100, 100, 100)


@FORMS
def test_image_embeddings_equal_transformers(tiny, form):
    vision = _load(tiny, form).vision
    ref = tiny["refs"][2]
    ours = vision.encode([preprocess(im, BUDGET) for im in tiny["images"]])  # one padded batch
    for o, r in zip(ours, ref.embeds):
        assert o.shape == r.shape
        assert row_min_cosine(o, r) >= GATE, row_min_cosine(o, r)
    # batched == one at a time
    alone = vision.encode([preprocess(tiny["images"][1], BUDGET)])[0]
    assert torch.allclose(alone, ours[1], atol=1e-12)


def _our_logits(loaded, images, ids, **rows_kw):
    embeds = loaded.vision.encode([preprocess(im, BUDGET) for im in images])
    rows = image_rows(ids, embeds, loaded.vision.cfg)
    if rows_kw:
        rows = ImageRows(rows.mask, rows.rows * rows_kw.get("scale", 1.0), rows_kw.get("pad_id", rows.pad_id))
    return loaded.model.forward(ids, media=rows)


@FORMS
@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_with_images_equal_transformers(tiny, form, n_images):
    loaded = _load(tiny, form)
    ref = tiny["refs"][n_images]
    ours = _our_logits(loaded, tiny["images"][:n_images], ref.ids)
    assert row_min_cosine(ours, ref.logits) >= GATE, row_min_cosine(ours, ref.logits)
    assert torch.equal(ours.argmax(-1), ref.logits.argmax(-1))
    assert (ref.ids == BOI).sum() == n_images and (ref.ids == EOI).sum() == n_images


def test_image_rows_are_not_scaled_by_sqrt_d(tiny):
    """Pins the no-√d rule: the same rows ×√d (what token rows get) move the logits off the reference."""
    loaded, ref = _load(tiny, "hf"), tiny["refs"][1]
    scaled = _our_logits(loaded, tiny["images"][:1], ref.ids, scale=math.sqrt(loaded.model.cfg.d_model))
    assert row_min_cosine(scaled, ref.logits) < 0.999


def test_ple_reads_the_pad_row_at_image_positions(tiny):
    """Pins the PLE rule: reading the placeholder's own PLE row instead of <pad>'s moves the logits."""
    loaded, ref = _load(tiny, "hf"), tiny["refs"][1]
    assert loaded.vision.cfg.pad_id == 0
    wrong = _our_logits(loaded, tiny["images"][:1], ref.ids, pad_id=IMG)
    assert row_min_cosine(wrong, ref.logits) < 0.9999


def test_text_rows_before_the_image_do_not_see_it(tiny):
    """Causal attention over image tokens: logits before <|image> equal a text-only run."""
    loaded, ref = _load(tiny, "hf"), tiny["refs"][1]
    ours = _our_logits(loaded, tiny["images"][:1], ref.ids)
    k = len(TEXT[0]) + 1  # through <|image>
    assert torch.allclose(ours[:k], loaded.model.forward(ref.ids[:k]), atol=1e-12)


def test_count_mismatch_is_one_line(tiny):
    loaded, ref = _load(tiny, "hf"), tiny["refs"][1]
    embeds = loaded.vision.encode([preprocess(tiny["images"][0], BUDGET)])
    with pytest.raises(ImageError) as e:
        image_rows(ref.ids.tolist() + [IMG], embeds, loaded.vision.cfg)
    assert "\n" not in str(e.value) and "61 image placeholder" in str(e.value)


def test_mmproj_is_found_beside_the_model_and_text_models_have_none(tiny, tmp_path):
    assert _load(tiny, "gguf").vision is not None
    assert load_model(tiny["gguf"], vision=False).vision is None
    alone = tmp_path / "text.gguf"
    alone.write_bytes(tiny["gguf"].read_bytes())
    assert load_model(alone).vision is None


# --- hostile images: a one-line refusal each -----------------------------------------------------
def _png(w, h):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def _one_line(e):
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("name, text, said", [
    ("notes.png", "hello, not a picture", "not an image"),  # not an image
    ("pic.svg", '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "pic.svg"),  # unsupported format
])
def test_not_an_image_or_an_unsupported_format(tmp_path, name, text, said):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ImageError) as e:
        load_image(p)
    assert said in _one_line(e)


@pytest.mark.parametrize("w, h", [(1, 1)])
def test_one_pixel_image(w, h):
    with pytest.raises(ImageError) as e:
        load_image(_png(w, h), name="dot.png")
    assert "too small" in _one_line(e)


def test_zero_size_image():
    # a PNG header that declares 0x0 pixels
    data = bytearray(_png(2, 2))
    data[16:24] = (0).to_bytes(4, "big") * 2
    with pytest.raises(ImageError) as e:
        load_image(bytes(data), name="zero.png")
    assert "zero.png" in _one_line(e)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.jpg"
    p.write_bytes(b"")
    with pytest.raises(ImageError) as e:
        load_image(p)
    assert "empty" in _one_line(e)


def test_decompression_bomb(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # same check, a cheap image
    for size in ((40, 30), (64, 64)):  # the warning band (1-2x the cap) and beyond it
        with pytest.raises(ImageError) as e:
            load_image(_png(*size), name="bomb.png")
        assert "decompression bomb" in _one_line(e)


def test_exif_orientation_is_applied():
    img = Image.fromarray(np.random.default_rng(5).integers(0, 256, (60, 90, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes())
    shown = open_image(buf.getvalue(), "photo.jpg")
    assert shown.size == (60, 90)


def test_same_pixels_same_digest_and_different_pixels_differ(tiny):
    a, b = tiny["images"]
    assert preprocess(a, BUDGET).digest == preprocess(a.copy(), BUDGET).digest
    assert preprocess(a, BUDGET).digest != preprocess(b, BUDGET).digest


def test_bf16_encoder_stays_close(tiny):
    """The CUDA runtime dtype (bf16 activations; norms in fp32 as HF): close to the float64 reference."""
    from models.gemma4_vision import load_vision_hf

    vision = load_vision_hf(tiny["folder"], dtype=torch.bfloat16)
    ours = vision.encode([preprocess(tiny["images"][0], BUDGET)])[0]
    assert ours.dtype == torch.bfloat16
    assert cosine(ours, tiny["refs"][1].embeds[0]) > 0.99


def test_a_wrong_mmproj_is_refused_in_one_line(tiny, tmp_path):
    from models.gguf import GGUFError

    with pytest.raises(GGUFError) as e:
        load_model(tiny["gguf"], mmproj=tiny["gguf"])  # the text model is no image encoder
    assert "not an mmproj file" in _one_line(e)
    with pytest.raises(GGUFError) as e:
        load_model(tiny["gguf"], mmproj=tmp_path / "missing.gguf")
    assert "missing.gguf" in _one_line(e)


def test_a_quantized_mmproj_runs_on_llama_cpp_kernels(tiny, tmp_path):
    """A Q8_0 mmproj on the CPU where llama.cpp's kernels are: its quantized matrices stay the
    file's bytes (models/formats/ggml.GGMLWeight; the tiny tower's 48-wide inputs are not whole Q8_0
    blocks, so only the FFN's down projection is quantized), dense ones stay float32, and the
    embeddings stay close to transformers' (8-bit weights and activations: cosine > 0.999)."""
    from models.formats import GGMLWeight
    from models.gemma4_vision import load_vision_gguf
    from models.runtime import ggml_available

    if not ggml_available():
        pytest.skip("llama.cpp's kernels are not available here")
    q8 = write_mmproj(tiny["folder"], tmp_path / "mmproj-q8.gguf", quant="Q8_0")
    vision = load_vision_gguf(q8, dtype=torch.float32)
    assert isinstance(vision.w["v.blk.0.ffn_down.weight"], GGMLWeight)
    assert isinstance(vision.w["v.blk.0.attn_q.weight"], torch.Tensor)
    ours = vision.encode([preprocess(tiny["images"][0], BUDGET)])[0]
    assert cosine(ours.double(), tiny["refs"][1].embeds[0]) > 0.999
