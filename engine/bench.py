"""CPU benchmark: our prefill and decode tokens/s beside llama-cpp-python's on the same prompt.

Both run greedy decoding from the same token ids with the same thread count; the figures are
wall-clock over the whole prefill pass and over `n_decode` single-token steps.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from models.common import DenseKVCache
from models.loader import load_model


def _prompt(vocab: int, n: int) -> list[int]:
    rng = np.random.default_rng(0)
    return [2] + rng.integers(1000, min(vocab, 200_000), size=n - 1).tolist()


@torch.inference_mode()
def _ours(path: Path, prompt: list[int], n_decode: int, weight_dtype=torch.float16) -> dict:
    t0 = time.perf_counter()
    lm = load_model(path, with_tokenizer=False, weight_dtype=weight_dtype)
    load_s = time.perf_counter() - t0
    model, cache = lm.model, DenseKVCache()
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
    return {"load_s": load_s, "prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": n_decode / decode_s,
            "ids": ids}


def _llama_cpp(path: Path, prompt: list[int], n_decode: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + n_decode + 8, n_batch=len(prompt),
                          n_ubatch=len(prompt), n_threads=threads, n_threads_batch=threads, verbose=False)
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
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": n_decode / decode_s, "ids": ids}


def cpu_bench(path: Path, n_prompt: int = 128, n_decode: int = 64, threads: int = 0,
              with_llama_cpp: bool = True) -> dict:
    if threads:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    from models.gguf import GGUFFile
    vocab = len(GGUFFile(path).metadata.get("tokenizer.ggml.tokens", ())) or 32000
    prompt = _prompt(vocab, n_prompt)
    out = {"model": str(path), "threads": threads, "prompt_tokens": n_prompt, "decode_tokens": n_decode,
           "edgegem": _ours(path, prompt, n_decode)}
    rows = [("edgegem (torch, CPU)", out["edgegem"])]
    if with_llama_cpp:
        out["llama_cpp"] = _llama_cpp(path, prompt, n_decode, threads)
        rows.append(("llama-cpp-python 0.3.36", out["llama_cpp"]))
        out["decode_ratio"] = out["edgegem"]["decode_tok_s"] / out["llama_cpp"]["decode_tok_s"]
        out["prefill_ratio"] = out["edgegem"]["prefill_tok_s"] / out["llama_cpp"]["prefill_tok_s"]
        n_same = next((i for i, (a, b) in enumerate(zip(out["edgegem"]["ids"], out["llama_cpp"]["ids"]))
                       if a != b), n_decode)
        out["greedy_tokens_equal"] = n_same
    lines = [f"{Path(path).name}: {n_prompt}-token prompt, {n_decode} decode steps, {threads} threads",
             f"{'engine':28s} {'prefill tok/s':>14s} {'decode tok/s':>13s}"]
    lines += [f"{name:28s} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f}" for name, r in rows]
    if with_llama_cpp:
        lines.append(f"ratio (edgegem / llama.cpp): prefill {out['prefill_ratio']:.2f}x, "
                     f"decode {out['decode_ratio']:.2f}x; greedy tokens equal for the first "
                     f"{out['greedy_tokens_equal']} of {n_decode}")
    out["table"] = "\n".join(lines)
    for r in (out["edgegem"], out.get("llama_cpp", {})):
        r.pop("ids", None)
    return out
