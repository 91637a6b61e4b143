"""What the engine launches for which GPU, checked without one: the decode-attention split rule
(kernels.triton.attention.decode_splits, engine.batch_decode.decode_splits), launch parameters that follow
the GPU's arch (kernels.arch: a CUDA device's own, `assume_gpu` for dry runs), fp8 KV refused below
sm_80, and GPUs older than sm_75 on the torch path. A CUDA device is faked by patching
kernels.arch's two probes (`_have_cuda`, `_cuda_gpu`); nothing here needs a GPU except the last
test (`-m cuda`)."""
from __future__ import annotations

from triton_env import INTERPRET  # noqa: F401 - first: TRITON_INTERPRET before triton is imported

import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import api  # noqa: E402
from engine.attention_backend import get_attention_backend  # noqa: E402
from engine.batch_decode import capacity_of, decode_splits as table_splits  # noqa: E402
from engine.kv import FormatUnsupported, resolve_format  # noqa: E402
from kernels import arch  # noqa: E402
from kernels.triton.attention import (MERGE_SHARE, SPLIT_MIN_KEYS, decode_attention, decode_splits, extend_attention,  # noqa: E402
                               merge_read_bytes, split_read_bytes)
from kernels.triton.launch import record_launches, use_kernels  # noqa: E402

META = torch.device("meta")


@pytest.fixture
def fake_cuda(monkeypatch):
    """fake_cuda((7, 5), sms=24): torch.device("cuda") now answers as such a GPU."""
    def make(cap, sms=24):
        monkeypatch.setattr(arch, "_have_cuda", lambda: True)
        monkeypatch.setattr(arch, "_cuda_gpu", lambda index: arch.Gpu(tuple(cap), sms))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return make


# --- the split rule --------------------------------------------------------------------------------

# (n_h / n_kv = group, n_kv, hd) of the layers the split rule serves: E2B full / sliding, E4B full / sliding
LAYER_SHAPES = [(8, 1, 512), (8, 1, 256), (4, 2, 512), (4, 2, 256)]
KV_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn]


def _rule(keys, rows, n_kv, sms, group=8, hd=512, kv_dtype=torch.bfloat16):
    return decode_splits(keys, rows, n_kv, sms, group=group, hd=hd, kv_dtype=kv_dtype)


