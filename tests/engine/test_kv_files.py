"""KV files (engine/kv/file.py, engine/kv/sessions.py): a conversation's KV saved and restored, byte
for byte, with the same greedy continuation as without; bad files refused in one line; crashes and
full disks lose nothing."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.kv import file as kv_file
from engine.kv import KVDisk
from engine.sampler import SamplingParams
from engine.scheduler import Engine, EngineConfig
from models.loader import load_model
from tiny_models import TinySpec, write_tiny_gemma4

FORMATS = ("fp32", "bf16", "fp16", "int8_per_token_head", "fp8_per_token_head")
GREEDY = SamplingParams(max_tokens=12)
MID = "model-a"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # KV sharing (4 of 8 layers), window 8, head dims 64/128: every slab kind a file holds
    return load_model(write_tiny_gemma4(tmp_path_factory.mktemp("kvf") / "t.gguf", TinySpec(), seed=11))


def _engine(lm, fmt="fp32", model_id=MID, **kw):
    cfg = EngineConfig(kv_cache_dtype=fmt, swa_kv_cache_dtype=fmt, full_tokens=kw.pop("full_tokens", 512),
                       window_tokens=kw.pop("window_tokens", 512), **kw)
    return Engine(lm.model, None, cfg, model_id=model_id)


def _ask(eng, prompt, kv=None, params=GREEDY):
    req = eng.add(prompt, params, kv_session=str(kv) if kv else None)
    eng.run_to_completion()
    eng.sessions.flush()
    assert req.finish_reason in ("stop", "length"), req.finish_reason
    return req


def _prompt(seed, n=30):
    return [2] + np.random.default_rng(seed).integers(11, 384, size=n).tolist()


def _free(eng):
    return eng.pools.full.n_free, eng.pools.window.n_free


@pytest.mark.parametrize("fmt", FORMATS)
def test_restore_gives_the_saved_bytes_and_the_same_continuation(tiny, tmp_path, fmt):
    f = tmp_path / "conv.safetensors"
    p1 = _prompt(1)
    a = _engine(tiny, fmt)
    r1 = _ask(a, p1, f)
    saved = r1.all_ids[:-1]  # the last sampled token has no KV yet
    assert f.exists() and r1.restored_len == 0
    _, saved_t = kv_file.load(f, MID, a.sessions.layout())
    p2 = saved + _prompt(2, 9)
    want = _ask(a, p2)  # the next turn served from the in-memory cache
    assert want.cached_len == len(saved)

    b = _engine(tiny, fmt)  # a restart: empty pools and cache
    r2 = _ask(b, p2, f)
    assert r2.kv_error is None
    assert r2.restored_len == len(saved) == r2.cached_len
    assert r2.stats()["prefilled_tokens"] == len(p2) - len(saved)
    assert r2.output_ids == want.output_ids
    cold = _ask(_engine(tiny, fmt), p2)
    assert cold.output_ids == want.output_ids  # and both equal a cold prefill

    # restored KV bytes equal the saved ones, every slab and scale (the file now holds turn 2)
    again = kv_file.snapshot(b.pools, b.cache, b.window, saved, MID, type(b.model).__name__)
    for name, t in saved_t.items():
        got = again.tensors[name]
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
    assert any(k.startswith("window.") for k in saved_t) and any(k.endswith("_scale") for k in saved_t) == (
        "per_token_head" in fmt)


def test_prompt_extending_or_diverging_uses_the_common_prefix_only(tiny, tmp_path):
    f = tmp_path / "c.safetensors"
    p1 = _prompt(3, 40)
    _ask(_engine(tiny), p1, f)
    eng = _engine(tiny)
    diverge = p1[:33] + _prompt(4, 6)  # inside the saved tokens (within the kept window positions)
    r = _ask(eng, diverge, f)
    assert r.restored_len == 33 and r.stats()["prefilled_tokens"] == len(diverge) - 33
    assert r.output_ids == _ask(_engine(tiny), diverge).output_ids
    # a prompt that shares nothing restores nothing
    r = _ask(_engine(tiny), [3] + _prompt(5)[1:], f)
    assert r.restored_len == 0 and r.kv_error is None


def test_far_divergence_serves_only_what_the_window_allows(tiny, tmp_path):
    """The file keeps sliding-layer KV for its last window + margin positions only: a prompt that
    leaves the saved tokens before that gets what a sliding layer can still attend with."""
    f = tmp_path / "c.safetensors"
    eng = _engine(tiny, window_margin=4)
    p1 = _prompt(6, 60)
    _ask(eng, p1, f)
    _, t = kv_file.load(f, MID, eng.sessions.layout())
    n = len(p1) + 12 - 1
    assert t["window.pos"].tolist() == list(range(n - 8 - 4, n))
    r = _ask(_engine(tiny, window_margin=4), p1[:20] + [5, 6, 7])
    r2 = _ask(_engine(tiny, window_margin=4), p1[:20] + [5, 6, 7], f)
    assert r2.restored_len == 0 and r2.output_ids == r.output_ids


def _bad_copy(src: Path, dst: Path, how: str) -> Path:
    data = bytearray(src.read_bytes())
    if how == "truncated":
        data = data[:len(data) * 2 // 3]
    elif how == "bitflip":
        data[-100] ^= 0x10  # inside the last tensor's payload
    elif how == "header":
        data[20] ^= 0xFF
    elif how == "empty":
        data = bytearray()
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("how, words", [("truncated", "truncated"), ("bitflip", "checksum"),
                                        ("header", "header"), ("empty", "truncated")])
def test_damaged_files_are_refused_in_one_line_and_prefill_runs(tiny, tmp_path, how, words):
    good = tmp_path / "good.safetensors"
    p1 = _prompt(7)
    r1 = _ask(_engine(tiny), p1, good)
    p2 = r1.all_ids + [40, 41, 42]
    want = _ask(_engine(tiny), p2).output_ids
    bad = _bad_copy(good, tmp_path / "bad.safetensors", how)
    eng = _engine(tiny)
    before = _free(eng)
    r = _ask(eng, p2, bad)
    assert r.kv_error and words in r.kv_error and "\n" not in r.kv_error, r.kv_error
    assert r.restored_len == 0 and r.cached_len == 0 and r.output_ids == want
    eng.cache.clear()
    assert _free(eng) == before  # nothing taken by the refused file


@pytest.mark.parametrize("change, words", [
    (dict(model_id="model-b"), "another model"),
    (dict(fmt="int8_per_token_head"), "format"),
    (dict(window_margin=64, share_kv=False), "KV sharing"),
])
def test_files_of_another_model_or_format_are_refused(tiny, tmp_path, change, words):
    f = tmp_path / "c.safetensors"
    r1 = _ask(_engine(tiny), _prompt(8), f)
    p2 = r1.all_ids + [50, 51]
    eng = _engine(tiny, **change)
    r = _ask(eng, p2, f)
    assert r.kv_error and words in r.kv_error, r.kv_error
    assert r.restored_len == 0 and r.output_ids == _ask(_engine(tiny, **change), p2).output_ids


def test_a_full_disk_while_saving_leaves_the_chat_working(tiny, tmp_path, monkeypatch):
    real = kv_file.write

    def enospc(snap, path, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_file, "write", enospc)
    eng = _engine(tiny)
    f = tmp_path / "c.safetensors"
    r = _ask(eng, _prompt(9), f)
    assert not f.exists() and list(eng.sessions.errors) == ["KV file c.safetensors not saved: No space left on device"]
    assert not list(tmp_path.iterdir())  # no temporary file left behind
    monkeypatch.setattr(kv_file, "write", real)
    r2 = _ask(eng, r.all_ids + [60], f)  # the chat goes on, from the in-memory cache
    assert r2.cached_len == len(r.all_ids) - 1 and f.exists()


def test_kill_during_a_save_leaves_no_file_a_restore_would_use(tiny, tmp_path):
    """A child process saves and is killed with SIGKILL between write and rename: the target path
    keeps its previous (valid) file, the temporary file is cleaned up by the next KVDisk."""
    f = tmp_path / "kv" / "c.safetensors"
    p1 = _prompt(10)
    r1 = _ask(_engine(tiny, kv_dir=str(f.parent)), p1, f)
    old = f.read_bytes()
    script = textwrap.dedent(f"""
        import sys, time, torch
        sys.path[:0] = {sys.path!r}
        from engine.kv import file as kv_file
        snap = kv_file.KVSnapshot([1, 2, 3], {{"tokens": torch.tensor([1, 2, 3]),
                                  "full.0.k": torch.randn(3, 1, 64)}}, {{"edgegem_kv": "1"}})
        def hang(tmp):
            print("written", flush=True)
            time.sleep(60)
        kv_file.write(snap, {str(f)!r}, before_rename=hang)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "written"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert f.read_bytes() == old
    assert [p.name for p in f.parent.iterdir() if p.name.startswith(".")]  # the orphan
    KVDisk(f.parent, 1 << 30)
    assert [p.name for p in f.parent.iterdir()] == ["c.safetensors"]
    r = _ask(_engine(tiny), r1.all_ids + [70], f)
    assert r.restored_len == len(r1.all_ids) - 1 and r.kv_error is None


