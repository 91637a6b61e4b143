"""The batched static-buffer decode (engine/batch_decode.py) gives what the per-sequence path gives.

On the CPU the decoder runs the same static-buffer code a CUDA graph replays (the graph itself is
checked in tests/engine/test_cuda.py). Tiny models with a sliding window (8 for Gemma-4, 6 for Gemma 3)
shorter than the generated length, prompts of different lengths, so sequences of one batch have
different table lengths and window contents. The triton-backend case runs the kernels under
Triton's interpreter.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from engine.batch_decode import BatchDecoder, bucket_of, capacity_of  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import Engine, EngineConfig  # noqa: E402
from engine.kv import SequenceKV  # noqa: E402
from engine.speculative import SpecConfig  # noqa: E402
from models.gemma4_assistant import load_gemma4_assistant  # noqa: E402
from models.gguf import GGUFFile  # noqa: E402
from models.loader import load_model  # noqa: E402
from tiny_models import TinySpec, tiny_gemma3, write_tiny_assistant, write_tiny_gemma4  # noqa: E402

SPEC = TinySpec()  # 8 layers (S,S,S,F)x2, the last 4 KV-shared, window 8, PLE 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)  # > window 8
LENGTHS = (30, 19, 41, 12)  # one prompt length per concurrent request
INT8 = {"kv_cache_dtype": "int8_per_token_head", "swa_kv_cache_dtype": "int8_per_token_head"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These matrices are tiny: torch's thread pool costs more than it gives (this file: 24 s on one
    thread, 55 s on two busy cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return load_model(write_tiny_gemma4(tmp_path_factory.mktemp("bd") / "t.gguf", SPEC, seed=21)).model


def _prompt(n: int, seed: int) -> list[int]:
    return [2] + np.random.default_rng(seed).integers(11, 384, size=n - 1).tolist()


def _generate(model, prompts, params=GREEDY, spec=None, **cfg):
    """Output ids and, per request, the logits of every sampled row; batch sizes the decoder saw."""
    eng = Engine(model, None, EngineConfig(full_tokens=1024, **cfg), spec=spec)
    logits: dict[int, list] = {}
    post = eng._postprocess

    def spy(req, lg):
        logits.setdefault(req.id, []).append(lg.double())
        post(req, lg)

    eng._postprocess = spy
    sizes = []
    if eng.decoder is not None:
        fwd = eng.decoder.forward
        eng.decoder.forward = lambda kvs, toks, T: (sizes.append(len(kvs)), fwd(kvs, toks, T))[1]
    reqs = [eng.add(p, params) for p in prompts]
    eng.run_to_completion()
    return [r.output_ids for r in reqs], [torch.stack(logits[r.id]) for r in reqs], sizes, eng


def _assert_same(model, n, together=True, **cfg):
    prompts = [_prompt(LENGTHS[i], seed=i + 2) for i in range(n)]
    ids_b, lg_b, sizes, eng = _generate(model, prompts, batched_decode=True, **cfg)
    ids_s, lg_s, none, _ = _generate(model, prompts, batched_decode=False, **cfg)
    assert not none  # every decode step went through the batch
    if together:
        assert max(sizes) == n and bucket_of(n) in {B for B, _ in eng.decoder.statics}
    else:  # chunked prefill staggers the starts
        assert max(sizes) >= 2
    assert ids_b == ids_s and all(len(o) == GREEDY.max_tokens for o in ids_b)
    for a, b in zip(lg_b, lg_s):
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.min() > 0.99999, cos
    assert eng.pools.full.n_used == eng.cache.cached_tokens()  # every slot accounted for


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_gemma4_batched_equals_per_sequence(gemma4, n, kv):
    _assert_same(gemma4, n, **(INT8 if kv == "int8" else {}))


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_gemma3_batched_equals_per_sequence(kv):
    _assert_same(tiny_gemma3(), 3, **(INT8 if kv == "int8" else {}))


def test_debug_unshared_kv_and_chunked_prefill(gemma4):
    _assert_same(gemma4, 3, together=False, share_kv=False, prefill_chunk=5)


# --- draft-verify shape -----------------------------------------------------------------------------

def _prefilled(model, n, **cfg):
    eng = Engine(model, None, EngineConfig(full_tokens=512, batched_decode=False, **cfg))
    kvs = []
    for i in range(n):
        kv = SequenceKV(eng.pools, eng.window, model.dtype)
        eng.runner.forward(kv, _prompt(LENGTHS[i], seed=i + 2), 0, want_logits=False)
        kvs.append(kv)
    return eng, kvs


def _begin(kvs, rows):
    for kv, toks in zip(kvs, rows):
        kv.begin(torch.arange(len(kv), len(kv) + len(toks)))


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_verify_width_3_equals_per_sequence_verify(gemma4, kv):
    """T = 3 rows a sequence (one sequence drafted a single token: a padded row), 3 sequences
    padded to 4: logits and post-norm rows equal the per-sequence verify forward's."""
    eng, kvs = _prefilled(gemma4, 3, **(INT8 if kv == "int8" else {}))
    rows = [[50, 60, 70], [80, 90], [100, 110, 120]]
    dec = BatchDecoder(gemma4, eng.pools)
    _begin(kvs, rows)
    logits, ys = dec.forward(kvs, rows, 3)
    for s in kvs:
        s.end()
    assert logits.shape == (3, 3, gemma4.cfg.vocab_size) and ys.shape == (3, 3, gemma4.cfg.d_model)
    for s, toks, lg, y in zip(kvs, rows, logits, ys):
        start = len(s) - len(toks)
        s.truncate(start)  # roll back, then verify the same rows one sequence at a time
        ref_lg, ref_y = eng.runner.forward(s, toks, start, want_logits=True, all_rows=True, return_hidden=True)
        k = len(toks)
        assert torch.equal(lg[:k].argmax(-1), ref_lg.argmax(-1))
        for a, b in ((lg[:k], ref_lg), (y[:k], ref_y)):
            assert torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min() > 0.99999


