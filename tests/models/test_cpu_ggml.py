"""The CPU runtime on llama.cpp's kernels (models/formats/ggml.py, kernels/ggml/ops.py): every matrix
of a tiny Q4_K_M Gemma-4 multiplied by ggml, the elementwise chains run as ggml graphs, and the
whole model's greedy tokens equal to llama.cpp's.

The chains compute what llama.cpp computes (RMSNorm, GELU through ggml's f16 table), and every
product is llama.cpp's own. With llama.cpp's placement for the prompt's rows too (edgegem
multiplies prefill chunks of more than PACKED_ROWS rows by the GGUF bytes, llama.cpp by its
repacked Q4_K: other rounding), every layer's output equals llama.cpp's to 1e-7 and the greedy
tokens are llama.cpp's. Not bit for bit: RoPE and the attention round in another order (1e-7),
and once in a while that flips one activation's 8-bit rounding in a later product (~1e-3 of a
product, ~5e-3 of these logits), so a near-tie (top-2 gap under TIE in llama.cpp's own logits)
may go the other way; the tokens are compared up to the first one.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import ggml
from kernels.env import reload as reload_env
from models.formats import GGMLWeight
from models.formats import ggml as ggml_format
from tiny_models import (TinySpec, greedy_forward, llama_cpp_greedy_until_near_tie, llama_cpp_logits,
                         quantize_gguf, write_tiny_gemma4)

pytestmark = [pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")]
TIE = 0.01  # a top-2 logit gap one flipped 8-bit activation rounding can close (module doc)
PROMPTS = ([2, 5, 17, 33, 40, 61, 99, 120, 7, 300], [2, 100, 200, 300, 350, 50, 60],
           [2, 9, 8, 7, 6, 5, 4, 3, 11, 12, 13, 14])


@pytest.fixture(scope="module")
def tiny_q4km(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpuggml")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", TinySpec(), seed=7), d / "q4km.gguf")


@pytest.fixture(scope="module")
def fast(tiny_q4km):
    """llama.cpp's placement: the repacked Q4_K copies held on every CPU (auto keeps them on AVX-512 only)."""
    from models.loader import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGEGEM_CPU_REPACK", "on")
        reload_env()
        try:
            return load_model(tiny_q4km, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
        finally:
            mp.delenv("EDGEGEM_CPU_REPACK")
            reload_env()




def test_every_matrix_is_a_ggml_product(fast, tiny_q4km):
    """Quantized and dense (the F32 per_layer_model_proj) matrices, the fused q/k(/v) and gate/up,
    the tied Q6_K head: all GGUF bytes multiplied by ggml; the lookup tables stay pread rows."""
    from models.gguf import GGUFFile
    from models.formats import QuantWeight

    w = fast.w
    matrices = {n: v for n, v in w.items() if getattr(v, "shape", None) is not None and len(v.shape) == 2
                and n not in ("per_layer_token_embd.weight", "token_embd.host")}
    assert matrices and all(isinstance(v, GGMLWeight) for v in matrices.values()), \
        {n: type(v).__name__ for n, v in matrices.items() if not isinstance(v, GGMLWeight)}
    assert isinstance(w["token_embd.weight"], GGMLWeight) and isinstance(w["per_layer_model_proj.weight"], GGMLWeight)
    assert "blk.0.ffn_gate_up.weight" in w and isinstance(w["per_layer_token_embd.weight"], QuantWeight)
    f = GGUFFile(tiny_q4km)
    head = f.tensor("token_embd.weight")
    assert torch.equal(w["token_embd.weight"].raw.reshape(-1), torch.from_numpy(head.read()))  # the file's bytes
    gate_up = w["blk.0.ffn_gate_up.weight"]
    assert gate_up.repacked is not None and gate_up.repacked.repacked == ggml.repacks(gate_up.ggml_type, gate_up.shape[0])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_llama_cpps(fast, tiny_q4km, prompt, monkeypatch):
    monkeypatch.setattr(ggml_format, "PACKED_ROWS", 1 << 20)  # llama.cpp's placement for the prompt rows too
    ref = llama_cpp_greedy_until_near_tie(tiny_q4km, list(prompt), 24, TIE)
    assert len(ref) >= 8 and greedy_forward(fast, list(prompt), 24)[:len(ref)] == ref


def test_engine_greedy_tokens_equal_llama_cpps(tiny_q4km, monkeypatch):
    """The same through the engine (pooled KV, fast prefill off: llama.cpp runs every layer for
    every prompt row, and a KV-shared layer's rows feed only their own logits)."""
    from engine.api import open_model
    from engine.sampler import SamplingParams
    from engine.scheduler import Engine, EngineConfig

    monkeypatch.setattr(ggml_format, "PACKED_ROWS", 1 << 20)
    monkeypatch.setenv("EDGEGEM_CPU_REPACK", "on")
    reload_env()
    lm = open_model(tiny_q4km, exact=False)
    engine = Engine(lm.model, config=EngineConfig(full_tokens=256, prefill_chunk=512, fast_prefill=False))
    reqs = [engine.add(list(p), SamplingParams(temperature=0.0, max_tokens=16)) for p in PROMPTS]
    engine.run_to_completion()
    for p, r in zip(PROMPTS, reqs):
        ref = llama_cpp_greedy_until_near_tie(tiny_q4km, list(p), 16, TIE)
        assert len(ref) >= 8 and r.output_ids[:len(ref)] == ref


def test_a_decode_step_is_three_chains_a_layer(fast, monkeypatch):
    """Per layer of a decode step: the attention prologue, the residual after attention and the
    MLP with everything after it are one ggml graph each (the attention itself stays torch)."""
    from collections import Counter

    from kernels.ggml import ops as ggml_ops
    from models.kv_cache import DenseKVCache

    calls: Counter = Counter()
    for name in ("attention_prologue", "attn_residual", "ffn_residual", "add_rms_norm", "rms_norm",
                 "qkv_norm_rope", "gated_mlp", "linear_gelu_mul", "gelu_mul"):
        orig = getattr(ggml_ops, name)
        monkeypatch.setattr(ggml_ops, name, lambda *a, _o=orig, _n=name, **k: (calls.update([_n]), _o(*a, **k))[1])
    cache = DenseKVCache()
    fast.forward(torch.tensor([2, 5, 17]), cache=cache)
    calls.clear()
    fast.forward(torch.tensor([33]), torch.tensor([3]), cache)
    L = fast.cfg.n_layer
    # + 2 RMSNorms: the per-layer inputs' projection norm, and layer 0's attention norm (every later
    # pre-norm, and the final norm, come out of the previous chain)
    assert calls == Counter(attention_prologue=L, attn_residual=L, ffn_residual=L, rms_norm=2), calls


def test_logits_stay_as_close_to_llama_cpp_as_the_reference(fast, tiny_q4km):
    tokens = list(PROMPTS[0]) + list(range(20, 50))
    ref = llama_cpp_logits(tiny_q4km, tokens).astype(np.float64)
    ours = fast.forward(torch.tensor(tokens)).double().numpy()
    from models.loader import load_model

    exact = load_model(tiny_q4km, with_tokenizer=False).model.forward(torch.tensor(tokens)).double().numpy()

    def cos(a):
        return ((a * ref).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(ref, axis=-1))).min()

    assert cos(ours) >= 0.998 and cos(ours) >= cos(exact) - 2e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_repacked_copies_held_only_where_they_pay(monkeypatch):
    """auto: the repacked copy on AVX-512 CPUs while it takes at most REPACK_SHARE of the free
    memory, never on AVX2 alone (the GGUF bytes are as fast there); on/off force it."""
    lib = ggml.library()
    for avx512 in (False, True):
        monkeypatch.setitem(lib.features, "avx512", avx512)
        assert ggml_format.keeps_repacked_copies(10, free_bytes=1000) is avx512
        assert ggml_format.keeps_repacked_copies(300, free_bytes=1000) is False  # a 31B's 14 GB on 24 GB
        for forced, want in (("on", True), ("off", False)):
            monkeypatch.setenv("EDGEGEM_CPU_REPACK", forced)
            reload_env()
            assert ggml_format.keeps_repacked_copies(300, free_bytes=1000) is want
            monkeypatch.delenv("EDGEGEM_CPU_REPACK")
            reload_env()


