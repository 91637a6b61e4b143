"""Settings: this conversation's system prompt and sampling (saved with the conversation), and the
engine flags that need a model reload (KV format, memory budget, draft model; asked to confirm)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional

from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static, Switch, TextArea

from app.backend import BASE_MODEL_DEFAULTS, SamplingParams, fmt_size
from app.screens.kv_check import figure_lines

# Per-conversation defaults: llama.cpp-like chat sampling (DRY and XTC off, as llama.cpp has them).
DEFAULT_SETTINGS = {"system": "", "temperature": 0.7, "top_p": 0.95, "top_k": 64, "min_p": 0.0,
                    "repetition_penalty": 1.0, "max_tokens": 1024, "thinking": False, "image_tokens": 280,
                    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
                    "dry_sequence_breakers": list(SamplingParams().dry_sequence_breakers),
                    "xtc_probability": 0.0, "xtc_threshold": 0.1, "stop_at_blank_line": False,
                    "tool_steps": 8, "tool_choice": "auto"}
# Over those for a base model (the text-continuation mode): the engine's base-model defaults, the
# ones `edgegem run`, `chat` and the server's completion endpoints take too (DRY on over the whole
# text, a paragraph or so, ending at a blank line: engine/request_params.py says why).
BASE_SETTINGS = {**BASE_MODEL_DEFAULTS, "dry_sequence_breakers": list(BASE_MODEL_DEFAULTS["dry_sequence_breakers"])}
IMAGE_BUDGETS = (70, 140, 280, 560, 1120)  # soft tokens per image (engine.media); 280: 256 for a square
# name -> (label, type, lower bound, upper bound)
NUMBERS = {"temperature": ("Temperature", float, 0.0, 5.0), "top_p": ("Top-p", float, 0.0, 1.0),
           "top_k": ("Top-k (0: off)", int, 0, 1_000_000), "min_p": ("Min-p", float, 0.0, 1.0),
           "repetition_penalty": ("Repetition penalty", float, 0.1, 5.0),
           "max_tokens": ("Max tokens", int, 1, 1_000_000),
           "dry_multiplier": ("DRY multiplier (0: off)", float, 0.0, 100.0),
           "dry_base": ("DRY base", float, 1.0, 100.0),
           "dry_allowed_length": ("DRY allowed length", int, 0, 1_000_000),
           "dry_penalty_last_n": ("DRY window (-1: all)", int, -1, 1_000_000),
           "xtc_probability": ("XTC probability (0: off)", float, 0.0, 1.0),
           "xtc_threshold": ("XTC threshold", float, 0.0, 1.0),
           "tool_steps": ("Tool steps (replies with calls)", int, 1, 64)}
TOOL_CHOICES = ("auto", "required", "none")  # with tools: the model decides, every reply calls one, none
KV_FORMATS = ["auto", "bf16", "fp16", "fp32", "int8_per_token_head", "fp8_per_token_head"]


@dataclass
class SettingsResult:
    conversation: dict  # the new per-conversation settings
    engine: Optional[dict]  # engine flags that changed (None: no reload)


def parse_settings(raw: dict) -> dict:
    """Validate the form's strings into typed settings; ValueError names the first bad field."""
    out = {"system": raw.get("system", ""), "thinking": bool(raw.get("thinking")),
           "stop_at_blank_line": bool(raw.get("stop_at_blank_line"))}
    out["dry_sequence_breakers"] = parse_breakers(raw.get("dry_sequence_breakers", "[]"))
    if int(raw.get("image_tokens", DEFAULT_SETTINGS["image_tokens"])) not in IMAGE_BUDGETS:
        raise ValueError(f"Image tokens: one of {', '.join(map(str, IMAGE_BUDGETS))}")
    out["image_tokens"] = int(raw.get("image_tokens", DEFAULT_SETTINGS["image_tokens"]))
    if raw.get("tool_choice", "auto") not in TOOL_CHOICES:
        raise ValueError(f"Tool choice: one of {', '.join(TOOL_CHOICES)}")
    out["tool_choice"] = raw.get("tool_choice", "auto")
    for key, (label, typ, lo, hi) in NUMBERS.items():
        try:
            v = typ(str(raw[key]).strip())
        except (KeyError, ValueError):
            raise ValueError(f"{label}: not a number") from None
        if not lo <= v <= hi:
            raise ValueError(f"{label}: must be between {lo} and {hi}")
        out[key] = v
    return out


def parse_breakers(text) -> list[str]:
    """DRY's sequence breakers as the form shows them: a JSON list of strings (`["\\n", ":"]`)."""
    if isinstance(text, list):
        text = json.dumps(text)
    try:
        value = json.loads(str(text).strip() or "[]")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(b, str) and b for b in value):
        raise ValueError('DRY breakers: a JSON list of strings, e.g. ["\\n", ":", "\\"", "*"]')
    return value


def kv_disk_line(d: dict) -> str:
    budget = d.get("budget")
    cap = f" of {fmt_size(budget, ('GiB',))}" if budget else ""
    return f"{d.get('files', 0)} conversations, {fmt_size(d.get('bytes', 0), ('MiB',))}{cap}"


