"""Measure KV formats (kv-check, engine/bench/kv_quality.py) from the command palette: a modal with a
progress bar while a worker thread measures; the figures are cached and the settings screen shows
them next to the KV format choice.

Modal on purpose: the measurement runs on the loaded model's weights, so nothing else may use the
model meanwhile (no message can be sent while this screen is up). Escape or Cancel stops it at the
next chunk boundary; the screen closes once the worker has let go of the model.
"""
from __future__ import annotations

import threading
from typing import Optional

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, ProgressBar, Static

from app.messages import KVCheckDone, KVCheckProgress

SHORT = {"int8_per_token_head": "int8", "fp8_per_token_head": "fp8"}


def figure_lines(r: Optional[dict]) -> list[str]:
    """A line saying what was measured, then `int8: KLD 4.8e-03 mean, top-1 95.1%, 1560 B/tok` per
    format (B/tok: full-attention pool bytes per context token); narrow enough for the settings
    screen's value column (~48 cells)."""
    if not r:
        return []
    lines = [f"vs {r['reference']} KV on {r['device']}, {r['tokens']} tokens ({str(r.get('measured', '?'))[:10]})"]
    for name, f in r["formats"].items():
        lines.append(f"{SHORT.get(name, name)}: KLD {f['mean_kld']:.1e} mean, top-1 {f['top1_agreement']:.1%}, "
                     f"{f['bytes_per_token']} B/tok")
    lines += [f"{SHORT.get(name, name)}: not offered on this device" for name in r.get("skipped", {})]
    return lines


class KVCheckScreen(ModalScreen["dict | None"]):
    BINDINGS = [("escape", "cancel", "Cancel")]

    def __init__(self, backend, session, data_dir) -> None:
        super().__init__()
        self.backend, self.session, self.data_dir = backend, session, data_dir
        self.stop = threading.Event()
        self.result: Optional[dict] = None
        self.done = False  # the worker has ended (figures or an error shown): Escape closes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog kv-check"):
            yield Label("Measure KV formats (kv-check)", classes="heading")
            yield Static("Next-token KL divergence of each KV cache format against the reference format, "
                         "on a public-domain text longer than the sliding window, in 64-token chunks.",
                         markup=False)
            yield ProgressBar(total=1000, show_eta=False, id="kv-progress")
            yield Static("starting", id="kv-status", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="kv-close")

    def on_mount(self) -> None:
        self.run_worker(self._measure, thread=True, exclusive=True, group="kv-check", exit_on_error=False)

    def _measure(self) -> None:
        """Worker thread: never touches widgets; reports with post_message (thread-safe)."""
        try:
            r = self.backend.kv_check(self.session, self.data_dir,
                                      lambda frac, text: self.post_message(KVCheckProgress(frac, text)),
                                      self.stop.is_set)
        except Exception as e:  # noqa: BLE001 - cancelled, CUDA out of memory...: shown, not raised
            cancelled = self.stop.is_set()
            self.post_message(KVCheckDone(None, None if cancelled else (str(e).strip().splitlines() or
                                                                         [type(e).__name__])[0], cancelled))
        else:
            self.post_message(KVCheckDone(r))

    @on(KVCheckProgress)
    def show_progress(self, msg: KVCheckProgress) -> None:
        if not self.stop.is_set():
            self.query_one("#kv-progress", ProgressBar).update(progress=int(msg.fraction * 1000))
            self.query_one("#kv-status", Static).update(msg.text)

    @on(KVCheckDone)
    def finished(self, msg: KVCheckDone) -> None:
        if msg.cancelled:
            self.dismiss(None)
            return
        self.result, self.done = msg.result, True
        status = self.query_one("#kv-status", Static)
        if msg.error:
            status.update(f"kv-check failed: {msg.error}")
        else:
            status.update("\n".join(figure_lines(msg.result) + ["Saved: Settings (Ctrl+S) shows these figures."]))
        self.query_one("#kv-close", Button).label = "Close"

    def action_cancel(self) -> None:
        if self.done:
            self.dismiss(self.result)
        elif not self.stop.is_set():  # the worker stops at the next chunk and posts KVCheckDone
            self.stop.set()
            self.query_one("#kv-status", Static).update("stopping after this chunk…")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_cancel()
