"""HF safetensors folders (google/gemma-4-E2B-it layout) load into the same model as the GGUF.

Each tiny GGUF is re-saved as an HF folder under the spec's §2.5 names (written out here, not
derived from `HF_LAYER_NAMES`, so a wrong table entry fails), with a config.json built like the
published one; both must give the same logits. Spec: shared/design/gemma4-architecture.md §1, §2.5.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import TinySpec, write_tiny_gemma4

from models.gemma4 import Gemma4Config
from models.gguf import (
    GGUFError,
    GGUFFile,
    MissingTensorError,
    TensorShapeError,
    UnsupportedArchitectureError,
)
from models.hf import HFCheckpoint
from models.loader import load_model

# GGUF name -> HF name (after the text prefix), per spec §2.5.
GLOBAL = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
          "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
          "per_layer_model_proj.weight": "per_layer_model_projection.weight",
          "per_layer_proj_norm.weight": "per_layer_projection_norm.weight"}
LAYER = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
         "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
         "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
         "attn_output.weight": "self_attn.o_proj.weight",
         "post_attention_norm.weight": "post_attention_layernorm.weight",
         "ffn_norm.weight": "pre_feedforward_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
         "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
         "post_ffw_norm.weight": "post_feedforward_layernorm.weight", "layer_output_scale.weight": "layer_scalar",
         "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
         "post_norm.weight": "post_per_layer_input_norm.weight"}

DEFAULT = TinySpec()  # PLE, KV sharing, double-wide MLP
NO_PLE = TinySpec(n_layer=5, pattern=[True, True, False, True, False], n_kv_shared=2, n_head=4,
                  n_kv_head=2, ple_width=0, sliding_window=5, double_wide=False)


def text_config(spec: TinySpec) -> dict:
    """The `text_config` of a published Gemma-4 checkpoint, with the tiny spec's values."""
    kv = spec.n_kv_head if isinstance(spec.n_kv_head, int) else spec.n_kv_head[0]
    return {
        "model_type": "gemma4_text", "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layer,
        "num_attention_heads": spec.n_head, "num_key_value_heads": kv, "num_global_key_value_heads": None,
        "attention_k_eq_v": False, "head_dim": spec.hd_sliding, "global_head_dim": spec.hd_full,
        "intermediate_size": spec.ffn, "use_double_wide_mlp": spec.double_wide,
        "hidden_size_per_layer_input": spec.ple_width, "vocab_size_per_layer_input": spec.n_vocab,
        "num_kv_shared_layers": spec.n_kv_shared, "vocab_size": spec.n_vocab,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in spec.layer_pattern()],
        "sliding_window": spec.sliding_window, "rms_norm_eps": 1e-6,
        "final_logit_softcapping": spec.softcap, "max_position_embeddings": 4096,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        # as published: "vision" on 26B/31B (no per-layer embeddings), null on E2B/E4B
        "use_bidirectional_attention": None if spec.ple_width else "vision",
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                               "partial_rotary_factor": spec.partial_rotary}},
    }


