"""What the app needs from the engine, and nothing more: load a model (with progress), then a client.

`EngineBackend` is the real one (engine.api); tests pass a fake with the same members (`load`,
`with_options`, `options`, `model`). The app's screens and widgets never import `engine`, `models`
or `kernels`: this file is their one door into the engine (the CLI commands use engine.api).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from engine.api import (BASE_MODEL_DEFAULTS, EngineOptions, ErrorKind, GenerationParams, QueueFullError,
                        SamplingParams, audio_from_base64, audio_marker, generation_params, image_marker,
                        load_error_kind, split_thinking)
# structured output and tool calls for the API server (engine/constraints.py, engine/structured.py)
from engine.constraints import ConstraintError, from_ollama_format, from_response_format
from engine.memory_plan import fmt_size  # bytes -> "1.5 GiB": the one formatter (app and engine)
from engine.media import as_audio_input, as_image_input  # path | bytes -> ImageInput / AudioInput, or a one-line ValueError
from engine.structured import check_tool_request, ollama_tool_calls
from engine.tool_loop import DECLINED, run_tool_loop  # the chat's tool loop (app/screens/chat_tools.py)

__all__ = ["EngineBackend", "EngineOptions", "GenerationParams", "SamplingParams", "generation_params",
           "BASE_MODEL_DEFAULTS", "Session", "size", "fmt_size",
           "split_thinking", "plan_lines", "kv_pools", "exiting_on_signal", "as_image_input", "as_audio_input",
           "image_marker", "audio_marker", "audio_from_base64", "QueueFullError", "ErrorKind", "load_error_kind",
           "ConstraintError",
           "from_response_format", "from_ollama_format", "check_tool_request", "ollama_tool_calls",
           "run_tool_loop", "DECLINED"]

# progress(fraction 0..1, one-line description)
Progress = Callable[[float, str], None]


@dataclass
class Session:
    """A loaded model: its client (engine.client.EngineClient) and what the status panel shows."""

    client: Any
    # model, path, arch, device, runtime, demo, plan (bytes), context_limit, kind ("base" | "chat"), kind_reason
    info: dict = field(default_factory=dict)


class EngineBackend:
    def __init__(self, model: Optional[str] = None, options: EngineOptions = EngineOptions(),
                 device: str = "auto", exact: bool = False, mmproj: Optional[str] = None):
        self.model, self.options, self.device, self.exact = model, options, device, exact
        self.mmproj = mmproj  # a GGUF model's image encoder (None: an mmproj*.gguf beside it, if any)

    def with_options(self, **changes) -> "EngineBackend":
        """The same model with other engine flags (the settings screen's reload)."""
        return EngineBackend(self.model, replace(self.options, **changes), self.device, self.exact, self.mmproj)

    def load(self, progress: Progress) -> Session:
        from engine import api

        path = api.resolve_model(self.model)
        device = api.default_device() if self.device == "auto" else self.device
        progress(0.0, f"opening {path.name}")

        def on_tensor(done: int, total: int, nbytes: int, total_bytes: int) -> None:
            frac = nbytes / total_bytes if total_bytes else done / max(total, 1)
            progress(0.9 * frac, f"tensors {done}/{total} · {size(nbytes)} of {size(total_bytes)} → {device}")

        lm = api.open_model(path, exact=self.exact, device=device, embed_weights=self.options.embed_weights,
                            progress=on_tensor, mmproj=self.mmproj, options=self.options)
        progress(0.92, "allocating the KV pools")
        plan = api.engine_plan(lm, self.options)[0]
        client = api.start_client(lm, self.options)
        progress(1.0, "ready")
        status = client.status()
        info = {"model": lm.source.get("general.name") if hasattr(lm.source, "get") else path.name,
                "file": path.name, "path": str(path), "arch": lm.arch, "demo": self.model is None,
                "device": device, "context_limit": status.get("context_limit"),
                "draft": self.options.spec_draft_model,
                # per-conversation KV files (engine/kv/sessions.py), None when off
                "kv_dir": self.options.kv_dir, "kv_disk_budget": self.options.kv_disk_budget,
                "budget_bytes": plan.budget if plan is not None else None,
                # a tower turned off at load (models/loader.py) first, then the memory plan
                "plan": [n for n in (*getattr(lm, "notices", ()), api.placement_notice(lm, self.options)) if n]
                + plan_lines(plan, status)}
        info["runtime"] = client.model_info()["runtime"]  # models/runtime.py, decided at load
        info["model"] = info["model"] or path.stem
        # base models open in the text-continuation mode (models/model_kind.py: the rule)
        info["kind"], info["kind_reason"] = api.model_kind(lm)
        return Session(client, info)

    def kv_check(self, session: Session, data_dir, progress: Progress, should_stop: Callable[[], bool],
                 **kw) -> dict:
        """What each KV format costs on the loaded model (engine/bench/kv_quality.py), cached for
        `kv_check_cached`. Runs in the caller's worker thread on the session's weights: the caller
        keeps the chat idle meanwhile (app/screens/kv_check.py is modal). `kw`: n_tokens, chunk."""
        from engine.bench import kv_check, save_result

        result = kv_check(session.client.loaded, progress=progress, should_stop=should_stop, **kw)
        save_result(result, data_dir)
        return result

    def kv_check_cached(self, session: Session, data_dir) -> Optional[dict]:
        """This model file's figures on this device if measured (by the app or `edgegem kv-check`)."""
        from engine.bench import load_result

        path = session.info.get("path")
        return load_result(path, session.info.get("device") or "cpu", data_dir) if path else None


def exiting_on_signal(timeout: float = 1.0) -> None:
    """SIGTERM/SIGINT: closing engines wait at most `timeout` s for their KV files to be written."""
    from engine.kv import sessions as kv_sessions
    kv_sessions.EXIT_TIMEOUT = timeout


def size(n: Optional[int]) -> str:
    """The status panel's and the loading screen's sizes: "512 MiB", "1.40 GiB" ("?": not known)."""
    return "?" if n is None else fmt_size(n, decimals=(0, 2))


def kv_pools(status: dict) -> dict:
    """The KV pools of `client.status()` that hold layers: name -> capacity, used, unit_bytes, format."""
    return {k: p for k, p in status.get("pools", {}).items() if isinstance(p, dict) and p.get("slabs")}


def plan_lines(plan, status: dict) -> list[str]:
    """The memory plan as the loading screen prints it: weights and workspace from the plan, the KV
    pools as the engine actually built them (on the CPU without a budget they stop well short of
    what the plan would allow)."""
    pools = kv_pools(status)
    kv_bytes = sum(p["capacity"] * p["unit_bytes"] for p in pools.values())
    lines = []
    if plan is not None:
        rest = [c for c in plan.components if "KV pool" not in c["name"]]
        used = sum(c["device_bytes"] for c in rest) + kv_bytes
        lines.append(f"budget {size(plan.budget)} on {plan.device}: {size(used)} used on the device, "
                     f"{size(sum(c['host_bytes'] for c in rest))} in host memory")
        if plan.fitted:  # "fitted to the budget: prefill chunk 2048 -> 512, ..."
            lines.append(plan.fitted)
        for c in rest:
            where = [f"device {size(c['device_bytes'])}"] if c["device_bytes"] else []
            where += [f"host {size(c['host_bytes'])}"] if c["host_bytes"] else []
            lines.append(f"  {c['name']}: {', '.join(where) or '0'}")
    for name, p in pools.items():
        lines.append(f"  KV {name} pool: {p['capacity']} tokens × {p['slabs']} layers, {p['format']}, "
                     f"{size(p['capacity'] * p['unit_bytes'])}")
    lines.append(f"max context: {status.get('context_limit')} tokens")
    return lines
