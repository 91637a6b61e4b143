"""Settings: this conversation's system prompt and sampling (saved with the conversation), and the
engine flags that need a model reload (KV format, memory budget, draft model; asked to confirm)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static, Switch, TextArea

from app.screens.kv_check import figure_lines

# Per-conversation defaults: llama.cpp-like chat sampling.
DEFAULT_SETTINGS = {"system": "", "temperature": 0.7, "top_p": 0.95, "top_k": 64, "min_p": 0.0,
                    "repetition_penalty": 1.0, "max_tokens": 1024, "thinking": False, "image_tokens": 280}
IMAGE_BUDGETS = (70, 140, 280, 560, 1120)  # soft tokens per image (engine.media); 280: 256 for a square
# name -> (label, type, lower bound, upper bound)
NUMBERS = {"temperature": ("Temperature", float, 0.0, 5.0), "top_p": ("Top-p", float, 0.0, 1.0),
           "top_k": ("Top-k (0: off)", int, 0, 1_000_000), "min_p": ("Min-p", float, 0.0, 1.0),
           "repetition_penalty": ("Repetition penalty", float, 0.1, 5.0),
           "max_tokens": ("Max tokens", int, 1, 1_000_000)}
KV_FORMATS = ["auto", "bf16", "fp16", "fp32", "int8_per_token_head", "fp8_per_token_head"]


@dataclass
class SettingsResult:
    conversation: dict  # the new per-conversation settings
    engine: Optional[dict]  # engine flags that changed (None: no reload)


def parse_settings(raw: dict) -> dict:
    """Validate the form's strings into typed settings; ValueError names the first bad field."""
    out = {"system": raw.get("system", ""), "thinking": bool(raw.get("thinking"))}
    if int(raw.get("image_tokens", DEFAULT_SETTINGS["image_tokens"])) not in IMAGE_BUDGETS:
        raise ValueError(f"Image tokens: one of {', '.join(map(str, IMAGE_BUDGETS))}")
    out["image_tokens"] = int(raw.get("image_tokens", DEFAULT_SETTINGS["image_tokens"]))
    for key, (label, typ, lo, hi) in NUMBERS.items():
        try:
            v = typ(str(raw[key]).strip())
        except (KeyError, ValueError):
            raise ValueError(f"{label}: not a number") from None
        if not lo <= v <= hi:
            raise ValueError(f"{label}: must be between {lo} and {hi}")
        out[key] = v
    return out


def kv_disk_line(d: dict) -> str:
    mib = d.get("bytes", 0) / 2**20
    budget = d.get("budget")
    cap = f" of {budget / 2**30:.1f} GiB" if budget else ""
    return f"{d.get('files', 0)} conversations, {mib:.1f} MiB{cap}"


class SettingsScreen(ModalScreen["SettingsResult | None"]):
    BINDINGS = [("escape", "dismiss(None)", "Cancel"), ("ctrl+s", "save", "Save")]

    def __init__(self, settings: dict, engine: dict, kv_check: Optional[dict] = None,
                 kv_disk: Optional[dict] = None, clear_kv_disk: Optional[Callable[[], Optional[dict]]] = None) -> None:
        super().__init__()
        self.kv_disk = kv_disk  # conversations' KV files: files, bytes, budget (None: off)
        self.clear_kv_disk = clear_kv_disk
        self.settings = {**DEFAULT_SETTINGS, **settings}
        self.engine = engine  # kv_cache_dtype, gpu_memory_budget, spec_draft_model
        self.kv_check = kv_check  # this model's kv-check figures (engine/bench/kv_quality.py), once measured

    def compose(self) -> ComposeResult:
        s = self.settings
        with VerticalScroll(classes="dialog settings"):
            yield Label("This conversation", classes="heading")
            yield Label("System prompt")
            yield TextArea(s["system"], id="system", soft_wrap=True)
            with Grid(classes="numbers"):
                for key, (label, *_rest) in NUMBERS.items():
                    yield Label(label)
                    yield Input(str(s[key]), id=key, compact=True)
                yield Label("Thinking (Gemma-4)")
                yield Switch(bool(s["thinking"]), id="thinking")
                yield Label("Image tokens")
                yield Select([(str(b), b) for b in IMAGE_BUDGETS], allow_blank=False, compact=True,
                             value=int(s["image_tokens"]) if int(s["image_tokens"]) in IMAGE_BUDGETS else 280,
                             id="image_tokens")
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
        raw["image_tokens"] = self.query_one("#image_tokens", Select).value
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
