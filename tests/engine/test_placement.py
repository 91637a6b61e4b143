"""Which weights stay in host RAM beside a GPU (engine/placement.py) and how the memory plan sizes
the rest around them: llama.cpp's flags, the auto order, the hot-expert cache, refusals."""
import json
import re
import subprocess
import sys

import pytest

from engine.memory_plan import GiB, BudgetTooSmall, PlanOptions, parse_size, plan_memory
from engine.placement import PlacementFlags, auto_steps, from_flags, parse_overrides, spans
from models.synthetic import synthetic_layout

INT8 = dict(kv_format="int8_per_token_head", swa_format="int8_per_token_head")


@pytest.fixture(scope="module")
def moe():
    return synthetic_layout("26b-a4b")


@pytest.fixture(scope="module")
def dense():
    return synthetic_layout("31b")


def _names(layout):
    return list(layout.tensors)


def _plan(layout, budget, **kw):
    return plan_memory(layout, PlanOptions(budget=parse_size(budget), device="cuda", **kw))


def test_overrides_read_like_llama_cpp_and_bad_ones_say_so_in_one_line():
    assert parse_overrides(["exps=CPU,attn_q=cuda0", r"blk\.3\.=gpu"]) == (
        ("exps", "cpu"), ("attn_q", "cuda"), (r"blk\.3\.", "cuda"))
    for bad in ("exps", "exps=tpu", "=cpu", "blk.(=cpu"):
        with pytest.raises(ValueError) as e:
            parse_overrides([bad])
        assert "\n" not in str(e.value) and "--override-tensor" in str(e.value)


def test_cpu_moe_and_n_cpu_moe_hold_the_banks_of_those_layers(moe):
    names = _names(moe)
    every = from_flags(names, 30, PlacementFlags(cpu_moe=True))
    banks = {n for n in names if re.search(r"ffn_(gate_up|gate|up|down)_exps\.weight$", n)}
    assert every.host == banks and every.expert_layers == tuple(range(30)) and not every.cpu_layers
    first7 = from_flags(names, 30, PlacementFlags(n_cpu_moe=7))
    assert first7.expert_layers == tuple(range(7)) and len(first7.host) == len(banks) * 7 // 30
    assert "ffn_down_exps.scale" not in " ".join(first7.host)  # the router's scales stay with the GPU
    # an override after the flags wins: layer 3's banks back on the GPU, layer 12's attention to the host
    mixed = from_flags(names, 30, PlacementFlags(n_cpu_moe=7, overrides=parse_overrides(
        [r"blk\.3\..*exps=cuda", r"blk\.12\.attn_q\.=cpu"])))
    assert mixed.expert_layers == (0, 1, 2, 4, 5, 6) and mixed.n_other == 1
    assert "1 more tensor" in mixed.describe(30)


def test_an_override_that_splits_a_layers_banks_is_refused_in_one_line(moe):
    with pytest.raises(ValueError) as e:
        from_flags(_names(moe), 30, PlacementFlags(overrides=parse_overrides([r"blk\.4\.ffn_down_exps=cpu"])))
    assert "layer 4's expert banks would be split" in str(e.value) and "\n" not in str(e.value)
    whole = from_flags(_names(moe), 30, PlacementFlags(overrides=parse_overrides([r"blk\.4\..*_exps=cpu"])))
    assert whole.expert_layers == (4,)


def test_n_gpu_layers_keeps_the_last_n_on_the_gpu_as_llama_cpp(dense):
    p = from_flags(_names(dense), 60, PlacementFlags(n_gpu_layers=25))
    assert p.cpu_layers == tuple(range(35)) and p.gpu_layers(60) == 25
    assert all(n.split(".")[1] in {str(i) for i in range(35)} for n in p.host)
    assert "whole layers 0-34" in p.describe(60)
    assert from_flags(_names(dense), 60, PlacementFlags(n_gpu_layers=99)).host == frozenset()


def test_expert_flags_on_a_dense_model_and_negative_counts_are_one_line_errors(dense):
    for flags in (PlacementFlags(cpu_moe=True), PlacementFlags(n_cpu_moe=3), PlacementFlags(n_gpu_layers=-1)):
        with pytest.raises(ValueError) as e:
            from_flags(_names(dense), 60, flags)
        assert "\n" not in str(e.value)


