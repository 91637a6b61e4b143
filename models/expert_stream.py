"""Long prefill chunks of a host-experts layer on the GPU: the layer's expert banks streamed over
PCIe, double-buffered, instead of the CPU computing T rows x 8 experts.

The CPU's cost of a layer's experts grows with the chunk's rows; a bank's copy does not (26B-A4B:
272 MiB gate/up + 257 MiB down a layer, ~44 ms at 12 GB/s). From `STREAM_ROWS` rows on (llama.cpp
offloads host weights to the GPU for batches of 32 and more) the block's banks are copied into two
device buffers of the largest bank's size and multiplied there: while the GPU multiplies with one
bank, the copy stream fills the other with the next (gate/up -> down -> the next host layer's
gate/up), each use waiting for its own copy's event. Below the threshold (decode, short chunks)
the experts stay on the CPU (models/host_experts.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .formats import ExpertBank
from .ops import gelu_tanh

STREAM_ROWS = 32


class ExpertStream:
    """Two device buffers and the order of the banks to fill them with: `order` [(layer, bank
    index, ExpertBank in host memory)] over every host layer, gate/up (or gate, up) before down."""

    def __init__(self, banks: dict[int, list[ExpertBank]], device, rows: int = STREAM_ROWS):
        self.device, self.rows = torch.device(device), rows
        self.order = [(i, j, b) for i in sorted(banks) for j, b in enumerate(banks[i])]
        size = max((b.raw.numel() for _, _, b in self.order), default=0)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.held: list[Optional[int]] = [None, None]  # which position of `order` each buffer holds
        self.ready: list = [None, None]  # CUDA events of the buffers' last fills
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.copies = 0  # banks copied (tests, bench)
        self.last = 1  # the buffer read last

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def _fill(self, slot: int, pos: int) -> None:
        _, _, bank = self.order[pos]
        dst = self.buffers[slot][:bank.raw.numel()].view(bank.raw.shape)
        if self.stream is None:
            dst.copy_(bank.raw)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the buffer's last reader is done
            with torch.cuda.stream(self.stream):
                dst.copy_(bank.raw, non_blocking=True)
                self.ready[slot] = torch.cuda.Event()
                self.ready[slot].record(self.stream)
        self.held[slot] = pos
        self.copies += 1

    def bank(self, layer: int, j: int) -> ExpertBank:
        """Bank j of `layer` on the device (copied now if no prefetch brought it), and the next bank
        in `order` prefetched into the other buffer. The caller enqueues the bank's products before
        asking for the next one (the prefetch after that overwrites this buffer)."""
        pos = next(p for p, (i, jj, _) in enumerate(self.order) if i == layer and jj == j)
        if pos not in self.held:
            free = [k for k in (0, 1) if self.held[k] is None]
            self._fill(free[0] if free else 1 - self.last, pos)
        slot = self.last = self.held.index(pos)
        if self.ready[slot] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        host = self.order[pos][2]
        out = ExpertBank(self.buffers[slot][:host.raw.numel()].view(host.raw.shape), host.ggml_type, host.shape)
        nxt = (pos + 1) % len(self.order)
        if nxt not in self.held:
            self._fill(1 - slot, nxt)
        return out


def streamed_mix(stream: ExpertStream, layer: int, z: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
                 scale: Optional[torch.Tensor], I: int) -> torch.Tensor:
    """h2 [T, d] float32 = sum_k w * down(gelu_tanh(gate) * up) of the chosen experts, on the device
    from the streamed banks (z [T, d] the pre_2-normed residual, ids/wts [T, k]); each bank's
    products are enqueued before the next bank is asked for."""
    n_banks = sum(1 for i, _, _ in stream.order if i == layer)
    z = z.float()
    uniq = ids.unique().tolist()
    rows_of = {e: (ids == e).any(-1).nonzero(as_tuple=True)[0] for e in uniq}  # rows choosing e, ascending
    outs = []
    for j in range(n_banks - 1):  # gate/up, or gate then up
        bank = stream.bank(layer, j)
        outs.append({e: bank[e].linear(z[rows_of[e]]) for e in uniq})
    acts = {}
    for e in uniq:
        gate, up = (outs[0][e], outs[1][e]) if len(outs) == 2 else (outs[0][e][:, :I], outs[0][e][:, I:])
        acts[e] = gelu_tanh(gate) * up
    down = stream.bank(layer, n_banks - 1)
    h2 = torch.zeros_like(z)
    for e in uniq:
        y = down[e].linear(acts[e])  # [rows choosing e, d]
        rows, cols = (ids == e).nonzero(as_tuple=True)
        k_w = wts[rows, cols].float()
        if scale is not None:
            k_w = k_w * scale.to(z.device).float()[e]
        h2.index_add_(0, rows, y[torch.searchsorted(rows_of[e], rows)] * k_w[:, None])
    return h2
