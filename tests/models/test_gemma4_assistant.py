"""The Gemma 4 assistant (MTP drafter, design doc §4) against a tiny target.

The draft step is checked against an independent float64 re-implementation of §4.3/§4.4 written
plainly below (weights read with the `gguf` package's own reader, explicit einsum attention and
masks, sources hard-coded from the spec), and float32 against float64 of the model itself.
llama.cpp's own `gemma4-assistant` (an MTP context over the target's, tests/llama_cpp_mtp.py) is
the oracle of tests/models/test_gemma4_assistant_26b.py.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from tiny_models import TinySpec, write_tiny_assistant, write_tiny_gemma4

from models.kv_cache import DenseKVCache
from models.gemma4 import Gemma4Config, load_gemma4
from models.gemma4_assistant import (
    Gemma4Assistant,
    Gemma4AssistantConfig,
    ReadOnlyKV,
    load_gemma4_assistant,
)
from models.gguf import GGUFFile

N_PROMPT = 12  # > sliding window 8, so the sliding draft layers really mask
SPEC = TinySpec()  # 8 layers [S,S,S,F]x2, 4 KV-shared: sliding source 2, full source 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("asst")
    tpath = write_tiny_gemma4(d / "target.gguf", SPEC, seed=0)
    apath = write_tiny_assistant(d / "assistant.gguf", SPEC, seed=1)
    cpath = write_tiny_assistant(d / "assistant_centroids.gguf", SPEC, seed=2, n_centroids=64)
    out = {"tpath": tpath, "apath": apath, "cpath": cpath}
    prompt = torch.tensor(np.random.default_rng(3).integers(0, SPEC.n_vocab, N_PROMPT))
    for dt in (torch.float64, torch.float32):
        target = load_gemma4(GGUFFile(tpath), dtype=dt)
        cache = DenseKVCache()
        ys = {}
        target.forward(prompt, cache=cache, trace=lambda n, i, t, ys=ys: ys.setdefault(n, t))
        out[dt] = {"target": target, "cache": cache, "h": ys["result_norm"],
                   "asst": load_gemma4_assistant(GGUFFile(apath), dtype=dt)}
    return out


def _gguf_weights(path) -> dict:
    r = GGUFReader(str(path))
    return {t.name: torch.from_numpy(np.array(t.data)).to(torch.float64) for t in r.tensors}


def _rms(x, w=None, eps=1e-6):
    x = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return x if w is None else x * w


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def reference_draft(W, E_target, tok, h, P, cache, sources=(2, 2, 2, 3)):
    """§4.3 for one row, float64, plainly: 3 sliding layers (hd 64, base 1e4, window 8) then one
    full layer (hd 128, base 1e6, rope_freqs); 4 query heads over the cache's KV heads."""
    D, n_h, window = SPEC.d_model, 4, SPEC.sliding_window
    e = E_target[tok] * math.sqrt(D)
    z = W["nextn.pre_projection.weight"] @ torch.cat([e, h])
    for j in range(4):
        b, sliding = f"blk.{j}.", j < 3
        hd, base = (64, 1e4) if sliding else (128, 1e6)
        a = _rms(z, W[b + "attn_norm.weight"])
        q = _rms((W[b + "attn_q.weight"] @ a).reshape(n_h, hd), W[b + "attn_q_norm.weight"])
        half = hd // 2
        inv = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / hd)
        if not sliding:
            inv = inv / W["rope_freqs.weight"]
        cos, sin = torch.cos(P * inv), torch.sin(P * inv)
        q = torch.cat([q[:, :half] * cos - q[:, half:] * sin, q[:, half:] * cos + q[:, :half] * sin], -1)
        k, v, kpos = cache.read(sources[j])
        k, v = k.double(), v.double()
        group = n_h // k.shape[1]
        visible = kpos < P
        if sliding:
            visible &= (P - kpos) < window
        o = []
        for hh in range(n_h):
            s = torch.einsum("d,sd->s", q[hh], k[:, hh // group])
            s = torch.where(visible, s, torch.tensor(float("-inf"), dtype=s.dtype))
            o.append(torch.einsum("s,sd->d", torch.softmax(s, 0), v[:, hh // group]))
        o = torch.cat(o)
        z = z + _rms(W[b + "attn_output.weight"] @ o, W[b + "post_attention_norm.weight"])
        m = _rms(z, W[b + "ffn_norm.weight"])
        f = W[b + "ffn_down.weight"] @ (_gelu_tanh(W[b + "ffn_gate.weight"] @ m) * (W[b + "ffn_up.weight"] @ m))
        z = z + _rms(f, W[b + "post_ffw_norm.weight"])
        z = z * W[b + "layer_output_scale.weight"]
    y = _rms(z, W["output_norm.weight"])
    return W["token_embd.weight"] @ y, W["nextn.post_projection.weight"] @ y, y


class RecordingView:
    """A KV view that records which target layers are read (and can tamper with one)."""

    def __init__(self, cache, edit=None):
        self.cache, self.edit, self.layers = cache, edit, []

    def read(self, layer):
        self.layers.append(layer)
        k, v, p = self.cache.read(layer)
        return self.edit(layer, k, v, p) if self.edit else (k, v, p)


def _step(s, tokens, h, P, view=None):
    tokens = torch.as_tensor(tokens)
    return s["asst"].draft_step(tokens, h, torch.full((len(tokens),), P), s["target"],
                                view if view is not None else ReadOnlyKV(s["cache"]))


# --- configuration -------------------------------------------------------------------------

def test_config_from_gguf(setup):
    cfg = Gemma4AssistantConfig.from_gguf(GGUFFile(setup["apath"]))
    assert (cfg.n_layer, cfg.nextn_predict_layers, cfg.d_model, cfg.d_backbone) == (4, 4, 64, 256)
    assert cfg.is_sliding == (True, True, True, False) and cfg.head_dim == (64, 64, 64, 128)
    assert cfg.n_kv_head == (1,) * 4 and cfg.n_head == (4,) * 4 and cfg.sliding_window == 8
    assert cfg.rope_base == (1e4, 1e4, 1e4, 1e6) and cfg.full_rope_freq_factors[0] == 1.0
    assert cfg.vocab_size == SPEC.n_vocab and cfg.n_centroids == 0
    assert Gemma4AssistantConfig.from_gguf(GGUFFile(setup["cpath"])).n_centroids == 64
    assert cfg.validate_against(setup[torch.float64]["target"].cfg) == (2, 2, 2, 3)


def test_from_hf_e2b_routes_to_13_and_14():
    target = Gemma4Config.from_hf({"text_config": {
        "num_hidden_layers": 35, "hidden_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 1,
        "head_dim": 256, "global_head_dim": 512, "intermediate_size": 6144, "num_kv_shared_layers": 20,
        "hidden_size_per_layer_input": 256, "sliding_window": 512}})
    asst = Gemma4AssistantConfig.from_hf({
        "backbone_hidden_size": 1536, "use_ordered_embeddings": True, "num_centroids": 2048,
        "centroid_intermediate_top_k": 32,
        "text_config": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
                        "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
                        "intermediate_size": 2048, "num_kv_shared_layers": 4, "sliding_window": 512,
                        "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}})
    assert (asst.d_model, asst.d_backbone, asst.n_centroids, asst.centroid_top_k) == (256, 1536, 2048, 32)
    assert asst.validate_against(target) == (13, 13, 13, 14)


def test_validate_against_mismatched_targets(setup):
    cfg = setup[torch.float64]["asst"].cfg
    tcfg = setup[torch.float64]["target"].cfg
    cases = [
        (dataclasses.replace(tcfg, d_model=128), "embedding_length_out 256 != target embedding_length 128"),
        (dataclasses.replace(tcfg, n_kv_head=(2,) * 8), "expects 1 KV heads x 64 dims but target layer 2"),
        (dataclasses.replace(tcfg, head_dim=(64, 64, 64, 96) * 2, rope_dims=(64, 64, 64, 96) * 2),
         "target layer 3 caches 1 x 96"),
        (dataclasses.replace(tcfg, is_sliding=(True,) * 8), "no full layer"),
    ]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            cfg.validate_against(bad)
        assert "\n" not in str(e.value)
    # A full layer that is KV-shared resolves to the last KV-owning full layer (3), not itself.
    mixed = dataclasses.replace(tcfg, is_sliding=(True, True, True, False, False, True, True, False))
    assert cfg.validate_against(mixed) == (2, 2, 2, 3)
    wrong_kv = dataclasses.replace(cfg, n_kv_head=(2,) * 4)
    with pytest.raises(ValueError, match="expects 2 KV heads"):
        wrong_kv.validate_against(tcfg)
    # (A type with layers but no KV-owning one is already refused by Gemma4Config itself.)
    with pytest.raises(ValueError, match="no sliding layer"):
        cfg.validate_against(dataclasses.replace(tcfg, is_sliding=(False,) * 8, head_dim=(128,) * 8))


# --- which target KV is read -----------------------------------------------------------------

def test_draft_reads_target_layers_2_and_3(setup):
    s = setup[torch.float64]
    view = RecordingView(s["cache"])
    _step(s, [5], s["h"][-1:], N_PROMPT, view)
    assert view.layers == [2, 2, 2, 3]


def test_wrong_source_layer_is_caught(setup, monkeypatch):
    s = setup[torch.float64]
    good = _step(s, [5], s["h"][-1:], N_PROMPT)[0]
    real = Gemma4Assistant.kv_source
    monkeypatch.setattr(Gemma4Assistant, "kv_source",
                        lambda self, j, t: 0 if self.cfg.is_sliding[j] else real(self, j, t))
    bad = _step(s, [5], s["h"][-1:], N_PROMPT)[0]
    assert (good - bad).abs().max() > 1e-2


def test_attention_visibility_llama_cpp_rule(setup):
    """Sliding: keys with P − p' < W (p' = 5..11 for P = 12, W = 8); full: every p' < P; a stale
    cache entry at p' >= P (a rejected draft not yet rolled back) is never visible."""
    s = setup[torch.float64]
    base = _step(s, [5], s["h"][-1:], N_PROMPT)[0]

    def bump(layer_sel, pos_sel):
        def edit(layer, k, v, p):
            if layer == layer_sel:
                v = v.clone()
                v[p == pos_sel] += 3.0
            return k, v, p
        return _step(s, [5], s["h"][-1:], N_PROMPT, RecordingView(s["cache"], edit))[0]

    assert torch.equal(bump(2, 4), base)            # outside the sliding window
    assert (bump(2, 5) - base).abs().max() > 1e-3   # oldest key inside the window
    assert (bump(3, 0) - base).abs().max() > 1e-3   # full layer sees position 0

    def stale(layer, k, v, p):  # an extra entry at position P
        return torch.cat([k, k[-1:] * 5]), torch.cat([v, v[-1:] + 3]), torch.cat([p, p.new_tensor([N_PROMPT])])
    assert torch.equal(_step(s, [5], s["h"][-1:], N_PROMPT, RecordingView(s["cache"], stale))[0], base)


# --- exactness -------------------------------------------------------------------------------

def test_matches_float64_reference(setup):
    s = setup[torch.float64]
    W, Wt = _gguf_weights(setup["apath"]), _gguf_weights(setup["tpath"])
    h = torch.stack([s["h"][-1], s["h"][-2] * 0.5])
    logits, h_next, y = _step(s, [5, 300], h, N_PROMPT)
    for r, tok in enumerate([5, 300]):
        rl, rh, ry = reference_draft(W, Wt["token_embd.weight"], tok, h[r], N_PROMPT, s["cache"])
        assert torch.allclose(y[r], ry, atol=1e-11, rtol=0)
        assert torch.allclose(logits[r], rl, atol=1e-10, rtol=0)
        assert torch.allclose(h_next[r], rh, atol=1e-10, rtol=0)
    # The input embedding is the TARGET's token_embd, not the assistant's (same shape would hide it).
    assert not torch.allclose(Wt["token_embd.weight"][5, :64], W["token_embd.weight"][5])


def test_float32_matches_float64(setup):
    s64, s32 = setup[torch.float64], setup[torch.float32]
    h = s64["h"][-1:]
    l64, h64, _ = _step(s64, [7], h, N_PROMPT)
    l32, h32, _ = _step(s32, [7], h.float(), N_PROMPT)
    for a, b in ((l64, l32), (h64, h32)):
        assert torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min() >= 0.99999


def test_h_recurrence_same_position(setup):
    """Step 2 takes step 1's token and h′ at the same P; the target cache is not touched."""
    s = setup[torch.float64]
    W, Wt = _gguf_weights(setup["apath"]), _gguf_weights(setup["tpath"])
    n_before = len(s["cache"])
    h0 = s["h"][-1]
    l1, h1, _ = _step(s, [9], h0[None], N_PROMPT)
    t1 = int(l1[0].argmax())
    l2, h2, _ = _step(s, [t1], h1, N_PROMPT)
    rl1, rh1, _ = reference_draft(W, Wt["token_embd.weight"], 9, h0, N_PROMPT, s["cache"])
    rl2, rh2, _ = reference_draft(W, Wt["token_embd.weight"], int(rl1.argmax()), rh1, N_PROMPT, s["cache"])
    assert t1 == int(rl1.argmax())
    assert torch.allclose(l2[0], rl2, atol=1e-10, rtol=0) and torch.allclose(h2[0], rh2, atol=1e-10, rtol=0)
    assert len(s["cache"]) == n_before
    # h matters: the same token with the bootstrap h gives other logits.
    assert (_step(s, [t1], h0[None], N_PROMPT)[0] - l2).abs().max() > 1e-3


def test_rows_with_separate_views_equal_single_rows(setup):
    s = setup[torch.float64]
    other = DenseKVCache()
    s["target"].forward(torch.arange(20, 30), cache=other)
    h = torch.stack([s["h"][-1], s["h"][-3]])
    asst = s["asst"]
    both = asst.draft_step(torch.tensor([5, 6]), h, torch.tensor([N_PROMPT, 10]), s["target"],
                           [ReadOnlyKV(s["cache"]), ReadOnlyKV(other)])
    one = asst.draft_step(torch.tensor([5]), h[:1], torch.tensor([N_PROMPT]), s["target"], ReadOnlyKV(s["cache"]))
    two = asst.draft_step(torch.tensor([6]), h[1:], torch.tensor([10]), s["target"], ReadOnlyKV(other))
    assert torch.allclose(both[0][0], one[0][0], atol=1e-12) and torch.allclose(both[0][1], two[0][0], atol=1e-12)
    assert torch.allclose(both[1][1], two[1][0], atol=1e-12)


def test_centroid_masked_logits(setup):
    s = setup[torch.float64]
    g = GGUFFile(setup["cpath"])
    asst = load_gemma4_assistant(g, dtype=torch.float64)
    W = _gguf_weights(setup["cpath"])
    logits, _, y = asst.draft_step(torch.tensor([5, 8]), s["h"][-2:], torch.full((2,), N_PROMPT),
                                   s["target"], ReadOnlyKV(s["cache"]))
    order = torch.from_numpy(np.array(W["masked_embd_ordering"].numpy(), dtype=np.int64)).reshape(64, -1)
    for r in range(2):
        dense = W["token_embd.weight"] @ y[r]
        top = (W["masked_embd_centroids.weight"] @ y[r]).topk(32).indices
        cand = order[top].reshape(-1)
        assert cand.numel() == 32 * SPEC.n_vocab // 64
        assert torch.allclose(logits[r, cand], dense[cand], atol=1e-12)
        rest = torch.ones(SPEC.n_vocab, dtype=torch.bool)
        rest[cand] = False
        assert torch.all(logits[r, rest] == dense[cand].min() - 1)


def test_hf_safetensors_assistant_equals_gguf(tmp_path):
    """An HF folder (Gemma4AssistantForCausalLM names, config with backbone_hidden_size) of the
    same weights gives the same draft step as the GGUF."""
    import json

    from safetensors.torch import save_file

    from models.kv_cache import DenseKVCache
    from models.gemma4 import load_gemma4
    from models.gemma4_assistant import load_gemma4_assistant_hf
    from tiny_models import write_tiny_gemma4

    spec = TinySpec()
    target = load_gemma4(GGUFFile(write_tiny_gemma4(tmp_path / "t.gguf", spec, seed=5)))
    apath = write_tiny_assistant(tmp_path / "a.gguf", spec, seed=6)
    f = GGUFFile(apath)
    g = load_gemma4_assistant(f)
    cfg = g.cfg
    layer_names = {v: k for k, v in {
        "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight", "layer_scalar": "layer_output_scale.weight",
    }.items()}
    tensors = {"model.embed_tokens.weight": f.load("token_embd.weight"), "model.norm.weight": f.load("output_norm.weight"),
               "pre_projection.weight": f.load("nextn.pre_projection.weight"),
               "post_projection.weight": f.load("nextn.post_projection.weight")}
    for j in range(cfg.n_layer):
        for gguf_suffix, hf_suffix in layer_names.items():
            tensors[f"model.layers.{j}.{hf_suffix}"] = f.load(f"blk.{j}.{gguf_suffix}").contiguous()
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    layer_types = ["sliding_attention" if s else "full_attention" for s in cfg.is_sliding]
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gemma4_assistant", "backbone_hidden_size": cfg.d_backbone, "use_ordered_embeddings": False,
        "text_config": {"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "layer_types": layer_types,
                        "num_attention_heads": cfg.n_head[0], "num_key_value_heads": cfg.n_kv_head[0],
                        "head_dim": spec.hd_sliding, "global_head_dim": spec.hd_full,
                        "intermediate_size": cfg.ffn_width[0], "vocab_size": cfg.vocab_size,
                        "sliding_window": cfg.sliding_window, "rms_norm_eps": 1e-6,
                        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                               "partial_rotary_factor": spec.partial_rotary}}}}))
    h_model = load_gemma4_assistant_hf(folder)
    cache = DenseKVCache()
    prompt = torch.tensor([2] + list(range(20, 33)))
    target.forward(prompt, cache=cache)
    args = (torch.tensor([40]), torch.randn(1, cfg.d_backbone), torch.tensor([len(prompt)]), target, cache)
    a, b = g.draft_step(*args), h_model.draft_step(*args)
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-5), (x - y).abs().max()