def test_the_merge_never_costs_more_than_a_quarter_of_a_split():
    """Issue 21 item 2, over every SM count 20-170 and contexts 1K-128K (odd ones too), for E2B and
    E4B layers, every KV format and 1-12 query rows: the last split's merge reads (every split's
    fp32 [group, hd + 1] partial) at most MERGE_SHARE of what one split reads (its keys' K/V,
    scales, slots and positions); below that cap the SM fill decides (>= 2 programs per SM, or
    SPLIT_MIN_KEYS keys a split). Before, an H200 (132 SMs) gave E2B 264 splits from 17K keys and
    a merge 4-33x a split."""
    assert MERGE_SHARE <= 0.25
    contexts = [1024, 1500, 2048, 4096, 8192, 17408, 32768, 50000, 65536, 131072]
    for sms in range(20, 171):
        for group, n_kv, hd in LAYER_SHAPES:
            for kv in KV_DTYPES:
                key_bytes = 2 * hd * kv.itemsize + (8 if kv in (torch.int8, torch.float8_e4m3fn) else 0) + 16
                for keys in contexts:
                    for rows in (1, 2, 3, 4, 12):
                        s = _rule(keys, rows, n_kv, sms, group, hd, kv)
                        split = -(-keys // s) * key_bytes
                        merge = 0 if s == 1 else s * group * (hd + 1) * 4
                        assert merge <= MERGE_SHARE * split, (sms, group, n_kv, hd, kv, keys, rows, s)
                        assert merge == merge_read_bytes(s, group, hd) and split == split_read_bytes(keys, s, hd, kv)
                        if rows * n_kv * s < 2 * sms and s < keys // SPLIT_MIN_KEYS:
                            # the cap decided: one split more would make the merge of s + 1 partials
                            # exceed the share of an even split (keys / (s + 1))
                            more = s + 1
                            assert more * more * group * (hd + 1) * 4 > MERGE_SHARE * keys * key_bytes, \
                                (sms, group, hd, kv, keys, rows, s)
    # the H200 case of the issue: capped, and the GPU still gets many programs at long contexts
    assert _rule(17408, 1, 1, 132) == 23 and _rule(131072, 1, 1, 132) == 64


@pytest.mark.parametrize("sms", [14, 28, 46, 132])
def test_decode_splits_fill_the_gpu_where_keys_allow(sms):
    """Programs (rows x KV heads x splits) >= 2 per SM unless every split already holds only
    SPLIT_MIN_KEYS keys or the merge cap binds; never a split with fewer keys than that (beyond the
    first)."""
    for rows in (1, 2, 3, 4, 12):
        for n_kv in (1, 2):
            for keys in (16, 64, 100, 1000, 4096, 32768, 1 << 17):
                s = _rule(keys, rows, n_kv, sms)
                assert s >= 1 and (s == 1 or s * SPLIT_MIN_KEYS <= keys), (rows, n_kv, keys, s)
                if rows * n_kv * s < 2 * sms:
                    assert s == max(1, min(keys // SPLIT_MIN_KEYS, _rule(keys, 1, 1, 10 ** 6))), (rows, n_kv, keys, s)


def test_table_splits_are_constant_within_a_capacity_bucket():
    """The batched decoder's count depends on the table capacity, not the sequence length, so
    every length that shares a captured (B, T, capacity) shares its grid; meta/CPU take the
    reference GPU's SM count, `assume_gpu` another."""
    for rows, n_kv in ((1, 1), (4, 2), (6, 1)):
        by_cap: dict[int, set] = {}
        for n in list(range(1, 300)) + list(range(4000, 4200)) + [8191, 8192, 8193]:
            cap = capacity_of(n)
            by_cap.setdefault(cap, set()).add(table_splits(cap, rows, n_kv, META, 8, 256, torch.bfloat16))
        assert all(len(v) == 1 for v in by_cap.values()), by_cap
    assert table_splits(65536, 1, 1, META, 8, 512, torch.bfloat16) == _rule(65536, 1, 1, arch.REFERENCE.sms) == 45
    with arch.assume_gpu((7, 5), sms=16):  # 32 programs wanted: fewer SMs, fewer splits
        assert table_splits(65536, 1, 1, "cpu", 8, 512, torch.bfloat16) == 32


def _decode_launches(record):
    return [(tuple(launch.grid), launch.grid[2]) for launch in record.triton  # splits = grid dim 2
            if launch.name == "_decode_split_kernel"]


def test_dry_run_decode_grid_fixed_per_capacity_and_fills_the_gpu():
    """E2B B = 1 decode steps at 2100 and 4000 tokens (one full-table capacity, 4096) launch the
    same decode-attention grids; the full layers get >= 2 programs per SM of the reference GPU."""
    from engine.bench.dry_run import decode_step, dry_model

    model = dry_model("e2b")
    a = _decode_launches(decode_step(model, 1, 1, 2100, torch_ops=False).record)
    b = _decode_launches(decode_step(model, 1, 1, 4000, torch_ops=False).record)
    assert a == b and len(a) == model.cfg.n_layer
    full = [g for g, _ in a if g[2] == _rule(4096, 1, 1, arch.REFERENCE.sms, 8, 512)]
    assert len(full) == sum(not s for s in model.cfg.is_sliding)
    assert all(g[2] == 11 for g in full)  # the merge cap (fill alone wanted 56 on 28 SMs)


# --- launch parameters follow the arch -------------------------------------------------------------

def _record(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, hd=512, n_h=8, n_kv=1, rows=1):
    q = torch.empty(rows, n_h, hd, dtype=q_dtype, device=META)
    slab = torch.empty(4096, n_kv, hd, dtype=kv_dtype, device=META)
    slots = torch.empty(2048, dtype=torch.int64, device=META)
    q_pos = torch.empty(rows, dtype=torch.int64, device=META)
    with record_launches(torch_ops=False) as rec:
        decode_attention(q[0], slab, slab, slots, slots, q_pos[:1], 1.0)
        extend_attention(q, slab, slab, slots, slots, q_pos, 1.0)
    return {launch.name: launch.kwargs for launch in rec.triton}


def test_launch_parameters_follow_the_assumed_arch():
    """Turing: fp16 dot operands for bf16 queries, the head group unpadded, q.k in head-dim chunks
    of 32 (FMA dots); Ampere and newer: bf16 tensor-core dots over a 16-row padded group."""
    ampere = _record()
    with arch.assume_gpu((7, 5)):
        turing = _record(rows=3)
    d, e = ampere["_decode_split_kernel"], ampere["_extend_kernel"]
    assert (d["DOT_F16"], d["BLOCK_H"], d["BLOCK_DK"]) == (False, 16, 512)
    assert (e["DOT_F16"], e["BLOCK_DK"]) == (False, 512)
    d, e = turing["_decode_split_kernel"], turing["_extend_kernel"]
    assert (d["DOT_F16"], d["BLOCK_H"], d["BLOCK_DK"]) == (True, 8, 32)
    assert (e["DOT_F16"], e["BLOCK_M"], e["BLOCK_DK"]) == (True, 8, 32)


def test_a_cuda_device_answers_for_itself(fake_cuda):
    fake_cuda((7, 5), sms=40)
    assert arch.gpu_of("cuda") == arch.Gpu((7, 5), 40)
    with arch.assume_gpu((8, 9)):  # the override is for launches with no GPU behind them
        assert arch.gpu_of(torch.device("cuda", 0)).arch == (7, 5)
        assert arch.gpu_of(META).arch == (8, 9)
    assert table_splits(65536, 1, 1, "cuda", 8, 512, torch.bfloat16) == 45  # 80 wanted, the merge cap allows 45
    assert table_splits(65536, 1, 2, "cuda", 4, 256, torch.int8) == 40  # E4B-like: 40 wanted per KV head


# --- fp8 KV below sm_80, the torch path below sm_75 --------------------------------------------------

def test_fp8_kv_refused_below_sm80_naming_int8(fake_cuda):
    fake_cuda((7, 5))
    with pytest.raises(FormatUnsupported) as e:
        resolve_format("fp8_per_token_head", "cuda")
    msg = str(e.value)
    assert "\n" not in msg and "sm_75" in msg and "int8_per_token_head" in msg
    assert resolve_format("int8_per_token_head", "cuda").name == "int8_per_token_head"
    assert resolve_format("fp8_per_token_head", "cpu").scaled  # the torch path converts fp8 itself
    fake_cuda((8, 0))
    assert resolve_format("fp8_per_token_head", "cuda").name == "fp8_per_token_head"
    with arch.assume_gpu((7, 5)), pytest.raises(FormatUnsupported):  # a dry run for Turing
        resolve_format("fp8_per_token_head", META)


def test_cli_refuses_fp8_on_turing_in_one_line(fake_cuda, capsys):
    from app.cli import main

    fake_cuda((7, 5))
    base = ["info", "--synthetic", "e2b", "--device", "cuda", "--gpu-memory-budget", "6GiB"]
    assert main(base + ["--kv-cache-dtype", "fp8_per_token_head"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgegem: error: ") and "int8_per_token_head" in err[0]
    assert main(base + ["--kv-cache-dtype", "int8_per_token_head"]) == 0
    out = capsys.readouterr().out
    assert "int8_per_token_head" in out and "fp8_per_token_head" not in out  # the by-format table skips it


def test_gpus_older_than_turing_take_the_torch_path(fake_cuda, monkeypatch):
    fake_cuda((6, 1))
    ok, why = arch.triton_supported("cuda")
    assert not ok and why.startswith("sm_61: older than sm_75 (Turing)") and why.endswith("the torch path runs")
    assert get_attention_backend("auto", "cuda").name == "torch"
    with pytest.raises(ValueError, match="sm_61"):
        get_attention_backend("triton", "cuda")
    from kernels.triton import launch
    assert not launch._device_ok(torch.device("cuda"))  # the models' fused-op dispatch
    loads = []
    monkeypatch.setattr(api, "load_model", lambda path, **kw: loads.append(kw))
    api.open_model("m.gguf", exact=False, device="cuda")
    assert loads[-1].get("quantized", False) is False and loads[-1]["weight_dtype"] == torch.float16
    fake_cuda((7, 5))
    assert get_attention_backend("auto", "cuda").name == "triton" and launch._device_ok(torch.device("cuda"))
    api.open_model("m.gguf", exact=False, device="cuda")
    assert loads[-1]["quantized"] is True and loads[-1]["dtype"] == torch.bfloat16
    assert use_kernels(torch.empty(1)) is False  # a CPU tensor outside kernels_on_cpu()


def test_auto_attention_backend_follows_the_models_runtime(fake_cuda):
    """The engine passes the runtime decided at load: triton attention for the triton runtime
    only, whatever the device says; without a runtime (a model built by hand) the device decides."""
    from models.runtime import Runtime

    fake_cuda((8, 6))
    assert get_attention_backend("auto", "cuda", Runtime.TRITON).name == "triton"
    for rt in (Runtime.GPU_TORCH, Runtime.REFERENCE):  # the model was loaded for torch ops
        assert get_attention_backend("auto", "cuda", rt).name == "torch", rt
    assert get_attention_backend("auto", "cuda").name == "triton"
    for rt in (Runtime.GGML, Runtime.CPU_TORCH, None):
        assert get_attention_backend("auto", "cpu", rt).name == "torch", rt


def test_gpu_support_table():
    rows = {cap: api.gpu_support(cap) for cap in ((6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0))}
    assert [c for c, s in rows.items() if s.triton] == [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0)]
    assert [c for c, s in rows.items() if s.fp8_kv] == [(8, 0), (8, 6), (8, 9), (9, 0)]
    assert rows[(7, 5)].attention_dots == "fp16" and rows[(8, 6)].attention_dots == "bf16"
    assert not api.gpu_support((8, 6), triton_installed=False).triton


# --- on a GPU -----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_capture_survives_another_threads_cuda_calls(tmp_path):
    """A loader thread allocating device memory (cudaMalloc) while the batched decoder captures
    its graph: with capture_error_mode="thread_local" the capture is not invalidated, and the
    replay equals the eager forward."""
    from engine.batch_decode import BatchDecoder
    from engine.scheduler import Engine, EngineConfig
    from engine.kv import SequenceKV
    from models.loader import load_model
    from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4

    path = quantize_gguf(write_tiny_gemma4(tmp_path / "f.gguf", TinySpec(), seed=17), tmp_path / "q.gguf")
    model = load_model(path, dtype=torch.float32, device="cuda", quantized=True, host_embeddings=True).model
    eng = Engine(model, None, EngineConfig(full_tokens=1024, attention_backend="triton", batched_decode=False))
    kv = SequenceKV(eng.pools, eng.window, model.dtype, backend=eng.attention_backend)
    eng.runner.forward(kv, [2] + list(range(20, 40)), 0, want_logits=False)
    stop, held = threading.Event(), []

    def loader():  # like the app's model loader: device tensors allocated one after another
        while not stop.is_set() and len(held) < 4000:  # 64 KiB each: a fresh 2 MiB segment every 32
            held.append(torch.empty(1 << 16, dtype=torch.uint8, device="cuda"))
            time.sleep(0.0005)

    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    try:
        out = []
        for dec in (BatchDecoder(model, eng.pools, eng.attention_backend),
                    BatchDecoder(model, eng.pools, eng.attention_backend, graphs=False)):
            kv.begin(torch.arange(len(kv), len(kv) + 1))
            out.append(dec.forward([kv], [[50]], 1)[0].double().cpu())
            kv.end()
            kv.truncate(len(kv) - 1)
    finally:
        stop.set()
        thread.join()
        held.clear()
    assert torch.nn.functional.cosine_similarity(out[0], out[1], dim=-1).min() > 0.99999