def test_auto_steps_go_banks_first_then_whole_layers(moe):
    steps = list(auto_steps(_names(moe), 30))
    assert not steps[0].host and steps[1].expert_layers == tuple(range(30)) and not steps[1].cpu_layers
    assert [s.cpu_layers for s in steps[2:5]] == [(0,), (0, 1), (0, 1, 2)]
    static = list(auto_steps(_names(moe), 30, partial=True))
    assert [s.expert_layers for s in static[1:4]] == [(0,), (0, 1), (0, 1, 2)]
    assert spans([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_26b_on_8gib_holds_128k_of_int8_kv_and_a_gib_of_hot_experts(moe):
    p = _plan(moe, "8GiB", ctx_size=131072, **INT8)
    pl = p.placement
    assert p.device_total <= p.budget and p.max_context >= 131072
    whole = _plan(moe, "8GiB", **INT8)  # without --ctx-size: the model's whole context first
    assert whole.max_context == 262144 and 0 < whole.placement["expert_cache_bytes"] < pl["expert_cache_bytes"]
    assert pl["host_expert_layers"] == list(range(30)) and pl["gpu_layers"] == 30
    assert pl["expert_cache_bytes"] >= GiB
    banks = sum(moe.tensor(n).n_bytes for n in moe.tensors if n.endswith("_exps.weight"))
    assert pl["host_expert_bytes"] == banks == sum(c["host_bytes"] for c in p.components
                                                     if c["name"] == "weights in host RAM")
    cache = next(c for c in p.components if c["name"] == "hot-expert cache")
    assert cache["device_bytes"] == pl["expert_cache_bytes"] and "expert slots" in cache["detail"]


def test_more_budget_never_places_more_in_host_ram(moe):
    plans = [_plan(moe, b, **INT8) for b in ("6GiB", "8GiB", "12GiB", "16GiB", "24GiB")]
    host = [p.placement["host_weight_bytes"] for p in plans]
    assert host == sorted(host, reverse=True) and [p.max_context for p in plans] == sorted(p.max_context for p in plans)
    assert [p.placement["expert_cache_bytes"] for p in plans[:4]] == sorted(p.placement["expert_cache_bytes"]
                                                                            for p in plans[:4])
    assert not plans[-1].placement["host_tensors"]  # 24 GiB holds the whole model and a full context


def test_moe_cache_off_splits_the_banks_statically_from_the_first_layer(moe):
    p = _plan(moe, "16GiB", moe_cache=0, **INT8)
    layers = p.placement["host_expert_layers"]
    assert layers == list(range(len(layers))) and 0 < len(layers) < 30
    assert p.placement["expert_cache_bytes"] == 0 and "hot-expert cache" not in [c["name"] for c in p.components]
    capped = _plan(moe, "16GiB", moe_cache=parse_size("512MiB"), **INT8)
    slot = capped.placement["expert_slot_bytes"]
    assert (512 << 20) - slot < capped.placement["expert_cache_bytes"] <= 512 << 20


def test_31b_on_12gib_puts_40_percent_of_layers_on_the_gpu_at_32k(dense):
    p = _plan(dense, "12GiB", ctx_size=32768, **INT8)
    pl = p.placement
    assert pl["gpu_layers"] >= 24 and p.max_context >= 32768 and p.device_total <= p.budget
    assert pl["cpu_layers"] == list(range(60 - pl["gpu_layers"]))
    full = next(c for c in p.components if c["name"] == "full KV pool")
    assert full["host_bytes"] > 0  # the CPU layers' KV lives in host memory
    # the same budget with the flags the plan chose gives the same plan
    same = _plan(dense, "12GiB", ctx_size=32768, placement=PlacementFlags(n_gpu_layers=pl["gpu_layers"]), **INT8)
    assert same.placement["host_tensors"] == pl["host_tensors"] and same.max_context == p.max_context


def test_e_models_keep_their_layers_on_the_gpu():
    e4b = synthetic_layout("e4b")
    with pytest.raises(BudgetTooSmall):
        _plan(e4b, "3.3GiB")


def test_a_budget_nothing_fits_refuses_in_one_line_with_what_would(dense):
    with pytest.raises(BudgetTooSmall) as e:
        _plan(dense, "1GiB")
    msg = str(e.value)
    assert "\n" not in msg and "whole layers 0-58 in host RAM" in msg and "--device cpu" in msg
    flags, changes = e.value.suggestions[-1]
    assert flags.startswith("--gpu-memory-budget")
    plan_memory(dense, PlanOptions(budget=changes["budget"], device="cuda"))  # the tip fits


def test_off_a_gpu_the_plan_places_nothing(moe):
    p = plan_memory(moe, PlanOptions(budget=parse_size("24GiB"), device="cpu",
                                     placement=PlacementFlags(cpu_moe=True)))
    assert p.placement == {} and "weights in host RAM" not in [c["name"] for c in p.components]


def test_info_json_and_text_name_the_placement():
    base = [sys.executable, "-m", "app.cli", "info", "--synthetic", "26b-a4b", "--gpu-memory-budget", "8GiB",
            "--kv-cache-dtype", "int8_per_token_head", "--swa-kv-cache-dtype", "int8_per_token_head",
            "--ctx-size", "131072"]
    out = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)["plan"]
    assert plan["max_context"] >= 131072 and plan["placement"]["gpu_layers"] == 30
    assert plan["placement"]["host_expert_layers"] == list(range(30)) and plan["placement"]["expert_cache_bytes"] >= GiB
    text = subprocess.run(base + ["--n-cpu-moe", "24"], capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    assert "placement: expert banks of layers 0-23 in host RAM; 30 of 30 layers on the GPU (--n-cpu-moe 24)" in text.stdout
    short = subprocess.run(base + ["--n-cpu-moe", "12"], capture_output=True, text=True, timeout=300)
    assert short.returncode == 2 and short.stderr.count("\n") == 1
    assert "expert banks of layers 0-11 in host RAM" in short.stderr and "try --n-cpu-moe 22," in short.stderr


MOE_SPEC = dict(n_layer=3, pattern=[True, True, False], n_kv_shared=0, ple_width=0, n_head=4, n_kv_head=[2, 2, 1],
                n_expert=5, n_expert_used=3, expert_ffn=160, double_wide=False, v_on_full_layers=False, tied=False)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from tiny_models import TinySpec, write_tiny_gemma4
    return write_tiny_gemma4(tmp_path_factory.mktemp("placement") / "moe.gguf", TinySpec(**MOE_SPEC), seed=3)


def test_cpu_moe_on_the_cpu_says_so_in_one_line_and_runs_it_all_there(tiny_moe):
    args = ["run", "--model", str(tiny_moe), "--prompt", "the", "--max-tokens", "4", "--temperature", "0",
            "--device", "cpu", "--json"]
    run = [sys.executable, "-m", "app.cli", *args]
    plain = subprocess.run(run, capture_output=True, text=True, timeout=300)
    flagged = subprocess.run(run + ["--cpu-moe", "-ot", "attn=cuda"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == flagged.returncode == 0, flagged.stderr
    notes = [line for line in flagged.stderr.splitlines() if "--cpu-moe" in line]
    assert notes == ["edgegem: --cpu-moe --override-tensor attn=cuda places weights beside a GPU; this model runs on "
                     "the cpu (no CUDA device here), so every weight is in host RAM and the CPU computes it all"]
    assert json.loads(flagged.stdout)["ids"] == json.loads(plain.stdout)["ids"]


def test_the_app_shows_the_placement_notice_in_its_loading_plan(tiny_moe):
    from dataclasses import replace

    from app.backend import EngineBackend
    from engine.api import EngineOptions

    session = EngineBackend(str(tiny_moe), replace(EngineOptions(), placement=PlacementFlags(n_cpu_moe=2)),
                            device="cpu").load(lambda frac, what: None)
    try:
        assert session.info["plan"][0].startswith("--n-cpu-moe 2 places weights beside a GPU; this model runs on the cpu")
    finally:
        session.client.close()


def test_a_cuda_load_keeps_the_planned_banks_and_whole_dense_layers_and_refuses_moe_layers(moe, dense):
    """31B's first whole layers run on the CPU beside a GPU (models/host_layers.py): the load keeps
    every tensor of them in host RAM; 26B's whole layers do not run yet: one line before the load."""
    from dataclasses import replace as with_

    from engine.api import EngineOptions, host_placement
    opts = with_(EngineOptions(), gpu_memory_budget="8GiB", kv_cache_dtype="int8_per_token_head",
                 swa_kv_cache_dtype="int8_per_token_head", ctx_size=131072)
    kept = host_placement(moe, opts)
    assert kept == {n for n in moe.tensors if n.endswith("_exps.weight")}
    assert host_placement(moe, with_(opts, gpu_memory_budget="24GiB")) == frozenset()
    layers = host_placement(dense, with_(opts, gpu_memory_budget="12GiB", ctx_size=32768))
    assert layers == {n for n in dense.tensors if n.startswith(tuple(f"blk.{i}." for i in range(28)))}
    with pytest.raises(ValueError) as e:
        host_placement(moe, with_(opts, gpu_memory_budget="4GiB"))
    msg = str(e.value)
    assert "whole layers 0-1 in host RAM" in msg and "mixture of experts" in msg and "\n" not in msg


def test_the_draft_and_the_head_stay_on_the_gpu_when_banks_leave(moe, tmp_path):
    """A draft over PCIe gains little (its head is the target's vocabulary product): the plan
    keeps the draft whole and the tied head on the device whatever it moves to host RAM."""
    from tiny_models import TinySpec, write_tiny_assistant
    draft = write_tiny_assistant(tmp_path / "draft.gguf", TinySpec(**MOE_SPEC), seed=2)
    p = _plan(moe, "8GiB", draft=draft, ctx_size=131072, **INT8)
    parts = {c["name"]: c for c in p.components}
    assert parts["draft model"]["device_bytes"] > 0 and parts["draft model"]["host_bytes"] == 0
    head = parts["token_embd (tied LM head)"]
    assert head["device_bytes"] == moe.tensor("token_embd.weight").n_bytes
    assert not any(n.startswith(("token_embd", "output")) for n in p.placement["host_tensors"])
