"""`edgegem serve`: the local API server (app/server/), OpenAI- and Ollama-compatible, on one
loaded model; and the server flags the app's `--serve` shares. Registered by app/cli.py."""
from __future__ import annotations

import sys
from pathlib import Path

from .server.config import DEFAULT_MAX_BODY, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_PORT, ServerConfig, read_key_file


def add_server_args(g) -> None:
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only); another needs --api-key")
    key = g.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", help="clients must send Authorization: Bearer KEY")
    key.add_argument("--api-key-file", metavar="FILE", help="the key from a file's first line (keeps it out of ps)")
    g.add_argument("--insecure-no-key", action="store_true",
                   help="serve a non-loopback --host without a key (anyone who reaches the port may use it)")
    g.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME",
                   help="a Host header name to answer besides IP addresses and localhost (repeatable; '*': any)")
    g.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin allowed to call (repeatable), e.g. https://chat.example; "
                        "loopback origins always are")
    g.add_argument("--max-body", default="32MiB", metavar="SIZE", help="request body limit (413 past it)")
    g.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                   help="pixels per image a request may send")
    g.add_argument("--max-queued-requests", type=int, default=32, metavar="N",
                   help="requests waiting for the engine; past it, 429")
    g.add_argument("--default-max-tokens", type=int, metavar="N",
                   help="answer length for requests that give none (default: up to the context)")
    g.add_argument("--access-log", action="store_true", help="log every request (serve only)")


def add_command(sub, engine_args, image_model_args) -> None:
    s = sub.add_parser("serve", help="OpenAI- and Ollama-compatible API server on one model (/v1, /api)")
    s.add_argument("--model", help="GGUF file, models-folder name or HF folder (default: the demo model)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0 picks a free one")
    add_server_args(s.add_argument_group("server"))
    s.add_argument("--kv-dir", metavar="DIR",
                   help="keep each finished conversation's KV here; a later request that extends it (also after "
                        "a restart) restores it instead of prefilling")
    s.add_argument("--kv-disk-budget", default="4GiB", metavar="SIZE", help="--kv-dir's cap (least recently used go)")
    engine_args(s)
    image_model_args(s)


def server_config(a, port: int) -> ServerConfig:
    from engine.memory_plan import parse_size
    key = read_key_file(a.api_key_file) if a.api_key_file else a.api_key
    cfg = ServerConfig(host=a.host, port=port, api_key=key, insecure_no_key=a.insecure_no_key,
                       allowed_hosts=list(a.allowed_hosts), cors_origins=list(a.cors_origin),
                       max_body=parse_size(a.max_body) if a.max_body else DEFAULT_MAX_BODY,
                       max_image_pixels=a.max_image_pixels, max_queued_requests=a.max_queued_requests,
                       default_max_tokens=a.default_max_tokens, image_tokens=a.image_tokens or 280)
    if cfg.max_queued_requests < 0 or (cfg.default_max_tokens is not None and cfg.default_max_tokens < 1):
        raise ValueError("--max-queued-requests must be >= 0 and --default-max-tokens >= 1")
    cfg.check()
    return cfg


def _progress(name: str):
    marks = {}

    def on_tensor(done: int, total: int, nbytes: int, total_bytes: int) -> None:
        pct = int(100 * (nbytes / total_bytes if total_bytes else done / max(total, 1)))
        step = pct // 25 * 25
        if step not in marks:
            marks[step] = True
            print(f"edgegem: loading {name}: {step}% ({done}/{total} tensors)", file=sys.stderr, flush=True)
    return on_tensor


def cmd_serve(a) -> int:
    from dataclasses import replace

    from engine import api
    from engine.memory_plan import parse_size

    from .cli_options import _device, _engine_options, _start_client
    from .server.run import bind, serve, url_of
    from .server.state import ServerState

    cfg = server_config(a, a.port)  # refused in one line before anything loads
    sock = bind(cfg.host, cfg.port)  # a port in use: one line, before the model loads
    opts = _engine_options(a)
    if a.kv_dir:
        budget = parse_size(a.kv_disk_budget) if a.kv_disk_budget not in ("0", "") else 0
        if not budget:
            raise ValueError("--kv-dir needs a --kv-disk-budget above 0")
        opts = replace(opts, kv_dir=str(Path(a.kv_dir).expanduser()), kv_disk_budget=budget, kv_save="answer")
        cfg.kv_auto = True
    path = api.resolve_model(a.model)
    lm = api.open_model(path, exact=False, device=_device(a), embed_weights=a.embed_weights,
                        progress=_progress(path.name), mmproj=a.mmproj, options=opts)
    client = _start_client(lm, opts)
    state = ServerState(cfg, client)
    url = url_of(cfg.host, sock)
    try:
        print(f"edgegem: serving {state.model_id} at {url} (OpenAI API: {url}/v1, Ollama API: {url}/api)",
              flush=True)
        serve(state, sock, access_log=a.access_log)
    finally:
        client.close()  # aborts what still runs; KV files get at most 1 s on a signal
        sock.close()
    return 0


COMMANDS = {"serve": cmd_serve}
