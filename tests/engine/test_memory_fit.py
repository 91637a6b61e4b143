"""Tight budgets fit instead of failing (issue 14): the planner halves the prefill chunk (down to
256), then lowers the running requests (down to 1), says so in one `fitted` line, and refuses only
below that. Values the user gave are kept; the refusal then names the flag to lower."""
from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from tiny_models import TinySpec, write_tiny_gemma4

from app.backend import plan_lines
from engine import api
from engine.memory_plan import BudgetTooSmall, PlanOptions, fit_steps, parse_size, plan_memory
from models.synthetic import synthetic_layout
from models.gemma4 import Gemma4Config


@pytest.fixture(scope="module")
def layouts():
    out = {}
    for name in ("e2b", "e4b"):
        g = synthetic_layout(name)
        out[name] = g, Gemma4Config.from_gguf(g)
    return out


def steps(opt: PlanOptions) -> list[tuple[int, int]]:
    """(chunk, running) of the steps that keep the KV formats as asked."""
    return [(s.chunk, s.running) for s in fit_steps(opt) if (s.kv_format, s.swa_format) == (opt.kv_format, opt.swa_format)]


def test_fit_order_chunk_first_then_running_requests():
    cuda = steps(PlanOptions())
    assert cuda[:5] == [(2048, 4), (1024, 4), (512, 4), (256, 4), (2048, 3)] and cuda[-1] == (256, 1)
    assert len(cuda) == 16
    assert steps(PlanOptions(device="cpu", kv_format="fp32", swa_format="fp32")) == [
        (512, 4), (256, 4), (512, 3), (256, 3), (512, 2), (256, 2), (512, 1), (256, 1)]
    assert steps(PlanOptions(prefill_chunk=2048)) == [(2048, 4), (2048, 3), (2048, 2), (2048, 1)]
    assert steps(PlanOptions(max_running=2)) == [(2048, 2), (1024, 2), (512, 2), (256, 2)]
    assert steps(PlanOptions(prefill_chunk=100, max_running=8)) == [(100, 8)]  # given: kept, even below 256


def test_cpu_auto_kv_narrows_to_bf16_before_a_request_is_given_up():
    """The CPU's "auto" KV (fp32) is tried at every chunk, then bf16 from the default settings on,
    before the running requests are lowered (llama.cpp's default KV is f16)."""
    got = [(s.kv_format, s.swa_format, s.chunk, s.running) for s in fit_steps(PlanOptions(device="cpu", swa_format="auto"))]
    assert got[:3] == [("auto", "auto", 512, 4), ("auto", "auto", 256, 4), ("bf16", "bf16", 512, 4)]
    assert all(k == w == "bf16" for k, w, _, _ in got[2:]) and len(got) == 10 and got[-1][2:] == (256, 1)
    assert all(s.kv_format == "auto" for s in fit_steps(PlanOptions(device="cuda")))  # CUDA's auto is bf16 already


def test_31b_fits_a_24_gb_machine_on_bf16_kv_with_a_one_line_note():
    from engine.memory_plan import plan_memory

    g = synthetic_layout("31b")
    plan = plan_memory(g, PlanOptions(budget=int(21 * 2**30), device="cpu", kv_format="auto", swa_format="auto",
                                      dequantizes=False), Gemma4Config.from_gguf(g))
    assert plan.kv["full"]["format"] == plan.kv["window"]["format"] == "bf16"
    assert "KV auto -> bf16" in plan.fitted and plan.max_context >= 4096


FITS = [  # variant, budget, embed weights, chunk, running requests, note (synthetic Q4_K_M layouts, cuda)
    ("e2b", "2.5GiB", "host", 2048, 4, ""),
    ("e2b", "2GiB", "host", 512, 4, "fitted to the budget: prefill chunk 2048 -> 512"),
    ("e2b", "1.9GiB", "host", 256, 3, "fitted to the budget: prefill chunk 2048 -> 256, running requests 4 -> 3"),
    ("e2b", "4GiB", "device", 1024, 4, "fitted to the budget: prefill chunk 2048 -> 1024"),
    ("e4b", "4.5GiB", "host", 2048, 4, ""),
    ("e4b", "4GiB", "host", 1024, 4, "fitted to the budget: prefill chunk 2048 -> 1024"),
    ("e4b", "3.5GiB", "host", 256, 3, "fitted to the budget: prefill chunk 2048 -> 256, running requests 4 -> 3"),
    ("e4b", "3.4GiB", "host", 256, 1, "fitted to the budget: prefill chunk 2048 -> 256, running requests 4 -> 1"),
]


