"""The CPU side by side (`edgegem bench --device cpu`, engine/bench/cpu.py): edgegem beside
llama.cpp on one GGUF, each run in a spawned process of its own, with the token-agreement figure
(for how many greedy tokens each edgegem run agrees with llama.cpp's). Speed is not asserted."""
from __future__ import annotations

import json

import pytest

from engine.bench.cpu import cpu_side_by_side, leading_equal
from kernels import ggml
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4

N_PROMPT, N_DECODE = 11, 5  # odd lengths: nothing lines up with a block or a chunk


@pytest.fixture(scope="module")
def tiny_q4km(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpubench")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", TinySpec(), seed=3), d / "q4km.gguf")


def test_leading_equal_counts_tokens_before_the_first_difference():
    assert leading_equal([4, 5, 6, 7], [4, 5, 9, 7]) == 2
    assert leading_equal([4, 5], [4, 5]) == 2
    assert leading_equal([1], [2, 3]) == 0
    assert leading_equal([4, 5, 6], [4, 5]) == 2  # a run that stopped early agrees on no more than it made


@pytest.mark.skipif(not ggml.available(), reason="llama.cpp's libraries are needed for its run")
def test_side_by_side_reports_each_kind_and_its_greedy_agreement_with_llama_cpp(tiny_q4km):
    out = cpu_side_by_side(path=tiny_q4km, n_prompt=N_PROMPT, n_decode=N_DECODE, threads=1,
                           kinds=("llama.cpp", "loop", "engine"), repeat=1)
    runs = out["runs"]
    assert list(runs) == ["llama.cpp", "loop", "engine"]
    for kind, r in runs.items():
        assert r["load_s"] > 0 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["peak_rss"] > 0, kind
        assert len(r["rounds"]) == 1
    assert "greedy_tokens_equal" not in runs["llama.cpp"]
    for kind in ("loop", "engine"):
        assert 0 <= runs[kind]["greedy_tokens_equal"] <= N_DECODE
    assert "ids" not in json.dumps(out)  # token lists stay in the children's reports
    lines = out["table"].splitlines()
    assert lines[3].rstrip().endswith("greedy = llama.cpp's")
    assert lines[5].rstrip().endswith(f"of {N_DECODE}") and lines[6].rstrip().endswith(f"of {N_DECODE}")


@pytest.mark.skipif(not ggml.available(), reason="llama.cpp's libraries are needed for its run")
def test_side_by_side_without_llama_cpp_has_no_agreement_column(tiny_q4km):
    out = cpu_side_by_side(path=tiny_q4km, n_prompt=N_PROMPT, n_decode=N_DECODE, threads=1, kinds=("loop",),
                           repeat=1)
    assert "greedy_tokens_equal" not in out["runs"]["loop"]
    assert "greedy" not in out["table"]


@pytest.mark.skipif(not ggml.available(), reason="llama.cpp's libraries are needed for its run")
def test_batched_decode_beside_llama_cpp_keeps_each_sequences_tokens(tiny_q4km):
    """`bench --batch`: a row per kind and B; edgegem's first sequence decodes the tokens it
    decodes alone whatever runs beside it (decode together keeps a row's bits), llama.cpp's are
    counted, not asserted (its products of 4+ rows take other kernels)."""
    from engine.bench.batched import WARM, batched_side_by_side

    out = batched_side_by_side(path=tiny_q4km, batches=(1, 3, 2), n_prompt=N_PROMPT, n_steps=N_DECODE, threads=1)
    n_tokens = N_DECODE + WARM + 1
    for kind in ("llama.cpp", "engine"):
        rows = out["runs"][kind]
        assert list(rows) == ["1", "3", "2"]
        assert all(r["step_ms"] > 0 and r["tok_s"] > 0 for r in rows.values())
        assert rows["1"]["first_tokens_as_alone"] == n_tokens
        assert all(0 <= r["first_tokens_as_alone"] <= n_tokens for r in rows.values())
    assert all(r["first_tokens_as_alone"] == n_tokens for r in out["runs"]["engine"].values())
    assert f"{n_tokens} of {n_tokens}" in out["table"].splitlines()[-1]