def write_hf(folder: Path, gguf: Path, spec: TinySpec, *, text_only=False, shared_kv_garbage=False,
             drop=(), reshape=None) -> Path:
    """Save the GGUF's tensors as a 2-shard HF folder (plus extras the loader must ignore)."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = "model." if text_only else "model.language_model."
    f = GGUFFile(gguf)
    tensors: dict[str, torch.Tensor] = {}
    for name in f.tensors:
        if name == "rope_freqs.weight":  # HF has none: it must come from partial_rotary_factor
            continue
        t = f.load(name).contiguous()
        if name in GLOBAL:
            tensors[prefix + GLOBAL[name]] = t
        else:
            _, i, rest = name.split(".", 2)
            tensors[f"{prefix}layers.{i}.{LAYER[rest]}"] = t
    g = torch.Generator().manual_seed(1)
    if not text_only:  # towers of the multimodal wrapper
        tensors["model.vision_tower.x.weight"] = torch.randn(4, 4, generator=g)
        tensors["model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"] = torch.randn(8, 4, generator=g)
        tensors["model.embed_vision.embedding_projection.weight"] = torch.randn(4, 4, generator=g)
    if shared_kv_garbage:  # allowed on KV-shared layers, must never be read
        cfg = Gemma4Config.from_hf({"text_config": text_config(spec)})
        for i in range(cfg.first_shared, cfg.n_layer):
            rows, hd = cfg.n_kv_head[i] * cfg.head_dim[i], cfg.head_dim[i]
            for hf, shape in (("k_proj", (rows, cfg.d_model)), ("v_proj", (rows, cfg.d_model)), ("k_norm", (hd,))):
                tensors[f"{prefix}layers.{i}.self_attn.{hf}.weight"] = 50 * torch.randn(*shape, generator=g)
    for name in drop:
        del tensors[name]
    if reshape:
        name, shape = reshape
        tensors[name] = torch.zeros(shape)
    names = sorted(tensors)
    shards = {f"model-0000{k + 1}-of-00002.safetensors": names[k::2] for k in range(2)}
    for shard, keys in shards.items():
        save_file({n: tensors[n] for n in keys}, str(folder / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: s for s, keys in shards.items() for n in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg_json = text_config(spec) if text_only else {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text_config(spec), "vision_config": {"model_type": "gemma4_vision"}}
    (folder / "config.json").write_text(json.dumps(cfg_json))
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """spec -> (GGUF path, its model), each written once per module."""
    cache: dict[int, tuple[Path, object]] = {}

    def get(spec: TinySpec):
        if id(spec) not in cache:
            gguf = write_tiny_gemma4(tmp_path_factory.mktemp("g4") / "tiny.gguf", spec, seed=3)
            cache[id(spec)] = gguf, load_model(gguf).model
        return cache[id(spec)]
    return get


SPECS = pytest.mark.parametrize("spec", [DEFAULT, NO_PLE], ids=["ple-shared-doublewide", "no-ple"])


def prompt(spec: TinySpec, n=30) -> torch.Tensor:
    assert n > spec.sliding_window
    return torch.randint(0, spec.n_vocab, (n,), generator=torch.Generator().manual_seed(7))


def assert_same_config(hf: Gemma4Config, gg: Gemma4Config):
    """Every field equal; rope factors and eps up to GGUF's float32 rounding (of 1e30, 1e-6)."""
    assert replace(hf, full_rope_freq_factors=None, rms_eps=0) == replace(gg, full_rope_freq_factors=None, rms_eps=0)
    assert torch.allclose(torch.tensor(hf.full_rope_freq_factors), torch.tensor(gg.full_rope_freq_factors))
    assert hf.rms_eps == pytest.approx(gg.rms_eps)


def assert_same_logits(a: torch.Tensor, b: torch.Tensor):
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    cos = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
    assert cos > 0.999999


@SPECS
@pytest.mark.parametrize("garbage", [False, True], ids=["plain", "shared-kv-garbage"])
def test_hf_folder_matches_gguf(built, spec, tmp_path, garbage):
    gguf, ref = built(spec)
    folder = write_hf(tmp_path / "hf", gguf, spec, shared_kv_garbage=garbage)
    loaded = load_model(folder)
    assert loaded.arch == "gemma4" and isinstance(loaded.source, HFCheckpoint)
    assert_same_config(loaded.config, ref.cfg)
    tok = prompt(spec)
    assert_same_logits(loaded.model.forward(tok), ref.forward(tok))


@SPECS
def test_text_only_checkpoint(built, spec, tmp_path):
    gguf, ref = built(spec)
    loaded = load_model(write_hf(tmp_path / "hf", gguf, spec, text_only=True))
    assert_same_config(loaded.config, ref.cfg)
    tok = prompt(spec)
    assert_same_logits(loaded.model.forward(tok), ref.forward(tok))


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg
    return msg


