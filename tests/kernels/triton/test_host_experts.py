"""Host experts beside a GPU (models/host_experts.py) on a tiny 26B-A4B-shaped MoE: with the GPU's
segments as Triton kernels on CPU tensors (the interpreter), banks in host RAM on the first layer or
on every layer give the greedy tokens and logits of the all-CPU ggml runtime and of the float
reference; each layer crosses once each way with the bytes it should; a bad placement is refused."""
from __future__ import annotations

import triton_env  # noqa: F401  (TRITON_INTERPRET before triton is imported)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import ggml  # noqa: E402
from kernels.triton.launch import kernels_on_cpu  # noqa: E402
from models.host_experts import crossing_bytes, expert_mix, route  # noqa: E402
from models.loader import load_model  # noqa: E402
from models.ops import rms_norm  # noqa: E402
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4  # noqa: E402

pytestmark = pytest.mark.skipif(not ggml.available(), reason="the host experts run on llama.cpp's kernels")

# 26B-A4B-like: no PLE, no KV sharing, a MoE block on every layer; odd expert counts
MOE = TinySpec(n_layer=3, pattern=[True, True, False], n_kv_shared=0, ple_width=0, n_head=4, n_kv_head=[2, 2, 1],
               n_expert=5, n_expert_used=3, expert_ffn=160, double_wide=False, v_on_full_layers=False, tied=False)
PROMPT = [2, 17, 99, 200, 5, 301, 64, 9, 250, 33, 120]


def _banks(layers):
    return frozenset(f"blk.{i}.{n}" for i in layers for n in ("ffn_gate_up_exps.weight", "ffn_down_exps.weight"))


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    d = tmp_path_factory.mktemp("host-experts")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", MOE, seed=3), d / "q4.gguf", "Q4_K_M")


def _greedy(model, n=4):
    ids, rows = list(PROMPT), []
    for _ in range(n):
        logits = model.forward(torch.tensor(ids))[-1].double()
        rows.append(logits)
        ids.append(int(logits.argmax()))
    return ids[len(PROMPT):], torch.stack(rows)


@pytest.mark.parametrize("layers", [(0,), (0, 1, 2)])
def test_host_experts_give_the_cpu_runtimes_tokens_and_logits(q4, layers):
    cpu = load_model(q4, weight_dtype=torch.float16, cpu_quant=True, with_tokenizer=False).model
    ref = load_model(q4, dtype=torch.float64, with_tokenizer=False).model
    hybrid = load_model(q4, quantized=True, with_tokenizer=False, host_tensors=_banks(layers)).model
    assert hybrid.host_expert_layers == frozenset(layers)
    assert all(hybrid.w[n].raw.device.type == "cpu" for n in _banks(layers))
    want_ids, want = _greedy(cpu)
    exact_ids, exact = _greedy(ref)
    with kernels_on_cpu():
        got_ids, got = _greedy(hybrid)
    assert got_ids == want_ids == exact_ids
    # Only the experts go through ggml (8-bit activations in its K-quant dots, GELU by an f16
    # table), the rest is the kernels' float32: the hybrid is no further from the float64
    # reference than the all-ggml runtime is, and within twice that of the runtime itself.
    def dist(a, b):
        return float((1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).max())

    assert 0 < dist(got, exact) <= dist(want, exact)
    assert dist(got, want) <= 2 * dist(want, exact)


