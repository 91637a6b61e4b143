"""`edgegem bench --kv-resume`: reopening a conversation from its KV file against prefilling it.

For each conversation length N: engine A prefills N tokens of the built-in text (time to first
token = the cold cost) and saves the KV file; engine B, a fresh one (a restart: empty pools and
prefix cache), gets those N tokens plus a new 16-token message with the file as its KV session
(time to first token = the resume cost: read, checksum, copy into the pools, prefill 16 tokens,
one token). Then the file size per token for each KV format at the shortest length.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from ..kv.file import model_identity
from ..sampler import SamplingParams
from ..scheduler import Engine, EngineConfig
from .kv_quality import DEFAULT_TEXT

NEW_MESSAGE = 16
FORMATS = ("fp32", "bf16", "fp16", "int8_per_token_head", "fp8_per_token_head")


def _tokens(lm, n: int) -> list[int]:
    ids = lm.tokenizer.encode(Path(DEFAULT_TEXT).read_text(encoding="utf-8"))
    out = list(ids)
    while len(out) < n + NEW_MESSAGE:
        out += ids[1:]  # no second BOS
    return out[:n + NEW_MESSAGE]


def _engine(lm, fmt: str, n: int, model_id: str) -> Engine:
    cfg = EngineConfig(kv_cache_dtype=fmt, swa_kv_cache_dtype=fmt, full_tokens=n + NEW_MESSAGE + 64,
                       max_running_requests=1, prefill_chunk=512 if lm.model.device.type == "cpu" else 2048)
    return Engine(lm.model, None, cfg, model_id=model_id)


def _ttft(eng: Engine, prompt: list[int], kv: Optional[Path]):
    req = eng.add(prompt, SamplingParams(max_tokens=1), kv_session=str(kv) if kv else None)
    eng.run_to_completion()
    if req.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"bench request ended with {req.finish_reason}")
    return req, req.t_first - req.t_submit


def kv_resume_bench(lm, lengths=(2048, 8192, 32000), fmt: str = "auto", formats=FORMATS,
                    progress: Callable[[str], None] = lambda s: None) -> dict:
    """Cold prefill vs resume from a KV file for each length, and file bytes per token per format."""
    from ..kv.format import resolve_format

    device = lm.model.device
    fmt = resolve_format(fmt, device).name
    model_id = model_identity(lm.path)
    limit = lm.config.context_length
    rows, sizes = [], []
    with tempfile.TemporaryDirectory(prefix="edgegem-kv-bench-") as tmp:
        for n in lengths:
            if n + NEW_MESSAGE >= limit:
                raise ValueError(f"--kv-lengths: {n} + {NEW_MESSAGE} tokens do not fit the {limit}-token context")
            toks = _tokens(lm, n)
            f = Path(tmp) / f"{n}.safetensors"
            progress(f"{n} tokens: cold prefill")
            a = _engine(lm, fmt, n, model_id)
            _, cold = _ttft(a, toks[:n], f)
            t0 = time.perf_counter()
            a.close()  # the save (written off the decode path; timed here for the table)
            save = time.perf_counter() - t0
            progress(f"{n} tokens: resume")
            b = _engine(lm, fmt, n, model_id)
            req, warm = _ttft(b, toks, f)
            if req.restored_len != n:
                raise RuntimeError(f"resume restored {req.restored_len} of {n} tokens ({req.kv_error})")
            rows.append({"tokens": n, "cold_prefill_s": cold, "resume_s": warm, "speedup": cold / warm,
                         "save_s": save, "file_bytes": f.stat().st_size,
                         "prefilled_on_resume": req.n_prompt - req.cached_len})
        n = min(lengths)
        toks = _tokens(lm, n)
        for name in formats:
            try:
                resolve_format(name, device)
            except ValueError:
                continue
            f = Path(tmp) / f"fmt-{name}.safetensors"
            e = _engine(lm, name, n, model_id)
            _ttft(e, toks[:n], f)
            e.close()
            sizes.append({"format": name, "tokens": n, "file_bytes": f.stat().st_size,
                          "bytes_per_token": f.stat().st_size / n})
    where = f"{device}, runtime {lm.runtime.value}"
    return {"model": lm.path.name, "device": str(device), "runtime": lm.runtime.value, "kv_format": fmt,
            "new_message_tokens": NEW_MESSAGE, "rows": rows, "file_sizes": sizes,
            "table": _table(lm.path.name, where, fmt, rows, sizes)}


def _table(model: str, device: str, fmt: str, rows: list, sizes: list) -> str:
    out = [f"KV resume vs cold prefill: {model} on {device}, KV {fmt}, a new {NEW_MESSAGE}-token message",
           f"{'tokens':>7} {'cold prefill':>13} {'resume':>9} {'speedup':>8} {'save':>8} {'file':>10}"]
    for r in rows:
        out.append(f"{r['tokens']:7d} {r['cold_prefill_s']:12.2f}s {r['resume_s']:8.3f}s {r['speedup']:7.1f}x "
                   f"{r['save_s']:7.3f}s {r['file_bytes'] / 2**20:8.1f}MiB")
    if sizes:
        out.append(f"file size per token ({sizes[0]['tokens']} tokens; sliding layers keep only the last window):")
        for s in sizes:
            out.append(f"  {s['format']:22s} {s['bytes_per_token']:9.0f} B/token")
    return "\n".join(out)
