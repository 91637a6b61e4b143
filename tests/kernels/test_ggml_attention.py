"""A CPU decode step's attention on llama.cpp's kernel (kernels/ggml/attention.py: ggml's
flash_attn_ext over a masked window of a KV slab) against its float64 reference, and the engine's
windows (engine/kv/sequence.SequenceKV._masked) over the pools' slots.

Tolerances follow the formats: float32 K/V: float32 sums in another order (online softmax, expf),
~1e-6 of the output's scale; float16 K/V: ggml accumulates V in float16 (2^-11 relative a step,
over up to S steps of a running sum whose terms are <= 1 in weight: 4e-3 of |v| here); bfloat16
K: q is rounded to bfloat16 for the dot (2^-9 relative), scores move by ~2^-9 |q||k| (1.5e-2 of |v|
at these sizes).
"""
from __future__ import annotations

import pytest
import torch

from kernels import ggml
from kernels.env import reload

pytestmark = pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")

from kernels.ggml import attention as ga  # noqa: E402

TOL = {torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 1.5e-2}


def _case(n_h, n_kv, hd, S, dtype, seed=0, holes=3):
    g = torch.Generator().manual_seed(seed)
    slab_k = torch.randn(S + 9, n_kv, hd, generator=g).to(dtype)  # a window of a bigger slab: offset views
    slab_v = torch.randn(S + 9, n_kv, hd, generator=g).to(dtype)
    q = torch.randn(1, n_h, hd, generator=g) * hd ** -0.5
    mask = torch.zeros(1, S, dtype=torch.float16)
    if holes:
        mask[0, ::holes] = float("-inf")
    return q, slab_k[5:5 + S], slab_v[5:5 + S], mask


