"""`edgegem` command line. With no command (or `app`) it opens the full-screen chat; `run` prints
one reply to stdout for scripts; `chat` is a plain line chat; score, tokenize, info, bench, kv-check.

Bad input ends in one line on stderr and exit code 2; `--debug` shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from . import cli_chat, cli_kvcheck, cli_serve, cli_tools

EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edgegem", description="Gemma-4 chat and engine for small GPUs. With no command, "
        "`edgegem [--model M] [flags]` opens the chat app (`edgegem app --help` lists its flags).")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"edgegem {_version()}")
    sub = p.add_subparsers(dest="cmd")

    a = sub.add_parser("app", help="the full-screen chat (the default: `edgegem [--model PATH] [flags]`)")
    a.add_argument("--model", help="GGUF file or HF folder (default: the demo model)")
    a.add_argument("--data-dir", metavar="DIR",
                   help="where conversations are kept (default: $EDGEGEM_DATA_DIR or the XDG data dir)")
    _engine_args(a)
    _image_model_args(a, budget_default=None)
    a.add_argument("--kv-disk-budget", default="4GiB", metavar="SIZE",
                   help="disk kept for conversations' KV under <data-dir>/kv/ (least recently used go first; "
                        "0 turns saving off)")
    # A chat should go on when it outgrows the context: the app drops the oldest turns by default.
    a.set_defaults(context_overflow="truncate")
    srv = a.add_argument_group("API server in the app (--serve)")
    srv.add_argument("--serve", nargs="?", type=int, const=cli_serve.DEFAULT_PORT, metavar="PORT",
                     help=f"also serve the OpenAI and Ollama APIs on this app's engine (port {cli_serve.DEFAULT_PORT} "
                          f"unless given); the status panel shows the address and the requests in flight")
    cli_serve.add_server_args(srv)

    s = sub.add_parser("score", help="write float32 logits [n_tokens, vocab] of every position")
    s.add_argument("--model", required=True)
    s.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 2,17,300")
    s.add_argument("--out", required=True, help="output .npy file")
    _image_args(s)
    _audio_args(s)

    t = sub.add_parser("tokenize", help="print the token ids of a text as a JSON list")
    t.add_argument("--model", required=True)
    t.add_argument("--text", required=True)
    _image_args(t)
    _audio_args(t)

    r = sub.add_parser("run", help="generate a reply to one prompt, streamed to stdout")
    r.add_argument("--model", help="GGUF file or HF folder (default: the demo model)")
    r.add_argument("--prompt", required=True)
    r.add_argument("--system", help="system prompt (chat mode)")
    _image_args(r)
    _audio_args(r)
    _sampling_args(r)
    r.add_argument("--raw", action="store_true", help="no chat template: continue the text as is")
    out = r.add_mutually_exclusive_group()
    out.add_argument("--json-schema", metavar="FILE", help="the reply is JSON valid under this JSON schema")
    out.add_argument("--grammar", metavar="FILE",
                     help="the reply follows this grammar: llguidance Lark (`start: ...`) or llama.cpp GBNF "
                          "(`root ::= ...`)")
    r.add_argument("--json", action="store_true", help="end with one JSON object (ids, text, timings)")
    r.add_argument("--exact", action="store_true",
                   help="float32 weights (reference numerics) instead of the faster float16 CPU format")
    _engine_args(r)
    _kv_session_arg(r)

    i = sub.add_parser("info", help="architecture, layer plan, tensor types and sizes, memory plan")
    i.add_argument("model", nargs="?", help="GGUF file (or use --synthetic)")
    i.add_argument("--synthetic", choices=["e2b", "e4b"], help="a synthetic Gemma-4 E2B/E4B Q4_K_M layout")
    _memory_args(i, swa_default="bf16")
    _fit_args(i)
    i.add_argument("--spec-draft-model", metavar="PATH", help="draft (assistant) GGUF kept on the device")
    i.add_argument("--mmproj", metavar="FILE",
                   help="image/audio encoders to plan for (default: an mmproj*.gguf beside the model)")
    i.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="target of the plan")
    i.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="prefill and decode tokens/s (CPU: ours beside llama.cpp's; "
                                     "cuda or --synthetic: the engine bench)")
    b.add_argument("--model", help="GGUF file (default: the demo model)")
    b.add_argument("--synthetic", choices=["e2b", "e4b"],
                   help="random-weight E2B/E4B with the real shapes and Q4_K_M mix, built in memory")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu with a GGUF: edgegem beside llama-cpp-python; cuda (or --synthetic): the engine bench")
    b.add_argument("--prompt-tokens", type=int, default=128, help="CPU-vs-llama.cpp bench: prompt length")
    b.add_argument("--decode-tokens", type=int, default=64, help="CPU-vs-llama.cpp bench: decode steps")
    b.add_argument("--threads", type=int, default=0, help="CPU threads (0: the physical cores)")
    b.add_argument("--no-llama-cpp", action="store_true", help="skip the llama-cpp-python run")
    b.add_argument("--engine", action="store_true",
                   help="--device cpu (a GGUF or --synthetic): time edgegem through the engine (as run and the app "
                        "use it) rather than the model's own loop, each run in a process of its own")
    b.add_argument("--both", action="store_true",
                   help="--device cpu (a GGUF or --synthetic): the model loop, the engine and the engine without "
                        "fast prefill, beside llama.cpp")
    b.add_argument("--keep-gguf", metavar="PATH",
                   help="--device cpu --synthetic: write the synthetic GGUF here (reused when it exists)")
    b.add_argument("--profile", action="store_true",
                   help="--device cpu: where one decode step's time goes, per op, at --prompt-tokens of context "
                        "over --decode-tokens steps")
    g = b.add_argument_group("engine bench (--device cuda or --synthetic)")
    _memory_args(g)
    g.add_argument("--fast-prefill", choices=["on", "off"], default="on")
    g.add_argument("--prompt-lengths", default="512,4096,16384", metavar="N,N,...", help="prefill prompt lengths")
    g.add_argument("--contexts", default="0,4096,32768", metavar="N,N,...", help="decode contexts")
    g.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per context")
    g.add_argument("--peak-bandwidth", type=float, metavar="GBps",
                   help="the device's peak memory bandwidth (default: a table of known GPUs)")
    g = b.add_argument_group("static bench (--static --synthetic e2b|e4b: no GPU needed)")
    g.add_argument("--static", action="store_true",
                   help="count the kernels of one decode step and the weight bytes per token, and compile each "
                        "decode GEMV format for --arch: SASS instructions per weight byte, bandwidth cap")
    g.add_argument("--arch", default="sm_86", metavar="SM", help="--static: compile target, sm_75, sm_80, sm_86, sm_89, sm_90 or sm_120")
    b.add_argument("--spec-draft-model", metavar="PATH",
                   help="assistant GGUF: decode tok/s with and without it, acceptance, verify cost")
    b.add_argument("--spec-tokens", type=int, default=2)
    b.add_argument("--constraints", action="store_true",
                   help="structured output: the token mask's cost per token on --model's vocabulary "
                        "(llguidance, and xgrammar if installed)")
    g = b.add_argument_group("audio tower (--audio)")
    g.add_argument("--audio", action="store_true",
                   help="encode time of the audio tower per clip length (--mmproj's tower, else the E2B/E4B "
                        "geometry with random weights)")
    g.add_argument("--audio-seconds", default="1,10,30", metavar="S,S,...", help="clip lengths in seconds")
    g.add_argument("--mmproj", metavar="FILE", help="--audio: the mmproj whose audio tower to time")
    g = b.add_argument_group("KV files (--kv-resume)")
    g.add_argument("--kv-resume", action="store_true",
                   help="reopening a conversation from its KV file against prefilling it, and file size per "
                        "token per KV format")
    g.add_argument("--kv-lengths", default="2048,8192,32000", metavar="N,N,...", help="conversation lengths")
    g = b.add_argument_group("API server (--serve)")
    g.add_argument("--serve", action="store_true",
                   help="edgegem serve beside llama_cpp.server on the same GGUF: aggregate decode tok/s with "
                        "--clients concurrent streaming clients, and a long conversation's second-turn TTFT")
    g.add_argument("--clients", default="1,4,16", metavar="N,N,...", help="--serve: concurrent clients per run")
    g.add_argument("--serve-tokens", type=int, default=32, metavar="N", help="--serve: tokens per answer")
    g.add_argument("--long-words", type=int, default=1200, metavar="N",
                   help="--serve: words of the long conversation's first message")
    g.add_argument("--max-running-requests", type=int, metavar="N",
                   help="--serve: edgegem's running requests (default: its own default)")
    b.add_argument("--json", action="store_true")

    c = sub.add_parser("chat", help="plain line-by-line chat in the terminal (no full-screen app)")
    c.add_argument("--model", help="GGUF file (default: the demo model)")
    c.add_argument("--system")
    c.add_argument("--thinking", action="store_true", help="let the model think first (Gemma-4)")
    _image_args(c, what="an image for the first message (repeatable; later ones: a line `/image PATH`)")
    _audio_args(c, what="an audio file for the first message (repeatable; later ones: a line `/audio PATH`)")
    _sampling_args(c, temperature=0.7)
    _engine_args(c)
    _kv_session_arg(c)
    cli_tools.add_commands(sub)
    cli_kvcheck.add_command(sub)
    cli_serve.add_command(sub, _engine_args, _image_model_args)
    return p


def _memory_args(g, swa_default: str = "auto") -> None:
    """The budget and KV-format flags `run`, `chat`, `info` and `bench` share."""
    g.add_argument("--gpu-memory-budget", metavar="SIZE",
                   help="memory for weights, workspace and KV: 8GiB, 7.5G, 8000MB (default: 90%% of free "
                        "device memory; host memory on the CPU)")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="F",
                   help="full-attention KV: auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32, "
                        "int8_per_token_head, fp8_per_token_head")
    g.add_argument("--swa-kv-cache-dtype", default=swa_default, metavar="F", help="sliding-window KV format")
    g.add_argument("--embed-weights", choices=["host", "device"], default="host",
                   help="host: token/per-layer embedding tables stay in host memory (tied head stays on the device)")


def _fit_args(g) -> None:
    """Left unset, the memory plan lowers these to fit the budget (chunk halved down to 256, then
    requests down to 1) and says so; a value given is kept, and a refusal names the flag to lower."""
    g.add_argument("--max-running-requests", type=int, metavar="N",
                   help="requests decoded together (default 4, fewer when the budget needs it)")
    g.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="prompt tokens per step (default 2048 on cuda, 512 on cpu; halved down to 256 when the "
                        "budget needs it)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    _memory_args(g)
    _fit_args(g)
    g.add_argument("--fast-prefill", choices=["on", "off"], default="on",
                   help="prompt tokens but the last skip the KV-shared layers")
    g.add_argument("--cache-type", choices=["radix", "naive"], default="radix", help="prefix cache")
    g.add_argument("--context-overflow", choices=["error", "truncate"], default="error",
                   help="truncate: drop the oldest whole turns after the system prompt")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when torch sees a GPU (untested on GPUs so far), else cpu")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto: triton kernels on cuda, the torch reference on cpu")
    g.add_argument("--spec-algo", choices=["none", "mtp"], default=None,
                   help="speculative decoding; mtp: the Gemma-4 assistant draft (on when a draft is given)")
    g.add_argument("--spec-draft-model", metavar="PATH", help="Gemma-4 assistant GGUF (gemma4-assistant)")
    g.add_argument("--spec-tokens", type=int, default=2, help="draft tokens per round (2 for E2B, 4 for E4B)")
    g.add_argument("--spec-p-min", type=float, default=0.0,
                   help="stop drafting when the draft's top probability falls below this")
    g.add_argument("--threads", type=int, default=0, metavar="N",
                   help="CPU threads for torch and llama.cpp's kernels (default: the physical cores; 1 on a "
                        "machine busy with other work)")


def _kv_session_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-session", metavar="FILE",
                   help="a KV file: if it exists and fits this model, its KV serves the prompt's common prefix "
                        "(only the rest is prefilled); after each answer the KV of prompt + answer is saved to it")


def _kv_note(timings: dict, client=None) -> None:
    """One stderr line when a --kv-session file could not be used (the prompt was prefilled), and
    one per KV file that could not be written."""
    if timings and timings.get("kv_session_error"):
        print(f"edgegem: KV session not used, prefilled instead: {timings['kv_session_error']}", file=sys.stderr)
    if client is not None:
        for msg in client.kv_errors():
            print(f"edgegem: {msg}", file=sys.stderr)


def _engine_options(a):
    from engine.api import EngineOptions
    if a.spec_algo == "mtp" and not a.spec_draft_model:
        raise ValueError("--spec-algo mtp needs --spec-draft-model PATH (a gemma4-assistant GGUF)")
    return EngineOptions(gpu_memory_budget=a.gpu_memory_budget, kv_cache_dtype=a.kv_cache_dtype,
                         swa_kv_cache_dtype=a.swa_kv_cache_dtype, embed_weights=a.embed_weights,
                         max_running_requests=a.max_running_requests, prefill_chunk=a.prefill_chunk,
                         fast_prefill=a.fast_prefill == "on", cache_type=a.cache_type,
                         context_overflow=a.context_overflow, attention_backend=a.attention_backend,
                         spec_draft_model=None if a.spec_algo == "none" else a.spec_draft_model,
                         spec_tokens=a.spec_tokens, spec_p_min=a.spec_p_min)


def _start_client(lm, opts):
    """api.start_client, saying on stderr in one line what the memory plan lowered to fit the budget."""
    from engine import api
    plan = api.engine_plan(lm, opts)[0]
    if plan is not None and plan.fitted:
        print(f"edgegem: {plan.fitted}", file=sys.stderr)
    return api.start_client(lm, opts)


def _draft_path(name):
    """--spec-draft-model for the memory plan of `info`: a path, or the name of a pulled assistant
    in the models folder (the engine's load_draft resolves names itself)."""
    if not name:
        return None
    from engine.api import resolve_model
    return str(resolve_model(name))


def _kv_path(a):
    return str(Path(a.kv_session).expanduser()) if getattr(a, "kv_session", None) else None


def _device(a) -> str:
    from engine.api import default_device
    return default_device() if a.device == "auto" else a.device


def _sampling_args(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    g = p.add_argument_group("DRY and XTC (llama.cpp's flags and defaults; both off unless set)")
    g.add_argument("--dry-multiplier", type=float, default=0.0, metavar="X",
                   help="DRY: a token extending a repeat loses X * base^(length - allowed) (0: off; 0.8 is usual)")
    g.add_argument("--dry-base", type=float, default=1.75, metavar="X", help="DRY base (>= 1)")
    g.add_argument("--dry-allowed-length", type=int, default=2, metavar="N", help="DRY: repeats up to N are free")
    g.add_argument("--dry-penalty-last-n", type=int, default=64, metavar="N",
                   help="DRY: tokens scanned for repeats (-1: all, 0: off)")
    g.add_argument("--dry-sequence-breaker", action="append", metavar="S",
                   help="a string that cuts repeats (repeatable; replaces the defaults \\n : \" *; `none`: no breakers)")
    g.add_argument("--xtc-probability", type=float, default=0.0, metavar="P",
                   help="XTC: chance per token of removing the top choices (0: off)")
    g.add_argument("--xtc-threshold", type=float, default=0.1, metavar="P",
                   help="XTC: tokens at least this likely are the top choices (all but the least likely go)")


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("edgegem")
    except Exception:
        return "0+unknown"


def _params(a):
    from engine.api import SamplingParams
    breakers = a.dry_sequence_breaker
    dry = {} if breakers is None else {"dry_sequence_breakers": () if breakers == ["none"] else tuple(breakers)}
    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          seed=a.seed, max_tokens=a.max_tokens, repetition_penalty=a.repetition_penalty,
                          presence_penalty=a.presence_penalty, dry_multiplier=a.dry_multiplier,
                          dry_base=a.dry_base, dry_allowed_length=a.dry_allowed_length,
                          dry_penalty_last_n=a.dry_penalty_last_n, xtc_probability=a.xtc_probability,
                          xtc_threshold=a.xtc_threshold, **dry)


def _image_args(p, what: str = "an image for the prompt (repeatable; placed before the text unless it has "
                                  "<|image|> markers)") -> None:
    p.add_argument("--image", action="append", default=[], metavar="FILE", help=what)
    _image_model_args(p)


def _audio_args(p, what: str = "an audio file for the prompt (WAV/FLAC/OGG/MP3, repeatable, mixed with --image; "
                                  "placed before the text unless it has <|audio|> markers)") -> None:
    p.add_argument("--audio", action="append", default=[], metavar="FILE", help=what)


def _image_model_args(p, budget_default=280) -> None:
    """--image-tokens and --mmproj (the app: no default budget, so each conversation's setting wins)."""
    p.add_argument("--image-tokens", type=int, default=budget_default, choices=[70, 140, 280, 560, 1120],
                   help="soft-token budget per image (default 280: 256 tokens for a square image)"
                        + ("; the app: for conversations that did not set their own" if budget_default is None else ""))
    p.add_argument("--mmproj", metavar="FILE",
                   help="image/audio encoders of a GGUF model (default: an mmproj*.gguf beside the model)")


def cmd_score(a) -> int:
    import numpy as np

    from engine import api
    try:
        tokens = [int(x) for x in a.tokens.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--tokens must be comma-separated integers, got {a.tokens!r}") from None
    if not tokens:
        raise ValueError("--tokens is empty")
    lm = api.open_model(Path(a.model), mmproj=a.mmproj)
    images = api.load_images(lm, a.image, a.image_tokens)
    np.save(a.out, api.score(lm, tokens, images, api.load_audio(lm, a.audio)))
    return 0


def cmd_tokenize(a) -> int:
    from engine import api
    print(json.dumps(api.tokenize(Path(a.model), a.text, a.image, a.image_tokens, a.mmproj, a.audio)))
    return 0


def cmd_run(a) -> int:
    from engine import api
    constraint = _constraint(a)  # a bad schema or grammar is refused before the model loads
    lm = api.open_model(api.resolve_model(a.model), exact=a.exact, device=_device(a),
                        embed_weights=a.embed_weights, mmproj=a.mmproj)
    images = api.load_images(lm, a.image, a.image_tokens)  # refused in one line before the engine starts
    audio = api.load_audio(lm, a.audio)
    gen = api.GenerationParams(_params(a), kv_session=_kv_path(a), image_tokens=a.image_tokens,
                               constraint=constraint)
    client = _start_client(lm, _engine_options(a))
    try:
        out = api.run_prompt(client, lm, a.prompt, gen, raw=a.raw, system=a.system,
                             on_text=None if a.json else _emit, images=images, audio=audio)
        out["speculative"] = client.status().get("speculative")
    finally:
        client.close()  # waits for the KV file to be written
    _kv_note(out["timings"], client)
    if a.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        t = out["timings"]
        sys.stdout.write("\n")
        restored = f", {t['restored_tokens']} restored from {Path(a.kv_session).name}" if t.get("restored_tokens") else ""
        print(f"[{t['prompt_tokens']} prompt tokens ({t['prefilled_tokens']} prefilled{restored}) at "
              f"{t['prefill_tok_s']:.1f} tok/s, {t['output_tokens']} generated at {t['decode_tok_s']:.1f} tok/s]",
              file=sys.stderr)
    return 0


def _constraint(a):
    """--json-schema / --grammar FILE as an engine constraint (a bad file: one-line ValueError)."""
    from engine.constraints import grammar_constraint, json_schema_constraint
    path = a.json_schema or a.grammar
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    where = f"{Path(path).name}: "
    try:
        return json_schema_constraint(text) if a.json_schema else grammar_constraint(text)
    except ValueError as e:
        raise ValueError(where + str(e)) from None


def _emit(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_info(a) -> int:
    from engine import api
    from engine.memory_plan import PlanOptions, parse_size
    if a.model and a.synthetic:
        raise ValueError("give a MODEL file or --synthetic, not both")
    opt = PlanOptions(budget=parse_size(a.gpu_memory_budget) if a.gpu_memory_budget else None, device=a.device,
                      kv_format=a.kv_cache_dtype, swa_format=a.swa_kv_cache_dtype, embed_weights=a.embed_weights,
                      prefill_chunk=a.prefill_chunk, max_running=a.max_running_requests,
                      draft=_draft_path(a.spec_draft_model))
    model = str(api.resolve_model(a.model)) if a.model else None  # a path or a models-folder name
    if model and not a.synthetic:
        from dataclasses import replace

        from models.gemma4_vision import find_mmproj
        mmproj = a.mmproj or find_mmproj(model)
        opt = replace(opt, mmproj=Path(mmproj) if mmproj else None)
    d = api.describe(api.open_layout(model, a.synthetic), plan=opt)
    if a.json:
        print(json.dumps(d, indent=1))
        return 0
    print(f"{d['file']}\n  architecture {d['architecture']}  name {d['name']}")
    print(f"  {d['n_layer']} layers, d_model {d['d_model']}, vocab {d['vocab_size']}, "
          f"context {d['context_length']}, sliding window {d['sliding_window']}")
    for k in ("ple_width", "kv_shared_layers", "final_softcap", "n_expert"):
        if k in d:
            print(f"  {k}: {d[k]}")
    print("  layer  type     head_dim  heads/kv  ffn     kv_source")
    for L in d["layers"]:
        src = "own" if L["kv_source"] == L["layer"] else f"layer {L['kv_source']}"
        print(f"  {L['layer']:5d}  {L['type']:7s}  {L['head_dim']:8d}  {L['n_head']:2d}/{L['n_kv_head']:<5d}  "
              f"{L['ffn']:6d}  {src}")
    print("  tensor types:")
    for k, v in d["tensor_types"].items():
        print(f"    {k:6s} {v['tensors']:4d} tensors  {v['bytes'] / 2**20:9.1f} MiB")
    print(f"  total {d['total_bytes'] / 2**20:.1f} MiB")
    _print_plan(d["plan"])
    return 0


def _print_plan(p: dict) -> None:
    from engine.memory_plan import fmt_size
    if "error" in p:
        print(f"  memory plan ({p['budget_source']}, {fmt_size(p['budget'])}): {p['error']}")
        return
    o = p["options"]
    print(f"  memory plan for {p['model']} on {p['device']}: budget {fmt_size(p['budget'])} ({p['budget_source']}), "
          f"embed weights on {o['embed_weights']}, prefill chunk {o['prefill_chunk']}, "
          f"{o['max_running']} running requests")
    if p.get("fitted"):
        print(f"    {p['fitted']}")
    if p.get("capped"):
        print(f"    {p['capped']}")
    print(f"    {'component':28s} {'device':>10s} {'host':>10s}  detail")
    for c in p["components"]:
        print(f"    {c['name']:28s} {fmt_size(c['device_bytes']):>10s} {fmt_size(c['host_bytes']):>10s}  {c['detail']}")
    print(f"    {'total':28s} {fmt_size(p['device_total']):>10s} {fmt_size(p['host_total']):>10s}  "
          f"({fmt_size(p['unused_bytes'])} of the budget unused)")
    for k in ("full", "window"):
        kv = p["kv"][k]
        print(f"    {k} pool: {kv['format']}, {kv['unit_bytes']} B/token over {len(kv['layers'])} layers, "
              f"{kv['tokens']} tokens")
    print(f"    max context {p['max_context']} tokens (model limit {p['context_length']})")
    print(f"  max context by KV format (window pool {p['kv']['window']['format']}):")
    print(f"    {'format':22s} {'B/token':>8s} {'full pool tokens':>17s} {'max context':>12s}")
    for f, r in p["max_context_by_format"].items():
        if r is None:
            print(f"    {f:22s} {'':>8s} {'does not fit':>17s}")
        else:
            print(f"    {f:22s} {r['unit_bytes']:8d} {r['full_pool_tokens']:17d} {r['max_context']:12d}")


def _int_list(s: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {s!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise ValueError(f"{what} must list non-negative integers, got {s!r}")
    return vals


def cmd_bench(a) -> int:
    if a.model and a.synthetic:
        raise ValueError("give --model or --synthetic, not both")
    _int_list(a.prompt_lengths, "--prompt-lengths")  # bad lists fail before any work starts
    _int_list(a.contexts, "--contexts")
    if a.constraints:  # the grammar mask per token on the model's vocabulary (no weights loaded)
        from engine import api
        from engine.constraint_bench import constraint_bench
        out = constraint_bench(api.resolve_model(a.model), threads=a.threads)
    elif a.serve:  # the API server beside llama-cpp-python's, each in its own process
        from engine import api

        from .server.bench import serve_bench
        out = serve_bench(api.resolve_model(a.model), list(_int_list(a.clients, "--clients")), a.serve_tokens,
                          a.long_words, a.threads, not a.no_llama_cpp, a.max_running_requests,
                          progress=lambda s: print(s, file=sys.stderr))
    elif a.static:  # compiled, not run: kernels per step, bytes per token, GEMV instructions per byte
        if not a.synthetic:
            raise ValueError("--static needs --synthetic e2b or e4b")
        from engine.static_bench import static_report
        out = static_report(a.synthetic, a.arch, kv=a.kv_cache_dtype)
    elif a.audio:  # the audio tower's encode time per clip length
        from engine.audio_bench import audio_bench
        if a.threads:
            import torch
            torch.set_num_threads(a.threads)
        try:
            lengths = [float(x) for x in a.audio_seconds.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--audio-seconds must be comma-separated numbers, got {a.audio_seconds!r}") from None
        if not lengths or min(lengths) <= 0.01:
            raise ValueError("--audio-seconds needs lengths over 0.01 s")
        out = audio_bench(lengths, a.mmproj, "cuda" if a.device == "cuda" else "cpu",
                          progress=lambda s: print(s, file=sys.stderr))
    elif a.kv_resume:  # restore from a KV file vs cold prefill, through the engine
        from engine import api
        from engine.kv_bench import kv_resume_bench
        from engine.cpu_runtime import set_threads
        set_threads(a.threads)
        dev = "cuda" if a.device == "cuda" else "cpu"
        lm = api.open_model(api.resolve_model(a.model), exact=False, device=dev)
        out = kv_resume_bench(lm, _int_list(a.kv_lengths, "--kv-lengths"), a.kv_cache_dtype,
                              progress=lambda s: print(s, file=sys.stderr))
    elif a.spec_draft_model:  # with vs without the assistant draft, through the engine
        from engine import api
        from engine.bench import spec_bench
        out = spec_bench(api.resolve_model(a.model), Path(a.spec_draft_model), a.prompt_tokens, a.decode_tokens,
                         a.spec_tokens, device=a.device)
        out.pop("ids", None)
    elif a.device == "cpu" and a.profile:  # one decode step, piece by piece
        from engine import api
        from engine.cpu_bench import synthetic_gguf
        from engine.cpu_profile import profile_decode
        from engine.cpu_runtime import set_threads
        set_threads(a.threads)
        with synthetic_gguf(a.synthetic, Path(a.keep_gguf) if a.keep_gguf else None) as written:
            path = written or api.resolve_model(a.model)
            out = profile_decode(api.open_model(path, exact=False, device="cpu"), a.prompt_tokens, a.decode_tokens)
    elif a.device == "cpu" and (a.synthetic or a.both or a.engine):  # each run in its own process
        from engine import api
        from engine.cpu_bench import cpu_side_by_side
        kinds = ["loop", "engine", "engine-plain"] if a.both else ["engine" if a.engine else "loop"]
        out = cpu_side_by_side(path=None if a.synthetic else api.resolve_model(a.model), synthetic=a.synthetic,
                               n_prompt=a.prompt_tokens, n_decode=a.decode_tokens,
                               threads=a.threads, kinds=([] if a.no_llama_cpp else ["llama.cpp"]) + kinds,
                               keep=Path(a.keep_gguf) if a.keep_gguf else None)
    elif a.device == "cpu" and not a.synthetic:  # the CPU bench beside llama.cpp, as before
        from engine.bench import cpu_bench
        from engine import api
        path = api.resolve_model(a.model)
        out = cpu_bench(path, a.prompt_tokens, a.decode_tokens, threads=a.threads,
                        with_llama_cpp=not a.no_llama_cpp)
    else:
        import torch
        if a.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        if a.threads:
            torch.set_num_threads(a.threads)
        from engine.bench import gpu_bench
        model = None
        if not a.synthetic:
            from engine import api
            model = api.resolve_model(a.model)
        out = gpu_bench(model, device=a.device, budget=a.gpu_memory_budget, kv_cache_dtype=a.kv_cache_dtype,
                        swa_kv_cache_dtype=a.swa_kv_cache_dtype, embed_weights=a.embed_weights,
                        fast_prefill=a.fast_prefill == "on",
                        prompts=_int_list(a.prompt_lengths, "--prompt-lengths"),
                        contexts=_int_list(a.contexts, "--contexts"), decode_steps=a.decode_steps,
                        synthetic=a.synthetic, peak_bandwidth=a.peak_bandwidth)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(out["table"])
    return 0


def cmd_app(a) -> int:
    """The Textual app: loads the model in a worker, then the chat (app/app.py)."""
    import sqlite3

    from app.app import EdgegemApp
    from app.backend import EngineBackend
    from app.store import Store

    try:
        store = Store(Path(a.data_dir).expanduser() if a.data_dir else None)
    except sqlite3.Error as e:
        raise OSError(f"cannot open the conversation database: {e}") from None
    from dataclasses import replace

    from engine.memory_plan import parse_size
    budget = parse_size(a.kv_disk_budget) if a.kv_disk_budget not in ("0", "") else 0
    kv = {"kv_save": "evict", "kv_dir": str(store.data_dir / "kv"), "kv_disk_budget": budget} if budget else {}
    backend = EngineBackend(a.model, replace(_engine_options(a), **kv), a.device, mmproj=a.mmproj)
    server = None
    if a.serve is not None:  # refused (bad flags, port in use) in one line before the app starts
        from .server.run import BackgroundServer
        from .server.state import ServerState
        cfg = cli_serve.server_config(a, a.serve)
        cfg.kv_auto = bool(kv)  # API conversations' KV files go beside the app's, in one budget
        server = BackgroundServer(ServerState(cfg), cfg)
    app = EdgegemApp(backend, store,
                     default_settings={"image_tokens": a.image_tokens} if a.image_tokens else None, server=server)
    try:
        app.run()
    finally:
        if server is not None:
            server.stop()
    return app.return_code or 0


COMMANDS = {"app": cmd_app, "score": cmd_score, "tokenize": cmd_tokenize, "run": cmd_run, "info": cmd_info,
            "bench": cmd_bench, "chat": cli_chat.cmd_chat}
COMMANDS.update(cli_tools.COMMANDS)
COMMANDS.update(cli_kvcheck.COMMANDS)
COMMANDS.update(cli_serve.COMMANDS)


def _with_default_command(argv: list[str]) -> list[str]:
    """`edgegem [--model PATH] [flags]` means `edgegem app ...` (top-level --debug stays in front)."""
    if any(t in COMMANDS for t in argv) or {"-h", "--help", "--version"} & set(argv):
        return argv
    debug = [t for t in argv if t == "--debug"]
    return debug + ["app"] + [t for t in argv if t != "--debug"]


class Terminated(BaseException):
    """SIGTERM: unwinds like Ctrl-C (clients closed, files finished) and exits with 143."""


def _on_signal(signum, frame) -> None:
    from engine import kv_sessions
    kv_sessions.EXIT_TIMEOUT = 1.0  # end within ~2 s: a KV file still being written is dropped
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_with_default_command(sys.argv[1:] if argv is None else list(argv)))
    if args.cmd != "app" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)  # the app handles both in its event loop
        signal.signal(signal.SIGINT, _on_signal)
    try:
        from engine import failpoints
        if failpoints.CONFIG_ERROR:
            raise ValueError(failpoints.CONFIG_ERROR)
        if args.cmd in ("app", "run", "chat"):  # before any model loads: torch's and ggml's threads
            from engine.cpu_runtime import set_threads
            set_threads(args.threads)
        code = COMMANDS[args.cmd](args)
    except KeyboardInterrupt:
        code = 130
    except Terminated:
        code = 143
    except (ValueError, OSError, RuntimeError, KeyError) as e:
        if args.debug:
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"edgegem: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if code in (130, 143):  # a signal: clients are closed and files finished; skip the slow teardown
        _fast_exit(code)
    return code


def _fast_exit(code: int) -> None:
    """End now (interpreter teardown with torch loaded takes seconds on a busy machine; a signal
    must end the process within ~2 s). Everything that matters was closed before this."""
    import os
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
