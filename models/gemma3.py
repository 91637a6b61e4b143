"""Gemma 3 text models in plain torch (the bundled demo model is Gemma 3 270M Q4_K_M).

Spec: shared/design/gemma4-architecture.md §8. Differences from Gemma 4: q scaled by
1/√query_pre_attn_scalar, V not normed, no PLE, no KV sharing, no layer scale, integer sliding
pattern (every 6th layer full) when the file has no array. GGUF norm weights already hold the +1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from .decoder import DecoderModel, Trace
from .gemma3_ggml import fused_decode_layer
from .kv_cache import KVStore
from .metadata import ConfigError, metadata_reader, vocab_size_of
from .ops import (
    attend,
    attention_prologue,
    attn_residual,
    embedding_rows,
    ffn_residual,
    kernel_path,
    quant_rows_to_device,
    quantized_table,
    rms_norm,
    rope_dtype,
    rope_inv_freq,
    rows_to_device,
    head_logits,
)
from .token_graph import fused_decode_step
from .weights import load_weights


@dataclass(frozen=True)
class Gemma3Config:
    n_layer: int
    d_model: int
    vocab_size: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn_width: int
    is_sliding: tuple[bool, ...]
    sliding_window: int
    rope_base_full: float
    rope_base_sliding: float
    rope_scale_full: float = 1.0  # linear rope scaling factor on full layers (positions / factor)
    query_scale: float = 1.0  # multiplies q: 1/√head_dim (1/√(d/n_head) on the 27B)
    rms_eps: float = 1e-6
    final_softcap: Optional[float] = None
    context_length: int = 32768

    def __post_init__(self):
        if len(self.is_sliding) != self.n_layer:
            raise ConfigError(f"sliding pattern has {len(self.is_sliding)} entries for {self.n_layer} layers")
        if self.n_kv_head <= 0 or self.n_head % self.n_kv_head:
            raise ConfigError(f"{self.n_head} query heads over {self.n_kv_head} KV heads")

    # The same two facts Gemma 4 exposes, so engine code can treat both families alike.
    kv_shared_layers: tuple = ()

    def has_kv(self, layer: int) -> bool:
        return True

    def kv_source(self, layer: int) -> int:
        return layer

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.is_sliding[layer] else None

    @classmethod
    def from_gguf(cls, gguf, arch: str = "gemma3") -> "Gemma3Config":
        key = metadata_reader(gguf, arch)

        L = key.layer_count()
        pattern = key.read("attention.sliding_window_pattern", ("bools", "int"), None)
        if pattern is not None and not isinstance(pattern, int):
            is_sliding = tuple(bool(b) for b in pattern)
        else:
            period = pattern or 6  # llama.cpp load_swa_pattern(ml, 6)
            is_sliding = tuple(i % period < period - 1 for i in range(L))
        window = key.int("attention.sliding_window", 0)
        if window <= 0:
            is_sliding = (False,) * L
        d, n_head = key.int("embedding_length"), key.int("attention.head_count")
        if n_head <= 0 or d < n_head:   # d // n_head below is a head size, under a square root
            raise ConfigError(f"embedding length {d} over {n_head} heads")
        hd = key.int("attention.key_length", d // n_head)
        if hd <= 0:
            raise ConfigError(f"key_length {hd} must be positive")
        scale = 1.0 / math.sqrt(d // n_head if L == 62 else hd)  # 27B: d/n_head (llama.cpp)
        linear_rope = key.str("rope.scaling.type", "none") == "linear"
        factor = (key.float("rope.scaling.factor", 1.0) or 1.0) if linear_rope else 1.0
        cap = key.float("final_logit_softcapping", None)
        return cls(
            n_layer=L, d_model=d,
            vocab_size=vocab_size_of(gguf, key.int("vocab_size", 0)),
            n_head=n_head, n_kv_head=key.int("attention.head_count_kv", n_head), head_dim=hd,
            ffn_width=key.int("feed_forward_length"), is_sliding=is_sliding, sliding_window=window,
            rope_base_full=key.float("rope.freq_base", 1e6),
            rope_base_sliding=key.float("rope.freq_base_swa", 10000.0),
            rope_scale_full=factor, query_scale=scale,
            rms_eps=key.float("attention.layer_norm_rms_epsilon", 1e-6),
            final_softcap=cap or None,
            context_length=key.int("context_length", 32768),
        )


def tensor_plan(cfg: Gemma3Config, present: set[str]) -> dict[str, tuple[int, ...]]:
    d, hd = cfg.d_model, cfg.head_dim
    plan = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if "output.weight" in present:
        plan["output.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        plan.update({
            b + "attn_norm.weight": (d,), b + "attn_q.weight": (cfg.n_head * hd, d),
            b + "attn_k.weight": (cfg.n_kv_head * hd, d), b + "attn_v.weight": (cfg.n_kv_head * hd, d),
            b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,),
            b + "attn_output.weight": (d, cfg.n_head * hd), b + "post_attention_norm.weight": (d,),
            b + "ffn_norm.weight": (d,), b + "ffn_gate.weight": (cfg.ffn_width, d),
            b + "ffn_up.weight": (cfg.ffn_width, d), b + "ffn_down.weight": (d, cfg.ffn_width),
            b + "post_ffw_norm.weight": (d,),
        })
    return plan


class Gemma3Model(DecoderModel):
    """Same interface as `Gemma4Model`: embed / layer / norm / head / forward."""

    def __init__(self, cfg: Gemma3Config, weights: Mapping[str, Any], dtype=torch.float32, device="cpu"):
        self.cfg, self.w, self.dtype, self.device = cfg, dict(weights), dtype, torch.device(device)
        self.head_w = self.w.get("output.weight", self.w["token_embd.weight"])
        inv_s = rope_inv_freq(cfg.head_dim, cfg.rope_base_sliding)
        inv_f = rope_inv_freq(cfg.head_dim, cfg.rope_base_full)
        self.set_rope([inv_s if s else inv_f for s in cfg.is_sliding],
                      [1.0 if s else 1.0 / cfg.rope_scale_full for s in cfg.is_sliding])

    def embed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, None]:
        table = self.w.get("token_embd.host", self.w["token_embd.weight"])
        if kernel_path(self.w["output_norm.weight"]) and quantized_table(table):
            x = quant_rows_to_device([table], tokens, self.device, self.dtype)[0]  # dequantized on the device
        else:
            x = rows_to_device(embedding_rows(table, tokens), self.device, self.dtype)
        return x * math.sqrt(self.cfg.d_model), None

    def layer(self, i: int, x: torch.Tensor, pos: torch.Tensor, pl: None, cache: KVStore,
              trace: Trace = None, last_key: None = None) -> torch.Tensor:
        """Decoder layer i; `last_key` is always None (no images here: causal throughout)."""
        cfg, w, b, eps = self.cfg, self.w, f"blk.{i}.", self.cfg.rms_eps
        hd = cfg.head_dim
        a = self.pre_norm(x, w[b + "attn_norm.weight"])
        cos, sin = self.rope(i, pos, rope_dtype(x))
        nxt = w[f"blk.{i + 1}.attn_norm.weight"] if i + 1 < cfg.n_layer else w["output_norm.weight"]
        if not trace:  # a decode token on llama.cpp's CPU kernels: the whole layer in one ggml graph
            fused = fused_decode_layer(x, a, w, b, cfg.n_head, cfg.n_kv_head, hd, eps, cos, sin, False, cache, i,
                                       cfg.window(i), cfg.query_scale, nxt)
            if fused is not None:
                self.keep_norm(fused[0], nxt, fused[1])
                return fused[0]
        # q/k norm + RoPE; v stays raw (Gemma 3 has no v norm); K/V stored
        q = attention_prologue(a, w, b, cfg.n_head, cfg.n_kv_head, hd, eps, cos, sin, cache, i, pos, v_norm=False)
        o = attend(cache, i, i, q, pos, cfg.window(i), scale=cfg.query_scale)
        x, m = attn_residual(x, o, w[b + "attn_output.weight"], w[b + "post_attention_norm.weight"], eps,
                             w[b + "ffn_norm.weight"])
        x, n = ffn_residual(x, rms_norm(x, w[b + "ffn_norm.weight"], eps) if m is None else m, w, b, eps,
                            next_weight=nxt)
        self.keep_norm(x, nxt, n)  # kernel path: the next layer's attention norm (or the final norm)
        if trace:
            trace("l_out", i, x)
        return x

    def decode_step(self, x: torch.Tensor, pos: torch.Tensor, caches: list, pl: None = None
                    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """B embedded tokens x [B, d] at positions pos [B], caches[b] row b's KV (one sequence a
        row, or one repeated for a verify's rows), through every layer, the final norm and the
        head as one ggml graph (models.token_graph) -> (logits [B, vocab], the last residual
        [B, d] for the caller's finite check, the final norm's rows [B, d]), or None where it
        does not apply (the layers then run one by one)."""
        return fused_decode_step(self, x, None, pos, caches, False, self.cfg.query_scale)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre_norm(x, self.w["output_norm.weight"])

    def head(self, y: torch.Tensor) -> torch.Tensor:
        return head_logits(y, self.head_w, self.cfg.final_softcap)


def load_gemma3(gguf, dtype=torch.float32, device="cpu", weight_dtype=None, quantized=False,
                host_embeddings=False, progress=None, cpu_quant=False) -> Gemma3Model:
    gguf.check_architecture(("gemma3",))
    cfg = Gemma3Config.from_gguf(gguf)
    weights = load_weights(gguf, tensor_plan(cfg, set(gguf.tensors)), dtype, device, weight_dtype, quantized,
                           host_embeddings, progress, cpu_quant)
    return Gemma3Model(cfg, weights, dtype=dtype, device=device)
