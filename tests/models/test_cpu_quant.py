"""The CPU runtime format (models/cpu_quant.py, models/formats/int4.py): every GGUF type's int4 repack against the float32
reference dequantization + matmul, on odd shapes; a quantized tiny Gemma-4 keeps its greedy tokens
on it; a non-finite activation is one error naming the layer (models/decoder.py FiniteWatch).

Bounds (relative Frobenius error against models.quant.dequantize, float32): the only rounding of
the repack is each group's scale and zero to bf16 (2^-9 relative), so the weights are within 5e-3;
the int4pack GEMV also rounds the activations to bf16 (another ~2^-9 per element): 8e-3. The
prefill GEMM runs in the dtype `formats.int4.gemm_dtype()` picks for this CPU, and both dtypes are
tested on every machine (forced): float32 has the weights' error only (5e-3); bf16 (picked where
the CPU has AVX512-BF16 or AMX) rounds W, x and the output to bf16 once each, three more
roundings of <= 2^-9 RMS relative: 5e-3 + 3 * 2^-9 = 1.09e-2.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

import models.cpu_quant as cq
import models.formats.int4 as i4
from models.synthetic import random_quant_bytes
from models.formats import Int4Weight
from models.quant import dequantize

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4  # noqa: E402

BF16_STEP = 2.0 ** -9  # RMS relative error of one rounding to bf16 (8 significant bits)
pytestmark = pytest.mark.cpu_runtime
WEIGHT_BOUND, GEMV_BOUND = 5e-3, 8e-3
GEMM_BOUND = {torch.float32: WEIGHT_BOUND, torch.bfloat16: WEIGHT_BOUND + 3 * BF16_STEP}
FP16_BOUND = 1e-3  # the wider types in float16: values and GEMV inputs rounded to 2^-11
# (rows, in): rows not a multiple of the 32-row pack block (padding), several 256-value super-blocks
SHAPES = {"Q4_K": (45, 512), "Q5_K": (77, 256), "Q6_K": (45, 768), "Q8_0": (61, 96), "Q5_0": (33, 160),
          "Q4_0": (70, 64)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _matrix(tn: str, seed: int = 0):
    n, k = SHAPES[tn]
    g = torch.Generator().manual_seed(seed)
    raw = random_quant_bytes(tn, n, k, 0.05, g, "cpu")
    if tn in ("Q4_K", "Q5_K"):  # arbitrary 6-bit scales and mins, not the synthetic m == sc
        per_row = raw.view(n * k // 256, -1)
        per_row[:, 4:16] = torch.randint(0, 256, (per_row.shape[0], 12), dtype=torch.uint8, generator=g)
    return raw, dequantize(raw, int(T[tn]), (n, k))


def test_pack_layout_matches_torch():
    """Our uint8 packer and unpacker agree with torch's own converter (the layout is probed once)."""
    bn = i4.pack_block_rows()
    q = torch.randint(0, 16, (3 * bn, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(i4._pack(q.to(torch.uint8), bn), packed)
    assert torch.equal(i4._unpack(packed, bn, 96), q)


@pytest.mark.parametrize("gemm", [torch.float32, torch.bfloat16], ids=["gemm_f32", "gemm_bf16"])
@pytest.mark.parametrize("tn", sorted(SHAPES))
def test_int4_weight_matches_reference(tn, gemm, monkeypatch):
    raw, ref = _matrix(tn)
    n, k = ref.shape
    w = Int4Weight(raw, int(T[tn]), (n, k))
    assert _rel(w.dense(), ref) < WEIGHT_BOUND
    ids = torch.tensor([n - 1, 0, 31, 32, 17, 17])
    assert _rel(w.rows(ids), ref[ids]) < WEIGHT_BOUND
    x = torch.randn(3, 2, k, generator=torch.Generator().manual_seed(2))  # GEMV rows: int4pack
    y = w.linear(x)
    assert y.shape == (3, 2, n) and y.dtype == torch.float32
    assert _rel(y, x @ ref.t()) < GEMV_BOUND
    # prefill rows: dequantized row blocks (several: a block of 32 rows) + a GEMM in the dtype forced
    monkeypatch.setattr(i4, "BLOCK_VALUES", 32 * 2 * k)
    monkeypatch.setattr(i4, "gemm_dtype", lambda: gemm)
    xs = torch.randn(i4.GEMV_ROWS + 7, k, generator=torch.Generator().manual_seed(3))
    assert _rel(w.linear(xs), xs @ ref.t()) < GEMM_BOUND[gemm]


def test_gemm_dtype_is_bf16_only_where_the_cpu_has_it():
    """The prefill GEMM dtype follows the CPU: bf16 only with AVX512-BF16 or AMX (and oneDNN)."""
    flags = set(open("/proc/cpuinfo").read().split("flags", 2)[1].split("\n", 1)[0].split())
    fast = bool({"avx512_bf16", "amx_bf16"} & flags) and torch.backends.mkldnn.is_available()
    assert i4.gemm_dtype() == (torch.bfloat16 if fast else torch.float32)


@pytest.mark.parametrize("tn", ["Q6_K", "Q8_0", "Q5_0", "Q5_K"])
def test_wider_types_as_float16(tn, monkeypatch):
    """The 5- to 8-bit types' float16 form (HalfWeight): GEMV in float16, prefill by upcast row
    blocks (several: a block of 32 rows here)."""
    from models.formats import half as half_format

    raw, ref = _matrix(tn)
    n, k = ref.shape
    monkeypatch.setattr(cq, "BLOCK_VALUES", 32 * k)
    monkeypatch.setattr(half_format, "BLOCK_VALUES", 32 * k)
    half = cq.cpu_weight(raw, int(T[tn]), (n, k))
    assert half.dtype == torch.float16 and _rel(half.float(), ref) < FP16_BOUND
    w = half_format.HalfWeight(half)
    for rows in (1, 70):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert _rel(w.linear(x), x @ ref.t()) < FP16_BOUND


def test_int4_weight_bytes_near_the_file():
    """Q4_K: 4 bits + a bf16 scale and zero per 32 values, 5 bits a value (the file: 4.5)."""
    raw, _ = _matrix("Q4_K")
    w = Int4Weight(raw, int(T.Q4_K), SHAPES["Q4_K"])
    assert w.nbytes == w.n_pad * SHAPES["Q4_K"][1] * 5 // 8


@pytest.fixture(scope="module")
def tiny_q4km(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpuq")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", TinySpec(), seed=7), d / "q4km.gguf")


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    from models.kv_cache import DenseKVCache

    cache, ids, out = DenseKVCache(), list(prompt), []
    logits = model.forward(torch.tensor(ids), cache=cache)[-1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward(torch.tensor([out[-1]]), torch.tensor([len(prompt) + len(out) - 1]), cache)[-1]
    return out


def test_tiny_model_keeps_greedy_tokens(tiny_q4km, torch_cpu_formats):
    from models.loader import load_model

    exact = load_model(tiny_q4km, with_tokenizer=False).model
    fast = load_model(tiny_q4km, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
    assert isinstance(fast.w["blk.0.ffn_gate_up.weight"], Int4Weight)  # Q4_K gate and up, stacked
    from models.formats.int8_head import Int8Head, available
    if available():  # x86: the tied Q6_K head ranks in int8, its top rows exact
        assert isinstance(fast.w["token_embd.weight"], Int8Head)
    assert not isinstance(fast.w["per_layer_token_embd.weight"], (Int4Weight, torch.Tensor))  # GGUF rows
    prompt = [2, 5, 17, 33, 40, 61, 99, 120, 7, 300]
    assert _greedy(fast, prompt, 12) == _greedy(exact, prompt, 12)


@pytest.mark.parametrize("kernels", ["torch", "ggml"])
def test_non_finite_activation_names_the_layer(tiny_q4km, kernels, monkeypatch):
    from models import runtime
    from models.decoder import NonFiniteError
    from models.loader import load_model

    if kernels == "torch":
        monkeypatch.setattr(runtime, "ggml_available", lambda: False)
    elif not runtime.ggml_available():
        pytest.skip("llama.cpp's kernels are not available here")
    model = load_model(tiny_q4km, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
    model.w["blk.3.post_ffw_norm.weight"] = torch.full_like(model.w["blk.3.post_ffw_norm.weight"], float("inf"))
    with pytest.raises(NonFiniteError) as e:
        model.forward(torch.tensor([2, 5, 17]))
    assert e.value.layer == 3 and "layer 3 of 8" in str(e.value) and "\n" not in str(e.value)
    assert "layer 2: output sum" in e.value.details

    from engine.sampler import SamplingParams
    from engine.scheduler import Engine, EngineConfig

    engine = Engine(model, config=EngineConfig(full_tokens=64))  # the engine's step: same check
    engine.add([2, 5, 17], SamplingParams(max_tokens=2))
    with pytest.raises(NonFiniteError, match="layer 3 of 8"):
        engine.step()


def test_lookup_tables_read_rows_from_the_file(tiny_q4km):
    """The per-layer table is read row by row (pread), not through the memory map: the rows equal
    the file's, repeated and unordered ids included, and a bad id is an IndexError, not garbage."""
    import pickle

    from models.gguf import GGUFFile
    from models.loader import load_model
    from models.quant import dequantize_rows

    model = load_model(tiny_q4km, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
    table = model.w["per_layer_token_embd.weight"]
    assert table.reader is not None
    info = GGUFFile(tiny_q4km).tensor("per_layer_token_embd.weight")
    ids = torch.tensor([7, 3, 7, 0, table.shape[0] - 1, 3])
    want = dequantize_rows(info.data, info.ggml_type, ids, table.shape[1])
    assert torch.equal(table.rows(ids), want)
    assert torch.equal(table.raw_rows(ids), table.raw.index_select(0, ids))
    assert torch.equal(pickle.loads(pickle.dumps(table.reader)).rows(ids), table.reader.rows(ids))
    with pytest.raises(IndexError):
        table.rows(torch.tensor([table.shape[0]]))


def test_top_indices_equal_topk_on_odd_shapes():
    from models.formats.int8_head import top_indices

    g = torch.Generator().manual_seed(3)
    for rows, n, c, block in ((1, 4096, 64, 64), (3, 1536, 17, 32), (2, 1000, 8, 512), (1, 96, 64, 32)):
        y = torch.randn(rows, n, generator=g)
        y[0, :40] = 9.0  # ties inside one block
        got = top_indices(y, c, block)
        want = y.topk(c, dim=-1).values
        assert torch.equal(y.gather(1, got).sort(-1, descending=True).values, want)


def test_int8_head_ranks_in_int8_and_its_top_rows_are_exact():
    """Bound per format: the int8 logits (row-scaled int8 weights x 7-bit dynamic activations) are
    within 4% of the logits' RMS of float32's; the EXACT_ROWS best of every row by that ranking
    equal float32's x W^T within float rounding (1e-5 relative), which covers the true best
    EXACT_ROWS/4 of a flat random vocabulary, so greedy picks the same token."""
    from models.formats.int8_head import EXACT_ROWS, Int8Head, available

    if not available():
        pytest.skip("no fbgemm on this CPU build")
    raw, w = _matrix("Q8_0")  # 61 x 96: odd rows, three 32-value blocks
    big = torch.randn(3000, 96, generator=torch.Generator().manual_seed(1)) * 0.05  # a vocabulary > EXACT_ROWS
    big[:61] = w
    head = Int8Head(big, lambda ids: big[ids])
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    ref = x @ big.t()
    approx = head.rank(x)
    assert float((approx - ref).norm() / ref.norm()) < 0.04
    got = head.linear(x)
    rescored = approx.topk(EXACT_ROWS, dim=-1).indices  # where the int8 ranking put its best
    assert torch.allclose(got.gather(1, rescored), ref.gather(1, rescored), rtol=1e-5, atol=1e-6)
    top = ref.topk(EXACT_ROWS // 4, dim=-1).indices  # the head of the true ranking is among them
    assert torch.allclose(got.gather(1, top), ref.gather(1, top), rtol=1e-5, atol=1e-6)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert torch.equal(head.rows(torch.tensor([0, 60])), big[[0, 60]])
    assert got.dtype == x.dtype and head.linear(x[0]).shape == (3000,)
    # one row 50x the others (a prompt's BOS row) leaves the others as they were alone
    x[0] *= 50
    alone = torch.cat([head.rank(x[i:i + 1]) for i in range(x.shape[0])])
    err = ((head.rank(x) - x @ big.t()).norm(dim=1) / (x @ big.t()).norm(dim=1))
    assert float(err.max()) < 0.04, err
    assert float(((alone - x @ big.t()).norm(dim=1) / (x @ big.t()).norm(dim=1)).max()) < 0.04


def test_prefill_buffers_survive_inference_mode_then_no_grad():
    """The reused dequantization buffer made under inference_mode (a `score` or bench loop) must
    stay writable for the engine's no_grad forwards, and the other way round."""
    raw, w = _matrix("Q4_K")
    q = Int4Weight(raw, int(T.Q4_K), SHAPES["Q4_K"])
    x = torch.randn(i4.GEMV_ROWS + 3, SHAPES["Q4_K"][1])
    i4._buffers.clear()
    with torch.inference_mode():
        a = q.linear(x)
    with torch.no_grad():
        b = q.linear(x)
    assert torch.equal(a, b) and _rel(b, x @ w.t()) < GEMM_BOUND[i4.gemm_dtype()]
