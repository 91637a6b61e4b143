"""CPU side by side: edgegem (its model loop and/or the engine) and llama.cpp on the same GGUF,
each in a child process of its own so each peak RSS is its own.

`edgegem bench --device cpu --synthetic e2b` writes the synthetic full-size model (the real tensor
table and Q4_K_M type mix, random blocks: models/synthetic.py) to a temporary GGUF first, so
llama.cpp runs the very file edgegem runs. Prefill is one prompt of `n_prompt` tokens (llama.cpp:
one batch of the whole prompt; the model loop: one forward; the engine: its prefill chunks, with
fast prefill as configured), decode `n_decode` greedy steps after it; the same thread count.
Peak RSS is the child's own VmHWM: everything it touched, weights read through a memory map
included (llama.cpp maps the file; edgegem maps only its lookup tables). Each edgegem run's greedy
tokens are compared with llama.cpp's: how many of the first agree (the lowest over the rounds), a
check that both ran the same model, not only as fast.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import resource
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from models.kv_cache import DenseKVCache

from .table import Column, header, row

KINDS = ("llama.cpp", "loop", "engine", "engine-plain")
LABELS = {"llama.cpp": "llama-cpp-python 0.3.36", "loop": "edgegem model loop",
          "engine": "edgegem engine (fast prefill)", "engine-plain": "edgegem engine (--fast-prefill off)"}


def bench_prompt(vocab: int, n: int) -> list[int]:
    """`n` token ids: BOS, then ordinary tokens drawn with a fixed seed (the same prompt every run)."""
    rng = np.random.default_rng(0)
    # ordinary tokens: past the specials at the start of the vocabulary (1000 on real vocabularies)
    return [2] + rng.integers(min(1000, vocab // 4), min(vocab, 200_000), size=n - 1).tolist()


@torch.inference_mode()
def _greedy_loop(model, prompt: list[int], n_decode: int) -> dict:
    """The model's own loop: one forward over the prompt, then one per greedy token (DenseKVCache)."""
    cache = DenseKVCache()
    t0 = time.perf_counter()
    logits = model.forward(torch.tensor(prompt), cache=cache, logits_rows=torch.tensor([len(prompt) - 1]))[0]
    prefill_s = time.perf_counter() - t0
    pos, ids = len(prompt), []
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = int(logits.argmax())
        ids.append(tok)
        logits = model.forward(torch.tensor([tok]), torch.tensor([pos]), cache)[0]
        pos += 1
    decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": n_decode / decode_s, "ids": ids}


def _llama_cpp(path: Path, prompt: list[int], n_decode: int, threads: int) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + n_decode + 8, n_batch=len(prompt),
                          n_ubatch=len(prompt), n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0  # its default placement: the file mapped, Q4_K repacked into memory
    try:
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - t0
        ids = []
        n_vocab = llm.n_vocab()
        t0 = time.perf_counter()
        for _ in range(n_decode):
            # logits of the last evaluated row straight from the context (no copy of all rows)
            last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
            tok = int(np.argmax(last))
            ids.append(tok)
            llm.eval([tok])
        decode_s = time.perf_counter() - t0
    finally:
        llm.close()
    return {"load_s": load_s, "prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": n_decode / decode_s,
            "ids": ids}