def test_evict_policy_saves_when_the_cache_lets_go_and_at_close(tiny, tmp_path):
    """The app's policy: nothing is written after an answer; a conversation's file appears when
    another one pushes it out of a small pool, and the rest at close."""
    folder = tmp_path / "kv"
    eng = _engine(tiny, kv_save="evict", kv_dir=str(folder), full_tokens=100, window_tokens=200,
                  max_running_requests=1)
    a, b = folder / "a.safetensors", folder / "b.safetensors"
    ra = _ask(eng, _prompt(11, 50), a)
    assert not a.exists() and eng.sessions.dirty
    rb = _ask(eng, _prompt(12, 50), b)  # needs a's slots: a is saved first
    assert a.exists() and not b.exists()
    eng.close()
    assert b.exists() and not eng.sessions.dirty
    r = _ask(_engine(tiny), ra.all_ids + [80, 81], a)
    assert r.restored_len == len(ra.all_ids) - 1
    r = _ask(_engine(tiny), rb.all_ids + [82], b)
    assert r.restored_len == len(rb.all_ids) - 1


def test_disk_budget_deletes_least_recently_used_files(tmp_path):
    disk = KVDisk(tmp_path, budget=2500)
    for i, name in enumerate("abc"):
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1000 + i, 1000 + i))
    os.utime(tmp_path / "a.safetensors", (2000, 2000))  # a was restored last: b is the oldest
    assert [p.name for p in disk.enforce()] == ["b.safetensors"]
    assert disk.usage() == (2, 2000)
    assert disk.clear() == 2 and disk.usage() == (0, 0)


