"""`edgegem` command line. With no command (or `app`) it opens the full-screen chat; `run` prints
one reply to stdout for scripts; `chat` is a plain line chat; score, tokenize, info, bench, kv-check.

Bad input ends in one line on stderr and exit code 2 (also an answer the engine ended for its
input: media its encoder refused, more tokens than the KV pool holds); an answer the engine ended
for its own failure (out of memory, a failed forward) exits 1; `--debug` shows the traceback.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from . import cli_chat, cli_chat_tools, cli_kvcheck, cli_mcp, cli_serve, cli_tools
from .cli_bench import cmd_bench
from .cli_info import cmd_info
from .cli_options import (_audio_args, _engine_args, _engine_options, _fit_args, _image_args, _image_model_args,
                          _kv_session_arg, _memory_args, _sampling_args, placement_args)
from .cli_run import cmd_run, cmd_score, cmd_tokenize

# `--synthetic` layouts (models/synthetic.py PUBLIC_VARIANTS; tests/engine/test_synthetic_bench.py keeps them equal)
SYNTHETIC_MODELS = ("e2b", "e4b", "26b-a4b", "31b")

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def _exit_code(e: BaseException) -> int:
    """engine.api.GenerationError by its kind; every other error here is bad input."""
    kind = getattr(e, "kind", None)
    if kind is None:
        return EXIT_BAD_INPUT
    from engine.api import ErrorKind
    return EXIT_BAD_INPUT if kind in (ErrorKind.BAD_INPUT, ErrorKind.CAPACITY) else EXIT_FAILED


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
    cli_mcp.add_tool_args(a)
    a.add_argument("--max-tool-steps", type=int, metavar="N",
                   help="replies with tool calls before the loop stops (default 8; also in Settings)")
    a.add_argument("--tool-choice", choices=["auto", "required", "none"],
                   help="with tools: auto (the model decides; the default), required (every reply calls one), "
                        "none (also in Settings)")
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
    i.add_argument("--synthetic", choices=SYNTHETIC_MODELS,
                   help="a synthetic Gemma-4 E2B/E4B/26B-A4B/31B Q4_K_M layout (no file needed)")
    _memory_args(i, swa_default="bf16")
    _fit_args(i)
    placement_args(i)
    i.add_argument("--spec-draft-model", metavar="PATH", help="draft (assistant) GGUF kept on the device")
    i.add_argument("--mmproj", metavar="FILE",
                   help="image/audio encoders to plan for (default: an mmproj*.gguf beside the model)")
    i.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="target of the plan")
    i.add_argument("--exact", action="store_true", help="name the runtime a load with --exact would use")
    i.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="prefill and decode tokens/s (CPU: ours beside llama.cpp's; "
                                     "cuda or --synthetic: the engine bench)")
    b.add_argument("--model", help="GGUF file (default: the demo model)")
    b.add_argument("--synthetic", choices=SYNTHETIC_MODELS,
                   help="random-weight E2B/E4B/26B-A4B/31B with the real shapes and Q4_K_M mix, built in memory")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu with a GGUF: edgegem beside llama-cpp-python; cuda (or --synthetic): the engine bench")
    b.add_argument("--prompt-tokens", type=int, default=128, help="CPU-vs-llama.cpp bench: prompt length")
    b.add_argument("--decode-tokens", type=int, default=64, help="CPU-vs-llama.cpp bench: decode steps")
    b.add_argument("--threads", type=int, default=0, help="CPU threads (0: $OMP_NUM_THREADS, else the physical cores)")
    b.add_argument("--no-llama-cpp", action="store_true", help="skip the llama-cpp-python run")
    b.add_argument("--engine", action="store_true",
                   help="--device cpu (a GGUF or --synthetic): time edgegem through the engine (as run and the app "
                        "use it) rather than the model's own loop, each run in a process of its own")
    b.add_argument("--both", action="store_true",
                   help="--device cpu (a GGUF or --synthetic): the model loop, the engine and the engine without "
                        "fast prefill, beside llama.cpp")
    b.add_argument("--keep-gguf", metavar="PATH",
                   help="--synthetic: write the synthetic GGUF here (reused when it exists); on cuda the bench "
                        "opens that file as run does (without it an MoE layout is built in memory, its placed "
                        "expert banks in host RAM)")
    b.add_argument("--profile", action="store_true",
                   help="--device cpu: where one decode step's time goes, per op, at --prompt-tokens of context "
                        "over --decode-tokens steps; cuda: the kernels of 8 more decode steps per context (device "
                        "time beside wall time, the top kernels)")
    g = b.add_argument_group("engine bench (--device cuda or --synthetic)")
    _memory_args(g)
    placement_args(g)
    g.add_argument("--fast-prefill", choices=["on", "off"], default="on")
    g.add_argument("--prompt-lengths", default="512,4096,16384", metavar="N,N,...", help="prefill prompt lengths")
    g.add_argument("--contexts", default="0,4096,32768", metavar="N,N,...", help="decode contexts")
    g.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per context")
    g.add_argument("--peak-bandwidth", type=float, metavar="GBps",
                   help="the device's peak memory bandwidth (default: a table of known GPUs)")
    g.add_argument("--rows", action="store_true",
                   help="print each prefill and decode row as one JSON line the moment it is measured "
                        "(a run stopped part-way keeps the rows it finished)")
    g = b.add_argument_group("static bench (--static --synthetic e2b|e4b|26b-a4b: no GPU needed)")
    g.add_argument("--static", action="store_true",
                   help="count the kernels of one decode step and the weight bytes per token, and compile each "
                        "decode GEMV format for --arch: SASS instructions per weight byte, bandwidth cap")
    g.add_argument("--arch", default="sm_86", metavar="SM", help="--static: compile target, sm_75, sm_80, sm_86, sm_89, sm_90 or sm_120")
    g = b.add_argument_group("offload model (--offload-model: 26B-A4B experts on the host CPU beside a GPU)")
    g.add_argument("--offload-model", action="store_true",
                   help="time one 26B-A4B layer's expert mix here (1 and --threads threads) and print the "
                        "predicted decode tok/s of GPU + host-experts systems beside llama.cpp's published figures")
    g.add_argument("--measure-seconds", type=float, default=2.0, metavar="S",
                   help="--offload-model: seconds of runs per measurement (the banks' building not counted)")
    g.add_argument("--hit-rate", type=float, default=0.3, metavar="H",
                   help="--offload-model: share of expert bytes a hot-expert cache serves from VRAM")
    g.add_argument("--offload-context", type=int, default=4096, metavar="N",
                   help="--offload-model: tokens of context the GPU's attention reads")
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
    g = b.add_argument_group("decode together (--batch: the CPU, beside llama.cpp's batched decode)")
    g.add_argument("--batch", metavar="B,B,...",
                   help="decode B sequences together on the CPU, edgegem's engine beside llama.cpp's own batched "
                        "decode (one llama_decode of B tokens a step): step ms, aggregate tok/s, gain over B=1 "
                        "(--prompt-tokens per sequence; --decode-tokens timed steps)")
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
    cli_mcp.add_tool_args(c)
    c.add_argument("--tool-choice", choices=["auto", "required", "none"], default="auto",
                   help="with tools: auto (the model decides), required (every reply calls one), none")
    c.add_argument("--max-tool-steps", type=int, default=8, metavar="N",
                   help="replies with tool calls before the loop stops (default 8)")
    cli_tools.add_commands(sub)
    cli_kvcheck.add_command(sub)
    cli_mcp.add_command(sub)
    cli_serve.add_command(sub, _engine_args, _image_model_args)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("edgegem")
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        return "0+unknown"


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
    tools = cli_chat_tools.app_tools(a, store.data_dir)  # a bad mcp.json: one line, before anything starts
    server = None
    if a.serve is not None:  # refused (bad flags, port in use) in one line before the app starts
        from .server.run import BackgroundServer
        from .server.state import ServerState
        cfg = cli_serve.server_config(a, a.serve)
        cfg.kv_auto = bool(kv)  # API conversations' KV files go beside the app's, in one budget
        server = BackgroundServer(ServerState(cfg), cfg)
    defaults = {**({"image_tokens": a.image_tokens} if a.image_tokens else {}),
                **({"tool_steps": a.max_tool_steps} if a.max_tool_steps else {}),
                **({"tool_choice": a.tool_choice} if a.tool_choice else {})}
    app = EdgegemApp(backend, store, default_settings=defaults or None, server=server,
                     tools=tools)
    try:
        app.run()
    finally:
        if server is not None:
            server.stop()
        if tools is not None:
            tools.close()
    return app.return_code or 0


COMMANDS = {"app": cmd_app, "score": cmd_score, "tokenize": cmd_tokenize, "run": cmd_run, "info": cmd_info,
            "bench": cmd_bench, "chat": cli_chat.cmd_chat}
COMMANDS.update(cli_tools.COMMANDS)
COMMANDS.update(cli_kvcheck.COMMANDS)
COMMANDS.update(cli_mcp.COMMANDS)
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
    from engine.kv import sessions as kv_sessions
    kv_sessions.EXIT_TIMEOUT = 1.0  # end within ~2 s: a KV file still being written is dropped
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_with_default_command(sys.argv[1:] if argv is None else list(argv)))
    if args.cmd != "app" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)  # the app handles both in its event loop
        signal.signal(signal.SIGINT, _on_signal)
    try:
        from engine.env import env
        env()  # a bad EDGEGEM_* value is one line here, not a traceback inside a forward
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
        return _exit_code(e)
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
