"""The assistant draft for a 26B-A4B-like target (design doc §4.1/§4.2), on tiny random GGUFs.

Target: MoE block on every layer, no KV-shared layers, no per-layer inputs, [S,S,S,S,S,F] (the
26B's 5:1 period), K = V on the full layer, per-layer KV heads as an array (2 sliding, 1 full).
Assistant: 4 dense layers [S,S,S,F], its own hidden size 96 against the target's 256 (the 26B's
assistant: 1024 against 2816), per-layer KV heads as the layers it reads (2, 2, 2, 1). With no KV
sharing in the target the draft reads simply its last sliding and last full layer (4 and 5; the
26B: 28 and 29), which is also llama.cpp's rule (n_layer-2, n_layer-1).

Against llama.cpp's own `gemma4-assistant` (tests/llama_cpp_mtp.py), on the SAME inputs: the KV
that llama.cpp's draft attention read (captured from its graph) and llama.cpp's h. The only
difference then is the arithmetic: float64 here, float32 with ggml's GELU there, which looks its
result up in a float16 table (input and output rounded to float16: a relative error up to 2^-11
per element, ggml-cpu `ggml_vec_gelu_f32` / GEGLU under GGML_GELU_FP16). The tolerance is that
format's: 2 x 2^-11 of the largest value. With the same float16 rounding emulated here the two
agree to float32 rounding, which shows the table is the whole difference.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.gemma4 import load_gemma4
from models.gemma4_assistant import Gemma4AssistantConfig, ReadOnlyKV, load_gemma4_assistant
from models.gguf import GGUFFile
from models.kv_cache import DenseKVCache
from tiny_models import TinySpec, write_tiny_assistant, write_tiny_gemma4

TARGET = TinySpec(n_layer=6, pattern=[True] * 5 + [False], n_kv_shared=0, ple_width=0, n_head=4,
                  n_kv_head=[2] * 5 + [1], n_expert=4, n_expert_used=2, expert_ffn=128, double_wide=False,
                  v_on_full_layers=False)
D_DRAFT = 96  # the assistant's own hidden size (!= the target's 256)
SOURCES = (4, 4, 4, 5)  # the target's last sliding and last full layer
N_PROMPT = 14  # > sliding window 8: the sliding draft layers really mask
GELU_FP16 = 2.0 ** -11  # relative error of ggml's float16 GELU table


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("asst26b")
    tpath = write_tiny_gemma4(d / "target.gguf", TARGET, seed=0)
    apath = write_tiny_assistant(d / "assistant.gguf", TARGET, seed=1, d_model=D_DRAFT, ffn=192)
    target = load_gemma4(GGUFFile(tpath), dtype=torch.float64)
    draft = load_gemma4_assistant(GGUFFile(apath), dtype=torch.float64)
    prompt = [2] + np.random.default_rng(3).integers(11, TARGET.n_vocab, N_PROMPT - 1).tolist()
    cache, ys = DenseKVCache(), {}
    target.forward(torch.tensor(prompt), cache=cache, trace=lambda n, i, t: ys.setdefault(n, t))
    return {"tpath": tpath, "apath": apath, "target": target, "draft": draft, "prompt": prompt,
            "cache": cache, "h": ys["result_norm"]}


class RecordingView:
    def __init__(self, cache):
        self.cache, self.layers = cache, []

    def read(self, layer):
        self.layers.append(layer)
        return self.cache.read(layer)


def test_26b_like_pair_loads_and_validates(pair):
    tcfg, cfg = pair["target"].cfg, Gemma4AssistantConfig.from_gguf(GGUFFile(pair["apath"]))
    assert tcfg.n_expert == 4 and not tcfg.kv_shared_layers and tcfg.n_kv_head == (2, 2, 2, 2, 2, 1)
    assert (cfg.d_model, cfg.d_backbone) == (D_DRAFT, tcfg.d_model)
    assert cfg.is_sliding == (True, True, True, False) and cfg.n_kv_head == (2, 2, 2, 1)
    assert cfg.validate_against(tcfg) == SOURCES


def test_draft_reads_the_last_sliding_and_last_full_target_layers(pair):
    view = RecordingView(pair["cache"])
    pair["draft"].draft_step(torch.tensor([5]), pair["h"][-1:], torch.tensor([N_PROMPT]), pair["target"], view)
    assert view.layers == list(SOURCES)


def test_one_kv_head_count_for_every_layer_is_refused(tmp_path, pair):
    """A draft written with the sliding layers' 2 KV heads everywhere cannot read the full layer."""
    bad = write_tiny_assistant(tmp_path / "bad.gguf", TARGET, seed=1, d_model=D_DRAFT, n_kv_head=2)
    with pytest.raises(ValueError, match="assistant full layer 3 expects 2 KV heads x 128 dims but target layer 5"):
        Gemma4AssistantConfig.from_gguf(GGUFFile(bad)).validate_against(pair["target"].cfg)


# --- llama.cpp's gemma4-assistant ------------------------------------------------------------

