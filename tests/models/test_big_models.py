"""The 26B-A4B and 31B: synthetic layouts at llama.cpp's Q4_K_M mix, the writer on the scaled-down
`tiny-moe`, their memory plan (context 262,144, window 1,024), and a CPU load refused when the
weights cannot fit in RAM. Full-size layouts are tensor tables only: nothing multi-gigabyte is
written or allocated."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from engine import api
from engine.kv import owning_layers, pool_unit_bytes, resolve_format
from engine.memory_plan import PlanOptions, parse_size, plan_memory
from engine.ram_check import RamTooSmall, check_host_ram, gguf_ram_bytes
from models.gemma4 import Gemma4Config
from models.gguf import GGUFFile
from models.synthetic import PUBLIC_VARIANTS, layout_tensors, synthetic_layout
from models.synthetic_gguf import write_synthetic_gguf

BIG = ("26b-a4b", "31b")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_synthetic_gguf("tiny-moe", tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", seed=3)


# --- layouts ---------------------------------------------------------------------------------
# architecture doc §1.1-1.2: (hidden, layers, heads, sliding/full KV heads, FFN, experts, used, expert FFN)
ARCH = {"26b-a4b": (2816, 30, 16, 8, 2, 2112, 128, 8, 704), "31b": (5376, 60, 32, 16, 4, 21504, 0, 0, 0)}


@pytest.mark.parametrize("name", BIG)
def test_big_layouts_have_the_documented_config(name):
    cfg = Gemma4Config.from_gguf(synthetic_layout(name))
    d, L, nh, kv_s, kv_f, ff, E, k, I = ARCH[name]
    assert (cfg.d_model, cfg.n_layer, cfg.n_expert, cfg.n_expert_used, cfg.expert_ffn_width) == (d, L, E, k, I)
    assert cfg.is_sliding == tuple((i + 1) % 6 != 0 for i in range(L))
    assert cfg.n_head == (nh,) * L and set(cfg.ffn_width) == {ff}
    assert cfg.n_kv_head == tuple(kv_s if s else kv_f for s in cfg.is_sliding)
    assert cfg.head_dim == tuple(256 if s else 512 for s in cfg.is_sliding)
    assert (cfg.context_length, cfg.sliding_window, cfg.ple_width, cfg.n_kv_shared) == (262144, 1024, 0, 0)


def test_26b_metadata_is_llama_cpps_real_26b(gemma4_vocab_path):
    """llama.cpp's vocab-only `ggml-vocab-gemma-4.gguf` carries the real 26B-A4B's hparams (spec
    [LC:vgguf]): every gemma4.* key equals the synthetic layout's (epsilon as float32; the real
    file gives the vocab size by its token list, the synthetic one as `gemma4.vocab_size`)."""
    import numpy as np

    real = {k: v for k, v in GGUFFile(gemma4_vocab_path).metadata.items() if k.startswith("gemma4.")}
    ours = {k: v for k, v in synthetic_layout("26b-a4b").metadata.items() if k.startswith("gemma4.")}
    assert ours.pop("gemma4.vocab_size") == 262144 and set(real) == set(ours)
    eps = "gemma4.attention.layer_norm_rms_epsilon"
    assert real.pop(eps) == pytest.approx(ours.pop(eps))
    for k in real:
        assert np.array_equal(np.asarray(real[k]), np.asarray(ours[k])), k


@pytest.mark.parametrize("name,params,total", [("26b-a4b", 25.23e9, 16_780_192_888),
                                                ("31b", 30.70e9, 18_671_229_168)])
def test_big_layouts_have_the_published_size(name, params, total):
    """Parameters as Google gives them (25.2 B, 30.7 B); bytes within 1% of the published llama.cpp
    Q4_K_M files (about 16.9 GB and 18.7 GB)."""
    g = synthetic_layout(name)
    assert sum(t.n_elements for t in g) == pytest.approx(params, rel=1e-3)
    assert g.total_bytes == total
    assert g.total_bytes == pytest.approx({"26b-a4b": 16.9e9, "31b": 18.7e9}[name], rel=0.01)


def test_26b_type_mix_follows_llama_quant_rules():
    g = synthetic_layout("26b-a4b")
    ty = {t.name: t.type_name for t in g}
    assert ty["token_embd.weight"] == "Q6_K" and "output.weight" not in ty  # tied head: the output's type
    assert "blk.5.attn_v.weight" not in ty and "blk.4.attn_v.weight" in ty  # V = K on full layers
    assert sum(n.endswith("attn_v.weight") for n in ty) == 25
    assert ty["blk.0.ffn_gate_inp.weight"] == "F32"  # the router is never quantized
    assert ty["blk.0.ffn_gate_up_exps.weight"] == "Q4_K" and ty["blk.0.attn_k.weight"] == "Q4_K"
    # ffn_down and ffn_down_exps share their layer's use_more_bits; rows of 2112 and 704 are not
    # whole 256-blocks, so Q6_K -> Q8_0 and Q4_K -> Q5_0 (tensor_type_fallback)
    assert ty["blk.0.ffn_down.weight"] == ty["blk.0.ffn_down_exps.weight"] == "Q8_0"
    assert ty["blk.4.ffn_down.weight"] == ty["blk.4.ffn_down_exps.weight"] == "Q5_0"
    assert g.tensor("blk.0.ffn_gate_up_exps.weight").shape == (128, 2 * 704, 2816)
    assert g.tensor("blk.0.ffn_down_exps.weight").shape == (128, 2816, 704)


@pytest.mark.parametrize("variant,types", [("tiny-moe", {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}),
                                           ("tiny-dense", {"Q4_K", "Q6_K", "F32"})])
def test_writer_output_is_what_llama_cpp_quantizes_to(tmp_path, variant, types):
    """The mix is llama.cpp's: its own quantizer, given the F32 form of the scaled-down MoE
    (26B-A4B) or dense (31B) layout, picks every tensor's type exactly as `layout_tensors` does
    (experts, fallbacks, which attn_v and ffn_down get Q6_K)."""
    pytest.importorskip("llama_cpp")
    from gguf import GGMLQuantizationType as T
    from tiny_models import quantize_gguf

    f32 = write_synthetic_gguf(variant, tmp_path / "f32.gguf", f32=True)
    got = {t.name: t.type_name for t in GGUFFile(quantize_gguf(f32, tmp_path / "q4km.gguf"))}
    assert got == {t.name: T(t.ggml_type).name for t in layout_tensors(variant)}
    assert set(got.values()) == types


def test_writer_writes_the_moe_layout_that_load_model_reads(tiny_moe):
    f, layout = GGUFFile(tiny_moe), synthetic_layout("tiny-moe")
    assert {t.name: (t.ggml_type, t.ne) for t in f} == {t.name: (t.ggml_type, t.ne) for t in layout}
    lm = api.open_model(tiny_moe, exact=True)
    assert (lm.config.n_expert, lm.config.n_expert_used, lm.config.n_kv_head[:3]) == (6, 2, (2, 2, 1))
    logits = lm.model.forward(torch.tensor([2, 17, 300, 41, 5]))
    assert logits.shape == (5, 512) and torch.isfinite(logits).all()
    assert plan_memory(f, PlanOptions(budget=parse_size("1GiB"))).to_dict() == \
        plan_memory(layout, PlanOptions(budget=parse_size("1GiB"))).to_dict() | {"model": "tiny-moe.gguf"}


def test_synthetic_choices_are_the_public_layouts():
    from app.cli import SYNTHETIC_MODELS
    assert SYNTHETIC_MODELS == PUBLIC_VARIANTS


# --- memory plan -----------------------------------------------------------------------------
@pytest.mark.parametrize("name,full,window", [("26b-a4b", 20480, 204800), ("31b", 81920, 819200)])
def test_kv_bytes_per_token_from_the_config(name, full, window):
    """bf16 KV per token (spec §1.4), summed from the config: 2 (K, V) x KV heads x head dim x 2 B."""
    cfg = Gemma4Config.from_gguf(synthetic_layout(name))
    bf16 = resolve_format("bf16")
    for sliding, want in ((False, full), (True, window)):
        layers = owning_layers(cfg, sliding)
        assert len(layers) == sum(cfg.is_sliding[i] == sliding for i in range(cfg.n_layer))  # no sharing
        assert sum(2 * cfg.n_kv_head[i] * cfg.head_dim[i] * 2 for i in layers) == want
        assert pool_unit_bytes(cfg, bf16, sliding) == want


@pytest.mark.parametrize("name,budget", [("26b-a4b", "24GiB"), ("31b", "40GiB"), ("31b", "141GiB")])
def test_window_layers_cost_the_window_not_the_context(name, budget):
    """The window pool holds W + chunk + spec margin + 2 cached windows a running request (W =
    1,024), whatever the context; the full pool takes the rest, up to (running + cached prefixes)
    x 262,144 tokens, and the longest context is min(262,144, full pool)."""
    g = synthetic_layout(name)
    cfg = Gemma4Config.from_gguf(g)
    opt = PlanOptions(budget=parse_size(budget))
    p = plan_memory(g, opt)
    run, chunk = p.options["max_running"], p.options["prefill_chunk"]
    W = 1024
    win_tokens = run * (W + chunk + opt.spec_margin + opt.prefix_windows * W)
    assert p.kv["window"]["tokens"] == win_tokens
    assert p.kv["window"]["bytes"] == win_tokens * pool_unit_bytes(cfg, resolve_format("bf16"), True)
    fixed = p.device_total - p.kv["full"]["bytes"]
    full_unit = p.kv["full"]["unit_bytes"]
    cap = (run + opt.prefix_contexts) * 262144
    assert p.kv["full"]["tokens"] == min((p.budget - fixed) // full_unit, cap)
    assert p.max_context == min(262144, p.kv["full"]["tokens"])
    assert p.context_length == 262144


def test_info_prints_the_mix_size_the_plan_and_no_fast_prefill(capsys):
    from app.cli import main
    assert main(["info", "--synthetic", "26b-a4b", "--gpu-memory-budget", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "total 16002.8 MiB (16,780,192,888 B, 16.78 GB)" in out
    assert "fast_prefill: does not apply: no KV-shared layers" in out
    assert "n_expert: 128" in out and "n_expert_used: 8" in out and "expert_ffn: 704" in out
    assert "memory plan for 26B-A4B on cuda" in out and "204800 B/token over 25 layers" in out
    assert main(["info", "--synthetic", "31b", "--gpu-memory-budget", "40GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total_bytes"] == 18_671_229_168 and d["plan"]["kv"]["full"]["unit_bytes"] == 81920
    assert d["fast_prefill"].startswith("does not apply")
    assert main(["info", "--synthetic", "e2b", "--gpu-memory-budget", "8GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fast_prefill"].startswith("applies: layers 15-34")


# --- RAM before loading ----------------------------------------------------------------------
def test_cpu_ram_needed_per_runtime():
    g = synthetic_layout("26b-a4b")
    assert gguf_ram_bytes(g, "ggml") == gguf_ram_bytes(g, "cpu_torch") == g.total_bytes  # tied: all read
    assert gguf_ram_bytes(g, "reference") == 4 * sum(t.n_elements for t in g)
    e2b = synthetic_layout("e2b")  # its PLE table stays in the file on the quantized runtimes
    assert gguf_ram_bytes(e2b, "ggml") == e2b.total_bytes - e2b.tensor("per_layer_token_embd.weight").n_bytes


def test_model_larger_than_ram_is_refused_before_loading(tiny_moe, monkeypatch):
    import engine.ram_check as ram_check

    loads = []
    monkeypatch.setattr(api, "load_model", lambda *a, **k: loads.append(a))
    monkeypatch.setattr(ram_check, "host_available", lambda: 1_000_000)
    with pytest.raises(RamTooSmall) as e:
        api.open_model(tiny_moe, exact=False, device="cpu")
    msg = str(e.value)
    need = gguf_ram_bytes(GGUFFile(tiny_moe), "ggml" if "ggml" in msg else "cpu_torch")
    assert "\n" not in msg and msg.startswith("tiny-moe.gguf: its weights need")
    assert f"{need / 1e6:.1f} MB of RAM" in msg and "1.0 MB is available" in msg
    assert (e.value.needed, e.value.budget) == (need, 1_000_000)
    assert api.load_error_kind(e.value) is api.ErrorKind.CAPACITY
    assert loads == []  # refused before any tensor was read


def test_refusal_counts_float32_for_exact_and_lets_a_fitting_model_load(tiny_moe):
    g = GGUFFile(tiny_moe)
    exact = gguf_ram_bytes(g, "reference")
    check_host_ram(tiny_moe, "reference", available=exact)  # exactly enough: loads
    with pytest.raises(RamTooSmall):
        check_host_ram(tiny_moe, "reference", available=exact - 1)
    check_host_ram(tiny_moe, "ggml", available=exact - 1)  # the quantized runtime needs less


def test_hf_folder_counts_its_safetensors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4321)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RamTooSmall, match="0.0 MB of RAM"):
        check_host_ram(tmp_path, "cpu_torch", available=4320)
    check_host_ram(tmp_path, "cpu_torch", available=4321)


def test_big_layout_through_replace_keeps_window_bound():
    """A longer model context (a GGUF with context_length raised) does not grow the window pool."""
    g = synthetic_layout("31b")
    cfg = Gemma4Config.from_gguf(g)
    opt = PlanOptions(budget=parse_size("60GiB"))
    a = plan_memory(g, opt, cfg)
    b = plan_memory(g, opt, replace(cfg, context_length=4 * 262144))
    assert a.kv["window"] == b.kv["window"] and b.kv["full"]["cap"] == 4 * a.kv["full"]["cap"]


def test_decode_bytes_count_only_the_used_experts():
    """A decode token reads its top k of E experts: the bench's bytes per token count k/E of each
    expert bank (tiny-moe: 2 of 6), all of every other device weight."""
    from engine.bench.throughput import device_weight_bytes
    from models.synthetic import synthetic_model

    model = synthetic_model("tiny-moe", quantized=False)
    banks = sum(w.numel() * w.element_size() for n, w in model.w.items() if n.endswith("_exps.weight"))
    rest = sum(w.numel() * w.element_size() for n, w in model.w.items() if not n.endswith("_exps.weight"))
    assert banks and device_weight_bytes(model) == pytest.approx(rest + banks * 2 / 6, abs=64)


def test_cpu_bench_refuses_a_synthetic_model_larger_than_ram_before_writing(monkeypatch, tmp_path):
    import engine.ram_check as ram_check
    from engine.bench.cpu import synthetic_gguf

    monkeypatch.setattr(ram_check, "host_available", lambda: 16 * 10 ** 9)  # a 16 GB machine
    with pytest.raises(RamTooSmall, match=r"^synthetic-31b: its weights need 18.7 GB of RAM .* 16.0 GB is available"):
        with synthetic_gguf("31b", tmp_path / "31b.gguf"):
            pass
    assert not (tmp_path / "31b.gguf").exists()


def test_run_prints_the_refusal_in_one_line_and_exits_2(tiny_moe, monkeypatch, capsys):
    import engine.ram_check as ram_check
    from app.cli import main

    monkeypatch.setattr(ram_check, "host_available", lambda: 2 * 10 ** 6)
    assert main(["run", "--model", str(tiny_moe), "--device", "cpu", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    need = gguf_ram_bytes(GGUFFile(tiny_moe), "ggml")
    assert len(err) == 1 and err[0].startswith(f"edgegem: error: tiny-moe.gguf: its weights need {need / 1e6:.1f} MB")
    assert "2.0 MB is available" in err[0]
