"""`edgegem kv-check`: what each KV cache format costs on one model (engine/bench/kv_quality.py), as a
table or JSON; the figures are cached for the app's settings screen. Registered by app/cli.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def add_command(sub) -> None:
    k = sub.add_parser("kv-check", help="next-token KL divergence of each KV cache format against the reference "
                                         "(fp32 on cpu, bf16 on cuda) on a text longer than the sliding window")
    k.add_argument("--model", help="GGUF file, models-folder name or HF folder (default: the demo model)")
    k.add_argument("--text", metavar="FILE", help="UTF-8 text to run (default: Pride and Prejudice ch. I-III, "
                                                  "shipped with edgegem)")
    k.add_argument("--tokens", type=int, default=1024, help="positions measured (capped by the text; default 1024)")
    k.add_argument("--chunk", type=int, default=64, help="tokens per forward: later chunks read stored KV")
    k.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    k.add_argument("--data-dir", metavar="DIR", help="where the figures are cached (default: $EDGEGEM_DATA_DIR, "
                                                     "else the platform's user data dir)")
    k.add_argument("--json", action="store_true")


def cmd_kv_check(a) -> int:
    from engine import api
    from engine.bench import kv_check, save_result

    text = name = None
    if a.text:  # read before the model loads: a bad path fails in a second, not after the load
        text, name = Path(a.text).expanduser().read_text(encoding="utf-8"), Path(a.text).name
    if a.tokens < 2 or a.chunk < 1:
        raise ValueError("--tokens must be at least 2 and --chunk at least 1")
    device = api.default_device() if a.device == "auto" else a.device
    if device == "cuda" and not _cuda():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    path = api.resolve_model(a.model)
    # CPU: float32 weights, the reference numerics (64-row chunks run the float32 GEMM either way).
    # CUDA: the engine's runtime layout, bf16 activations over quantized weights.
    lm = api.open_model(path, exact=device == "cpu", device=device)
    quiet = a.json or not sys.stderr.isatty()
    progress = None if quiet else (lambda frac, msg: print(f"\r  {frac:4.0%} {msg}   ", end="", file=sys.stderr,
                                                           flush=True))
    r = kv_check(lm, text, a.tokens, a.chunk, text_name=name, progress=progress)
    if progress is not None:
        print(file=sys.stderr)
    r["cache"] = str(save_result(r, a.data_dir))
    print(json.dumps(r, indent=1) if a.json else table(r))
    return 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def table(r: dict) -> str:
    m = r["model"]
    lines = [f"kv-check: {m['file']} ({m['name']}, {m['arch']}) on {r['device']}"
             + (f" ({r['runtime']})" if r.get("runtime") else "") + f", {r['activations']} activations",
             f"  {r['tokens']} tokens of {r['text']} in {r['chunk']}-token chunks (sliding window "
             f"{r['sliding_window']}), {r['seconds']:.0f} s",
             f"  next-token KL(p_{r['reference']} || p_format) per position, top-1: same argmax as the reference",
             f"  {'format':21s} {'B/token':>8s} {'mean KLD':>10s} {'p99 KLD':>10s} {'max KLD':>10s} {'top-1':>7s}",
             f"  {r['reference']:21s} {r['reference_bytes_per_token']:8d} {'reference':>10s}"]
    for name, f in r["formats"].items():
        lines.append(f"  {name:21s} {f['bytes_per_token']:8d} {f['mean_kld']:10.2e} {f['p99_kld']:10.2e} "
                     f"{f['max_kld']:10.2e} {f['top1_agreement']:7.1%}")
    for name, why in r.get("skipped", {}).items():
        lines.append(f"  {name:21s} skipped: {why}")
    lines.append("  B/token: full-attention pool bytes per context token (the window pool is bounded by the window)")
    if r.get("cache"):
        lines.append(f"  cached for the app: {r['cache']}")
    return "\n".join(lines)


COMMANDS = {"kv-check": cmd_kv_check}