@pytest.mark.parametrize("n_h,n_kv,hd,S", [(3, 1, 40, 77), (6, 3, 72, 5), (8, 1, 512, 600), (4, 1, 256, 1),
                                           (2, 2, 24, 513)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_attention_matches_the_float64_reference(n_h, n_kv, hd, S, dtype):
    """Grouped heads (n_h / n_kv), one key, the split-over-keys path (>= 512 keys), each KV dtype."""
    q, k, v, mask = _case(n_h, n_kv, hd, S, dtype, holes=3 if S > 1 else 0)
    out = ga.decode_attention(q, k, v, mask, 0.37)
    ref = ga.decode_attention_ref(q, k, v, mask, 0.37)
    assert out.shape == (1, n_h * hd) and out.dtype == torch.float32
    assert float((out - ref).abs().max()) <= TOL[dtype] * float(v.float().abs().max())


def test_masked_slots_are_never_read():
    """A -inf slot is skipped, not weighted by zero: NaN K/V there (another sequence's garbage, or
    memory never written) leaves the output finite and equal to attention over the others."""
    q, k, v, mask = _case(4, 1, 64, 130, torch.float32)
    k, v = k.clone(), v.clone()
    hidden = mask[0] == float("-inf")
    k[hidden], v[hidden] = float("nan"), float("nan")
    out = ga.decode_attention(q, k, v, mask, 0.5)
    seen = ~hidden
    ref = ga.decode_attention_ref(q, k[seen], v[seen], torch.zeros(1, int(seen.sum()), dtype=torch.float16), 0.5)
    assert torch.isfinite(out).all() and float((out - ref).abs().max()) <= 2e-6 * float(v[seen].abs().max())


def test_one_visible_slot_gives_its_value_row():
    q, k, v, mask = _case(3, 1, 32, 70, torch.float32, holes=0)
    mask.fill_(float("-inf"))
    mask[0, 41] = 0
    assert torch.equal(ga.decode_attention(q, k, v, mask, 1.0), v[41, 0].repeat(3).reshape(1, -1))


@pytest.mark.parametrize("bad", ["q rows", "kv heads", "mask length", "mask dtype", "q dtype", "v dtype"])
def test_bad_shapes_and_dtypes_are_one_line_errors(bad):
    q, k, v, mask = _case(4, 2, 16, 10, torch.float32)
    if bad == "q rows":
        q = q.repeat(2, 1, 1)
    elif bad == "kv heads":
        q = q[:, :3]
    elif bad == "mask length":
        mask = mask[:, :9]
    elif bad == "mask dtype":
        mask = mask.float()
    elif bad == "q dtype":
        q = q.double()
    else:
        v = v.half()
    with pytest.raises(ValueError, match="ggml decode_attention"):
        ga.decode_attention(q, k, v, mask, 1.0)


# --- the engine's windows over the pools ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import TinySpec, write_tiny_gemma4

    return write_tiny_gemma4(tmp_path_factory.mktemp("gattn") / "tiny.gguf", TinySpec(), seed=5)


def _sequence(tiny, full_slots, fmt="fp32"):
    from engine.kv import resolve_format
    from engine.kv import HybridKVPool
    from engine.kv import SequenceKV
    from models.loader import load_model

    cfg = load_model(tiny, with_tokenizer=False).model.cfg
    pools = HybridKVPool(cfg, 4096, 256, resolve_format(fmt))
    kv = SequenceKV(pools, cfg.sliding_window)
    n = len(full_slots)
    kv.attach_prefix(torch.tensor(full_slots), torch.arange(n - 4, n), torch.arange(40, 44))
    full = next(i for i in range(cfg.n_layer) if not cfg.is_sliding[i])
    win = next(i for i in range(cfg.n_layer) if cfg.is_sliding[i])
    return kv, pools, full, win


def test_window_covers_the_visible_slots_in_buckets_and_masks_the_rest(tiny):
    slots = list(range(7, 20)) + list(range(100, 130)) + [3000 - 1]  # three runs, ascending (`KVPool.alloc`)
    kv, pools, full, win = _sequence(tiny, slots[:-1])
    k, v, mask = kv._masked(full, None)
    lo = 7
    assert k.shape[0] == mask.shape[1] == 128 and k.data_ptr() == pools.full.k[pools.slab(full)][lo].data_ptr()
    seen = (mask[0] == 0).nonzero().flatten() + lo
    assert sorted(seen.tolist()) == sorted(slots[:-1])
    k, v, mask = kv._masked(win, kv.window)  # the window pool: positions n-4..n-1 at slots 40..43
    visible = [s for s, p in zip(range(40, 44), range(len(kv) - 4, len(kv))) if p > len(kv) - 1 - kv.window]
    assert mask.shape[1] == 64 and ((mask[0] == 0).nonzero().flatten() + 40).tolist() == visible
    kv2, *_ = _sequence(tiny, slots)  # one slot far away: spread over > 8x the count -> gathered in order
    assert kv2._masked(full, None) is None


def test_eight_bit_pools_keep_the_torch_path(tiny):
    kv, _, full, _ = _sequence(tiny, list(range(10)), fmt="int8_per_token_head")
    assert kv._masked(full, None) is None


def test_engine_decode_on_ggml_attention_agrees_with_the_torch_products(tiny, monkeypatch):
    """Three requests decoded together (their slots interleave in the pools): the ggml attention
    runs every decode step and gives the torch path's tokens and log-probabilities: the attention
    differs by float32 rounding (~1e-7), which the MLP's GELU table (its input rounded to float16,
    steps of 2^-11) can turn into one table step in a later activation: 2e-4 measured, 1e-3 allowed."""
    from engine.api import open_model
    from engine.sampler import SamplingParams
    from engine.scheduler import Engine, EngineConfig

    monkeypatch.setenv("EDGEGEM_CPU_STEP_GRAPH", "0")  # the layer by layer path: its attention is the kernel's run
    lm = open_model(tiny, exact=False)
    prompts = ([2, 5, 17, 33, 40, 61, 99], [2, 100, 200, 300], [2, 9, 8, 7, 6, 5, 4, 3, 11, 12, 13])
    calls = []
    orig = ga.decode_attention
    monkeypatch.setattr(ga, "decode_attention", lambda *a: (calls.append(1), orig(*a))[1])

    def run(mode):
        monkeypatch.setenv("EDGEGEM_CPU_ATTENTION", mode)
        reload()
        engine = Engine(lm.model, config=EngineConfig(full_tokens=256))
        reqs = [engine.add(list(p), SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)) for p in prompts]
        engine.run_to_completion()
        for r in reqs:
            events = []
            while not r.events.empty():
                events.append(r.events.get_nowait())
            r.picked = [lp for ev in events for lp in (ev.logprobs or [])]
        return reqs

    torch_reqs = run("torch")
    assert not calls
    ggml_reqs = run("ggml")
    assert len(calls) >= 3 * 11 * lm.model.cfg.n_layer  # every decode step, every layer
    for a, b in zip(torch_reqs, ggml_reqs):
        assert a.output_ids == b.output_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.picked, b.picked)) <= 1e-3
        assert len(a.picked) == len(a.output_ids)


