"""The status panel: model, device, memory, KV pools, this conversation's context, speeds, draft.

It pulls `client.status()` (a dict copy the engine thread refreshes after every step) on a timer,
so generation never waits for the UI; `refresh_from` only formats.
"""
from __future__ import annotations

from typing import Optional

from textual.widgets import Static

from app.backend import kv_pools, size


def _bar(used: int, cap: int, width: int = 8) -> str:
    frac = 0.0 if cap <= 0 else min(used / cap, 1.0)
    n = round(frac * width)
    return "█" * n + "░" * (width - n)


class StatusPanel(Static):
    def __init__(self, **kw) -> None:
        super().__init__("", markup=False, **kw)
        self.lines: list[str] = []

    def refresh_from(self, info: dict, status: dict, context_tokens: int, last: Optional[dict],
                     pending: tuple[int, int] = (0, 0), server=None, tools: Optional[str] = None) -> None:
        """`pending`: (images and clips, soft tokens) attached to the message being written;
        `server`: the API server running in this process (app/server/run.BackgroundServer), if any;
        `tools`: app/tools/session.AppTools.summary() when this run has tools."""
        lines = [f"model   {info.get('model', '?')}", f"file    {info.get('file', '?')}",
                 f"device  {info.get('device', '?')}" + (f" · {info['runtime']}" if info.get("runtime") else "")]
        pools = kv_pools(status)
        kv_bytes = sum(p["capacity"] * p["unit_bytes"] for p in pools.values())
        kv_used = sum(p["used"] * p["unit_bytes"] for p in pools.values())
        mem = status.get("device_memory")
        if info.get("budget_bytes"):
            lines.append(f"budget  {size(info['budget_bytes'])}"
                         + (f", {size(mem['allocated'])} used" if mem else ""))
        lines.append(f"KV      {size(kv_used)} used of {size(kv_bytes)}")
        for name, p in pools.items():
            lines.append(f"  {name:<6} {_bar(p['used'], p['capacity'])} {p['used']}/{p['capacity']}")
            lines.append(f"         {p['format']}")
        limit = status.get("context_limit") or info.get("context_limit") or 0
        lines.append(f"context {_bar(context_tokens, limit)} {context_tokens}/{limit}")
        lines.append(f"cached  {status.get('cached_prefix_tokens', 0)} prefix tokens")
        if last:
            lines.append(f"prefill {last.get('prefill_tok_s', 0.0):.1f} tok/s ({last.get('prefilled_tokens', 0)} tokens)")
            lines.append(f"decode  {last.get('decode_tok_s', 0.0):.1f} tok/s ({last.get('output_tokens', 0)} tokens)")
            if last.get("restored_tokens"):
                lines.append(f"disk    restored {last['restored_tokens']} tokens from disk")
            elif last.get("kv_session_error"):
                lines.append("disk    KV file not used (prefilled)")
        # Whether the model takes images (a vision encoder is loaded), what they cost in context.
        lines.append("images  " + ("yes" if status.get("images") else "no (no vision encoder)"))
        if last and last.get("image_tokens"):
            lines.append(f"  last prompt {last['image_tokens']} image tokens")
        lines.append("audio   " + ("yes" if status.get("audio") else "no (no audio encoder)"))
        if last and last.get("audio_tokens"):
            lines.append(f"  last prompt {last['audio_tokens']} audio tokens")
        if pending[0]:
            lines.append(f"  attached {pending[0]}: {pending[1]} tokens")
        spec = status.get("speculative")
        if spec is None and info.get("arch") == "gemma4":
            lines.append("draft   off (no assistant model)")
        if spec:
            lines.append(f"draft   {100 * spec.get('acceptance_rate', 0.0):.0f}% accepted, "
                         f"{spec.get('tokens_per_target_forward', 0.0):.2f} tok/forward")
            if spec.get("draft", "").startswith("draft off"):  # the engine's own decision, one line
                lines.append(f"  {spec['draft']}")
        experts = status.get("host_experts")
        if experts:  # expert banks in host RAM beside the GPU (llama.cpp's --cpu-moe)
            lines.append(f"experts {experts['layers']} layers in host RAM, {size(experts.get('to_host', 0))} "
                         f"out, {size(experts.get('to_device', 0))} back")
            if "hit_rate" in experts:
                lines.append(f"  hot   {100 * experts['hit_rate']:.0f}% on the GPU, {experts['cache_slots']} slots a layer")
        layers = status.get("cpu_layers")
        if layers:  # whole first layers in host RAM beside the GPU (llama.cpp's --n-gpu-layers)
            per = layers["cpu_ms"] / layers["forwards"] if layers.get("forwards") else 0.0
            lines.append(f"layers  {layers['layers']} on the CPU ({layers['runtime']}), "
                         f"{size(layers.get('to_device', 0))} over")
            if layers.get("forwards"):
                lines.append(f"  cpu   {per:.1f} ms a forward")
        if tools is not None:
            lines.append(f"tools   {tools}")
        if status.get("running"):
            lines.append(f"running {status['running']}, waiting {status.get('waiting', 0)}")
        if server is not None:
            lines.append(f"serving {server.url}")
            lines.append(f"  API requests in flight {server.in_flight}")
        if lines != self.lines:
            self.lines = lines
            self.update("\n".join(lines))
