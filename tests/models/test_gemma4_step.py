"""A Gemma-4 decode token as one ggml graph (models/gemma4_ggml.py `fused_decode_step`: every
layer, the final norm and the head) against the layer by layer graphs it replaces: the same nodes
in the same order, so the engine's tokens and log-probabilities are bit for bit the same. Three
tiny shapes quantized by llama.cpp: an E2B-like model (per-layer inputs, KV-shared layers reading
their source's window, double-wide MLP), a 26B-like MoE and a 31B-like dense one (K = V on its
full layers); two requests decoded together, the longer past a 64-key bucket of its full layers
(the token's graph is rebuilt on the way)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import ggml
from kernels.env import reload
from tests.models.test_ggml_layer import decode_greedy
from tests.models.test_ggml_step import step_rows
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4

pytestmark = pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")

SHAPES = {
    "e2b": TinySpec(n_layer=6, pattern=[True, True, False, True, True, False], n_kv_shared=3, ple_width=16,
                    n_head=4, n_kv_head=2, hd_sliding=32, hd_full=64, ffn=96, fused_qkv=True),
    "26b": TinySpec(n_layer=3, pattern=[True, True, False], n_kv_shared=0, ple_width=0, n_head=4,
                    n_kv_head=[2, 2, 1], n_expert=5, n_expert_used=3, expert_ffn=160, double_wide=False,
                    v_on_full_layers=False, tied=False),
    "31b": TinySpec(n_layer=4, pattern=[True, False, True, False], n_kv_shared=0, ple_width=0, n_head=4,
                    n_kv_head=[2, 1, 2, 1], double_wide=False, v_on_full_layers=False, softcap=None),
}


class _Lm:  # what decode_greedy reads of an opened model
    def __init__(self, model):
        self.model = model


@pytest.fixture(scope="module", params=sorted(SHAPES))
def tiny(request, tmp_path_factory):
    from models.loader import load_model

    d = tmp_path_factory.mktemp(f"step-{request.param}")
    path = quantize_gguf(write_tiny_gemma4(d / "f32.gguf", SHAPES[request.param], seed=7), d / "q.gguf", "Q4_K_M")
    lm = load_model(path, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True)
    assert lm.model.runtime.value == "ggml"
    return request.param, _Lm(lm.model)


def test_one_graph_a_token_gives_the_layer_by_layer_bits(tiny, monkeypatch):
    from models import gemma4

    name, lm = tiny
    rng = np.random.default_rng(3)
    prompts = ([2] + rng.integers(11, 300, size=57).tolist(), [2] + rng.integers(11, 300, size=6).tolist())
    ran = step_rows(monkeypatch, gemma4.Gemma4Model)
    whole = decode_greedy(lm, prompts, 12)
    assert sum(ran) >= 2 * 11 and all(ran) and max(ran) == 2, name  # every decode token, the two together
    monkeypatch.setenv("EDGEGEM_CPU_STEP_GRAPH", "0")
    reload()
    layers = decode_greedy(lm, prompts, 12)
    assert whole == layers, name
    assert all(len(ids) == 12 for ids, _ in whole)