def test_engine_keeps_the_folder_under_its_budget(tiny, tmp_path):
    folder = tmp_path / "kv"
    eng = _engine(tiny, kv_dir=str(folder))
    _ask(eng, _prompt(13), folder / "1.safetensors")
    one = (folder / "1.safetensors").stat().st_size
    eng = _engine(tiny, kv_dir=str(folder), kv_disk_budget=int(one * 2.5))
    for i in range(2, 5):
        _ask(eng, _prompt(13 + i), folder / f"{i}.safetensors")
    assert sorted(p.name for p in folder.iterdir()) == ["3.safetensors", "4.safetensors"]


def test_forget_deletes_the_file_and_a_pending_save(tiny, tmp_path):
    folder = tmp_path / "kv"
    eng = _engine(tiny, kv_save="evict", kv_dir=str(folder))
    a = folder / "a.safetensors"
    _ask(eng, _prompt(20), a)
    eng.sessions.forget(str(a))
    eng.close()
    assert not a.exists()


def test_gemma3_270m_round_trip(gemma3_270m_path, tmp_path):
    """The real demo model, prompt past its 512-token window, int8 KV: restored continuation equals
    the in-memory one."""
    lm = load_model(gemma3_270m_path, weight_dtype=torch.float16)
    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife. ") * 30
    p1 = lm.tokenizer.encode(text)[:560]
    f = tmp_path / "g3.safetensors"
    params = SamplingParams(max_tokens=6)
    kw = dict(fmt="int8_per_token_head", full_tokens=1024, window_tokens=1600, prefill_chunk=256)
    a = _engine(lm, **kw)
    r1 = _ask(a, p1, f, params)
    p2 = r1.all_ids + lm.tokenizer.encode(" Mr. Bennet said")
    want = _ask(a, p2, None, params)
    r2 = _ask(_engine(lm, **kw), p2, f, params)
    assert r2.restored_len == len(r1.all_ids) - 1 and r2.output_ids == want.output_ids
    layout = a.sessions.layout()
    assert layout["window_pool"]["layers"] and layout["full"]["layers"]


def test_kv_resume_bench_reports_every_length_and_format(tiny):
    from engine.bench.kv_resume import kv_resume_bench

    out = kv_resume_bench(tiny, lengths=(24, 40))
    assert [r["tokens"] for r in out["rows"]] == [24, 40]
    for r in out["rows"]:
        assert r["prefilled_on_resume"] == 16 and r["cold_prefill_s"] > 0 and r["resume_s"] > 0
        assert r["speedup"] == pytest.approx(r["cold_prefill_s"] / r["resume_s"])
    sizes = {s["format"]: s["bytes_per_token"] for s in out["file_sizes"]}
    assert set(sizes) == set(FORMATS)
    assert sizes["bf16"] < sizes["fp32"] and sizes["int8_per_token_head"] < sizes["bf16"]
    assert "speedup" in out["table"]


def test_a_file_of_another_format_version_is_refused(tiny, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    f = tmp_path / "c.safetensors"
    r1 = _ask(_engine(tiny), _prompt(21), f)
    with safe_open(str(f), framework="pt") as h:
        meta, tensors = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}
    save_file(tensors, str(f), metadata={**meta, "edgegem_kv": "2"})
    r = _ask(_engine(tiny), r1.all_ids + [90], f)
    assert r.kv_error == "c.safetensors: KV file format version 2, this edgegem reads version 1"
    assert r.restored_len == 0
