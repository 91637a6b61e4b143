"""A synthetic MoE built in memory with its expert banks in host RAM (models/synthetic.py
`host_tensors`), as `edgegem bench --synthetic 26b-a4b --device cuda --gpu-memory-budget 10GiB` and
`make gpu-check --quick` build the 26B-A4B: the plan's placement decides the banks, the loader's
form (ExpertBank over GGUF bytes) holds them, the engine decodes with host experts and the hot-expert
cache. The device side runs as Triton kernels on CPU tensors (the interpreter)."""
from __future__ import annotations

import triton_env  # noqa: F401  (TRITON_INTERPRET before triton is imported)

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.api import EngineOptions  # noqa: E402
from engine.placement import PlacementFlags  # noqa: E402
from kernels import ggml  # noqa: E402
from kernels.triton.launch import kernels_on_cpu  # noqa: E402
from models.formats import ExpertBank  # noqa: E402
from models.synthetic import synthetic_model, synthetic_specs  # noqa: E402

pytestmark = pytest.mark.skipif(not ggml.available(), reason="the host experts run on llama.cpp's kernels")


def _banks(variant: str, layers) -> frozenset:
    return frozenset(s["name"] for s in synthetic_specs(variant)
                     if s["name"].endswith("_exps.weight") and int(s["name"].split(".")[1]) in layers)


def test_placed_banks_are_host_expert_banks_of_one_random_draw_per_type_and_shape():
    """Each placed bank is an ExpertBank in host memory with the layout's type and shape; banks of
    the same type and shape hold the first one's bytes (copies, not views: each its own pages);
    the others stay device weights and the model knows its host layers."""
    host = _banks("tiny-moe", (0, 1, 4))
    model = synthetic_model("tiny-moe", "cpu", host_tensors=host)
    assert model.host_expert_layers == frozenset({0, 1, 4})
    specs = {s["name"]: s for s in synthetic_specs("tiny-moe")}
    for name in host:
        bank = model.w[name]
        assert isinstance(bank, ExpertBank) and bank.raw.device.type == "cpu" and bank.shape == specs[name]["shape"]
    a, b = model.w["blk.0.ffn_gate_up_exps.weight"], model.w["blk.4.ffn_gate_up_exps.weight"]
    assert torch.equal(a.raw, b.raw) and a.raw.data_ptr() != b.raw.data_ptr()
    assert not isinstance(model.w["blk.2.ffn_gate_up_exps.weight"], ExpertBank)


def test_a_host_tensor_that_is_not_a_bank_is_refused_before_anything_is_built():
    with pytest.raises(ValueError) as e:
        synthetic_model("tiny-moe", "cpu", host_tensors=_banks("tiny-moe", (0,)) | {"blk.0.attn_q.weight"})
    assert "only MoE expert banks" in str(e.value) and "\n" not in str(e.value)


def test_the_bench_decodes_a_synthetic_moe_with_the_plans_host_experts():
    """`gpu_bench(synthetic=, options=)`: `--cpu-moe` places every bank on the host; the decode row
    reports the crossings (one sync a layer and token), PCIe bytes, CPU expert time and the
    hot-expert cache's hits."""
    from engine.bench import gpu_bench

    with kernels_on_cpu():
        out = gpu_bench(synthetic="tiny-moe", device="cpu", prompts=(6,), contexts=(0,), decode_steps=2,
                        quantized=True, options=EngineOptions(gpu_memory_budget="1GiB",
                                                              placement=PlacementFlags(cpu_moe=True)))
    (row,) = out["decode"]
    assert row["steps"] == 2 and row["syncs_per_token"] == 6  # the 6 layers, each with host experts
    assert row["pcie_bytes_per_token"] > 0 and row["cpu_expert_ms_per_token"] > 0 and 0 <= row["hit_rate"] <= 1
    assert "host experts" in out["table"]
