"""Host experts beside a GPU (models/host_experts.py: llama.cpp's `-ngl 99 --n-cpu-moe N`) on a tiny
26B-A4B-like model with the other bank layout than tests/kernels/triton/test_host_experts.py's:
separate `ffn_gate_exps` / `ffn_up_exps`, Q8_0, 4 layers, 7 experts of width 96, top-2. The GPU's
segments run as Triton kernels on CPU tensors (the interpreter, `kernels_on_cpu`); the banks of the
first layers or of every layer stay as the file's bytes and go through ggml's `mul_mat_id`.

Pinned: a prompt chunk and then one-row decode steps give the greedy tokens of the all-CPU ggml
runtime and of the float64 reference, logits no further from the reference than the ggml runtime's
(with bf16 activations, as on a GPU: than the two roundings together);
the device router picks the experts the CPU graph and the float64 router pick; each host layer
crosses once each way per forward with (r, ids, weights) and the expert sum; a host tensor that is
not an expert bank is refused in one line.
"""
from __future__ import annotations

import triton_env  # noqa: F401  (TRITON_INTERPRET before triton is imported)

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import ggml  # noqa: E402
from kernels.triton.launch import kernels_on_cpu  # noqa: E402
from models import host_experts  # noqa: E402
from models.formats import ExpertBank  # noqa: E402
from models.gemma4_ggml import ggml_route  # noqa: E402
from models.kv_cache import DenseKVCache  # noqa: E402
from models.loader import load_model  # noqa: E402
from models.ops import linear, rms_norm  # noqa: E402
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4  # noqa: E402

pytestmark = pytest.mark.skipif(not ggml.available(), reason="the host experts run on llama.cpp's kernels")

SPLIT = TinySpec(n_layer=4, pattern=[True, True, True, False], n_kv_shared=0, ple_width=0, n_head=2,
                 n_kv_head=[1, 1, 1, 2], n_expert=7, n_expert_used=2, expert_ffn=96, double_wide=False,
                 v_on_full_layers=False, tied=False, fused_gate_up_exps=False)
PROMPT = [2, 41, 7, 230, 99, 5, 311, 18, 64]  # 9 rows: the prefill chunk
STEPS = 4  # one-row decode steps after it
BANKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _banks(layers) -> frozenset:
    return frozenset(f"blk.{i}.{n}" for i in layers for n in BANKS)


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    d = tmp_path_factory.mktemp("host-experts-split")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", SPLIT, seed=12), d / "q8.gguf", "Q8_0")


@pytest.fixture(scope="module")
def runtimes(q8):
    """The all-CPU ggml runtime and the float64 reference, with their greedy tokens and logits
    (seed 12: every top-2 logit gap of the reference >= 0.14; seed 11 has one of 0.05 that
    ggml's 8-bit activations close, in the ggml runtime and the hybrid alike)."""
    cpu = load_model(q8, weight_dtype=torch.float16, cpu_quant=True, with_tokenizer=False).model
    ref = load_model(q8, dtype=torch.float64, with_tokenizer=False).model
    assert (cpu.runtime.value, ref.runtime.value) == ("ggml", "reference")
    return cpu, ref, _greedy(cpu), _greedy(ref)


def _hybrid(q8, layers):
    model = load_model(q8, quantized=True, with_tokenizer=False, host_tensors=_banks(layers)).model
    assert model.runtime.value == "triton" and model.host_expert_layers == frozenset(layers)
    return model


def _greedy(model):
    """The prompt as one chunk, then STEPS one-row steps over a KV cache -> (tokens, logits
    [STEPS, V] float64: the rows each token was picked from)."""
    cache, ids, rows = DenseKVCache(), [], []
    logits = model.forward(torch.tensor(PROMPT), cache=cache)[-1]
    for _ in range(STEPS):
        rows.append(logits.double().cpu())
        ids.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(ids[-1:]), torch.tensor([len(PROMPT) + len(ids) - 1]), cache)[-1]
    return ids, torch.stack(rows)


def _dist(a, b) -> float:
    return float((1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).max())


