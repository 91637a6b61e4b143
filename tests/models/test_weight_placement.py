"""`--embed-weights host`: embedding lookup tables stay in host memory, everything else (and a tied
LM head) goes to the device. Checked with torch's `meta` device standing in for a GPU."""
from __future__ import annotations

import torch

from models.gemma4 import Gemma4Config, tensor_plan
from models.gguf import GGUFFile
from models.formats import QuantWeight
from models.weights import load_weights, weight_tensors
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4


def test_host_embeddings_placement(tmp_path):
    q4 = quantize_gguf(write_tiny_gemma4(tmp_path / "f.gguf", TinySpec(), seed=2), tmp_path / "q.gguf")
    f = GGUFFile(q4)
    plan = tensor_plan(Gemma4Config.from_gguf(f), set(f.tensors))

    def where(w):
        return weight_tensors(w)[0].device.type

    for quantized in (False, True):
        w = load_weights(f, plan, device="meta", quantized=quantized, host_embeddings=True)
        assert where(w["per_layer_token_embd.weight"]) == "cpu"
        assert where(w["token_embd.host"]) == "cpu"  # lookups
        assert where(w["token_embd.weight"]) == "meta"  # the tied LM head stays on the device
        q = w["blk.0.attn_qkv.weight" if quantized else "blk.0.attn_q.weight"]  # GGUF q/k/v stacked at load
        assert where(q) == "meta" and where(w["output_norm.weight"]) == "meta"
        dev = load_weights(f, plan, device="meta", quantized=quantized, host_embeddings=False)
        assert "token_embd.host" not in dev and where(dev["per_layer_token_embd.weight"]) == "meta"
    # a tied head in quantized form serves both the kernel matmul and row lookups
    w = load_weights(f, plan, quantized=True)
    assert isinstance(w["token_embd.weight"], QuantWeight)
    rows = w["token_embd.weight"].rows(torch.tensor([3, 7, 3]))
    dense = f.load("token_embd.weight")
    assert torch.equal(rows, dense[[3, 7, 3]])