def _gelu_like_ggml(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU: the float16 table (input and output rounded to float16), exact outside ±10."""
    y = F.gelu(x.half().to(x.dtype), approximate="tanh").half().to(x.dtype)
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


class CapturedKV:
    """llama.cpp's K/V of one draft step as a KV view: K [cells, n_kv*hd] in cell order, V
    transposed ([n_kv*hd, cells], its layout without flash attention); cell i holds position i."""

    def __init__(self, kv: dict, shapes: dict, n: int):
        self.kv, self.shapes, self.n = kv, shapes, n

    def read(self, layer):
        n_kv, hd = self.shapes[layer]
        k, v = self.kv[layer]
        k = k.reshape(-1, n_kv * hd)[:self.n].reshape(self.n, n_kv, hd)
        v = v.reshape(n_kv * hd, -1).T[:self.n].reshape(self.n, n_kv, hd)
        return torch.from_numpy(k.copy()).double(), torch.from_numpy(v.copy()).double(), torch.arange(self.n)


@pytest.fixture(scope="module")
def llama_chain(pair):
    """llama.cpp: the target over the prompt, then 4 chained greedy draft steps at position P."""
    from models.runtime import ggml_available

    if not ggml_available():
        pytest.skip("llama.cpp's kernels are not available here")
    from llama_cpp_mtp import LlamaCppDraftPair

    llm = LlamaCppDraftPair(pair["tpath"], pair["apath"])
    try:
        h = llm.prefill(pair["prompt"])
        steps, tok, h_in = [], 40, h[-1]
        for _ in range(4):
            logits, h_next, kv = llm.draft_step(tok, h_in, N_PROMPT)
            steps.append({"token": tok, "h": h_in, "logits": logits, "h_next": h_next, "kv": kv})
            tok, h_in = int(logits.argmax()), h_next
        return {"h": h, "steps": steps}
    finally:
        llm.close()


def _ours_on_llama_inputs(pair, step):
    tcfg = pair["target"].cfg
    shapes = {s: (tcfg.n_kv_head[s], tcfg.head_dim[s]) for s in SOURCES}
    logits, h_next, _ = pair["draft"].draft_step(
        torch.tensor([step["token"]]), torch.from_numpy(step["h"]).double()[None], torch.tensor([N_PROMPT]),
        pair["target"], CapturedKV(step["kv"], shapes, N_PROMPT))
    return logits[0].numpy(), h_next[0].numpy()


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ours).max())


def test_llama_cpp_draft_reads_the_same_target_layers(llama_chain):
    assert all(sorted(s["kv"]) == sorted(set(SOURCES)) for s in llama_chain["steps"])


def test_draft_equals_llama_cpps_on_the_same_inputs(pair, llama_chain):
    worst = 0.0
    for step in llama_chain["steps"]:
        logits, h_next = _ours_on_llama_inputs(pair, step)
        err = max(_rel(logits, step["logits"]), _rel(h_next, step["h_next"]))
        worst = max(worst, err)
        assert err <= 2 * GELU_FP16, f"relative difference {err:.3g} > 2 x 2^-11"
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] > 4 * GELU_FP16 * np.abs(logits).max():  # not a near tie
            assert logits.argmax() == step["logits"].argmax()
    print(f"26B-like draft vs llama.cpp: worst relative difference {worst:.3g} ({worst / GELU_FP16:.2f} x 2^-11)")


def test_the_difference_is_ggmls_float16_gelu(pair, llama_chain, monkeypatch):
    """With ggml's GELU rounding emulated, most steps agree to float32 rounding (an activation
    that lands on a float16 rounding boundary may still differ by one float16 step)."""
    import models.ops

    monkeypatch.setattr(models.ops, "gelu_tanh", _gelu_like_ggml)
    errs = []
    for step in llama_chain["steps"]:
        logits, h_next = _ours_on_llama_inputs(pair, step)
        errs.append(max(_rel(logits, step["logits"]), _rel(h_next, step["h_next"])))
    print("relative differences with the float16 GELU emulated:", [f"{e:.2g}" for e in errs])
    assert max(errs) <= GELU_FP16 and float(np.median(errs)) <= 2.0 ** -16


def test_draft_tokens_on_our_own_target_equal_llama_cpps(pair, llama_chain):
    """The whole pair: our float64 target's KV and h, our draft chained greedily, against
    llama.cpp's chain (every step's top-2 gap is wider than the two paths' rounding)."""
    assert _rel(pair["h"].numpy(), llama_chain["h"]) <= 2 * GELU_FP16  # the target's own GELUs
    tok, h = 40, pair["h"][-1:]
    for step in llama_chain["steps"]:
        assert tok == step["token"]
        logits, h, _ = pair["draft"].draft_step(torch.tensor([tok]), h, torch.tensor([N_PROMPT]), pair["target"],
                                                ReadOnlyKV(pair["cache"]))
        tok = int(logits[0].argmax())
        assert tok == int(step["logits"].argmax())