@pytest.mark.parametrize("layers", [(0, 1), (0, 1, 2, 3)], ids=["first-2", "all"])
def test_host_experts_on_the_first_layers_decode_the_cpu_runtimes_tokens(q8, runtimes, layers):
    cpu, ref, (cpu_ids, cpu_logits), (ref_ids, ref_logits) = runtimes
    hybrid = _hybrid(q8, layers)
    with kernels_on_cpu():
        ids, logits = _greedy(hybrid)
    assert ids == cpu_ids == ref_ids
    # The hybrid's experts are the ggml runtime's nodes (8-bit activations in the Q8_0 dots, GELU
    # by ggml's f16 table); everything else is the kernels' float32, where the ggml runtime rounds
    # too. So it is no further from the float64 reference than the ggml runtime is (5% slack for
    # where the two roundings happen to cancel), and within twice that of the runtime itself.
    assert _dist(logits, ref_logits) <= 1.05 * _dist(cpu_logits, ref_logits), (
        _dist(logits, ref_logits), _dist(cpu_logits, ref_logits))
    assert _dist(logits, cpu_logits) <= 2 * _dist(cpu_logits, ref_logits)


def test_with_bfloat16_activations_host_experts_keep_the_tokens(q8, runtimes):
    """The Triton runtime's default on a GPU: bf16 activations (float32 crossing to the host, back
    to bf16 for h1 + h2). Same greedy tokens; the logits' error at most the sum of the two
    roundings, the bf16 runtime's (no host experts) and the ggml runtime's (8-bit activations)."""
    cpu_logits, (ref_ids, ref_logits) = runtimes[2][1], runtimes[3]
    bf16 = load_model(q8, dtype=torch.bfloat16, quantized=True, with_tokenizer=False).model
    hybrid = load_model(q8, dtype=torch.bfloat16, quantized=True, with_tokenizer=False,
                        host_tensors=_banks(range(SPLIT.n_layer))).model
    with kernels_on_cpu():
        plain_ids, plain_logits = _greedy(bf16)
        ids, logits = _greedy(hybrid)
    assert ids == plain_ids == ref_ids
    assert _dist(logits, ref_logits) <= _dist(plain_logits, ref_logits) + _dist(cpu_logits, ref_logits)


def _route_f64(ref, i: int, r: torch.Tensor):
    """Spec §3.8's router in float64 on the reference weights: (ids [T, k], weights [T, k])."""
    cfg, w, b = ref.cfg, ref.w, f"blk.{i}."
    u = rms_norm(r.double(), None, cfg.rms_eps) * cfg.d_model ** -0.5 * w[b + "ffn_gate_inp.scale"].double()
    p = torch.softmax(linear(u, w[b + "ffn_gate_inp.weight"].double()), dim=-1)
    top_p, top_e = p.topk(cfg.n_expert_used, dim=-1)
    return top_e, top_p / top_p.sum(-1, keepdim=True)


def test_the_device_router_picks_the_experts_of_the_cpu_graph_and_the_reference(q8, runtimes, monkeypatch):
    """Every route a prefill chunk and the decode steps take: on the same residual rows, the ids
    (best first) of the device router equal those of ggml's router nodes and of the float64
    router; the weights agree to float32 rounding of a softmax over 7 logits."""
    cpu, ref = runtimes[:2]
    hybrid = _hybrid(q8, range(SPLIT.n_layer))
    seen = []
    route = host_experts.route

    def recording(model, i, r):
        ids, wts = route(model, i, r)
        seen.append((i, r.detach().clone(), ids.clone(), wts.clone()))
        return ids, wts

    monkeypatch.setattr(host_experts, "route", recording)
    with kernels_on_cpu():
        _greedy(hybrid)
    assert len(seen) == (1 + STEPS) * SPLIT.n_layer
    assert [r.shape[0] for _, r, _, _ in seen] == [len(PROMPT)] * SPLIT.n_layer + [1] * STEPS * SPLIT.n_layer
    for i, r, ids, wts in seen:
        g_ids, g_wts = ggml_route(cpu, i, r.float().contiguous())
        f_ids, f_wts = _route_f64(ref, i, r)
        assert torch.equal(ids.long(), g_ids.long()), (i, ids, g_ids)
        assert torch.equal(ids.long(), f_ids), (i, ids, f_ids)
        assert torch.allclose(wts.double(), f_wts, rtol=0, atol=1e-5), (i, wts, f_wts)
        assert torch.allclose(wts, g_wts, rtol=0, atol=1e-5), (i, wts, g_wts)