def _expert_part_f64(w, b, r, ids, wts, eps, I):
    """rms_norm(sum_k w * down(gelu_tanh(gate) * up)) * post_2 in float64, expert by expert."""
    z = rms_norm(r.double(), w[b + "pre_ffw_norm_2.weight"].double(), eps)
    h2 = torch.zeros_like(z)
    scale = w.get(b + "ffn_down_exps.scale")
    for t in range(r.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = z[t] @ w[b + "ffn_gate_up_exps.weight"][e].dense(torch.float64).T
            act = torch.nn.functional.gelu(gu[:I], approximate="tanh") * gu[I:]
            y = act @ w[b + "ffn_down_exps.weight"][e].dense(torch.float64).T
            h2[t] += float(wts[t, j]) * y * (float(scale[e]) if scale is not None else 1.0)
    return rms_norm(h2, w[b + "post_ffw_norm_2.weight"].double(), eps)


def test_the_host_graph_computes_the_experts_the_router_chose(q4):
    """The host part alone against its formula in float64 on the same ids and weights: ggml's
    K-quant dots round the activations to 8 bits (a 1/127 step of each block's largest) and its
    GELU reads an f16 table, so rows agree to ~1e-2 of their scale, not to the last bit."""
    cpu = load_model(q4, weight_dtype=torch.float16, cpu_quant=True, with_tokenizer=False).model
    ref = load_model(q4, dtype=torch.float32, with_tokenizer=False).model
    r = torch.from_numpy(np.random.default_rng(7).standard_normal((5, MOE.d_model)).astype(np.float32))
    for i in range(MOE.n_layer):
        b, eps = f"blk.{i}.", ref.cfg.rms_eps
        ids, wts = route(ref, i, r)
        assert ids.shape == (5, MOE.n_expert_used) and torch.allclose(wts.sum(-1), torch.ones(5))
        mix = expert_mix(cpu.w, b, r, ids.to(torch.int32).contiguous(), wts.contiguous(), eps)
        want = _expert_part_f64(ref.w, b, r, ids, wts, eps, MOE.expert_ffn)
        err = (mix.double() - want).abs().max() / want.abs().max()
        assert err < 3e-2, (i, float(err))  # 1.7e-2 seen (AVX2): the 8-bit rounding, not a wrong expert
        cos = torch.nn.functional.cosine_similarity(mix.double(), want, dim=-1)
        assert cos.min() > 0.999, cos


def test_each_host_layer_crosses_once_each_way_with_its_bytes(q4):
    hybrid = load_model(q4, quantized=True, with_tokenizer=False, host_tensors=_banks((0, 2))).model
    with kernels_on_cpu():
        hybrid.forward(torch.tensor(PROMPT))  # a prefill chunk: T rows a crossing
        before = dict(hybrid.host_traffic)
        hybrid.forward(torch.tensor(PROMPT[:1]))  # one row
    after = hybrid.host_traffic
    up, down = crossing_bytes(MOE.d_model, MOE.n_expert_used, 1)
    assert after["crossings"] - before["crossings"] == 2
    assert (after["to_host"] - before["to_host"], after["to_device"] - before["to_device"]) == (2 * up, 2 * down)
    assert before["to_host"] == 2 * crossing_bytes(MOE.d_model, MOE.n_expert_used, len(PROMPT))[0]
    assert crossing_bytes(2816, 8) == (11328, 11264)  # 26B-A4B decode: d 2816, top-8


def test_only_expert_banks_stay_on_the_host_and_a_dense_model_has_none(q4, tmp_path):
    with pytest.raises(ValueError) as e:
        load_model(q4, quantized=True, with_tokenizer=False, host_tensors=frozenset({"blk.0.attn_q.weight"}))
    assert "only MoE expert banks" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        load_model(q4, quantized=True, with_tokenizer=False, host_tensors=_banks((7,)))
    assert "no such expert bank" in str(e.value)
    dense = write_tiny_gemma4(tmp_path / "dense.gguf", TinySpec(n_layer=2, pattern=[True, False], n_kv_shared=0,
                                                                ple_width=0), seed=1)
    with pytest.raises(ValueError):
        load_model(dense, with_tokenizer=False, host_tensors=_banks((0,)))


@pytest.mark.parametrize("slots", [2, 5])
def test_a_hot_expert_cache_splits_the_mix_and_keeps_the_answer(q4, slots):
    """Cached experts computed on the device, the misses by the CPU graph: the same greedy tokens
    as without the cache, logits as close to the reference, hits counted; with a slot for every
    expert, after the first forward every pick is a hit and nothing crosses to the host."""
    from models.expert_cache import ExpertCache
    from models.host_experts import cache_banks

    plain = load_model(q4, quantized=True, with_tokenizer=False, host_tensors=_banks((0, 1, 2))).model
    cached = load_model(q4, quantized=True, with_tokenizer=False, host_tensors=_banks((0, 1, 2))).model
    cached.expert_cache = ExpertCache(cache_banks(cached), slots)
    ref = load_model(q4, dtype=torch.float64, with_tokenizer=False).model
    exact_ids, exact = _greedy(ref, 2)
    with kernels_on_cpu():
        want_ids, want = _greedy(plain, 2)
        got_ids, got = _greedy(cached, 2)
    assert got_ids == want_ids == exact_ids
    dist = lambda a, b: float((1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).max())  # noqa: E731
    assert dist(got, exact) <= 2 * dist(want, exact)
    stats = cached.expert_cache.stats
    assert stats.lookups == (2 * len(PROMPT) + 1) * 3 * MOE.n_expert_used and 0 < stats.hits < stats.lookups
    if slots == MOE.n_expert:
        before = dict(cached.host_traffic)
        with kernels_on_cpu():
            cached.forward(torch.tensor(PROMPT))
        after = cached.host_traffic  # every expert on the device: the picks go to the host, nothing back
        assert after["crossings"] - before["crossings"] == 3 and after["to_device"] == before["to_device"]


def test_the_engine_runs_host_experts_and_reports_the_cache(q4):
    """Through the Engine (prefill chunks, the batched decoder, Triton attention): the same greedy
    tokens as the all-CPU runtime's engine, and the status carries the crossings and hit rate."""
    from engine.sampler import SamplingParams
    from engine.scheduler import Engine, EngineConfig
    from models.expert_cache import ExpertCache
    from models.host_experts import cache_banks

    def run(model, backend):
        eng = Engine(model, None, EngineConfig(full_tokens=64, window_tokens=64, prefill_chunk=6,
                                               attention_backend=backend, batched_decode=True))
        req = eng.add(PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
        eng.run_to_completion()
        return req.output_ids, eng.status()

    want, plain = run(load_model(q4, weight_dtype=torch.float16, cpu_quant=True, with_tokenizer=False).model, "torch")
    hybrid = load_model(q4, quantized=True, with_tokenizer=False, host_tensors=_banks((0, 1, 2))).model
    hybrid.expert_cache = ExpertCache(cache_banks(hybrid), 3)
    with kernels_on_cpu():
        got, status = run(hybrid, "triton")
    assert got == want and plain["host_experts"] is None
    he = status["host_experts"]
    assert he["layers"] == 3 and he["cache_slots"] == 3 and 0 < he["hit_rate"] < 1 and he["crossings"] > 0
    assert he["to_host"] > he["to_device"] > 0 and he["cpu_ms"] > 0 and he["hits"] <= he["lookups"]


def test_the_bench_row_takes_per_token_figures_from_two_statuses():
    from engine.bench.throughput import host_expert_row

    before = {"layers": 30, "crossings": 60, "to_host": 1000, "to_device": 900, "cpu_ms": 5.0,
              "lookups": 480, "hits": 100}
    after = {"layers": 30, "crossings": 180, "to_host": 1000 + 4 * 30 * 11328, "to_device": 900 + 4 * 30 * 11264,
             "cpu_ms": 5.0 + 4 * 12.5, "lookups": 480 + 4 * 240, "hits": 100 + 4 * 60}
    row = host_expert_row(before, after, 4)
    assert row == {"pcie_bytes_per_token": 30 * (11328 + 11264), "cpu_expert_ms_per_token": 12.5,
                   "syncs_per_token": 30.0, "hit_rate": 0.25}


def test_long_chunks_stream_the_banks_and_keep_the_answer(q4):
    """Chunks of STREAM_ROWS+ rows multiply the host layers' experts from two device buffers the
    banks are copied into (double-buffered, the next bank prefetched); shorter ones stay on the
    CPU: the same greedy tokens as the all-CPU runtime, every bank copied once a chunk."""
    from models.expert_stream import ExpertStream
    from models.host_experts import cache_banks

    cpu = load_model(q4, weight_dtype=torch.float16, cpu_quant=True, with_tokenizer=False).model
    ref = load_model(q4, dtype=torch.float64, with_tokenizer=False).model
    hybrid = load_model(q4, quantized=True, with_tokenizer=False, host_tensors=_banks((0, 2))).model
    hybrid.expert_stream = ExpertStream(cache_banks(hybrid), "cpu", rows=len(PROMPT))
    biggest = max(b.raw.numel() for bs in cache_banks(hybrid).values() for b in bs)
    assert hybrid.expert_stream.buffer_bytes == 2 * biggest
    want_ids, want = _greedy(cpu, 2)
    exact_ids, exact = _greedy(ref, 2)
    with kernels_on_cpu():
        got_ids, got = _greedy(hybrid, 2)  # forwards of 11 and 12 rows: both streamed
    assert got_ids == want_ids == exact_ids
    # 2 layers x 2 banks (gate/up, down) a forward, each prefetched while the one before is used
    # (the last prefetch is the next chunk's first bank), plus the very first bank's own copy
    assert hybrid.expert_stream.copies == 1 + 2 * 4
    assert "host_traffic" not in hybrid.__dict__  # nothing went through the CPU's experts
    dist = lambda a, b: float((1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).max())  # noqa: E731
    assert dist(got, exact) < 1e-9  # the kernels' float32 and the torch experts: the reference's numbers
    with kernels_on_cpu():
        hybrid.forward(torch.tensor(PROMPT[:3]))  # 3 rows: the CPU's experts
    assert hybrid.host_traffic["crossings"] == 2


def test_a_cached_experts_product_dequantizes_in_one_kernel(q4):
    """A hot slot's expert on the device: its GGUF bytes dequantized by one Triton pass
    (kernels/triton/qdequant.py), not ~40 torch ops; the product equals the torch path's to float32
    rounding (same values, another summation order), on odd row counts."""
    from kernels.triton.launch import record_launches
    from models.formats.experts import ExpertBank

    bank = load_model(q4, quantized=True, with_tokenizer=False, host_tensors=_banks((0,))).model.w[
        "blk.0.ffn_gate_up_exps.weight"]
    assert isinstance(bank, ExpertBank)
    for rows in (1, 3):
        x = torch.randn(rows, bank.shape[2], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = bank[2].linear(x)  # the torch path (no kernels on the CPU outside kernels_on_cpu)
        with kernels_on_cpu():
            got = bank[2].linear(x)
            with record_launches() as rec:  # records the launches (it does not run them)
                bank[2].linear(x)
        assert [launch.name for launch in rec.triton] == ["_qdequant_kernel"]
        assert rec.n_torch <= 4, rec.torch_ops  # the casts and the product
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))
