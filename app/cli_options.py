"""The command line's shared option handling: the flag groups the subcommands add to their parsers
(engine, memory, sampling, images, audio, KV files) and what turns parsed flags into the engine's
options, parameters and client. Every `app/cli_*.py` subcommand module and `app/cli.py` import it;
it imports none of them (no import circle)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


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

def placement_args(g) -> None:
    """Beside a GPU, which weights stay in host RAM (llama.cpp's flags; engine/placement.py). Without
    them the plan places (auto): expert banks first, then whole layers, and says so."""
    g.add_argument("--cpu-moe", "-cmoe", action="store_true",
                   help="every MoE expert bank in host RAM, computed by the CPU (26B-A4B)")
    g.add_argument("--n-cpu-moe", "-ncmoe", type=int, metavar="N", help="the expert banks of the first N layers in host RAM")
    g.add_argument("--n-gpu-layers", "-ngl", type=int, metavar="N",
                   help="N layers on the GPU (the last N, as llama.cpp's); the first ones stay whole on the CPU")
    g.add_argument("--override-tensor", "-ot", action="append", default=[], metavar="RE=cpu|cuda",
                   help="weights whose GGUF name matches RE go there, after the flags above (e.g. exps=cpu)")
    g.add_argument("--ctx-size", "-c", type=int, metavar="N",
                   help="the context the placement keeps room for (default: the model's for expert banks, "
                        "4096 before a whole layer leaves the GPU)")
    g.add_argument("--moe-cache", default="auto", metavar="off|SIZE",
                   help="GPU memory for hot experts when banks are in host RAM (default auto: what the plan leaves)")


def placement_options(a) -> dict:
    """PlanOptions fields (placement, ctx_size, moe_cache) from the parsed placement flags."""
    from engine.memory_plan import parse_size
    from engine.placement import PlacementFlags, parse_overrides
    cache = {"off": 0, "auto": None}.get(str(a.moe_cache).lower(), None)
    if cache is None and str(a.moe_cache).lower() != "auto":
        cache = parse_size(a.moe_cache)
    flags = PlacementFlags(cpu_moe=a.cpu_moe, n_cpu_moe=a.n_cpu_moe, n_gpu_layers=a.n_gpu_layers,
                           overrides=parse_overrides(a.override_tensor))
    return {"placement": flags, "ctx_size": a.ctx_size, "moe_cache": cache}


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
    placement_args(g)
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
                   help="CPU threads for torch and llama.cpp's kernels (default: $OMP_NUM_THREADS, else the "
                        "physical cores; 1 on a machine busy with other work)")

def _kv_session_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-session", metavar="FILE",
                   help="a KV file: if it exists and fits this model, its KV serves the prompt's common prefix "
                        "(only the rest is prefilled); after each answer the KV of prompt + answer is saved to it")

def _sampling_args(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    """Left unset (None), a flag takes the engine's default, a base model's where it has one
    (engine/request_params.py: DRY on, 256 tokens, a blank-line stop); a value given always wins."""
    p.add_argument("--max-tokens", type=int, help="the most tokens to write (default 256)")
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-k", type=int, help="keep the K most likely tokens (default 0: off)")
    p.add_argument("--top-p", type=float, help="keep the fewest tokens holding P of the probability (default 1.0)")
    p.add_argument("--min-p", type=float, help="drop tokens under P times the top one's probability (default 0.0)")
    p.add_argument("--repetition-penalty", type=float, help="penalty on tokens seen in the last 64 (default 1.0: off)")
    p.add_argument("--presence-penalty", type=float, help="subtracted once from tokens seen in the last 64 (default 0.0)")
    p.add_argument("--seed", type=int)
    p.add_argument("--stop-at-blank-line", action=argparse.BooleanOptionalAction,
                   help="end the answer at the first blank line after some text (default: on for a base model, "
                        "off for a chat model)")
    g = p.add_argument_group("DRY and XTC (llama.cpp's flags and defaults: both off unless set; DRY on for "
                             "a base model)")
    g.add_argument("--dry-multiplier", type=float, metavar="X",
                   help="DRY: a token extending a repeat loses X * base^(length - allowed) (0: off, the default; "
                        "0.8 is usual and a base model's default)")
    g.add_argument("--dry-base", type=float, metavar="X", help="DRY base (>= 1; default 1.75)")
    g.add_argument("--dry-allowed-length", type=int, metavar="N", help="DRY: repeats up to N are free (default 2)")
    g.add_argument("--dry-penalty-last-n", type=int, metavar="N",
                   help="DRY: tokens scanned for repeats (-1: all, a base model's default; 0: off; default 64)")
    g.add_argument("--dry-sequence-breaker", action="append", metavar="S",
                   help="a string that cuts repeats (repeatable; replaces the defaults \\n : \" * (a base model: "
                        ": \" *); `none`: no breakers)")
    g.add_argument("--xtc-probability", type=float, metavar="P",
                   help="XTC: chance per token of removing the top choices (0: off, the default)")
    g.add_argument("--xtc-threshold", type=float, metavar="P",
                   help="XTC: tokens at least this likely are the top choices (all but the least likely go; "
                        "default 0.1)")

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
                         spec_tokens=a.spec_tokens, spec_p_min=a.spec_p_min, **placement_options(a))

def _start_client(lm, opts):
    """api.start_client, saying on stderr in one line each what loaded differently (a tower turned
    off: `lm.notices`) and what the memory plan lowered to fit the budget."""
    from engine import api
    for notice in [*getattr(lm, "notices", ()), api.placement_notice(lm, opts)]:
        if notice:
            print(f"edgegem: {notice}", file=sys.stderr)
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

SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "repetition_penalty",
                  "presence_penalty", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                  "xtc_probability", "xtc_threshold", "stop_at_blank_line")

def _generation(a, base_model: bool = False, **request):
    """The request's GenerationParams from the sampling flags (engine.api.generation_params: the
    flags given over a base model's defaults over the engine's); `request`: its other fields."""
    from engine.api import generation_params
    fields = {k: getattr(a, k, None) for k in SAMPLING_FLAGS}
    breakers = a.dry_sequence_breaker
    if breakers is not None:
        fields["dry_sequence_breakers"] = () if breakers == ["none"] else tuple(breakers)
    return generation_params(fields, base_model, **request)

def _params(a, base_model: bool = False):
    """The sampling flags as the engine's SamplingParams (a base model's defaults where unset)."""
    return _generation(a, base_model).sampling

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

def _int_list(s: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {s!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise ValueError(f"{what} must list non-negative integers, got {s!r}")
    return vals
