"""The hot-expert cache's grouped GEMV (kernels/triton/qgrouped.py) against its torch reference and
the float64 product of models/quant.py's dequantization, on every GGUF type the kernel reads, odd
row counts (a tail program), one and two K steps (and a partial step of 32-value blocks), pairs
repeating and skipping slots, and bad inputs refused in one line."""
from __future__ import annotations

from triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch

from kernels.triton.qgrouped import grouped_gemv, grouped_gemv_ref
from models.quant import GGMLType, dequantize, row_bytes
from test_kernels_qmatmul import TYPES, _shapes, assert_close_bound, random_weight


def _stack(t, n_out: int, n_in: int, slots: int) -> torch.Tensor:
    return torch.stack([random_weight(t, n_out, n_in, seed=int(t) * 10 + s) for s in range(slots)])


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("step", [0, 1], ids=["one-step", "two-steps"])
def test_grouped_gemv_matches_ref_and_float64(t, step):
    n_out, n_in = _shapes(t)[step]
    w = _stack(t, n_out, n_in, 3)
    slots = torch.tensor([2, 0, 2, 1, 2], dtype=torch.int32)  # slot 2 thrice, every slot used
    x = torch.randn(5, n_in, generator=torch.Generator().manual_seed(3)) * 0.1
    Ws = [dequantize(w[s], t, (n_out, n_in)).double() for s in range(3)]
    want = torch.stack([x[p].double() @ Ws[int(s)].T for p, s in enumerate(slots)])
    bound = torch.stack([x[p].double().abs() @ Ws[int(s)].abs().T for p, s in enumerate(slots)])
    got = grouped_gemv(x.to(DEVICE), w.to(DEVICE), t, slots.to(DEVICE), n_in).cpu()
    assert got.dtype == torch.float32 and got.shape == (5, n_out)
    assert_close_bound(got, want, bound, 1e-5, f"{t.name} kernel vs float64")
    assert_close_bound(grouped_gemv_ref(x, w, t, slots, n_in), want, bound, 1e-5, f"{t.name} ref vs float64")


def test_no_pairs_give_an_empty_result():
    w = _stack(GGMLType.Q8_0, 7, 64, 2)
    y = grouped_gemv(torch.zeros(0, 64).to(DEVICE), w.to(DEVICE), GGMLType.Q8_0,
                     torch.zeros(0, dtype=torch.int64).to(DEVICE), 64)
    assert y.shape == (0, 7)


def test_bad_inputs_are_refused_in_one_line():
    t, n_in = GGMLType.Q4_K, 256
    w = _stack(t, 5, n_in, 2).to(DEVICE)
    x = torch.zeros(3, n_in).to(DEVICE)
    s = torch.zeros(3, dtype=torch.int32).to(DEVICE)
    cases = [((x, w, GGMLType.F16, s, n_in), "has no kernel"), ((x, w, t, s, 100), "multiple of the Q4_K block"),
             ((x, w[:, :, :-1].contiguous(), t, s, n_in), f"uint8 [S, N, {row_bytes(t, n_in)}]"),
             ((x[:, :128], w, t, s, n_in), "x must be float [P, 256]"),
             ((x, w, t, s[:2], n_in), "slots must be int [P=3]"),
             ((x, w, t, s.float(), n_in), "slots must be int")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")) as e:
            grouped_gemv(*args)
        assert "\n" not in str(e.value)
