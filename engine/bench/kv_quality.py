"""`edgegem kv-check`: what each KV cache format costs on one model, as next-token KL divergence.

The method of the 270M table in docs/benchmarks.md#the-8-bit-formats-in-the-test
(tests/engine/test_kv_formats.py): a text longer than the sliding window goes through the model in
64-token chunks, once per KV format, each format in its own pools, so every chunk after the
first attends over KV that earlier chunks stored (and rounded) the way decode does. Each chunk's
next-token distributions are compared with the reference format's (fp32 on the CPU: exact; bf16
on CUDA: the engine's default there): KL(p_ref || p_fmt) per position in float64, its mean / p99
/ max, and how often the top-1 token agrees.

Results are cached per model file and device under <data dir>/kv-check/ (the app's settings
screen shows them next to the KV format choice).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ..kv.format import FormatUnsupported, pool_unit_bytes, resolve_format
from ..kv.pool import HybridKVPool
from ..runner import ModelRunner
from ..kv.sequence import SequenceKV, ggml_attention_for

CANDIDATES = ("bf16", "fp16", "fp32", "int8_per_token_head", "fp8_per_token_head")
DEFAULT_TOKENS = 1024  # twice Gemma's 512-token sliding window: half the positions read evicted-window KV
DEFAULT_CHUNK = 64
DEFAULT_TEXT = Path(__file__).parents[1] / "data" / "kv_check.txt"  # Pride and Prejudice ch. I-III, ~4260 tokens
DEFAULT_TEXT_NAME = "Pride and Prejudice, ch. I-III (built in)"

# progress(fraction 0..1, one-line description); should_stop() -> True cancels between chunks
Progress = Callable[[float, str], None]


class KVCheckCancelled(Exception):
    """should_stop() said so; nothing was measured or cached."""


def reference_format(device: str | torch.device) -> str:
    return resolve_format("auto", device).name  # fp32 on the CPU, bf16 on CUDA


def formats_to_check(device: str | torch.device, wanted=CANDIDATES) -> tuple[list[str], dict[str, str]]:
    """The formats this device offers besides the reference, and {format: why skipped}."""
    ref, out, skipped = reference_format(device), [], {}
    for name in wanted:
        if name == ref:
            continue
        try:
            resolve_format(name, device)
        except FormatUnsupported as e:  # fp8 below sm_80
            skipped[name] = str(e)
            continue
        out.append(name)
    return out, skipped


class _Ref:
    """Reference logit rows a: p = softmax(a) and the parts of KL(p || q) that depend on a only."""

    def __init__(self, ref: torch.Tensor):
        a = ref.double()  # [T, V]
        self.lse = torch.logsumexp(a, -1)
        self.p = torch.exp(a - self.lse[:, None])
        self.pa, self.top = torch.linalg.vecdot(self.p, a), ref.argmax(-1)

    def kl(self, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row KL(p || softmax(b)) in float64 and top-1 agreement flags. With log p = a - lse(a),
        log q = b - lse(b) and sum p = 1: KL = p·a - p·b - lse(a) + lse(b); no [T, V] log q is built."""
        b = other.double()
        kl = self.pa - torch.linalg.vecdot(self.p, b) - self.lse + torch.logsumexp(b, -1)
        return kl.cpu(), (self.top == other.argmax(-1)).cpu()


def _sequence(model, fmt_name: str, n_tokens: int, backend) -> SequenceKV:
    """One format's own pools, the sliding-window pool in the same format, room for every token."""
    fmt = resolve_format(fmt_name, model.device)
    pools = HybridKVPool(model.cfg, n_tokens, n_tokens, fmt, fmt, model.device)
    window = model.cfg.sliding_window if any(model.cfg.is_sliding) else None
    return SequenceKV(pools, window, model.dtype, backend=backend, ggml_attention=ggml_attention_for(model, backend))


def _summary(kl: torch.Tensor, top1: torch.Tensor) -> dict:
    return {"mean_kld": float(kl.mean()), "p99_kld": float(torch.quantile(kl, 0.99)),
            "max_kld": float(kl.max()), "top1_agreement": float(top1.double().mean())}


