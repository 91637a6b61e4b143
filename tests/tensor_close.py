"""`assert_close`: the kernel tests' elementwise tolerance check, which names the worst elements
when it fails (a kernel bug shows as a pattern of indices, not one max error)."""
from __future__ import annotations

import pytest
import torch


def assert_close(got, want, atol: float, rtol: float, what: str, check_dtype: bool = True) -> None:
    """|got - want| <= atol + rtol |want| elementwise (NaN never passes); on failure list the worst
    elements. `check_dtype`: the two must also share a dtype."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if check_dtype:
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    g, w = got.double().cpu(), want.double().cpu()
    err = (g - w).abs()
    excess = err - (atol + rtol * w.abs())
    excess = torch.where(torch.isnan(err), torch.full_like(excess, float("inf")), excess)
    if bool((excess <= 0).all()):
        return
    order = excess.reshape(-1).argsort(descending=True)[:8]
    lines = []
    for flat in order.tolist():
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
        lines.append(f"  {idx}: got {g[idx].item():.6g} want {w[idx].item():.6g} |diff| {err[idx].item():.3g}")
    bad = int((~(excess <= 0)).sum())
    pytest.fail(f"{what}: {bad}/{g.numel()} elements beyond atol={atol} rtol={rtol}; worst:\n" + "\n".join(lines))
