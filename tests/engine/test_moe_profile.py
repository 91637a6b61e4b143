"""The per-op profile's MoE split (engine/bench/moe_profile.py): the dense branch and the router
timed as graphs of their own compute what the block computes (against the float64 reference's
pieces, within the 8-bit activation rounding of ggml's products), and the split covers every MoE
layer. Timings themselves are not asserted (benchmarks measure them)."""
from __future__ import annotations

import pytest
import torch

from kernels import ggml
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4

pytestmark = pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")
MOE = TinySpec(n_layer=3, pattern=[True, True, False], n_kv_shared=0, ple_width=0, n_head=4, n_kv_head=[2, 2, 1],
               n_expert=5, n_expert_used=3, expert_ffn=160, double_wide=False, v_on_full_layers=False, tied=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from models.loader import load_model

    d = tmp_path_factory.mktemp("moeprof")
    path = quantize_gguf(write_tiny_gemma4(d / "f32.gguf", MOE, seed=3), d / "q.gguf", "Q4_K_M")
    fast = load_model(path, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
    ref = load_model(path, with_tokenizer=False, dtype=torch.float64).model
    return fast, ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b).norm(dim=-1) / b.norm(dim=-1)).max())


def test_dense_branch_and_router_graphs_compute_the_blocks_pieces(models):
    from engine.bench.moe_profile import part_runs
    from models.ops import linear, rms_norm

    fast, ref = models
    cfg, eps = ref.cfg, ref.cfg.rms_eps
    r = torch.randn(5, cfg.d_model, generator=torch.Generator().manual_seed(1)) * 3
    for i in range(cfg.n_layer):
        w, b, r64 = ref.w, f"blk.{i}.", r.double()
        runs = part_runs(fast, i, r)
        h1 = rms_norm(ref._mlp(i, rms_norm(r64, w[b + "ffn_norm.weight"], eps)), w[b + "post_ffw_norm_1.weight"], eps)
        assert _rel(runs["dense branch"](), h1) < 0.03, i
        u = rms_norm(r64, None, eps) * cfg.d_model ** -0.5 * w[b + "ffn_gate_inp.scale"].double()
        top = torch.softmax(linear(u, w[b + "ffn_gate_inp.weight"]), dim=-1).topk(cfg.n_expert_used, dim=-1)[0]
        got = runs["router"]()
        assert got.shape == (5, cfg.n_expert_used) and torch.allclose(got.sum(-1), torch.ones(5), atol=1e-6)
        assert _rel(got, top / top.sum(-1, keepdim=True)) < 0.03, i
        assert _rel(runs["whole block"](), ref._moe_ffn(i, r64)) < 0.03, i


def test_split_covers_every_moe_layer_and_adds_up(models):
    from engine.bench.moe_profile import moe_block_split

    out = moe_block_split(models[0], rows=1, repeat=1)
    assert out["layers"] == MOE.n_layer and out["rows"] == 1
    ms = out["ms"]
    assert ms["whole block"] > 0 and ms["dense branch"] > 0 and ms["router"] > 0
    assert ms["experts (mul_mat_id x2, GEGLU, mix)"] == pytest.approx(ms["whole block"] - ms["dense branch"] - ms["router"])