def _peak_rss() -> int:
    """This process's own peak RSS in bytes: /proc's VmHWM. Not ru_maxrss: exec records there the
    peak of the memory map it replaces, so a child of a parent that wrote a 3 GB GGUF would report
    the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration, ValueError):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _run_loop(path: str, prompt: list[int], n_decode: int, threads: int) -> dict:
    from ..api import open_model

    t0 = time.perf_counter()
    lm = open_model(Path(path), exact=False, device="cpu")
    load_s = time.perf_counter() - t0
    return {"load_s": load_s, "runtime": lm.runtime.value, **_greedy_loop(lm.model, prompt, n_decode)}


def _run_engine(path: str, prompt: list[int], n_decode: int, threads: int, fast_prefill: bool = True) -> dict:
    """Through the client thread, as `edgegem run` and the app drive it."""
    from .. import api
    from ..request_params import GenerationParams
    from ..sampler import SamplingParams

    t0 = time.perf_counter()
    lm = api.open_model(Path(path), exact=False, device="cpu")
    load_s = time.perf_counter() - t0
    client = api.start_client(lm, api.EngineOptions(fast_prefill=fast_prefill))
    try:
        gen = GenerationParams(SamplingParams(temperature=0.0, max_tokens=n_decode + 1))
        rid = client.submit_ids(list(prompt), gen)
        last, ids = None, []
        for ev in client.stream(rid):
            last = ev
            ids += ev.token_ids
        if last.error:
            raise RuntimeError(last.error)
        st = last.stats
    finally:
        client.close()
    # the prompt's token, then n_decode steps: the first n_decode are what the loop and llama.cpp produce
    return {"load_s": load_s, "runtime": lm.runtime.value, "prefill_tok_s": st["prefill_tok_s"],
            "decode_tok_s": st["decode_tok_s"], "ids": ids[:n_decode]}


def _child(kind: str, path: str, prompt: list[int], n_decode: int, threads: int, out) -> None:
    from ..cpu_runtime import set_threads

    set_threads(threads)
    try:
        if kind == "llama.cpp":
            r = _llama_cpp(Path(path), prompt, n_decode, threads)
        elif kind == "loop":
            r = _run_loop(path, prompt, n_decode, threads)
        else:
            r = _run_engine(path, prompt, n_decode, threads, fast_prefill=kind == "engine")
        r["peak_rss"] = _peak_rss()
        out.put(r)
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out.put({"error": f"{type(e).__name__}: {e}"})


def run_child(kind: str, path: Path, prompt: list[int], n_decode: int, threads: int) -> dict:
    """One measurement in a fresh process (spawned: nothing of ours is inherited, so its RSS is
    its own)."""
    return run_in_child(_child, kind, (kind, str(path), prompt, n_decode, threads))


def run_in_child(target, kind: str, args: tuple) -> dict:
    """target(*args, queue) in a spawned process: the dict it puts on the queue, or a one-line
    RuntimeError naming `kind` when it reports an error or dies without a word."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    while True:  # a child that dies without reporting (killed, out of memory) must not hang us
        try:
            r = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"{kind} run died (exit code {p.exitcode})") from None
    p.join()
    if "error" in r:
        raise RuntimeError(f"{kind} run failed: {r['error']}")
    return r


@contextlib.contextmanager
def synthetic_gguf(variant: Optional[str], keep: Optional[Path] = None) -> Iterator[Optional[Path]]:
    """The synthetic `e2b`/`e4b`/`26b-a4b`/`31b` written to a GGUF (at `keep`, reused when it
    exists; else a temporary file removed afterwards), or None when no variant is asked for. A
    layout whose weights cannot fit in RAM is refused before anything is written (RamTooSmall)."""
    if not variant:
        yield None
        return
    from models.synthetic import synthetic_layout
    from models.synthetic_gguf import write_synthetic_gguf

    from ..ram_check import check_layout_ram
    check_layout_ram(synthetic_layout(variant), "ggml")  # both runs hold about the file's bytes

    if keep is not None and Path(keep).exists():
        yield Path(keep)
        return
    if keep is not None:
        yield write_synthetic_gguf(variant, Path(keep))
        return
    with tempfile.TemporaryDirectory(prefix="edgegem-bench-") as tmp:
        yield write_synthetic_gguf(variant, Path(tmp) / f"synthetic-{variant}.gguf")