@pytest.mark.parametrize("layers", [(1,), (0, 2, 3)], ids=["one", "three"])
def test_each_forward_crosses_once_each_way_per_host_layer(q8, layers, monkeypatch):
    """Counted at the block's two crossings (host_experts._send: r, ids and weights to the host
    staging; _receive: the CPU graph's [T, d] back): the prompt chunk and then each one-row step
    make exactly n of each, n the host layers, with the rows of the forward."""
    hybrid = _hybrid(q8, layers)
    up, down = [], []
    send, receive = host_experts._send, host_experts._receive

    def counting_send(model, r, ids, wts):
        up.append((tuple(r.shape), tuple(ids.shape), tuple(wts.shape)))
        return send(model, r, ids, wts)

    def counting_receive(model, i, r, sent, normed):
        out = receive(model, i, r, sent, normed)
        down.append(tuple(out.shape))
        return out

    monkeypatch.setattr(host_experts, "_send", counting_send)
    monkeypatch.setattr(host_experts, "_receive", counting_receive)
    d, k, n = SPLIT.d_model, SPLIT.n_expert_used, len(layers)
    cache = DenseKVCache()
    with kernels_on_cpu():
        hybrid.forward(torch.tensor(PROMPT), cache=cache)
        T = len(PROMPT)
        assert up == [((T, d), (T, k), (T, k))] * n and down == [(T, d)] * n
        for step in range(2):
            up.clear(), down.clear()
            hybrid.forward(torch.tensor([7 + step]), torch.tensor([T + step]), cache)
            assert up == [((1, d), (1, k), (1, k))] * n and down == [(1, d)] * n
    # what those crossings weigh, and for 26B-A4B (d 2816, top-8): 11,328 bytes up, 11,264 down
    assert host_experts.crossing_bytes(d, k) == (4 * d + 8 * k, 4 * d)
    assert host_experts.crossing_bytes(2816, 8) == (11328, 11264)


@pytest.mark.parametrize("name", ["blk.0.ffn_norm.weight", "blk.1.ffn_gate_inp.weight", "output.weight",
                                  "blk.2.ffn_down_exps.scale"])
def test_a_host_tensor_that_is_not_an_expert_bank_is_refused_in_one_line(q8, name):
    with pytest.raises(ValueError) as e:
        load_model(q8, quantized=True, with_tokenizer=False, host_tensors=_banks((0,)) | {name})
    msg = str(e.value)
    assert name in msg and "only MoE expert banks" in msg and "\n" not in msg


def test_host_banks_stay_the_files_bytes_on_the_cpu(q8):
    """The named banks are ExpertBanks over the file's bytes in host memory, as ggml's `mul_mat_id`
    reads them: [E, rows, cols] of Q8_0 blocks (34 bytes per 32 values)."""
    hybrid = _hybrid(q8, (0,))
    for n in _banks((0,)):
        bank = hybrid.w[n]
        assert isinstance(bank, ExpertBank) and bank.raw.device.type == "cpu", n
        E, rows, cols = bank.shape
        assert E == SPLIT.n_expert and bank.raw.numel() == E * rows * cols // 32 * 34, n


def test_a_layer_with_only_some_of_its_banks_on_the_host_is_refused_in_one_line(q8):
    """gate and up on the device with down on the host would cross [T, k, I] activations, not
    [T, d] rows: a layer's banks go to the host together."""
    with pytest.raises(ValueError) as e:
        load_model(q8, quantized=True, with_tokenizer=False,
                   host_tensors=_banks((0,)) | {"blk.2.ffn_down_exps.weight"})
    msg = str(e.value)
    assert msg.startswith("blk.2.ffn_gate_exps.weight: a layer's expert banks stay in host RAM together"), msg
    assert "\n" not in msg


@pytest.mark.cuda
@pytest.mark.skipif(triton_env.INTERPRET or not torch.cuda.is_available(),
                    reason="a CUDA device with compiled kernels: TRITON_INTERPRET=0 pytest -m cuda")
def test_on_a_gpu_each_host_layer_waits_once_and_decodes_the_cpu_runtimes_tokens(q8, runtimes, monkeypatch):
    """The model on cuda (float32 activations, as above), every layer's banks on the host: the greedy
    tokens of the ggml runtime, and inside each host layer no implicit synchronization (torch's
    sync debug mode raises on one) and exactly one explicit wait, the copies' event."""
    import models.gemma4 as gemma4

    cpu_ids = runtimes[2][0]
    model = load_model(q8, device="cuda", quantized=True, with_tokenizer=False,
                       host_tensors=_banks(range(SPLIT.n_layer))).model
    assert all(model.w[n].raw.device.type == "cpu" for n in _banks(range(SPLIT.n_layer)))
    waits = []
    synchronize = torch.cuda.Event.synchronize

    def counted(event):
        waits.append(event)
        return synchronize(event)

    def strict(model, i, r):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return host_experts.host_moe_ffn(model, i, r)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    _greedy(model)  # the first forwards copy the norm weights to the host once (`_on_host`)
    waits.clear()
    monkeypatch.setattr(gemma4, "host_moe_ffn", strict)
    ids, _ = _greedy(model)
    assert ids == cpu_ids
    assert len(waits) == (1 + STEPS) * SPLIT.n_layer