class SettingsScreen(ModalScreen["SettingsResult | None"]):
    BINDINGS = [("escape", "dismiss(None)", "Cancel"), ("ctrl+s", "save", "Save")]

    def __init__(self, settings: dict, engine: dict, kv_check: Optional[dict] = None,
                 kv_disk: Optional[dict] = None, clear_kv_disk: Optional[Callable[[], Optional[dict]]] = None,
                 mode: str = "") -> None:
        super().__init__()
        self.mode = mode  # "text continuation (base model: why)" or "" for a chat model
        self.kv_disk = kv_disk  # conversations' KV files: files, bytes, budget (None: off)
        self.clear_kv_disk = clear_kv_disk
        self.settings = {**DEFAULT_SETTINGS, **settings}
        self.engine = engine  # kv_cache_dtype, gpu_memory_budget, spec_draft_model
        self.kv_check = kv_check  # this model's kv-check figures (engine/bench/kv_quality.py), once measured

    def compose(self) -> ComposeResult:
        s = self.settings
        with VerticalScroll(classes="dialog settings"):
            yield Label("This conversation", classes="heading")
            if self.mode:
                yield Static(f"Mode: {self.mode}", id="mode", markup=False)
            yield Label("System prompt")
            yield TextArea(s["system"], id="system", soft_wrap=True)
            with Grid(classes="numbers"):
                for key, (label, *_rest) in NUMBERS.items():
                    yield Label(label)
                    yield Input(str(s[key]), id=key, compact=True)
                yield Label("DRY breakers")
                yield Input(json.dumps(list(s["dry_sequence_breakers"])), id="dry_sequence_breakers", compact=True)
                yield Label("Stop at a blank line")
                yield Switch(bool(s["stop_at_blank_line"]), id="stop_at_blank_line")
                yield Label("Thinking (Gemma-4)")
                yield Switch(bool(s["thinking"]), id="thinking")
                yield Label("Image tokens")
                yield Select([(str(b), b) for b in IMAGE_BUDGETS], allow_blank=False, compact=True,
                             value=int(s["image_tokens"]) if int(s["image_tokens"]) in IMAGE_BUDGETS else 280,
                             id="image_tokens")
                yield Label("Tool choice")
                yield Select([(c, c) for c in TOOL_CHOICES], allow_blank=False, compact=True, id="tool_choice",
                             value=s["tool_choice"] if s["tool_choice"] in TOOL_CHOICES else "auto")
            yield Label("Engine (applied by reloading the model)", classes="heading")
            with Grid(classes="numbers"):
                yield Label("KV cache format")
                yield Select([(f, f) for f in KV_FORMATS], value=self.engine.get("kv_cache_dtype") or "auto",
                             allow_blank=False, id="kv_cache_dtype", compact=True)
                if self.kv_check:  # measured by the palette's "Measure KV formats" or `edgegem kv-check`
                    yield Label("KV format cost")
                    yield Static("\n".join(figure_lines(self.kv_check)), id="kv-figures", markup=False)
                if self.kv_disk is not None:
                    yield Label("KV on disk")
                    with Horizontal(classes="kv-disk"):
                        yield Static(kv_disk_line(self.kv_disk), id="kv-disk", markup=False)
                        yield Button("Clear", id="clear-kv", compact=True)
                yield Label("Memory budget")
                yield Input(self.engine.get("gpu_memory_budget") or "", placeholder="default, or e.g. 8GiB",
                            id="gpu_memory_budget", compact=True)
                yield Label("Draft model")
                yield Input(self.engine.get("spec_draft_model") or "", placeholder="assistant GGUF path or name",
                            id="spec_draft_model", compact=True)
            yield Static("", id="settings-error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "clear-kv":
            if self.clear_kv_disk is not None:
                self.kv_disk = self.clear_kv_disk() or self.kv_disk
                self.query_one("#kv-disk", Static).update(kv_disk_line(self.kv_disk))
            return
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_save(self) -> None:
        raw = {key: self.query_one(f"#{key}", Input).value for key in NUMBERS}
        raw["system"] = self.query_one("#system", TextArea).text
        raw["thinking"] = self.query_one("#thinking", Switch).value
        raw["stop_at_blank_line"] = self.query_one("#stop_at_blank_line", Switch).value
        raw["dry_sequence_breakers"] = self.query_one("#dry_sequence_breakers", Input).value
        raw["image_tokens"] = self.query_one("#image_tokens", Select).value
        raw["tool_choice"] = self.query_one("#tool_choice", Select).value
        try:
            conv = parse_settings(raw)
        except ValueError as e:
            self.query_one("#settings-error", Static).update(str(e))
            return
        engine = {"kv_cache_dtype": self.query_one("#kv_cache_dtype", Select).value,
                  "gpu_memory_budget": self.query_one("#gpu_memory_budget", Input).value.strip() or None,
                  "spec_draft_model": self.query_one("#spec_draft_model", Input).value.strip() or None}
        now = {"kv_cache_dtype": self.engine.get("kv_cache_dtype") or "auto",
               "gpu_memory_budget": self.engine.get("gpu_memory_budget") or None,
               "spec_draft_model": self.engine.get("spec_draft_model") or None}
        changed = {k: v for k, v in engine.items() if v != now[k]}
        self.dismiss(SettingsResult(conv, changed or None))
