"""llama.cpp's MoE product (`ggml_mul_mat_id`, kernels/ggml/moe.py) over expert banks held as GGUF
bytes, and the bank format (models/formats/experts.py) that holds them.

mul_mat_id groups the (token, slot) pairs by expert and runs the weight type's vec_dot on each
expert's rows, the same kernel a plain mul_mat of that expert runs: so each output row equals
ggml's product of the expert's own byte slice bit for bit, and the float64 reference within the
activation-quantization bound of tests/kernels/test_ggml_products.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from test_ggml_products import error_bound, random_matrix

from kernels import ggml
from models.formats import ExpertBank

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "F16", "BF16", "F32")
ODD = {"K": 256, "0": 96, "F": 33}  # the smallest odd-ish row length each family allows


def _k(tn: str) -> int:
    return ODD["K"] if tn.endswith("_K") else ODD["0"] if tn[-2:] in ("_0", "_1") else ODD["F"]


def _bank(tn: str, E: int, n: int, k: int, seed: int = 0) -> ExpertBank:
    raw = random_matrix(tn, E * n, k, seed).contiguous().clone()  # [E*n, row bytes], 64-byte aligned
    return ExpertBank(raw, int(T[tn]), (E, n, k))


@pytest.mark.parametrize("tn", TYPES)
def test_one_expert_dequantizes_as_gguf_does_over_its_byte_slice(tn):
    from gguf.quants import dequantize

    E, n, k = 5, 7, _k(tn)
    bank = _bank(tn, E, n, k)
    assert bank.nbytes == bank.raw.untyped_storage().nbytes()  # only the bytes: no float copy
    for e in (0, 3, 4):
        one = bank[e]
        assert one.shape == (n, k) and one.raw.data_ptr() == bank.raw.data_ptr() + e * bank.raw.stride(0)
        want = dequantize(bank.raw[e].numpy(), T[tn]).reshape(n, k)
        assert np.array_equal(one.dense().numpy(), want.astype(np.float32))
        x = torch.randn(3, k, dtype=torch.float64)
        assert torch.equal(one.linear(x), x @ torch.from_numpy(want.astype(np.float64)).t())  # float64 stays exact


@pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")
@pytest.mark.parametrize("tn", TYPES)
@pytest.mark.parametrize("tokens,n_x", [(1, 1), (7, 1), (5, 3)])
def test_mul_mat_id_rows_are_each_experts_own_product(tn, tokens, n_x):
    E, n, k, n_used = 5, 24, _k(tn), 3
    bank = _bank(tn, E, n, k, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, n_x, k, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:n_used] for _ in range(tokens)]).int()
    y = ggml.mul_mat_id(bank.ggml_bank(), x, ids)  # [T, n_used, n]
    want = ggml.mul_mat_id_ref(bank.raw, bank.ggml_type, bank.shape, x, ids)
    for t in range(tokens):
        for j in range(n_used):
            e, xr = int(ids[t, j]), x[t, j % n_x][None]
            own = ggml.Matrix(bank.raw[e].reshape(n, -1), bank.ggml_type, (n, k), repack=False).mul(xr)
            assert torch.equal(y[t, j], own[0]), (t, j, e)
            bound = error_bound(bank.raw[e].reshape(n, -1), tn, (n, k), xr)[0]
            assert ((y[t, j].double() - want[t, j]).abs() <= bound * 1.01 + 1e-12).all(), (t, j)


@pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")
def test_bank_binds_the_bytes_without_a_copy():
    bank = _bank("Q4_K", 3, 16, 256)
    node = bank.ggml_bank()
    assert node.raw.data_ptr() == bank.raw.data_ptr() and node.nbytes == bank.nbytes
    with pytest.raises(ValueError):
        ggml.Bank(bank.raw.reshape(-1)[1:], bank.ggml_type, bank.shape)  # misaligned (and short)