def measure(model, tokens: list[int], chunk: int = DEFAULT_CHUNK, formats: Optional[list[str]] = None,
            progress: Optional[Progress] = None, should_stop: Optional[Callable[[], bool]] = None) -> dict:
    """Figures of each format against the reference on `tokens` (the core of `kv_check`).
    Every chunk runs the reference first, then each format; only per-position KL values are kept
    (a chunk's [64, 262144] float64 logits are 128 MiB, the whole text's would be GiBs)."""
    from ..attention_backend import get_attention_backend

    if chunk < 1 or len(tokens) < 2:
        raise ValueError(f"kv-check needs at least 2 tokens and a chunk of at least 1, got {len(tokens)} and {chunk}")
    device = model.device
    ref = reference_format(device)
    if formats is None:
        formats, skipped = formats_to_check(device)
    else:
        skipped = {}
    backend = get_attention_backend("auto", device, getattr(model, "runtime", None))
    backend = None if backend.name == "torch" else backend  # the engine's choice: triton on CUDA
    runner = ModelRunner(model, fast_prefill=False)
    ref_kv = _sequence(model, ref, len(tokens), backend)  # its own pools even when `formats` names it too
    seqs = {name: _sequence(model, name, len(tokens), backend) for name in formats}
    parts: dict[str, tuple[list, list]] = {name: ([], []) for name in formats}
    n, steps, t0 = len(tokens), -(-len(tokens) // chunk), time.perf_counter()
    for i, s in enumerate(range(0, n, chunk)):
        if should_stop is not None and should_stop():
            raise KVCheckCancelled("kv-check cancelled")
        piece = tokens[s:s + chunk]
        want = _Ref(runner.forward(ref_kv, piece, s, True, all_rows=True))  # [T, V]
        for name in formats:
            kl, top1 = want.kl(runner.forward(seqs[name], piece, s, True, all_rows=True))
            parts[name][0].append(kl)
            parts[name][1].append(top1)
        if progress is not None:
            progress((i + 1) / steps, f"{s + len(piece)}/{n} tokens, {len(formats) + 1} KV formats")
    for kv in [ref_kv, *seqs.values()]:
        kv.release()
    cfg = model.cfg
    out = {name: {**_summary(torch.cat(kl), torch.cat(top1)),
                  "bytes_per_token": pool_unit_bytes(cfg, resolve_format(name, device), sliding=False)}
           for name, (kl, top1) in parts.items()}
    return {"reference": ref, "reference_bytes_per_token": pool_unit_bytes(cfg, resolve_format(ref, device), False),
            "formats": out, "skipped": skipped, "tokens": n, "chunk": chunk,
            "sliding_window": getattr(cfg, "sliding_window", None), "device": device.type,
            "activations": str(model.dtype).removeprefix("torch."), "runtime": model.runtime.value,
            "seconds": round(time.perf_counter() - t0, 1)}


def kv_check(lm, text: Optional[str] = None, n_tokens: int = DEFAULT_TOKENS, chunk: int = DEFAULT_CHUNK,
             text_name: Optional[str] = None, formats: Optional[list[str]] = None,
             progress: Optional[Progress] = None, should_stop: Optional[Callable[[], bool]] = None) -> dict:
    """Measure a loaded model (models.loader.LoadedModel) on `text` (default: the built-in book),
    its first `n_tokens` tokens (fewer if the text is shorter). Returns `measure`'s figures plus the
    model's identity and the text's name."""
    if lm.tokenizer is None:
        raise ValueError(f"{lm.path}: the model has no tokenizer")
    if n_tokens < 2:
        raise ValueError(f"--tokens must be at least 2, got {n_tokens}")
    if text is None:
        text, text_name = DEFAULT_TEXT.read_text(encoding="utf-8"), DEFAULT_TEXT_NAME
    tokens = lm.tokenizer.encode(text, parse_special=False)[:n_tokens]  # BOS, then the text as plain text
    out = measure(lm.model, tokens, chunk, formats, progress, should_stop)
    path = Path(lm.path)
    name = lm.source.get("general.name") if hasattr(lm.source, "get") else None
    out["model"] = {"name": name or path.stem, "file": path.name, "path": str(path.resolve()),
                    "size": _size(path), "arch": lm.arch}
    out["text"] = text_name or "text"
    out["measured"] = time.strftime("%Y-%m-%d %H:%M")
    return out


def _size(path: Path) -> Optional[int]:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


# --- the cache: <data dir>/kv-check/<model stem>-<key>-<device>.json ------------------------------

def cache_path(model_path: str | Path, device: str, data_dir: Optional[str | Path] = None) -> Path:
    """The key is the model file's resolved path, size and mtime: a file replaced in place (a new
    quant pulled under the same name) gets new figures, a renamed copy is measured again."""
    from ..models_dir import data_dir as default_data_dir

    p = Path(model_path).expanduser().resolve()
    st = p.stat()
    key = hashlib.sha1(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return default_data_dir(data_dir) / "kv-check" / f"{p.stem}-{key}-{torch.device(device).type}.json"


def save_result(result: dict, data_dir: Optional[str | Path] = None) -> Path:
    """Write atomically (a temp file renamed over), so a reader never sees half a file."""
    path = cache_path(result["model"]["path"], result["device"], data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_result(model_path: str | Path, device: str, data_dir: Optional[str | Path] = None) -> Optional[dict]:
    """The cached figures for this model file on this device, or None (not measured, the file
    changed since, or the cache is unreadable: a cache never stops the app)."""
    try:
        r = json.loads(cache_path(model_path, device, data_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return r if isinstance(r, dict) and isinstance(r.get("formats"), dict) else None
