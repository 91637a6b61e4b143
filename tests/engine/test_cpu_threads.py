"""The CPU runtime's default thread count: $OMP_NUM_THREADS where it is a positive count (torch's
own pool follows it; the test runner's workers set it), else the physical cores."""
from __future__ import annotations

import pytest

from engine import cpu_runtime


@pytest.mark.parametrize("value, expected", [("3", 3), ("1", 1), ("5,2", 5)])
def test_omp_num_threads_sets_the_default(monkeypatch, value, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert cpu_runtime.default_threads() == expected


@pytest.mark.parametrize("value", [None, "", "0", "-2", "many"])
def test_without_a_positive_count_the_default_is_the_physical_cores(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    monkeypatch.setattr(cpu_runtime, "physical_cores", lambda: 7)
    assert cpu_runtime.default_threads() == 7


def test_set_threads_without_a_count_takes_the_default(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        assert cpu_runtime.set_threads(None) == 1 == torch.get_num_threads() == cpu_runtime.threads()
    finally:
        cpu_runtime.set_threads(before)
