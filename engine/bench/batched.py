"""Decode of B sequences together on the CPU: edgegem's engine beside llama.cpp's own batched
decode on the same GGUF (`edgegem bench --device cpu --batch 1,2,4`), each side in a child process
of its own per B.

What it answers: how much a step of B sequences costs against a step of one, on this CPU, with
llama.cpp's kernels on both sides; the ceiling a server with parallel slots reaches here. llama.cpp:
one context with `n_seq_max` = B (unified KV), each sequence's prompt decoded, then steps of one
`llama_decode` of B tokens, each sequence's logits argmaxed as a server samples its slots.
edgegem: the engine (no client thread, no HTTP) with B greedy requests running; a step decodes all
of them (`Engine._decode_together` on the CPU). Both time `n_steps` steps after `WARM` untimed
ones; the median step is reported, and the aggregate B / median.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Optional

import numpy as np

from .table import Column, header, row

WARM = 3  # untimed steps first (graphs built, pages touched)


def _prompts(vocab: int, B: int, n: int) -> list[list[int]]:
    """B different prompts of n tokens (BOS, then ordinary tokens from a fixed seed)."""
    rng = np.random.default_rng(1)
    return [[2] + rng.integers(min(1000, vocab // 4), min(vocab, 200_000), size=n - 1).tolist() for _ in range(B)]


def _llama_cpp(path: str, prompts: list[list[int]], n_steps: int, threads: int) -> tuple[list[float], list[int]]:
    import llama_cpp

    B, n = len(prompts), len(prompts[0])
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=threads, n_threads_batch=threads, verbose=False)
    p = llama_cpp.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = B * (n + n_steps + WARM + 8), max(n, B), max(n, B), B
    p.n_threads = p.n_threads_batch = threads
    p.kv_unified = True
    ctx = llama_cpp.llama_init_from_model(llm._model.model, p)
    batch = llama_cpp.llama_batch_init(max(n, B), 0, B)
    n_vocab = llm.n_vocab()
    try:
        def decode(items):
            batch.n_tokens = len(items)
            for i, (tok, pos, s, want) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = s, want
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        def argmax(i: int) -> int:  # row i's logits straight from the context, as engine/bench/cpu.py reads them
            return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))

        toks = []
        for s, prompt in enumerate(prompts):
            decode([(t, j, s, int(j == n - 1)) for j, t in enumerate(prompt)])
            toks.append(argmax(n - 1))
        times, first = [], [toks[0]]
        for step in range(WARM + n_steps):
            t0 = time.perf_counter()
            decode([(toks[s], n + step, s, 1) for s in range(B)])
            toks = [argmax(s) for s in range(B)]
            times.append(time.perf_counter() - t0)
            first.append(toks[0])
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llm.close()
    return times[WARM:], first


def _engine(path: str, prompts: list[list[int]], n_steps: int, threads: int) -> tuple[list[float], list[int]]:
    from ..api import open_model
    from ..sampler import SamplingParams
    from ..scheduler import Engine, EngineConfig

    lm = open_model(Path(path), exact=False, device="cpu")
    B, n = len(prompts), len(prompts[0])
    eng = Engine(lm.model, None, EngineConfig(max_running_requests=B, full_tokens=B * (n + n_steps + WARM + 8)))
    reqs = [eng.add(p, SamplingParams(temperature=0.0, max_tokens=n_steps + WARM + 4)) for p in prompts]
    while any(r.state.name in ("WAITING", "PREFILL") for r in reqs):
        eng.step()
    times = []
    for _ in range(WARM + n_steps):
        if any(r.state.name != "DECODE" for r in reqs):
            raise RuntimeError("a request left decode early")
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return times[WARM:], list(reqs[0].output_ids)


def _child(kind: str, path: str, prompts, n_steps: int, threads: int, out) -> None:
    from ..cpu_runtime import set_threads

    set_threads(threads)
    try:
        run = _llama_cpp if kind == "llama.cpp" else _engine
        times, ids = run(path, prompts, n_steps, threads)
        out.put({"times": times, "ids": ids})
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out.put({"error": f"{type(e).__name__}: {e}"})


KINDS = ("llama.cpp", "engine")
LABELS = {"llama.cpp": "llama-cpp-python 0.3.36", "engine": "edgegem engine"}
COLUMNS = (Column("", 26, align="<"), Column("B", 3, "d"), Column("step ms", 9, ".2f"), Column("tok/s", 8, ".1f"),
           Column("vs B=1", 7), Column("1st sequence's tokens = B=1's", 30))


def batched_side_by_side(path: Optional[Path] = None, synthetic: Optional[str] = None, batches=(1, 2, 4),
                         n_prompt: int = 128, n_steps: int = 64, threads: int = 0, kinds=KINDS,
                         keep: Optional[Path] = None) -> dict:
    """Median decode step and aggregate tok/s of B sequences decoded together, per B in `batches`
    and kind (module doc), kinds alternating within each B; `vs B=1` the aggregate against the
    same kind's B = 1 row (when measured)."""
    from models.gguf import GGUFFile

    from .cpu import leading_equal, run_in_child, synthetic_gguf
    from .cpu_profile import cpu_flags
    from ..cpu_runtime import default_threads, kernels

    threads = threads or default_threads()
    rows: dict = {k: {} for k in kinds}
    with synthetic_gguf(synthetic, keep) as written:
        path = written or path
        vocab = len(GGUFFile(path).metadata.get("tokenizer.ggml.tokens", ())) or 32000
        for B in batches:
            prompts = _prompts(vocab, B, n_prompt)
            for k in kinds:
                got = run_in_child(_child, k, (k, str(path), prompts, n_steps, threads))
                step = statistics.median(got["times"])
                rows[k][B] = {"step_ms": step * 1e3, "tok_s": B / step, "ids": got["ids"]}
    for v in rows.values():  # the first prompt is the same for every B (`_prompts`): its tokens alone
        alone = v[1]["ids"] if 1 in v else None
        for r in v.values():
            ids = r.pop("ids")
            if alone is not None:
                r["first_tokens_as_alone"] = leading_equal(ids, alone)
    out = {"model": f"synthetic {synthetic.upper()}" if synthetic else Path(path).name, "threads": threads,
           "prompt_tokens": n_prompt, "steps": n_steps, "cpu": cpu_flags(), "kernels": kernels()["detail"],
           "runs": {k: {str(B): r for B, r in v.items()} for k, v in rows.items()}}
    lines = [f"{out['model']}: B sequences decoded together, {n_prompt}-token prompts, median of {n_steps} steps "
             f"after {WARM}, {threads} threads", f"  {out['cpu']}", f"  CPU kernels: {out['kernels']}",
             header(COLUMNS)]
    for k, v in rows.items():
        for B, r in v.items():
            vs = f"{r['tok_s'] / v[1]['tok_s']:.2f}x" if 1 in v else ""
            same = f"{r['first_tokens_as_alone']} of {n_steps + WARM + 1}" if 1 in v else ""
            lines.append(row(COLUMNS, [LABELS[k], B, r["step_ms"], r["tok_s"], vs, same]).rstrip())
    out["table"] = "\n".join(lines)
    return out
