"""HF folders saved by current transformers (`per_layer_config`) load like the older form.

transformers 5.x no longer writes `global_head_dim` / `num_global_key_value_heads` into a Gemma-4
text config: `Gemma4TextConfig.__post_init__` turns them into per-layer overrides and
`save_pretrained` writes those as `per_layer_config` ({"03": {"head_dim": 512}}: keys are layer
indices zero-padded to one width, each holding only what differs from the global `head_dim` /
`num_key_value_heads`). `new_form` below writes that form from an old one the same way, so the
tests without transformers pin it too; with transformers installed its own `save_pretrained`
writes the folder and its float64 logits are the oracle. Spec: gemma4-architecture.md §2.8 (end).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_hf_safetensors import DEFAULT, NO_PLE, _one_line, assert_same_logits, prompt, real_config, write_hf
from tiny_models import write_tiny_gemma4

from models.gemma4 import Gemma4Config
from models.gguf import GGUFError
from models.loader import load_model


def new_form(config_json: dict) -> dict:
    """The config as transformers 5.24 `save_pretrained` writes it (configuration_gemma4.py and
    integrations/heterogeneity/configuration_utils.py: overrides equal to the global value are
    dropped, empty layers too, keys zero-padded)."""
    out = json.loads(json.dumps(config_json))
    c = out.get("text_config", out)
    hd_full = c.pop("global_head_dim", 512)
    n_kv_full = c.pop("num_global_key_value_heads", None)
    overrides = {}
    for i, kind in enumerate(c["layer_types"]):
        if kind != "full_attention":
            continue
        layer = {"head_dim": hd_full}
        if c.get("attention_k_eq_v") and n_kv_full is not None:
            layer["num_key_value_heads"] = n_kv_full
        layer = {k: v for k, v in layer.items() if v != c[k]}
        if layer:
            overrides[i] = layer
    width = len(str(max(overrides))) if overrides else 1
    c["per_layer_config"] = {str(i).zfill(width): layer for i, layer in overrides.items()}
    return out


def k_eq_v_config() -> dict:
    """31B-style: full layers have their own KV-head count, used because `attention_k_eq_v`."""
    hf = real_config(512, 12, 4, 1024, False, 0, 6)
    hf["text_config"].update(attention_k_eq_v=True, num_global_key_value_heads=2, hidden_size_per_layer_input=0)
    return hf


@pytest.mark.parametrize("hf", [real_config(1536, 35, 1, 6144, True, 20, 5),
                                real_config(2560, 42, 2, 10240, False, 18, 6), k_eq_v_config()],
                         ids=["E2B", "E4B", "k_eq_v"])
def test_per_layer_config_gives_the_same_layers_as_global_keys(hf):
    new = new_form(hf)
    assert "global_head_dim" not in new["text_config"] and new["text_config"]["per_layer_config"]
    assert Gemma4Config.from_hf(new) == Gemma4Config.from_hf(hf)


def test_the_forms_differ_where_they_should():
    """E2B's new form: only head dims (KV heads equal); k_eq_v: the full layers' KV heads too."""
    e2b = new_form(real_config(1536, 35, 1, 6144, True, 20, 5))["text_config"]["per_layer_config"]
    assert e2b == {f"{i:02d}": {"head_dim": 512} for i in range(4, 35, 5)}
    kv = Gemma4Config.from_hf(new_form(k_eq_v_config()))
    assert kv.n_kv_head == (4,) * 5 + (2,) + (4,) * 5 + (2,)
    assert kv.head_dim == (256,) * 5 + (512,) + (256,) * 5 + (512,)


def test_absent_global_head_dim_means_512_as_in_transformers():
    hf = real_config(1536, 35, 1, 6144, True, 20, 5)
    del hf["text_config"]["global_head_dim"]
    assert set(Gemma4Config.from_hf(hf).head_dim) == {256, 512}


@pytest.mark.parametrize("spec", [DEFAULT, NO_PLE], ids=["ple-shared-doublewide", "no-ple"])
def test_per_layer_config_folder_matches_gguf(spec, tmp_path):
    gguf = write_tiny_gemma4(tmp_path / "tiny.gguf", spec, seed=3)
    folder = write_hf(tmp_path / "hf", gguf, spec)
    cfg_file = folder / "config.json"
    cfg_file.write_text(json.dumps(new_form(json.loads(cfg_file.read_text()))))
    tok = prompt(spec)
    assert_same_logits(load_model(folder).model.forward(tok), load_model(gguf).model.forward(tok))


@pytest.mark.parametrize("per_layer, words", [
    ({"03": {"head_dim": 128, "intermediate_size": 64}}, "unsupported override intermediate_size"),
    ({"9": {"head_dim": 128}}, "layer 9 of a 8-layer"),
    ({"full": {"head_dim": 128}}, "'full' is not a layer index"),
])
def test_bad_per_layer_config_is_refused_in_one_line(tmp_path, per_layer, words):
    gguf = write_tiny_gemma4(tmp_path / "tiny.gguf", DEFAULT, seed=3)
    folder = write_hf(tmp_path / "hf", gguf, DEFAULT)
    cfg = new_form(json.loads((folder / "config.json").read_text()))
    cfg["text_config"]["per_layer_config"] = per_layer
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GGUFError) as e:
        load_model(folder)
    assert "per_layer_config" in _one_line(e) and words in _one_line(e)


# --- transformers itself writes the folder and gives the reference logits --------------------
def _transformers_folder(folder: Path, **overrides):
    """A random tiny Gemma4ForCausalLM saved by transformers; returns (model in float64, folder)."""
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
              num_attention_heads=2, num_key_value_heads=1, head_dim=64, global_head_dim=128, sliding_window=8,
              layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2, final_logit_softcapping=30.0,
              vocab_size_per_layer_input=384, hidden_size_per_layer_input=32, num_kv_shared_layers=4,
              use_double_wide_mlp=True, max_position_embeddings=4096)
    kw.update(overrides)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**kw))
    # transformers' init (std 0.02, unit norms) gives near-constant logits; spread every weight
    # so a wrong head dim, KV head count or norm shows in the logits.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    model.save_pretrained(folder)
    model = model.double().eval()
    if kw.get("enable_moe_block"):  # its default grouped_mm experts refuse float64
        model.set_experts_implementation("eager")
    return model, folder


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {},  # E-series: PLE, KV sharing, double-wide MLP; full layers differ in head dim only
    dict(num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=4, attention_k_eq_v=True,
         num_global_key_value_heads=2, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
         hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False),  # 31B-style
    # 26B-A4B-style: enable_moe_block on every layer, experts.gate_up_proj fused [E, 2I, d], odd sizes
    dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, attention_k_eq_v=True,
         num_global_key_value_heads=2, layer_types=["sliding_attention"] * 5 + ["full_attention"],
         hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, intermediate_size=200,
         enable_moe_block=True, num_experts=5, top_k_experts=2, moe_intermediate_size=72),
], ids=["e-series", "k_eq_v", "moe"])
def test_transformers_saved_folder_matches_transformers_logits(tmp_path, overrides):
    ref_model, folder = _transformers_folder(tmp_path / "hf", **overrides)
    saved = json.loads((folder / "config.json").read_text())
    assert "per_layer_config" in saved and "global_head_dim" not in saved  # the form under test
    tok = prompt(DEFAULT)
    with torch.no_grad():
        ref = ref_model(tok[None]).logits[0]
    ours = load_model(folder, dtype=torch.float64).model.forward(tok)
    # transformers builds its RoPE tables in float32 even for a float64 model: ~2e-5 of logits ~5.
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()

    # The same weights under the older keys give the very same model.
    old = {k: v for k, v in saved.items() if k != "per_layer_config"}
    old["global_head_dim"] = 128
    if overrides.get("attention_k_eq_v"):
        old["num_global_key_value_heads"] = 2
    (folder / "config.json").write_text(json.dumps(old))
    assert torch.equal(load_model(folder, dtype=torch.float64).model.forward(tok), ours)


# --- a tower that cannot be built: the text model loads, that medium is off -------------------
def _multimodal_folder(folder: Path, audio_channels, vision_width=None):
    """A random tiny Gemma4ForConditionalGeneration with a vision and an audio tower, saved by
    transformers; `vision_width` rewrites config.json's vision hidden_size afterwards (weights that
    no longer fit their config). Returns transformers' float64 model."""
    transformers = pytest.importorskip("transformers")
    from tiny_vision import V
    cfg = transformers.Gemma4Config(
        text_config=dict(vocab_size=V, vocab_size_per_layer_input=V, hidden_size=96, intermediate_size=160,
                         num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         global_head_dim=64, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                         sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                         "sliding_attention", "full_attention"],
                         final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=2, eos_token_id=1),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=3,
                           num_key_value_heads=3, head_dim=16, patch_size=16, pooling_kernel_size=3,
                           position_embedding_size=64),
        audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          subsampling_conv_channels=audio_channels, output_proj_dims=24))
    model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # spread the weights so the logits say something (as _transformers_folder)
        for name, p in model.named_parameters():
            p.copy_(0.5 + torch.rand(p.shape, generator=g) if p.ndim == 1 else
                    torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    if vision_width:
        c = json.loads((folder / "config.json").read_text())
        c["vision_config"]["hidden_size"] = vision_width
        (folder / "config.json").write_text(json.dumps(c))
    return model.double().eval()


@pytest.mark.slow
def test_unbuildable_audio_tower_turns_audio_off_and_keeps_the_text_model(tmp_path):
    """subsampling_conv_channels [8, 4]: transformers sizes the input projection from C0
    ((8 // 4) * 4 = 8 inputs) while its convolutions give it (128 / 4) * 4 = 128 features, so
    not even transformers can run that tower: no correct tower exists to build. The folder loads
    as a text model, with one notice."""
    ref = _multimodal_folder(tmp_path, [8, 4])
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # transformers' own tower
        ref.model.audio_tower(torch.randn(1, 40, 128, dtype=torch.float64), torch.ones(1, 40, dtype=torch.bool))
    lm = load_model(tmp_path, dtype=torch.float64)
    assert lm.audio is None and lm.vision is not None
    assert lm.notices == [f"{tmp_path.name}: audio input off: its audio tower cannot be built (shape [32, 8] "
                          "where [32, 128] was expected (tensor a.input_projection.weight))"]
    tok = torch.randint(0, 480, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(input_ids=tok[None]).logits[0]
    assert torch.allclose(lm.model.forward(tok), want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_unbuildable_vision_tower_turns_images_off(tmp_path):
    """Vision weights that do not fit their config (hidden_size rewritten 48 -> 40) and a working
    audio tower (C0 = 128, as the real ones): images off with a notice, audio still on."""
    _multimodal_folder(tmp_path, [128, 4], vision_width=40)
    lm = load_model(tmp_path)
    assert lm.vision is None and lm.audio is not None
    assert len(lm.notices) == 1 and lm.notices[0].startswith(f"{tmp_path.name}: image input off: its image tower")
    assert "\n" not in lm.notices[0]