# --- who decides: the model's runtime, once per engine ---------------------------------------------
@pytest.mark.parametrize("ggml_loaded,attention,on_ggml", [(True, "ggml", True), (False, "ggml", False),
                                                           (True, "torch", False)])
def test_engine_decodes_on_ggml_attention_where_the_runtime_says(tiny, monkeypatch, ggml_loaded, attention, on_ggml):
    """A ggml-runtime model's engine hands its sequences ggml's decode attention; a cpu_torch model's
    engine does not, nor does EDGEGEM_CPU_ATTENTION=torch. Decided once per engine
    (engine.kv.sequence.ggml_attention_for), not by probing the query every layer."""
    from engine.api import open_model
    from engine.sampler import SamplingParams
    from engine.scheduler import Engine, EngineConfig
    from models import runtime
    from models.runtime import Runtime

    monkeypatch.setattr(runtime, "ggml_available", lambda: ggml_loaded)
    monkeypatch.setenv("EDGEGEM_CPU_ATTENTION", attention)
    monkeypatch.setenv("EDGEGEM_CPU_STEP_GRAPH", "0")  # the layer by layer path: its attention is the kernel's run
    reload()
    lm = open_model(tiny, exact=False)
    assert lm.model.runtime is (Runtime.GGML if ggml_loaded else Runtime.CPU_TORCH)
    calls = []
    orig = ga.decode_attention
    monkeypatch.setattr(ga, "decode_attention", lambda *a: (calls.append(1), orig(*a))[1])
    engine = Engine(lm.model, config=EngineConfig(full_tokens=256))
    assert engine.ggml_attention is on_ggml
    req = engine.add([2, 5, 17, 33], SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # admits and prefills: the request's SequenceKV carries the engine's decision
    assert req.kv.ggml_attention is on_ggml
    engine.run_to_completion()
    assert len(req.output_ids) == 4 and bool(calls) is on_ggml


def test_a_float64_query_keeps_the_torch_products_on_a_ggml_sequence(tiny, monkeypatch):
    """The exactness tests run float64 models through the same SequenceKV: a float64 query takes
    the torch products even where the runtime says ggml (whose kernel reads float32 rows): a dtype
    condition, kept beside the runtime's answer. A float32 query on the same slots takes ggml's."""
    from engine.kv import HybridKVPool, SequenceKV, resolve_format
    from models.loader import load_model

    cfg = load_model(tiny, with_tokenizer=False).model.cfg
    pools = HybridKVPool(cfg, 256, 256, resolve_format("fp32"))
    kv = SequenceKV(pools, cfg.sliding_window, torch.float64, ggml_attention=True)
    kv.begin(torch.arange(10))
    kv.end()
    kv.begin(torch.tensor([10]))
    full = next(i for i in range(cfg.n_layer) if not cfg.is_sliding[i])
    slab = pools.slab(full)
    g = torch.Generator().manual_seed(3)
    for t in (pools.full.k[slab], pools.full.v[slab]):
        t.copy_(torch.randn(t.shape, generator=g))
    n_kv, hd = pools.full.k[slab].shape[1:]
    q = torch.randn(1, cfg.n_head[full], hd, generator=g, dtype=torch.float64) * hd ** -0.5
    calls = []
    orig = ga.decode_attention
    monkeypatch.setattr(ga, "decode_attention", lambda *a: (calls.append(1), orig(*a))[1])
    exact = kv.attend(full, q, torch.tensor([10]), None, 1.0)
    assert not calls and exact.dtype == torch.float64
    fast = kv.attend(full, q.float(), torch.tensor([10]), None, 1.0)
    assert calls == [1] and fast.dtype == torch.float32
    torch.testing.assert_close(fast.double(), exact, rtol=0, atol=1e-5)