CPU_COLUMNS = (Column("", 36, align="<"), Column("load s", 7, ".1f"), Column("prefill tok/s", 13, ".1f"),
               Column("decode tok/s", 12, ".2f"), Column("vs llama.cpp", 22), Column("peak RSS", 22),
               Column("greedy = llama.cpp's", 21))


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy runs agree on before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def cpu_side_by_side(path: Optional[Path] = None, synthetic: Optional[str] = None, n_prompt: int = 1024,
                     n_decode: int = 32, threads: int = 0, kinds=("llama.cpp", "loop", "engine"),
                     keep: Optional[Path] = None, repeat: int = 3) -> dict:
    """Prefill/decode tok/s and peak RSS of each of `kinds` on a GGUF (`path`) or the synthetic
    `e2b`/`e4b` written to a temporary file (kept at `keep` when given): `repeat` rounds, the kinds
    alternating within each (so a change in the machine's load hits every kind alike), each
    kind's best round reported (prefill and decode each their best; peak RSS the largest). With
    llama.cpp among the kinds, each other kind's `greedy_tokens_equal`: for how many of the first
    `n_decode` greedy tokens it agreed with llama.cpp's, the lowest over the rounds."""
    from models.gguf import GGUFFile

    from .cpu_profile import cpu_flags
    from ..cpu_runtime import default_threads, kernels

    threads = threads or default_threads()
    with synthetic_gguf(synthetic, keep) as written:
        path = written or path
        vocab = len(GGUFFile(path).metadata.get("tokenizer.ggml.tokens", ())) or 32000
        prompt = bench_prompt(vocab, n_prompt)
        file_bytes = os.path.getsize(path)
        rounds = [{k: run_child(k, path, prompt, n_decode, threads) for k in kinds} for _ in range(max(1, repeat))]
    rows = {k: {"load_s": min(r[k]["load_s"] for r in rounds),
                "prefill_tok_s": max(r[k]["prefill_tok_s"] for r in rounds),
                "decode_tok_s": max(r[k]["decode_tok_s"] for r in rounds),
                "peak_rss": max(r[k]["peak_rss"] for r in rounds),
                "rounds": [{m: r[k][m] for m in ("load_s", "prefill_tok_s", "decode_tok_s", "peak_rss")}
                           for r in rounds]}
            for k in kinds}
    if "llama.cpp" in kinds:
        for k in kinds:
            if k != "llama.cpp":
                rows[k]["greedy_tokens_equal"] = min(leading_equal(r[k]["ids"], r["llama.cpp"]["ids"]) for r in rounds)
    out = {"model": f"synthetic {synthetic.upper()}" if synthetic else Path(path).name, "file_bytes": file_bytes,
           "threads": threads, "prompt_tokens": n_prompt, "decode_tokens": n_decode, "runs": rows,
           "cpu": cpu_flags(), "kernels": kernels()["detail"], "repeat": repeat,
           # the runtime edgegem's runs loaded with (models/runtime.py), as the children reported it
           "runtime": next((r[k]["runtime"] for r in rounds for k in kinds if "runtime" in r[k]), None)}
    ref = rows.get("llama.cpp")
    lines = [f"{out['model']} ({file_bytes / 1e9:.2f} GB file): {n_prompt}-token prompt, {n_decode} decode steps, "
             f"{threads} threads, best of {repeat} alternating rounds",
             f"  {out['cpu']}", f"  edgegem's runtime: {out['runtime']}; CPU kernels: {out['kernels']}",
             header(CPU_COLUMNS[:6 if ref is None else 7])]
    for k, r in rows.items():
        vs = "" if ref is None or k == "llama.cpp" else \
            f"{r['prefill_tok_s'] / ref['prefill_tok_s']:.2f}x / {r['decode_tok_s'] / ref['decode_tok_s']:.2f}x / " \
            f"{r['load_s'] / ref['load_s']:.2f}x"
        same = [f"{r['greedy_tokens_equal']} of {n_decode}"] if "greedy_tokens_equal" in r else []
        lines.append(row(CPU_COLUMNS, [LABELS[k], r["load_s"], r["prefill_tok_s"], r["decode_tok_s"], vs,
                                       f"{r['peak_rss'] / 1e9:.2f} GB ({r['peak_rss'] / file_bytes:.2f}x file)",
                                       *same]).rstrip())
    if ref is not None and repeat > 1:  # every round's ratios, not only the best rounds'
        for k, r in rows.items():
            if k != "llama.cpp":
                lines.append(f"  {LABELS[k]}, each round vs llama.cpp's same round (prefill / decode / load): " + ", ".join(
                    f"{a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x / {a['decode_tok_s'] / b['decode_tok_s']:.2f}x / "
                    f"{a['load_s'] / b['load_s']:.2f}x" for a, b in zip(r["rounds"], ref["rounds"])))
    out["table"] = "\n".join(lines)
    return out
