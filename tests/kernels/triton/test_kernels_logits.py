"""Logits leave the kernel path in float32 (issue 21 item 1): the quantized head's GEMV writes float32
and the final softcap reads it, for a bf16 model too. bf16 logits are 0.125 apart between 16 and 32
(Gemma's softcap is 30), which turned near-ties into greedy ties and moved probabilities by 6-13%
against llama.cpp and the CPU path. Checked under the interpreter against a float64 reference of the
same bf16 hidden state, at logits in that range, on the GEMV (1 row, a 3-row verify) and the
prefill path (20 rows), and through the engine (runner and batched decoder)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the kernel path needs triton")

from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import Engine, EngineConfig  # noqa: E402
from kernels.triton.launch import kernels_on_cpu  # noqa: E402
from kernels.triton.qpack import dequantize_packed_ref  # noqa: E402
from models.kv_cache import DenseKVCache  # noqa: E402
from models.loader import load_model  # noqa: E402
from test_kernels_model import SPEC  # noqa: E402
from tiny_models import quantize_gguf, write_tiny_gemma4  # noqa: E402


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("logits")
    q4 = quantize_gguf(write_tiny_gemma4(d / "f32.gguf", SPEC, seed=29), d / "q4.gguf")
    model = load_model(q4, dtype=torch.bfloat16, quantized=True).model
    assert model.head_w.packed is not None and model.cfg.final_softcap == 30.0
    return model


def _hidden(model, n: int) -> torch.Tensor:
    """The bf16 post-final-norm rows y [n, d] of n tokens, through the kernel path."""
    tokens = torch.tensor([2, 17, 99, 200, 5, 383, 64, 9, 1, 300, 41, 7][:n] + [11] * max(0, n - 12))
    with kernels_on_cpu():
        x, pl = model.embed(tokens)
        cache, pos = DenseKVCache(), torch.arange(n)
        for i in range(model.cfg.n_layer):
            x = model.layer(i, x, pos, None if pl is None else pl[:, i], cache)
        return model.norm(x)


@pytest.mark.parametrize("rows", [1, 3, 20], ids=["decode", "verify", "prefill"])
def test_bf16_model_gives_fp32_logits_of_its_bf16_hidden_state(bf16_model, rows):
    y = _hidden(bf16_model, rows)
    assert y.dtype == torch.bfloat16
    W = dequantize_packed_ref(bf16_model.head_w.packed).double()       # the head as the file holds it
    raw = y.double() @ W.T
    # Scale rows so the pre-cap logits reach +-60: softcapped values then fill 16..30, where bf16
    # steps are 0.125 (the row scale is exact in bf16: a power of two).
    scale = 2.0 ** round(float(torch.log2(60.0 / raw.abs().amax())))
    y = (y.float() * scale).to(torch.bfloat16)
    want = 30.0 * torch.tanh((y.double() @ W.T) / 30.0)
    assert want.abs().max() > 20.0
    with kernels_on_cpu():
        got = bf16_model.head(y)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs().max().item()
    # float32 accumulation over d = 256 values: ~1e-5 here; one bf16 rounding of a logit near 25
    # is up to 0.0625
    assert err < 2e-3, f"max |logit error| {err:.2e}"


def test_engine_samples_from_fp32_logits_of_a_bf16_model(bf16_model):
    """The runner (prefill's last row) and the batched decoder hand float32 logits to the sampler."""
    eng = Engine(bf16_model, None, EngineConfig(full_tokens=64, window_tokens=64, prefill_chunk=6,
                                                kv_cache_dtype="bf16", swa_kv_cache_dtype="bf16",
                                                attention_backend="triton", batched_decode=True))
    seen = []
    runner_forward, decoder_forward = eng.runner.forward, eng.decoder.forward

    def spy_runner(*a, **k):
        out = runner_forward(*a, **k)
        if out is not None:
            seen.append(("runner", out.dtype))
        return out

    def spy_decoder(*a, **k):
        out = decoder_forward(*a, **k)
        seen.append(("decoder", out[0].dtype))
        return out

    eng.runner.forward, eng.decoder.forward = spy_runner, spy_decoder
    with kernels_on_cpu():
        req = eng.add([2, 17, 99, 200, 5, 383, 64, 9], SamplingParams(max_tokens=3))
        eng.run_to_completion()
    assert len(req.output_ids) == 3
    assert seen == [("runner", torch.float32), ("decoder", torch.float32), ("decoder", torch.float32)], seen