def test_without_copies_every_matrix_is_the_files_bytes_once(tiny_q4km, monkeypatch):
    """EDGEGEM_CPU_REPACK=off: no matrix holds a second layout, its bytes are the file's, and the
    greedy tokens are llama.cpp's up to a near-tie (llama.cpp multiplies its repacked Q4_K: other
    rounding, module doc)."""
    from models.loader import load_model

    monkeypatch.setenv("EDGEGEM_CPU_REPACK", "off")
    reload_env()
    one = load_model(tiny_q4km, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
    mats = [v for v in one.w.values() if isinstance(v, GGMLWeight)]
    assert mats and all(m.repacked is None and m.nbytes == m.plain.raw.numel() for m in mats)
    assert any(ggml.repacks(m.ggml_type, m.shape[0]) for m in mats)  # there was something to copy
    ref = llama_cpp_greedy_until_near_tie(tiny_q4km, list(PROMPTS[0]), 16, TIE)
    assert len(ref) >= 8 and greedy_forward(one, list(PROMPTS[0]), 16)[:len(ref)] == ref


def test_matrices_in_2mb_pages_give_the_same_logits_and_leave_the_files_map(tiny_q4km, monkeypatch):
    """EDGEGEM_CPU_HUGEPAGES=on: every ggml matrix's bytes are copied out of the file's map into
    2 MB-page chunks (kernels/ggml/pages.py), the same bytes: the logits are bit for bit those
    of the mapped model (off)."""
    from models.gguf import in_cow_map
    from models.loader import load_model

    models = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("EDGEGEM_CPU_HUGEPAGES", mode)
        reload_env()
        models[mode] = load_model(tiny_q4km, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True).model
    mapped = {n: in_cow_map(v.plain.raw.data_ptr(), v.plain.nbytes)
              for mode, m in models.items() for n, v in m.w.items() if isinstance(v, GGMLWeight) and mode == "on"}
    assert mapped and not any(mapped.values())
    head = models["off"].w["token_embd.weight"].plain
    assert in_cow_map(head.raw.data_ptr(), head.nbytes)  # off: the tied head is the file's map
    for n, v in models["on"].w.items():
        if isinstance(v, GGMLWeight):
            assert torch.equal(v.raw, models["off"].w[n].raw), n
    tokens = torch.tensor(PROMPTS[1])
    assert torch.equal(models["on"].forward(tokens), models["off"].forward(tokens))
