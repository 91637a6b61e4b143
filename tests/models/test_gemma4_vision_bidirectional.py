"""Images on 26B-A4B / 31B (gemma4-architecture.md §3.6, gemma4-vision.md §4.4): with
`use_bidirectional_attention == "vision"` an image's soft tokens attend to each other both ways on
the sliding layers (full layers and text stay causal; `<|image>` / `<image|>` are text). Tiny
26B-like (MoE block) and 31B-like configs with a standardized vision tower, through an HF folder
and our own GGUF + mmproj, against transformers' float64 model at every position of a prompt with
one and with two images (models/image_attention.py)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from tiny_vision import (BIG_VISION, BOI, BUDGET, EOI, IMG, TEXT_26B, TEXT_31B, build_tiny_multimodal,  # noqa: E402
                         random_image, reference, write_mmproj, write_text_gguf)

from models.gemma4 import Gemma4Config, MediaRows  # noqa: E402
from models.gemma4_vision import image_rows, preprocess  # noqa: E402
from models.loader import load_model  # noqa: E402
from models.metadata import ConfigError  # noqa: E402

TEXT = [[2, 10, 11], [12, 13, 14], [15, 16, 17]]  # pieces around the image blocks
MODELS = {"26b-moe": TEXT_26B, "31b-dense": TEXT_31B}


@pytest.fixture(scope="module", params=list(MODELS))
def big(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder = root / "hf"
    model = build_tiny_multimodal(folder, MODELS[request.param], BIG_VISION)
    images = [random_image(100, 150, 0), random_image(200, 120, 1)]
    (root / "gguf").mkdir()
    gguf = write_text_gguf(folder, root / "gguf" / "tiny-big.gguf")
    write_mmproj(folder, root / "gguf" / "mmproj-tiny-big-f32.gguf")
    refs = {1: reference(model, images[:1], TEXT[:2]), 2: reference(model, images, TEXT)}
    return dict(hf=folder, gguf=gguf, images=images, refs=refs)


_loaded: dict = {}


def _load(big, form, dtype=torch.float64):
    key = (str(big[form]), dtype)
    if key not in _loaded:
        _loaded[key] = load_model(big[form], dtype=dtype)
    return _loaded[key]


def _rows(lm, images, ids) -> MediaRows:
    return image_rows(ids, lm.vision.encode([preprocess(im, BUDGET) for im in images]), lm.vision.cfg)


def _logits(lm, images, ids, **override) -> torch.Tensor:
    rows = _rows(lm, images, ids)
    if override:
        rows = MediaRows(rows.mask, rows.rows, rows.pad_id, **override)
    return lm.model.forward(ids, media=rows).double()


def _tolerance(big, form, images, ids) -> float:
    """transformers' float64 model still runs RMSNorm, softmax, RoPE angles and the pooling in
    float32 (gemma4-vision.md §7 step 3); that rounding moves its logits less than running the
    whole of our model in float32 does, so twice our own float32-vs-float64 difference bounds it."""
    f64 = _logits(_load(big, form), images, ids)
    f32 = _logits(_load(big, form, torch.float32), images, ids)
    return 2 * float((f32 - f64).abs().max())


@pytest.mark.parametrize("form", ["hf", "gguf"])
@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_at_every_position_equal_transformers_float64(big, form, n_images):
    ref = big["refs"][n_images]
    images = big["images"][:n_images]
    lm = _load(big, form)
    assert lm.model.cfg.image_bidirectional and lm.vision.cfg.standardize
    ours = _logits(lm, images, ref.ids)
    tol = _tolerance(big, form, images, ref.ids)
    diff = (ours - ref.logits).abs().amax(-1)  # [T]: every position, image rows included
    assert tol < 1e-2, tol  # a float64 comparison: far below the logits' scale (|z| up to 30)
    assert float(diff.max()) <= tol, (float(diff.max()), tol, int(diff.argmax()))


def test_causal_or_boi_eoi_in_the_block_would_fail_that_tolerance(big):
    """The two plausible wrong masks are caught: causal image tokens (E2B/E4B's rule), and
    `<|image>` / `<image|>` counted into the block. Each moves the logits 100x past the tolerance."""
    ref, images = big["refs"][2], big["images"]
    lm = _load(big, "hf")
    tol = _tolerance(big, "hf", images, ref.ids)
    ids = ref.ids
    wide = (ids == IMG) | (ids == BOI) | (ids == EOI)
    for label, override in (("causal", dict(image=None)), ("boi/eoi in the block", dict(image=wide))):
        off = float((_logits(lm, images, ids, **override) - ref.logits).abs().max())
        assert off > 100 * tol, (label, off, tol)


def test_image_rows_see_later_rows_of_their_image_and_text_before_stays_causal(big):
    """Changing the image's last soft token changes the logits at its first soft token (both
    ways), and not before the image (text stays causal)."""
    ref, images = big["refs"][1], big["images"][:1]
    lm = _load(big, "hf")
    ids = ref.ids
    rows = _rows(lm, images, ids)
    first, last = int((ids == IMG).nonzero()[0]), int((ids == IMG).nonzero()[-1])
    moved_rows = rows.rows.clone()
    moved_rows[-1] += 1.0
    a = lm.model.forward(ids, media=rows)
    b = lm.model.forward(ids, media=MediaRows(rows.mask, moved_rows, rows.pad_id, image=rows.image))
    assert last - first > lm.model.cfg.sliding_window  # the last row is beyond the first row's window
    assert float((a[first] - b[first]).abs().max()) > 1e-3
    assert torch.equal(a[:first], b[:first])


def test_use_bidirectional_attention_is_read_from_the_config(big):
    cfg = json.loads((big["hf"] / "config.json").read_text())
    assert Gemma4Config.from_hf(cfg).image_bidirectional
    cfg["text_config"]["use_bidirectional_attention"] = None
    assert not Gemma4Config.from_hf(cfg).image_bidirectional
    cfg["text_config"]["use_bidirectional_attention"] = "all"  # an encoder, not a chat model
    with pytest.raises(ConfigError, match="use_bidirectional_attention 'all'"):
        Gemma4Config.from_hf(cfg)


def test_logits_equal_llama_cpp_on_the_same_gguf(big):
    """llama.cpp (llama-cpp-python 0.3.36) over the same text GGUF, the image rows (ours, float32)
    decoded as mtmd decodes them (tiny_vision.llama_cpp_logits_with_images). Its CPU GELU reads a
    float16 table (ggml-cpu/vec.h GGML_GELU_FP16), so it differs from our float64 run already on a
    text-only prompt of the same length (~0.02-0.1 on these tiny models): twice that is the gate.
    The causal mask (E2B/E4B's rule) is off by more than ten gates."""
    pytest.importorskip("llama_cpp")
    from tiny_models import llama_cpp_logits
    from tiny_vision import llama_cpp_logits_with_images

    ref, images = big["refs"][2], big["images"]
    lm = _load(big, "gguf")
    ids = ref.ids
    rows = _rows(lm, images, ids)
    rows = MediaRows(rows.mask, rows.rows.float().double(), rows.pad_id, image=rows.image)  # what llama.cpp gets
    is_image, pieces, start, row = (ids == IMG).tolist(), [], 0, 0
    for k in range(1, len(ids) + 1):  # runs of text ids and of image rows, in order
        if k == len(ids) or is_image[k] != is_image[start]:
            if is_image[start]:
                pieces.append(rows.rows[row:row + k - start].float().numpy())
                row += k - start
            else:
                pieces.append(ids[start:k].tolist())
            start = k
    theirs = torch.from_numpy(llama_cpp_logits_with_images(big["gguf"], pieces)).double()
    ours = lm.model.forward(ids, media=rows).double()
    causal = lm.model.forward(ids, media=MediaRows(rows.mask, rows.rows, rows.pad_id)).double()
    assert theirs.shape == ours.shape
    text = torch.where(ids == IMG, torch.arange(len(ids)) % 400 + 20, ids)  # the images' places as text
    floor = float((lm.model.forward(text).double() - torch.from_numpy(llama_cpp_logits(big["gguf"], text.tolist())))
                  .abs().max())
    gate = 2 * max(floor, 1e-3)
    off = float((ours - theirs).abs().max())
    assert off <= gate, (off, floor)
    assert float((causal - theirs).abs().max()) > 10 * gate