@pytest.mark.parametrize("variant,budget,embed,chunk,running,note", FITS)
def test_tight_budget_fits_at_the_mildest_settings(layouts, variant, budget, embed, chunk, running, note):
    g, cfg = layouts[variant]
    opt = PlanOptions(budget=parse_size(budget), embed_weights=embed)
    p = plan_memory(g, opt, cfg)
    assert (p.options["prefill_chunk"], p.options["max_running"], p.fitted) == (chunk, running, note)
    assert p.options["step_tokens"] == chunk + running * 9
    assert p.device_total <= p.budget and p.kv["full"]["tokens"] >= 4096
    assert p.to_dict()["fitted"] == note  # what `info --json` prints
    # every milder setting, planned exactly as given, does not fit
    tried = fit_steps(opt)
    chosen = [(s.chunk, s.running) for s in tried].index((chunk, running))
    for milder in tried[:chosen]:
        with pytest.raises(BudgetTooSmall):
            plan_memory(g, milder, cfg, _suggest=False)


@pytest.mark.parametrize("variant,budget,embed", [("e2b", "1.8GiB", "host"), ("e2b", "3.5GiB", "device"),
                                                  ("e4b", "3.3GiB", "host"), ("e4b", "5GiB", "device")])
def test_refused_only_below_chunk_256_and_one_request(layouts, variant, budget, embed):
    g, cfg = layouts[variant]
    opt = PlanOptions(budget=parse_size(budget), embed_weights=embed)
    with pytest.raises(BudgetTooSmall) as ei:
        plan_memory(g, opt, cfg)
    msg = str(ei.value)
    assert "\n" not in msg and "need at prefill chunk 256, 1 running request;" in msg
    assert "--prefill-chunk" not in msg and "--max-running-requests" not in msg  # the fit tried them all
    for _, overrides in ei.value.suggestions:
        plan_memory(g, replace(opt, **overrides), cfg)


def test_a_given_chunk_is_kept_and_the_running_requests_fit_around_it(layouts):
    g, cfg = layouts["e4b"]
    p = plan_memory(g, PlanOptions(budget=parse_size("4GiB"), prefill_chunk=2048), cfg)
    assert (p.options["prefill_chunk"], p.options["max_running"]) == (2048, 1)
    assert p.fitted == "fitted to the budget: running requests 4 -> 1"
    p = plan_memory(g, PlanOptions(budget=parse_size("4GiB"), max_running=2), cfg)
    assert (p.options["prefill_chunk"], p.options["max_running"], p.fitted) == (
        1024, 2, "fitted to the budget: prefill chunk 2048 -> 1024")


@pytest.mark.parametrize("given,at,flag", [
    ({"prefill_chunk": 2048}, "prefill chunk 2048, 1 running request", "--prefill-chunk 512"),
    ({"max_running": 4}, "prefill chunk 256, 4 running requests", "--max-running-requests 3"),
    ({"prefill_chunk": 2048, "max_running": 4}, "prefill chunk 2048, 4 running requests",
     "--prefill-chunk 256 --max-running-requests 3"),
])
def test_refusal_of_given_values_names_the_flag_to_lower(layouts, given, at, flag):
    g, cfg = layouts["e4b"]
    opt = PlanOptions(budget=parse_size("3.5GiB"), **given)
    with pytest.raises(BudgetTooSmall) as ei:
        plan_memory(g, opt, cfg)
    msg = str(ei.value)
    assert "\n" not in msg and f"need at {at};" in msg and flag in msg
    for _, overrides in ei.value.suggestions:  # each suggestion fits (the fit still works on the rest)
        plan_memory(g, replace(opt, **overrides), cfg)


def _fake_loaded(g, cfg, device="cuda"):
    """What engine_plan reads of a LoadedModel: the GGUF layout, its config and the model's device."""
    return SimpleNamespace(source=g, config=cfg, model=SimpleNamespace(device=torch.device(device)))


@pytest.mark.parametrize("opts,chunk,running", [
    (api.EngineOptions(gpu_memory_budget="3.5GiB"), 256, 3),
    (api.EngineOptions(gpu_memory_budget="4GiB"), 1024, 4),
    (api.EngineOptions(gpu_memory_budget="4GiB", prefill_chunk=2048), 2048, 1),
    (api.EngineOptions(gpu_memory_budget="8GiB", prefill_chunk=512, max_running_requests=2), 512, 2),
])
def test_engine_config_runs_with_the_fitted_values(layouts, opts, chunk, running):
    g, cfg = layouts["e4b"]
    lm = _fake_loaded(g, cfg)
    plan = api.engine_plan(lm, opts)[0]
    ec = api.engine_config(lm, opts)
    assert (ec.prefill_chunk, ec.max_running_requests) == (chunk, running)
    assert (ec.full_tokens, ec.window_tokens) == (plan.kv["full"]["tokens"], plan.kv["window"]["tokens"])