def test_speculative_decoding_through_the_batch(gemma4, tmp_path):
    """A draft model on top: every verify goes through the T = 1 + K shape, output unchanged."""
    draft = load_gemma4_assistant(GGUFFile(write_tiny_assistant(tmp_path / "a.gguf", SPEC, seed=32)))
    prompts = [_prompt(LENGTHS[i], seed=i + 2) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    plain, _, _, _ = _generate(gemma4, prompts, params, batched_decode=False)
    spec, _, sizes, eng = _generate(gemma4, prompts, params, spec=SpecConfig(draft, tokens=2, adaptive=False), batched_decode=True)
    assert spec == plain and max(sizes) == 3 and set(eng.decoder.statics) == {(4, 3)}
    assert eng.status()["speculative"]["rounds"] > 0
    assert eng.pools.full.n_used == eng.cache.cached_tokens()


# --- static buffers -----------------------------------------------------------------------------------

def _pool_snapshot(pools):
    snap = {}
    for pool in (pools.full, pools.window):
        for i in pool.layers:
            snap[(pool.name, i)] = [pool.k[i].clone(), pool.v[i].clone()] + (
                [pool.k_scale[i].clone(), pool.v_scale[i].clone()] if pool.fmt.scaled else [])
    return snap


def _changed_rows(pools, before) -> dict[str, set[int]]:
    out = {"full": set(), "window": set()}
    for pool in (pools.full, pools.window):
        for i in pool.layers:
            now = [pool.k[i], pool.v[i]] + ([pool.k_scale[i], pool.v_scale[i]] if pool.fmt.scaled else [])
            for a, b in zip(before[(pool.name, i)], now):
                diff = (a != b).reshape(a.shape[0], -1).any(-1)
                out[pool.name] |= set(diff.nonzero().flatten().tolist())
    return out


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_static_buffers_are_reused_and_padding_writes_nothing(gemma4, kv):
    eng, kvs = _prefilled(gemma4, 3, **(INT8 if kv == "int8" else {}))
    dec = BatchDecoder(gemma4, eng.pools)
    ptrs = None
    for step, rows in enumerate(([[7], [8], [9]], [[10, 11], [12], [13, 14]], [[15], [16], [17]])):
        T = max(map(len, rows))
        before = _pool_snapshot(eng.pools)
        _begin(kvs, rows)
        new = {"full": set(), "window": set()}
        for s in kvs:
            full, win = s.step_slots
            new["full"] |= set(full.tolist())
            new["window"] |= set(win.tolist())
        dec.forward(kvs, rows, T)
        for s in kvs:
            s.end()
        # Only the real rows' new slots changed: the dummy 4th sequence and the padded verify rows
        # (slot -1) wrote nothing, not even into the last slot, which -1 would index.
        changed = _changed_rows(eng.pools, before)
        assert changed["full"] == new["full"] and changed["window"] == new["window"]
        st = dec.statics[(4, T)]
        if T == 1:
            # The inputs (outputs are whatever the run made: under a graph, the captured tensors).
            now = [t.data_ptr() for t in (st.x, st.pl, st.staged, st.pos, st.new_full, st.new_win, st.full_slots,
                                         st.full_pos, st.win_slots, st.win_pos, *st.rope[0], *st.rope[-1])]
            assert ptrs is None or now == ptrs  # the same buffers, refilled in place
            ptrs = now
    assert set(dec.statics) == {(4, 1), (4, 2)}


def test_tables_grow_past_their_capacity(gemma4):
    """A sequence longer than the first capacity gets new, larger buffers; results stay right."""
    eng, kvs = _prefilled(gemma4, 1)
    dec = BatchDecoder(gemma4, eng.pools)
    s = kvs[0]
    first_cap = None
    for tok in range(11, 11 + capacity_of(len(s)) - len(s) + 2):
        _begin([s], [[tok]])
        lg, _ = dec.forward([s], [[tok]], 1)
        s.end()
        first_cap = first_cap or dec.statics[(1, 1)].full_cap
        s.truncate(len(s) - 1)
        ref = eng.runner.forward(s, [tok], len(s), want_logits=True)
        assert torch.nn.functional.cosine_similarity(lg[0, 0].double(), ref.double(), dim=0) > 0.99999
    assert dec.statics[(1, 1)].full_cap == 2 * first_cap


# --- triton kernels (interpreter on the CPU) ----------------------------------------------------------

@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_triton_backend_batched_equals_reference(gemma4, kv):
    """The triton path: kv_store skips slot -1, decode_attention runs one slot list per query row
    with a fixed num_splits; same greedy tokens as the per-sequence torch reference."""
    pytest.importorskip("triton")
    prompts = [_prompt(n, seed=s) for n, s in ((11, 2), (9, 3), (13, 4))]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    cfg = INT8 if kv == "int8" else {}
    ref, lg_ref, _, _ = _generate(gemma4, prompts, params, batched_decode=False, **cfg)
    out, lg, sizes, eng = _generate(gemma4, prompts, params, batched_decode=True, attention_backend="triton", **cfg)
    assert eng.decoder.triton and max(sizes) == 3 and out == ref
    for a, b in zip(lg, lg_ref):
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.9999