def test_errors(built, tmp_path):
    spec = DEFAULT
    gguf, _ = built(spec)
    (tmp_path / "empty").mkdir()
    with pytest.raises(GGUFError) as e:
        load_model(tmp_path / "empty")
    assert "config.json" in _one_line(e)

    no_st = tmp_path / "no_st"
    no_st.mkdir()
    (no_st / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text_config(spec)}))
    with pytest.raises(GGUFError) as e:
        load_model(no_st)
    assert "safetensors" in _one_line(e)

    missing = write_hf(tmp_path / "missing", gguf, spec, drop=["model.language_model.layers.2.self_attn.q_proj.weight"])
    with pytest.raises(MissingTensorError) as e:
        load_model(missing)
    assert "blk.2.attn_q.weight" in _one_line(e)

    bad = write_hf(tmp_path / "shape", gguf, spec,
                   reshape=("model.language_model.layers.1.mlp.up_proj.weight", (spec.ffn + 1, spec.d_model)))
    with pytest.raises(TensorShapeError) as e:
        load_model(bad)
    assert "blk.1.ffn_up.weight" in _one_line(e)

    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(other)
    assert "llama" in _one_line(e)


# --- the published configs (spec §1.1) give the literal arrays of §1.2 --------------------------
def real_config(d, L, n_kv, ff, double_wide, n_shared, period) -> dict:
    types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(L)]
    return {"model_type": "gemma4", "text_config": {
        "model_type": "gemma4_text", "hidden_size": d, "num_hidden_layers": L, "num_attention_heads": 8,
        "num_key_value_heads": n_kv, "num_global_key_value_heads": None, "attention_k_eq_v": False,
        "head_dim": 256, "global_head_dim": 512, "intermediate_size": ff, "use_double_wide_mlp": double_wide,
        "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
        "num_kv_shared_layers": n_shared, "layer_types": types, "sliding_window": 512,
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "vocab_size": 262144,
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                               "partial_rotary_factor": 0.25}}}}


E2B_SLIDING = [1, 1, 1, 1, 0] * 7
E2B_KV_SRC = list(range(15)) + [13, 13, 13, 13, 14] * 4
E4B_SLIDING = [1, 1, 1, 1, 1, 0] * 7
E4B_KV_SRC = list(range(24)) + [22, 22, 22, 22, 22, 23] * 3


@pytest.mark.parametrize("hf, sliding, ffn, kv_src, n_kv, d", [
    (real_config(1536, 35, 1, 6144, True, 20, 5), E2B_SLIDING, [6144] * 15 + [12288] * 20, E2B_KV_SRC, 1, 1536),
    (real_config(2560, 42, 2, 10240, False, 18, 6), E4B_SLIDING, [10240] * 42, E4B_KV_SRC, 2, 2560),
], ids=["E2B", "E4B"])
def test_from_hf_real_configs(hf, sliding, ffn, kv_src, n_kv, d):
    cfg = Gemma4Config.from_hf(hf)
    L = len(sliding)
    assert cfg.n_layer == L and cfg.d_model == d and cfg.vocab_size == 262144
    assert list(cfg.is_sliding) == [bool(s) for s in sliding]
    assert list(cfg.head_dim) == [256 if s else 512 for s in sliding]
    assert list(cfg.ffn_width) == ffn
    assert [cfg.kv_source(i) for i in range(L)] == kv_src
    assert list(cfg.n_kv_head) == [n_kv] * L and list(cfg.n_head) == [8] * L
    assert list(cfg.rope_base) == [1e4 if s else 1e6 for s in sliding]
    assert list(cfg.rope_dims) == list(cfg.head_dim)
    assert cfg.full_rope_freq_factors == (1.0,) * 64 + (1e30,) * 192
    assert (cfg.sliding_window, cfg.ple_width, cfg.final_softcap, cfg.rms_eps) == (512, 256, 30.0, 1e-6)
    assert (cfg.n_kv_shared, cfg.first_shared) == {35: (20, 15), 42: (18, 24)}[L]
