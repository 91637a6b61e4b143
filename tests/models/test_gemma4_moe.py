"""The Gemma-4 26B-A4B MoE block on a tiny random model (5 experts, 3 used, expert width 160, an
untied head so greedy tokens vary): expert banks held as the file's bytes on every runtime
(models/formats/experts.py), the block as one ggml graph on `ggml_mul_mat_id`
(models/gemma4_ggml.py) equal to llama.cpp's own bit for bit on the same placement, within the
formats' tolerance of the float64 reference, the ggml runtime's greedy tokens equal to
llama.cpp's, and the cpu_torch runtime's to the float64 reference's.

Two files, quantized by llama.cpp: Q4_K_M with the fused `ffn_gate_up_exps` (Q4_K gate/up; the
160-wide down rows fall back to Q5_0 and Q8_0) and Q8_0 with separate `ffn_gate_exps` /
`ffn_up_exps`; the bit-for-bit check also over F32, F16, BF16, Q6_K and Q4_0 files.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kernels import ggml
from models.formats import ExpertBank
from models.gguf import GGUFFile
from tiny_models import (TinySpec, greedy_forward, llama_cpp_greedy_until_near_tie, quantize_gguf, write_tiny_gemma4)

MOE = TinySpec(n_layer=3, pattern=[True, True, False], n_kv_shared=0, ple_width=0, n_head=4, n_kv_head=[2, 2, 1],
               n_expert=5, n_expert_used=3, expert_ffn=160, double_wide=False, v_on_full_layers=False, tied=False)
FILES = {"q4km-fused": (MOE, "Q4_K_M"), "q8_0-split": (dataclasses.replace(MOE, fused_gate_up_exps=False), "Q8_0")}
PROMPTS = ([2, 5, 17, 33, 40, 61, 99, 120, 7, 300], [2, 100, 200, 300, 350, 50, 60])
TIE = 0.01  # a top-2 logit gap that rounding differences may close (tests/models/test_cpu_ggml.py)
needs_ggml = pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")


@pytest.fixture(scope="module", params=list(FILES))
def moe_file(request, tmp_path_factory):
    spec, ftype = FILES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", spec, seed=3), d / "q.gguf", ftype)


_models: dict = {}  # (path, runtime, dtype) -> the loaded model, shared by the tests of a file


def _load(path, runtime: str, dtype=torch.float32):
    """The model of `path` on `runtime` (cpu_torch: call under the torch_cpu_formats fixture)."""
    from models.loader import load_model

    key = (str(path), runtime, dtype)
    if key not in _models:
        if runtime == "reference":
            _models[key] = load_model(path, with_tokenizer=False, dtype=dtype).model
        else:
            _models[key] = load_model(path, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
        assert _models[key].runtime.value == runtime
    return _models[key]




@pytest.mark.parametrize("runtime", ["reference", "ggml", "cpu_torch"])
def test_quantized_banks_load_as_their_file_bytes_on_every_runtime(moe_file, runtime, request):
    if runtime == "cpu_torch":
        request.getfixturevalue("torch_cpu_formats")
    elif runtime == "ggml" and not ggml.available():
        pytest.skip(ggml.reason())
    model = _load(moe_file, runtime)
    assert model.runtime.value == runtime
    f = GGUFFile(moe_file)
    banks = {n: f.tensor(n) for n in f.tensors if "_exps.weight" in n}
    assert banks
    for name, info in banks.items():
        w = model.w[name]
        assert isinstance(w, ExpertBank) and w.shape == tuple(info.shape) and w.ggml_type == info.ggml_type
        # only the file's bytes: the storage holds n_bytes, not E*out*in floats
        assert w.nbytes == info.n_bytes == w.raw.untyped_storage().nbytes()
        assert torch.equal(w.raw.reshape(-1), torch.from_numpy(info.read()))
    sizes = {int(np.prod(info.shape)) for info in banks.values()}
    for v in model.w.values():  # no float copy of a bank anywhere
        for t in getattr(v, "tensors", (v,) if isinstance(v, torch.Tensor) else ()):
            assert not (t.is_floating_point() and t.numel() in sizes), t.shape


def _assert_block_bits_equal_llama_cpps(path, model, batches=(0, 1)) -> None:
    """Each layer's block on the residual rows llama.cpp fed its own (`attn_out-i`: the prompt's 10
    rows in one batch, then one decode row) gives llama.cpp's `ffn_moe_combined-i`, bit for bit.
    llama.cpp keeps every weight in the GGUF layout (`use_extra_bufts` off), as the caller's
    graph does (PACKED_ROWS 0): the same products, nodes and order."""
    from ggml_capture import capture_nodes
    from models import gemma4_ggml

    L, d = MOE.n_layer, MOE.d_model
    names = {f"{n}-{i}" for n in ("attn_out", "ffn_moe_combined") for i in range(L)}
    cap = capture_nodes(path, [PROMPTS[0], [44]], names, extra_bufts=False)
    for batch in batches:
        for i in range(L):
            r = torch.from_numpy(cap[f"attn_out-{i}"][batch].reshape(-1, d))
            ours = gemma4_ggml.fused_moe_ffn(model, i, r)
            assert ours.shape[0] == (len(PROMPTS[0]) if batch == 0 else 1)
            assert np.array_equal(ours.numpy(), cap[f"ffn_moe_combined-{i}"][batch].reshape(-1, d)), (batch, i)


@needs_ggml
def test_moe_block_equals_llama_cpps_bit_for_bit_on_the_same_placement(moe_file, monkeypatch):
    from models.formats import ggml as ggml_format

    monkeypatch.setattr(ggml_format, "PACKED_ROWS", 0)
    _assert_block_bits_equal_llama_cpps(moe_file, _load(moe_file, "ggml"))


@needs_ggml
@pytest.mark.parametrize("ftype", ["F32", "F16", "BF16", "Q6_K", "Q4_0"])
def test_moe_block_bits_for_dense_and_other_bank_types(ftype, tmp_path_factory, monkeypatch):
    from models.formats import ggml as ggml_format
    from models.loader import load_model

    monkeypatch.setattr(ggml_format, "PACKED_ROWS", 0)
    d = tmp_path_factory.mktemp(ftype)
    path = write_tiny_gemma4(d / "f32.gguf", MOE, seed=3)
    if ftype != "F32":
        path = quantize_gguf(path, d / "q.gguf", ftype)
    model = load_model(path, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
    bank = model.w["blk.0.ffn_gate_up_exps.weight"]
    assert isinstance(bank, ExpertBank) and bank.ggml_type == int(GGUFFile(path).tensor(
        "blk.0.ffn_gate_up_exps.weight").ggml_type)
    _assert_block_bits_equal_llama_cpps(path, model)


@needs_ggml
@pytest.mark.parametrize("rows", [1, 9])
def test_moe_block_matches_the_float64_reference(moe_file, rows):
    """The graph against models/gemma4.py's torch block in float64 on the same residual rows: within
    the 8-bit activation rounding of its products (the dense MLP alone is ~1.3% off on these
    inputs) and the f16 GELU table; a missing expert is ~10x that (the control: top-2 of 3)."""
    from models import gemma4_ggml

    fast, ref = _load(moe_file, "ggml"), _load(moe_file, "reference", torch.float64)
    r = torch.randn(rows, MOE.d_model, generator=torch.Generator().manual_seed(rows)) * 3
    for i in range(MOE.n_layer):
        want = ref._moe_ffn(i, r.double())
        got = gemma4_ggml.fused_moe_ffn(fast, i, r).double()
        b = f"blk.{i}."
        parts = gemma4_ggml.moe_parts(fast.w, b, rows)
        top2 = gemma4_ggml.moe_ffn(r, fast.w, b, fast.cfg.rms_eps, MOE.n_expert_used - 1, parts).double()
        rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
        assert rel < 0.03, (i, float(rel))
        assert ((top2 - want).norm(dim=-1) / want.norm(dim=-1)).min() > 0.1  # one expert missing


@needs_ggml
def test_prefill_runs_one_moe_graph_a_layer_over_all_rows(moe_file, monkeypatch):
    from models import gemma4_ggml
    from models.formats.experts import ExpertMatrix

    rows_seen = []
    run = gemma4_ggml.moe_ffn
    monkeypatch.setattr(gemma4_ggml, "moe_ffn", lambda r, *a: (rows_seen.append(r.shape[0]), run(r, *a))[1])
    monkeypatch.setattr(ExpertMatrix, "dense", lambda *a: pytest.fail("an expert was dequantized"))
    model = _load(moe_file, "ggml")
    model.forward(torch.tensor(PROMPTS[0]))
    assert rows_seen == [len(PROMPTS[0])] * MOE.n_layer


@needs_ggml
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_llama_cpps(moe_file, prompt):
    ref = llama_cpp_greedy_until_near_tie(moe_file, list(prompt), 16, TIE)
    assert len(ref) >= 8 and greedy_forward(_load(moe_file, "ggml"), list(prompt), 16)[:len(ref)] == ref


@needs_ggml
def test_engine_batched_decode_gives_llama_cpps_tokens(moe_file):
    """Through the engine: both prompts decoded together (the MoE graph over 2 rows a step, each
    row routed on its own), fast prefill off (llama.cpp runs every layer for every prompt row)."""
    from engine.api import open_model
    from engine.sampler import SamplingParams
    from engine.scheduler import Engine, EngineConfig

    lm = open_model(moe_file, exact=False)
    engine = Engine(lm.model, config=EngineConfig(full_tokens=256, prefill_chunk=512, fast_prefill=False))
    reqs = [engine.add(list(p), SamplingParams(temperature=0.0, max_tokens=12)) for p in PROMPTS]
    engine.run_to_completion()
    for p, r in zip(PROMPTS, reqs):
        ref = llama_cpp_greedy_until_near_tie(moe_file, list(p), 12, TIE)
        assert len(ref) >= 8 and r.output_ids[:len(ref)] == ref


def _decode_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float64 logits [len(tokens), V] predicting each of `tokens` after `prompt`: the prompt in one
    forward, then `tokens` fed one a forward (teacher forcing)."""
    from models.kv_cache import DenseKVCache

    cache = DenseKVCache()
    out = [model.forward(torch.tensor(prompt), cache=cache)[-1]]
    for j, t in enumerate(tokens[:-1]):
        out.append(model.forward(torch.tensor([t]), torch.tensor([len(prompt) + j]), cache)[-1])
    return torch.stack(out).double()


