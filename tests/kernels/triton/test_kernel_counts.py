"""Kernels launched by one B = 1 decode step of the batched decoder (engine/bench/dry_run.py: the CUDA
path run on the meta device, Triton launches recorded, device-side torch ops counted).

The count is deterministic, so it is pinned: a change that adds launches to the decode step shows
up here with the per-kernel breakdown. Before the fusions of issue 11 (cos/sin once per step,
constants cast at load, residual add + norm fused, q/k/v and gate/up stacked, the attention
prologue and K/V store in one launch, one input copy) E2B counted 1036 (654 Triton + 382 torch)
and E4B 1283.

With them E2B counted 509 and E4B 612; then the GELU·mul of the MLP and of the per-layer-input
gate moved into GEMV epilogues (gate/up rows interleaved: the GLU epilogue; inp_gate: gelu · pl)
and split decode attention merges its partials in its last split instead of a reduce launch.
Per layer that leaves the GEMVs (6, 7 where a Q6_K attn_v cannot join the Q4_K q/k), the fused
attention prologue (or the q norm + RoPE of a KV-shared layer), one attention launch and three
residual norms: 11-12.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the launch recorder intercepts Triton launches")

from engine.bench.dry_run import decode_step, dry_model, prefill_chunk  # noqa: E402

PINNED = {"e2b": 404, "e4b": 486}
TARGET = {"e2b": 450, "e4b": 520}  # issue 11


@pytest.fixture(scope="module")
def e2b():
    return dry_model("e2b")


@pytest.fixture(scope="module")
def steps():
    return {v: decode_step(dry_model(v)) for v in ("e2b", "e4b")}


def _breakdown(run) -> str:
    rec = run.record
    return (f"{rec.total} kernels = {rec.n_triton} Triton {dict(rec.triton_counts().most_common())} + "
            f"{rec.n_torch} torch {dict(rec.torch_ops.most_common())}")


@pytest.mark.parametrize("variant", ["e2b", "e4b"])
def test_decode_step_kernel_count_is_pinned(steps, variant):
    run = steps[variant]
    assert run.kernels == PINNED[variant], f"{variant} B=1 decode step: {_breakdown(run)}"


@pytest.mark.parametrize("variant", ["e2b", "e4b"])
def test_decode_step_structure(steps, variant):
    """Per layer one attention prologue (KV-owning layers: norm, RoPE and the K/V store in one
    launch; KV-shared: q norm + RoPE), three fused residual norms (the GELU·mul in GEMV epilogues); per step a handful
    of torch ops (the input copies, the embedding's scale and PLE projection, the output copies)."""
    model = dry_model(variant)
    cfg = model.cfg
    rec = steps[variant].record
    n = rec.triton_counts()
    owning = cfg.first_shared
    why = _breakdown(steps[variant])
    assert n["_qkv_norm_rope_store_kernel"] == owning and "_kv_store_kernel" not in n, why
    assert n["_rms_norm_rope_kernel"] == cfg.n_layer - owning + 1, why  # + layer 0's attention norm
    assert n["_add_rms_norm_kernel"] == 3 * cfg.n_layer + 1, why  # + the per-layer inputs
    # the MLP's and the PLE gate's GELU·mul are GEMV epilogues (gate_up GLU, inp_gate); split
    # attention merges its partials in the last split: one launch each
    assert "_gelu_tanh_mul_kernel" not in n and "_decode_reduce_kernel" not in n, why
    assert n["_decode_split_kernel"] == cfg.n_layer, why
    stacked = sum(name.endswith(("attn_qkv.weight", "ffn_gate_up.weight")) for name in model.w)
    assert stacked == owning + cfg.n_layer, why
    assert rec.n_torch <= 6 and not {"_to_copy", "add", "mul", "cos", "sin"} & {
        op for op, c in rec.torch_ops.items() if c > 1}, why


@pytest.mark.parametrize("variant", ["e2b", "e4b"])
def test_decode_step_meets_the_issue_target(steps, variant):
    assert steps[variant].kernels <= TARGET[variant], _breakdown(steps[variant])


@pytest.mark.parametrize("chunk,context", [(64, 0), (300, 700), (1, 4096)], ids=["first-chunk", "chunk", "decode"])
def test_one_host_to_device_copy_of_slot_tables_per_forward(e2b, chunk, context):
    """Issue 21 item 3: an eager forward through the runner (a prefill chunk; its KV-shared layers'
    last-token pass; a decode outside a graph) copies host data to the device twice: the gathered
    embedding rows and the step's positions + slot tables, packed (pinned on CUDA, non-blocking).
    Each pageable `.to(device)` makes the host wait for the GPU; attention did two per layer (74
    copies for an E2B chunk)."""
    run = prefill_chunk(e2b, chunk, context=context)
    assert run.record.host_copies == 2, f"{run.record.host_copies} copies: {dict(run.record.torch_ops)}"


def test_batched_decode_step_copies_its_inputs_once(steps):
    """The batched decoder: the embedding rows and one packed buffer of every other input."""
    assert steps["e2b"].record.host_copies == 2