def test_a_loaded_cpu_model_is_planned_with_the_memory_its_weights_already_hold(layouts, monkeypatch):
    """The engine plans after the load: on the CPU the weights already took their share of
    available memory, and the plan counts them again in what it needs, so what the process holds
    (RssAnon) is counted back in. Without that a model filling most of RAM (the 26B-A4B's 16.8 GB
    on 24 GiB) was refused at engine start for its own weights."""
    from engine import memory_plan

    g, cfg = layouts["e4b"]
    lm = _fake_loaded(g, cfg, device="cpu")
    held = int(parse_size("3GiB"))  # about E4B's weights (2.8 GB)
    monkeypatch.setattr(memory_plan, "host_available", lambda: int(parse_size("2GiB")))  # what is left after the load
    monkeypatch.setattr(memory_plan, "process_anon_bytes", lambda: held)  # what the load took
    plan = api.engine_plan(lm, api.EngineOptions())[0]
    assert plan.options["budget"] == int(0.9 * parse_size("2GiB")) + held
    monkeypatch.setattr(memory_plan, "process_anon_bytes", lambda: 0)  # the same memory, weights not counted back
    with pytest.raises(BudgetTooSmall):
        api.engine_plan(lm, api.EngineOptions())


def test_app_loading_plan_says_what_was_fitted(layouts):
    g, cfg = layouts["e4b"]
    plan = plan_memory(g, PlanOptions(budget=parse_size("3.5GiB")), cfg)
    lines = plan_lines(plan, {"pools": {}, "context_limit": plan.max_context})
    assert lines[1] == "fitted to the budget: prefill chunk 2048 -> 256, running requests 4 -> 3"
    roomy = plan_memory(g, PlanOptions(budget=parse_size("8GiB")), cfg)
    assert not any("fitted" in line for line in plan_lines(roomy, {"pools": {}, "context_limit": 1}))


def edgegem(capsys, *args):
    from app.cli import main
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_info_e4b_in_4gib_shows_a_fitted_plan(capsys):
    rc, out, err = edgegem(capsys, "info", "--synthetic", "e4b", "--gpu-memory-budget", "4GiB")
    assert rc == 0, err
    assert "prefill chunk 1024, 4 running requests\n    fitted to the budget: prefill chunk 2048 -> 1024\n" in out
    rc, out, err = edgegem(capsys, "info", "--synthetic", "e4b", "--gpu-memory-budget", "4GiB", "--json")
    p = json.loads(out)["plan"]
    assert p["fitted"] == "fitted to the budget: prefill chunk 2048 -> 1024"
    assert (p["options"]["prefill_chunk"], p["options"]["max_running"]) == (1024, 4)
    rc, out, err = edgegem(capsys, "info", "--synthetic", "e4b", "--gpu-memory-budget", "3.5GiB",
                           "--prefill-chunk", "2048")
    assert rc == 2 and err.count("\n") == 1 and "--prefill-chunk 512" in err


def test_cli_run_says_it_fitted_and_runs(tmp_path, capsys):
    """A tiny model on the CPU at the exact budget of chunk 256: the default 512 is halved, stderr
    says so in one line, and the engine is built with 256."""
    from models.loader import load_model
    tiny = write_tiny_gemma4(tmp_path / "tiny.gguf", TinySpec(), seed=3)
    lm = load_model(tiny)
    with pytest.raises(BudgetTooSmall) as ei:
        exact = PlanOptions(budget=1, device="cpu", kv_format="fp32", swa_format="fp32", prefill_chunk=256, max_running=4)
        plan_memory(lm.source, exact, lm.config, _suggest=False)
    budget = str(ei.value.needed)
    ec = api.engine_config(lm, api.EngineOptions(gpu_memory_budget=budget))
    assert (ec.prefill_chunk, ec.max_running_requests) == (256, 4)
    rc, out, err = edgegem(capsys, "run", "--model", tiny, "--prompt", "the", "--max-tokens", "3",
                           "--temperature", "0", "--device", "cpu", "--gpu-memory-budget", budget, "--json")
    assert rc == 0, err
    assert "edgegem: fitted to the budget: prefill chunk 512 -> 256\n" in err
    assert len(json.loads(out.strip().splitlines()[-1])["ids"]) == 3
