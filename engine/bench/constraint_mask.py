"""`edgegem bench --constraints --model GGUF`: what the structured-output token mask costs per token
on a model's vocabulary (the 262,144 tokens of Gemma 4), with llguidance (what the engine uses) and,
when it is installed, xgrammar (the alternative it was measured against; not a dependency).

Each case walks a written document's tokens (the forced path a model would take) REPEATS times
after one untimed walk: per token, the library's mask (`compute_*`) and with it unpacked to [V]
bool and applied to a [V] float32 logits row (what engine.constraints.GrammarState.mask does
before sampling). `setup_ms`: the grammar compile and matcher creation a request pays once;
`tokenizer_s`: the tokenizer conversion, once per model.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from ..constraints import GrammarState, json_object_constraint, json_schema_constraint, ll_tokenizer
from ..tool_grammar import tool_call_constraint

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["items", "total", "paid"], "properties": {
    "items": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                         "required": ["sku", "qty", "price", "kind"], "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"},
        "kind": {"enum": ["book", "tool", "food"]}}}},
    "total": {"type": "number"}, "paid": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}}}}}

CASES = {  # name: (schema or None for the tool call, document)
    "json_schema person": (PERSON, {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                                    "tags": ["math", "engines", "poetry"]}),
    "json_schema nested order": (ORDER, {"items": [{"sku": "A-100", "qty": 2, "price": 3.5, "kind": "book"},
                                                   {"sku": "B-7", "qty": 1, "price": 12.25, "kind": "tool"},
                                                   {"sku": "C-33", "qty": 10, "price": 0.99, "kind": "food"}],
                                         "total": 29.15, "paid": True}),
    "json_object": ({"type": "object"}, {"city": "Zürich", "temps": [1.5, -2, 300.0], "ok": None,
                                         "note": "a \"quoted\" word"}),
    "tool call (Gemma syntax)": (None, '<|tool_call>call:get_weather{city:<|"|>Paris, the capital of France<|"|>,'
                                       'days:3,unit:<|"|>c<|"|>}<tool_call|>'),
}


def _stats(compute: list[float], total: list[float]) -> dict:
    c, t = sorted(x * 1e3 for x in compute), sorted(x * 1e3 for x in total)
    return {"compute_mean_ms": round(statistics.mean(c), 4), "compute_p50_ms": round(c[len(c) // 2], 4),
            "mean_ms": round(statistics.mean(t), 4), "p50_ms": round(t[len(t) // 2], 4),
            "p99_ms": round(t[min(len(t) - 1, int(len(t) * 0.99))], 4)}


REPEATS = 3   # timed walks per case, after one untimed walk (first-use work inside the libraries)


def _llguidance_case(tok, schema, doc) -> dict:
    if schema is None:
        con = tool_call_constraint([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, tok)
    else:
        con = json_object_constraint() if schema == {"type": "object"} else json_schema_constraint(schema, strict=True)
    text = doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False)
    ids = tok.encode(text, add_bos=False)
    logits = torch.zeros(tok.vocab_size)
    compute, total, setup = [], [], []
    for rep in range(REPEATS + 1):
        t0 = time.perf_counter()
        state = GrammarState(con, tok)
        setup.append(time.perf_counter() - t0)
        for t in ids + [None]:
            t0 = time.perf_counter()
            allowed = state.allowed()   # the library's bitmask, unpacked to [V] bool
            t1 = time.perf_counter()
            masked = logits.masked_fill(~allowed, float("-inf"))
            t2 = time.perf_counter()
            if rep:
                compute.append(t1 - t0)
                total.append(t2 - t0)
            if t is not None:
                assert masked[t] == 0, f"the grammar refused {tok.decode([t])!r} of its own document"
                state.consume(t)
        assert state.is_accepting(), "the document does not complete the grammar"
    return {"tokens": len(ids), "setup_ms": round(statistics.median(setup[1:]) * 1e3, 2), **_stats(compute, total)}


def _xgrammar_case(info, compiler, tok, schema, doc) -> Optional[dict]:
    import xgrammar as xgr
    if schema is None:
        return None   # the Gemma-syntax tool grammar is built for llguidance's Lark dialect only
    ids = tok.encode(json.dumps(doc, ensure_ascii=False), add_bos=False)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    logits = torch.zeros(1, tok.vocab_size)
    compute, total, setup = [], [], []
    for rep in range(REPEATS + 1):
        t0 = time.perf_counter()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                            separators=(", ", ": ")))
        setup.append(time.perf_counter() - t0)
        for t in ids + [None]:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            t1 = time.perf_counter()
            masked = logits.clone()
            xgr.apply_token_bitmask_inplace(masked, bitmask)
            t2 = time.perf_counter()
            if rep:
                compute.append(t1 - t0)
                total.append(t2 - t0)
            if t is not None:
                assert m.accept_token(t), f"xgrammar refused {tok.decode([t])!r}"
    return {"tokens": len(ids), "setup_ms": round(statistics.median(setup[1:]) * 1e3, 2), **_stats(compute, total)}


def constraint_bench(path: Path, threads: int = 0) -> dict:
    """Mask cost per token for each case, llguidance and (if installed) xgrammar."""
    from models.tokenizer import Tokenizer
    if threads:
        torch.set_num_threads(threads)
    tok = Tokenizer.from_gguf(path)
    t0 = time.perf_counter()
    ll_tokenizer(tok)
    out: dict = {"vocab": tok.vocab_size, "torch_threads": torch.get_num_threads(),
                 "llguidance": {"tokenizer_s": round(time.perf_counter() - t0, 2)}}
    for name, (schema, doc) in CASES.items():
        out["llguidance"][name] = _llguidance_case(tok, schema, doc)
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = "not installed"
        out["table"] = _table(out)
        return out
    special = set(tok.special_ids())
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([b"" if i in special else tok.token_bytes(i) for i in range(tok.vocab_size)],
                             xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.eog_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=max(1, torch.get_num_threads()), cache_enabled=False)
    out["xgrammar"] = {"tokenizer_s": round(time.perf_counter() - t0, 2)}
    for name, (schema, doc) in CASES.items():
        r = _xgrammar_case(info, compiler, tok, schema, doc)
        if r is not None:
            out["xgrammar"][name] = r
    out["table"] = _table(out)
    return out


def _table(out: dict) -> str:
    rows = [f"mask per token on a {out['vocab']:,}-token vocabulary (compute + unpack + apply), "
            f"{out['torch_threads']} torch threads",
            "| library | case | tokens | setup ms | mask only: mean / p50 ms | with unpack+apply: mean / p50 / p99 ms |",
            "|---|---|---|---|---|---|"]
    for lib in ("llguidance", "xgrammar"):
        res = out.get(lib)
        if not isinstance(res, dict):
            continue
        for name, r in res.items():
            if isinstance(r, dict):
                rows.append(f"| {lib} | {name} | {r['tokens']} | {r['setup_ms']} | {r['compute_mean_ms']} / "
                            f"{r['compute_p50_ms']} | {r['mean_ms']} / {r['p50_ms']} / {r['p99_ms']} |")
        rows.append(f"| {lib} | tokenizer conversion (once per model) | | {res['tokenizer_s'] * 1e3:.0f} | | |")
    return "\n".join(rows)