def test_torch_fallback_gives_the_same_greedy_tokens(moe_file, torch_cpu_formats):
    """EDGEGEM_CPU_KERNELS=torch (the cpu_torch runtime, experts dequantized one at a time from the
    banks' bytes) picks the float64 reference's greedy tokens, decoding along the reference's
    continuation, wherever the reference's top-2 gap exceeds what the fallback's formats move a
    logit by: the dense Q4_K matrices in int4 with bf16 scales and the F32 router in float16 move
    these logits by ~5e-3 on average and can flip a near-tied routing (up to ~0.35 at one
    position of 40), so the tied steps are skipped rather than ending the comparison. (One prompt,
    12 tokens: each expert product dequantizes its expert, ~2 s a step on the loaded 2-core VM.)"""
    model, ref_model, prompt = _load(moe_file, "cpu_torch"), _load(moe_file, "reference", torch.float64), PROMPTS[0]
    ref_tokens = greedy_forward(ref_model, list(prompt), 12)
    ref = _decode_logits(ref_model, list(prompt), ref_tokens)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= 0.05
    assert int(clear.sum()) >= 8
    ours = _decode_logits(model, list(prompt), ref_tokens).argmax(-1)
    assert torch.equal(ours[clear], torch.tensor(ref_tokens)[clear])
