"""`edgegem bench --serve`: the API server against llama-cpp-python's own server (`llama_cpp.server`)
on the same GGUF and machine, each in a process of its own, one after the other.

- Aggregate decode: N concurrent streaming clients (1, 4, 16), each a different prompt through
  `/v1/completions` (the raw text on both servers, so no chat-template difference), greedy, a fixed
  token limit; tokens / wall time from the first request sent to the last stream's end. Tokens
  are the streamed text chunks (both servers stream one token per chunk). llama-cpp-python's
  server runs one request at a time (its lock; `--interrupt_requests false` so a new request
  waits instead of cutting the running stream off).
- Second turn of a long conversation: a ~`long_tokens` excerpt of Pride and Prejudice and a question,
  answered; then the same text + answer + a second question: time to the first streamed token of
  that second turn (edgegem: its radix prefix cache; llama-cpp-python: it keeps the last prompt's
  KV and reuses the common prefix).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

TOPICS = ["the sea", "a red fox", "winter", "bread", "a lighthouse", "trains", "honey bees", "the moon",
          "a violin", "rain", "mountains", "a library", "coffee", "owls", "the desert", "bicycles"]


def _prompt(i: int) -> str:
    return f"Here is a short story about {TOPICS[i % len(TOPICS)]}.\n\nOnce upon a time"


def _start(cmd: list[str], ready: re.Pattern, env: dict, timeout: float = 300) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    end = time.time() + timeout
    while time.time() < end:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            break
        m = ready.search(line)
        if m:  # keep reading its output, or a full pipe would stall it
            threading.Thread(target=p.stdout.read, daemon=True).start()
            return p, m.group(1)
    p.kill()
    raise RuntimeError(f"{cmd[2]} did not start")


def _stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()


async def _one(client, url: str, prompt: str, n: int) -> tuple[int, Optional[float], float]:
    """(tokens, time to first token, end) of one streamed completion."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}  # no model: each its own
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("text"):
                tokens += 1
                if first is None:
                    first = time.perf_counter() - t0
    return tokens, first, time.perf_counter()


async def _concurrent(url: str, clients: int, n: int) -> dict:
    import httpx
    async with httpx.AsyncClient(timeout=None) as c:
        await _one(c, url, _prompt(99), 2)  # warm up: the first request pays one-off costs
        t0 = time.perf_counter()
        outs = await asyncio.gather(*[_one(c, url, _prompt(i), n) for i in range(clients)])
    wall = max(end for _, _, end in outs) - t0
    tokens = sum(t for t, _, _ in outs)
    ttfts = [f for _, f, _ in outs if f is not None]
    return {"clients": clients, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None}


def _long_text(n_words: int) -> str:
    import engine
    text = (Path(engine.__file__).parent / "data" / "kv_check.txt").read_text(encoding="utf-8")
    return " ".join(text.split()[:n_words])


async def _second_turn(url: str, long_words: int, n: int) -> dict:
    import httpx
    turn1 = f"{_long_text(long_words)}\n\nQuestion: who is Mr. Bingley?\nAnswer:"
    async with httpx.AsyncClient(timeout=None) as c:
        t1 = time.perf_counter()
        body = {"prompt": turn1, "max_tokens": n, "temperature": 0}
        r = await c.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        first_turn_s = time.perf_counter() - t1
        answer = r.json()["choices"][0]["text"]
        turn2 = f"{turn1}{answer}\n\nQuestion: and Mrs. Bennet?\nAnswer:"
        _, ttft, _ = await _one(c, url, turn2, 4)
    return {"first_turn_s": first_turn_s, "second_turn_ttft_s": ttft}


def _measure(url: str, clients: list[int], n: int, long_words: int) -> dict:
    return {"concurrent": [asyncio.run(_concurrent(url, k, n)) for k in clients],
            "second_turn": asyncio.run(_second_turn(url, long_words, n))}


def serve_bench(model: Path, clients: list[int], n_tokens: int = 32, long_words: int = 1200, threads: int = 0,
                with_llama_cpp: bool = True, max_running: Optional[int] = None, progress=print) -> dict:
    """edgegem serve runs with its defaults (4 running requests on the CPU) unless `max_running`."""
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out: dict = {"model": str(model), "n_tokens": n_tokens, "clients": clients, "servers": {}}
    ours = [sys.executable, "-m", "app.cli", "serve", "--model", str(model), "--port", "0", "--max-queued-requests", "64"]
    if max_running:
        ours += ["--max-running-requests", str(max_running)]
    runs = [("edgegem serve", ours, re.compile(r" at (http://\S+) "))]
    if with_llama_cpp:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port",
               str(port), "--n_ctx", "8192", "--verbose", "false",
               "--interrupt_requests", "false"]  # its default drops a running stream for each new request
        if threads:
            cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
        runs.append(("llama_cpp.server", cmd, re.compile(r"Uvicorn running on (http://\S+)")))
    for name, cmd, ready in runs:
        progress(f"bench --serve: starting {name}")
        p, url = _start(cmd, ready, env)
        try:
            out["servers"][name] = _measure(url, clients, n_tokens, long_words)
        finally:
            _stop(p)
    out["table"] = _table(out)
    return out


def _table(out: dict) -> str:
    names = list(out["servers"])
    head = "| clients | " + " | ".join(f"{n} tok/s (mean TTFT)" for n in names) + " |"
    lines = [head, "| --- |" + " --- |" * len(names)]
    for i, k in enumerate(out["clients"]):
        cells = []
        for n in names:
            r = out["servers"][n]["concurrent"][i]
            ttft = f"{r['mean_ttft_s']:.2f} s" if r["mean_ttft_s"] is not None else "-"
            cells.append(f"{r['tok_s']:.1f} ({ttft})")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    cells = []
    for n in names:
        s = out["servers"][n]["second_turn"]
        cells.append(f"{s['second_turn_ttft_s']:.2f} s (first turn {s['first_turn_s']:.1f} s)")
    lines.append("| second-turn TTFT, long conversation | " + " | ".join(cells) + " |")
    return "\n".join(lines)
