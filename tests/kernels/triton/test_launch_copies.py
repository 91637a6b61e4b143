"""The launch recorder's copies between host and device (kernels/triton/launch.py): each copy
counted with its bytes in the destination's dtype, device -> host copies out of meta given
stand-in values, and one host wait per group of device -> host copies."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.triton.launch import record_launches  # noqa: E402


def test_copies_bytes_and_waits_on_meta():
    r = torch.empty(1, 7, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(1, 3, dtype=torch.int64, device="meta")
    host_r, host_ids = torch.empty(1, 7), torch.empty(1, 3, dtype=torch.int32)
    with record_launches() as rec:
        host_r.copy_(r)
        host_ids.copy_(ids)  # same group: one wait
        back = host_r.to("meta")
        r2 = back * 2  # a device op ends the group
        torch.empty(2, 5, device="meta").cpu()  # a second group
    assert rec.copies == [("to_host", 7 * 4), ("to_host", 3 * 4), ("to_device", 7 * 4), ("to_host", 10 * 4)]
    assert rec.host_waits == 2 and rec.host_copies == 1
    assert (rec.copy_count("to_host"), rec.copy_bytes("to_host")) == (3, 80)
    assert torch.equal(host_ids, torch.tensor([[0, 1, 2]], dtype=torch.int32))  # picks 0..k-1
    assert torch.allclose(host_r, torch.full((1, 7), 1 / 7))
    assert r2.device.type == "meta" and rec.torch_ops["mul"] == 1
