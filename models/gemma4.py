"""Gemma 4 text models (E2B, E4B, 26B-A4B MoE, 31B dense) in plain torch.

Spec: shared/design/gemma4-architecture.md §1-3. Weights are kept under their GGUF names
(`blk.3.attn_q.weight`); the HF safetensors loader renames into them (`HF_NAMES` below).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from .decoder import DecoderModel, Trace
from .gemma4_ggml import fused_moe_ffn
from .host_experts import check_host_banks, expert_ffn, host_moe_ffn, layer_banks
from .host_layers import HostLayers, check_cpu_layers, host_plan, layer_of, load_host_layers, whole_layers
from .image_attention import image_last_key
from .kv_cache import KVStore
from .metadata import ConfigError, metadata_reader, vocab_size_of
from .ops import (add_rms_norm, attend, attention_prologue, attn_residual, embedding_rows, ffn_residual, gated_mlp,
                  head_logits, kernel_path, linear, linear_gelu_mul, quant_rows_to_device, quantized_table,
                  rms_norm, rope_dtype, rope_inv_freq, rows_to_device, scaled_add_rms_norm)
from .token_graph import fused_decode_step
from .weights import load_weights, progress_parts


def _per_layer(value: Any, n_layer: int, what: str) -> tuple[int, ...]:
    """A GGUF/HF value that is either a scalar or a per-layer array."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (int(value),) * n_layer
    vals = tuple(int(v) for v in value)
    if len(vals) != n_layer:
        raise ConfigError(f"{what} has {len(vals)} entries for {n_layer} layers")
    return vals


def check_layer_arrays(cfg, who: str = "") -> None:
    """Per-layer arrays of a Gemma-4 (or assistant) config: one entry a layer, whole KV groups,
    rope within the head. `who` prefixes the one-line error ("assistant ")."""
    L = cfg.n_layer
    for name in ("n_head", "n_kv_head", "head_dim", "is_sliding", "ffn_width", "rope_base", "rope_dims"):
        if len(getattr(cfg, name)) != L:
            raise ConfigError(f"{who}{name} has {len(getattr(cfg, name))} entries for {L} layers")
    for i in range(L):
        if cfg.n_kv_head[i] <= 0 or cfg.n_head[i] % cfg.n_kv_head[i]:
            raise ConfigError(f"{who}layer {i}: {cfg.n_head[i]} query heads over {cfg.n_kv_head[i]} KV heads")
        if cfg.rope_dims[i] % 2 or not 0 <= cfg.rope_dims[i] <= cfg.head_dim[i]:
            raise ConfigError(f"{who}layer {i}: rope dims {cfg.rope_dims[i]} for head dim {cfg.head_dim[i]}")


def kv_sharing_plan(is_sliding: Sequence[bool], n_kv_shared: int) -> tuple[tuple[int, int], ...]:
    """(layer, source) for every KV-shared layer: the last non-shared layer of the same type (§1.3)."""
    n_layer = len(is_sliding)
    first = n_layer - n_kv_shared
    if not 0 <= first <= n_layer:
        raise ConfigError(f"{n_kv_shared} KV-shared layers in a {n_layer}-layer model")
    plan = []
    for i in range(first, n_layer):
        src = next((j for j in range(first - 1, -1, -1) if is_sliding[j] == is_sliding[i]), None)
        if src is None:
            kind = "sliding" if is_sliding[i] else "full"
            raise ConfigError(
                f"KV-shared layer {i} ({kind}) has no earlier non-shared {kind} layer to read KV from")
        plan.append((i, src))
    return tuple(plan)


# The only per-layer overrides Gemma-4's transformers attention reads (`config.per_layer_config[i]`).
HF_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")


def hf_attention_shapes(c: Mapping[str, Any], is_sliding: Sequence[bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(head_dim, n_kv_head) per layer from an HF text config in either form (spec §2.8, end).

    Current transformers (5.x) writes the global `head_dim` / `num_key_value_heads` (the sliding
    layers' values) plus `per_layer_config`: {"03": {"head_dim": 512}, ...}, keys zero-padded layer
    indices, each holding only the values that differ from the global ones (full layers' head dim;
    their KV heads too when `attention_k_eq_v`). Older ones wrote `global_head_dim` (transformers'
    default 512 when the key is absent) and `num_global_key_value_heads` (used only with
    `attention_k_eq_v`); transformers turns those into the same overrides on load.
    """
    L = len(is_sliding)
    hd = int(c.get("head_dim") or 256)
    n_kv = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    if "per_layer_config" in c:
        overrides: dict[int, Mapping[str, Any]] = {}
        for key, layer in (c["per_layer_config"] or {}).items():
            try:
                i = int(key)
            except ValueError:
                raise ConfigError(f"per_layer_config key {key!r} is not a layer index") from None
            if not 0 <= i < L:
                raise ConfigError(f"per_layer_config names layer {i} of a {L}-layer model")
            unknown = sorted(set(layer) - set(HF_LAYER_OVERRIDES))
            if unknown:  # an override we do not apply would load a different model than transformers
                raise ConfigError(f"per_layer_config layer {i}: unsupported override {', '.join(unknown)}")
            overrides[i] = layer
    else:
        hd_full = c.get("global_head_dim", 512)
        full: dict[str, Any] = {"head_dim": hd_full if hd_full is not None else hd}
        if c.get("attention_k_eq_v") and c.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = c["num_global_key_value_heads"]
        overrides = {i: full for i, s in enumerate(is_sliding) if not s}
    head_dim = tuple(int(overrides.get(i, {}).get("head_dim") or hd) for i in range(L))
    n_kv_head = tuple(int(overrides.get(i, {}).get("num_key_value_heads") or n_kv) for i in range(L))
    return head_dim, n_kv_head


@dataclass(frozen=True)
class Gemma4Config:
    n_layer: int
    d_model: int
    vocab_size: int
    n_head: tuple[int, ...]
    n_kv_head: tuple[int, ...]
    head_dim: tuple[int, ...]
    is_sliding: tuple[bool, ...]
    sliding_window: int
    ffn_width: tuple[int, ...]
    rope_base: tuple[float, ...]
    rope_dims: tuple[int, ...]
    full_rope_freq_factors: Optional[tuple[float, ...]]  # proportional RoPE on full layers (§2.6)
    rms_eps: float = 1e-6
    final_softcap: Optional[float] = None
    ple_width: int = 0
    n_kv_shared: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn_width: int = 0
    context_length: int = 131072
    # 26B/31B: image tokens attend both ways inside their image on sliding layers (image_attention.py)
    image_bidirectional: bool = False
    # Derived in __post_init__: the one list attention and the KV pool both read.
    kv_shared_layers: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self):
        check_layer_arrays(self)
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ConfigError(f"{self.n_expert_used} experts used of {self.n_expert}")
        object.__setattr__(self, "kv_shared_layers", kv_sharing_plan(self.is_sliding, self.n_kv_shared))

    # --- derived facts ---------------------------------------------------------------------
    @property
    def first_shared(self) -> int:
        return self.n_layer - self.n_kv_shared

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends over (itself unless KV-shared)."""
        return dict(self.kv_shared_layers).get(layer, layer)

    def has_kv(self, layer: int) -> bool:
        return layer < self.first_shared

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.is_sliding[layer] else None

    # --- constructors ----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gguf, arch: str = "gemma4") -> "Gemma4Config":
        """From a `models.gguf.GGUFFile` (metadata plus the small `rope_freqs` tensor), per §2.8."""
        key = metadata_reader(gguf, arch)

        L = key.layer_count()
        is_sliding = tuple(bool(b) for b in key.bools("attention.sliding_window_pattern"))
        if len(is_sliding) != L:
            raise ConfigError(f"sliding_window_pattern has {len(is_sliding)} entries for {L} layers")
        hd_f, hd_s = key.int("attention.key_length"), key.int("attention.key_length_swa")
        if key.int("attention.value_length", hd_f) != hd_f or key.int("attention.value_length_swa", hd_s) != hd_s:
            raise ConfigError("value_length must equal key_length (llama.cpp refuses otherwise)")
        n_head = _per_layer(key.int_or_ints("attention.head_count"), L, "head_count")
        rot_f, rot_s = key.int("rope.dimension_count", hd_f), key.int("rope.dimension_count_swa", hd_s)
        base_f, base_s = key.float("rope.freq_base", 10000.0), key.float("rope.freq_base_swa", 10000.0)
        factors = None
        if "rope_freqs.weight" in gguf:
            factors = tuple(float(v) for v in gguf.load("rope_freqs.weight").flatten().tolist())
        cap = key.float("final_logit_softcapping", None)
        return cls(
            n_layer=L,
            d_model=key.int("embedding_length"),
            vocab_size=vocab_size_of(gguf, key.int("vocab_size", 0)),
            n_head=n_head,
            n_kv_head=_per_layer(key.int_or_ints("attention.head_count_kv", n_head), L, "head_count_kv"),
            head_dim=tuple(hd_s if s else hd_f for s in is_sliding),
            is_sliding=is_sliding,
            sliding_window=key.int("attention.sliding_window"),
            ffn_width=_per_layer(key.int_or_ints("feed_forward_length"), L, "feed_forward_length"),
            rope_base=tuple(base_s if s else base_f for s in is_sliding),
            rope_dims=tuple(rot_s if s else rot_f for s in is_sliding),
            full_rope_freq_factors=factors,
            rms_eps=key.float("attention.layer_norm_rms_epsilon", 1e-6),
            final_softcap=cap or None,
            ple_width=key.int("embedding_length_per_layer_input", 0),
            n_kv_shared=key.int("attention.shared_kv_layers", 0),
            n_expert=key.int("expert_count", 0),
            n_expert_used=key.int("expert_used_count", 0),
            expert_ffn_width=_per_layer(key.int_or_ints("expert_feed_forward_length", 0), L, "expert_ffn")[0],
            context_length=key.int("context_length", 131072),
            # No GGUF key says it: llama.cpp turns it on unless n_embd is 1536/2560 (E2B/E4B); the
            # per-layer embeddings tell the same families apart here, tiny test models included.
            image_bidirectional=not key.int("embedding_length_per_layer_input", 0),
        )

    @classmethod
    def from_hf(cls, config_json: Mapping[str, Any]) -> "Gemma4Config":
        """From an HF `config.json` (multimodal wrapper with `text_config`, or a text-only one)."""
        c = config_json.get("text_config", config_json)
        L = int(c["num_hidden_layers"])
        types = c.get("layer_types") or [
            "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(L)]
        is_sliding = tuple(t == "sliding_attention" for t in types)
        head_dim, n_kv_head = hf_attention_shapes(c, is_sliding)
        full_dims = {hd for hd, s in zip(head_dim, is_sliding) if not s}
        if len(full_dims) > 1:  # one proportional-RoPE table serves every full layer
            raise ConfigError(f"full-attention layers differ in head dim {sorted(full_dims)}")
        hd_f = full_dims.pop() if full_dims else head_dim[0]
        n_shared = int(c.get("num_kv_shared_layers", 0) or 0)
        ff = int(c["intermediate_size"])
        ffn = tuple(ff * 2 if c.get("use_double_wide_mlp") and i >= L - n_shared else ff for i in range(L))
        rp = c.get("rope_parameters") or {}
        rs, rf = rp.get("sliding_attention", {}), rp.get("full_attention", {})
        factors = None
        if rf.get("rope_type") == "proportional":
            n_rot_pairs = int(float(rf.get("partial_rotary_factor", 1.0)) * hd_f / 2)
            factors = tuple(1.0 if j < n_rot_pairs else 1e30 for j in range(hd_f // 2))
        moe = bool(c.get("enable_moe_block"))
        bidir = c.get("use_bidirectional_attention")
        if bidir not in (None, "vision"):  # "all": an encoder (transformers' is_causal False), not a chat model
            raise ConfigError(f"use_bidirectional_attention {bidir!r} is not supported (null or \"vision\")")
        return cls(
            n_layer=L,
            d_model=int(c["hidden_size"]),
            vocab_size=int(c.get("vocab_size", 262144)),
            n_head=(int(c["num_attention_heads"]),) * L,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            is_sliding=is_sliding,
            sliding_window=int(c.get("sliding_window", 512)),
            ffn_width=ffn,
            rope_base=tuple(float(rs.get("rope_theta", 10000.0)) if s else float(rf.get("rope_theta", 1e6))
                            for s in is_sliding),
            rope_dims=head_dim,
            full_rope_freq_factors=factors,
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            final_softcap=float(c["final_logit_softcapping"]) if c.get("final_logit_softcapping") else None,
            ple_width=int(c.get("hidden_size_per_layer_input", 0) or 0),
            n_kv_shared=n_shared,
            n_expert=int(c.get("num_experts", 0) or 0) if moe else 0,
            n_expert_used=int(c.get("top_k_experts", 0) or 0) if moe else 0,
            expert_ffn_width=int(c.get("moe_intermediate_size", 0) or 0) if moe else 0,
            context_length=int(c.get("max_position_embeddings", 131072)),
            image_bidirectional=bidir == "vision",
        )


# HF safetensors name (after the `model.language_model.` / `model.` prefix) -> GGUF name.
HF_GLOBAL_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}


@dataclass
class MediaRows:
    """Image and audio soft tokens of one forward: `rows` [n, d] (embed_vision / embed_audio
    output, in prompt order) fill the positions where `mask` [T] bool is set; `pad_id` is the PLE
    row those positions read. Both kinds follow the same rules (vision spec §4.2-4.3, audio §5).
    `image` [T] bool: which of them are image soft tokens (None: none), the runs that attend both
    ways inside their image on 26B/31B (models/image_attention.py)."""
    mask: torch.Tensor
    rows: torch.Tensor
    pad_id: int = 0
    image: Optional[torch.Tensor] = None

    def __post_init__(self):
        n = int(self.mask.sum())
        if n != self.rows.shape[0]:
            raise ValueError(f"{n} media positions for {self.rows.shape[0]} media rows")


ImageRows = MediaRows  # the name from when images were the only media


def tensor_plan(cfg: Gemma4Config, present: set[str]) -> dict[str, Optional[tuple[int, ...]]]:
    """GGUF tensor name -> expected torch shape (None: any) of every tensor the model reads.

    Optional tensors (attn_v, output, layer_output_scale, rope_freqs) appear only when `present`.
    K/V weights of KV-shared layers are never read, even if the file has them.
    """
    d, P, L = cfg.d_model, cfg.ple_width, cfg.n_layer
    plan: dict[str, Optional[tuple[int, ...]]] = {
        "token_embd.weight": (cfg.vocab_size, d),
        "output_norm.weight": (d,),
    }
    if "output.weight" in present:
        plan["output.weight"] = (cfg.vocab_size, d)
    if P:
        plan["per_layer_token_embd.weight"] = (cfg.vocab_size, L * P)
        plan["per_layer_model_proj.weight"] = (L * P, d)
        plan["per_layer_proj_norm.weight"] = (P,)
    for i in range(L):
        b, hd, nh, nkv = f"blk.{i}.", cfg.head_dim[i], cfg.n_head[i], cfg.n_kv_head[i]
        plan.update({
            b + "attn_norm.weight": (d,), b + "attn_q.weight": (nh * hd, d),
            b + "attn_q_norm.weight": (hd,), b + "attn_output.weight": (d, nh * hd),
            b + "post_attention_norm.weight": (d,), b + "ffn_norm.weight": (d,),
            b + "ffn_gate.weight": (cfg.ffn_width[i], d), b + "ffn_up.weight": (cfg.ffn_width[i], d),
            b + "ffn_down.weight": (d, cfg.ffn_width[i]), b + "post_ffw_norm.weight": (d,),
        })
        if cfg.has_kv(i):
            plan[b + "attn_k_norm.weight"] = (hd,)
            if b + "attn_qkv.weight" in present:  # fused by the converter: rows Q, K, V
                del plan[b + "attn_q.weight"]
                plan[b + "attn_qkv.weight"] = ((nh + 2 * nkv) * hd, d)
            else:
                plan[b + "attn_k.weight"] = (nkv * hd, d)
                if b + "attn_v.weight" in present:
                    plan[b + "attn_v.weight"] = (nkv * hd, d)
        if b + "layer_output_scale.weight" in present:
            plan[b + "layer_output_scale.weight"] = (1,)
        if P:
            plan.update({b + "inp_gate.weight": (P, d), b + "proj.weight": (d, P), b + "post_norm.weight": (d,)})
        if b + "ffn_gate_inp.weight" in present:  # MoE layer (26B-A4B)
            E, I = cfg.n_expert, cfg.expert_ffn_width
            plan.update({b + "ffn_gate_inp.weight": (E, d), b + "ffn_gate_inp.scale": (d,),
                         b + "pre_ffw_norm_2.weight": (d,), b + "post_ffw_norm_1.weight": (d,),
                         b + "post_ffw_norm_2.weight": (d,), b + "ffn_down_exps.weight": (E, d, I)})
            if b + "ffn_gate_up_exps.weight" in present:
                plan[b + "ffn_gate_up_exps.weight"] = (E, 2 * I, d)
            else:
                plan[b + "ffn_gate_exps.weight"] = (E, I, d)
                plan[b + "ffn_up_exps.weight"] = (E, I, d)
            if b + "ffn_down_exps.scale" in present:
                plan[b + "ffn_down_exps.scale"] = (E,)
    return plan


class Gemma4Model(DecoderModel):
    """The forward pass of §3 over a weight dict keyed by GGUF names.

    `forward` runs one sequence: tokens [T] at positions [T] against a KVStore. The engine calls the
    same pieces (`embed`, `layer`, `head`) to run only some layers or some rows (fast prefill).
    """

    host_expert_layers: frozenset = frozenset()  # MoE layers whose banks stay in host RAM (load_gemma4)
    host_layers: Optional[HostLayers] = None  # the first layers, whole, on the CPU beside a GPU (load_gemma4)

    def __init__(self, cfg: Gemma4Config, weights: Mapping[str, Any], dtype=torch.float32, device="cpu"):
        self.cfg, self.w, self.dtype, self.device = cfg, dict(weights), dtype, torch.device(device)
        self.head_w = self.w.get("output.weight", self.w["token_embd.weight"])
        # Per-layer inverse frequencies (one object per distinct set, so `rope` memoizes per type);
        # full layers carry the proportional-RoPE factors.
        freqs: dict = {}
        self.set_rope([
            freqs.setdefault((cfg.rope_dims[i], cfg.rope_base[i], cfg.is_sliding[i]), rope_inv_freq(
                cfg.rope_dims[i], cfg.rope_base[i], None if cfg.is_sliding[i] else cfg.full_rope_freq_factors))
            for i in range(cfg.n_layer)
        ])

    # --- pieces ----------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, media: Optional["MediaRows"] = None
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x0 = E[t]·√d  [T, d]; and the per-layer inputs pl [T, L, P] (§3.3) or None.
        `media`: image/audio soft-token rows that replace x0 at their positions."""
        cfg, w = self.cfg, self.w
        if media is None and self._quant_tables() is not None:
            return self._embed_kernels(tokens)
        # Media positions: the token part reads the <pad> row; media rows go in unscaled (only token
        # rows get √d), and the PLE context part reads the merged x0 (vision spec §4.3, audio §5).
        ids = tokens if media is None else tokens.masked_fill(media.mask.to(tokens.device), media.pad_id)
        x = rows_to_device(embedding_rows(w.get("token_embd.host", w["token_embd.weight"]), ids),
                           self.device, self.dtype) * math.sqrt(cfg.d_model)
        if media is not None:
            x[media.mask.to(x.device)] = media.rows.to(x.device, x.dtype)
        if not cfg.ple_width:
            return x, None
        T, L, P = tokens.shape[0], cfg.n_layer, cfg.ple_width
        tok = rows_to_device(embedding_rows(w["per_layer_token_embd.weight"], ids), self.device, self.dtype)
        tok = tok.reshape(T, L, P) * math.sqrt(P)
        ctx = linear(x, w["per_layer_model_proj.weight"]).reshape(T, L, P) * (cfg.d_model ** -0.5)
        ctx = rms_norm(ctx, w["per_layer_proj_norm.weight"], cfg.rms_eps)
        return x, (ctx + tok) * (2.0 ** -0.5)

    def _quant_tables(self) -> Optional[list]:
        """The lookup tables when the kernel path dequantizes their rows on the device, else None."""
        w = self.w
        tables = [w.get("token_embd.host", w["token_embd.weight"])]
        if self.cfg.ple_width:
            tables.append(w["per_layer_token_embd.weight"])
        ok = kernel_path(w["output_norm.weight"]) and all(map(quantized_table, tables))
        return tables if ok else None

    def _embed_kernels(self, tokens: torch.Tensor, out: tuple = (None, None)):
        """The kernel path of `embed`, into `out` buffers when given: the tables' quantized rows go to
        the device as they are and are dequantized there (ops.quant_rows_to_device); √d in one op;
        the per-layer inputs (rms_norm(ctx·d^-1/2) + tok·√P)·2^-1/2 in one fused pass."""
        cfg, w = self.cfg, self.w
        T, L, P = tokens.shape[0], cfg.n_layer, cfg.ple_width
        rows = quant_rows_to_device(self._quant_tables(), tokens, self.device, self.dtype)
        x = torch.mul(rows[0], math.sqrt(cfg.d_model), out=out[0])
        if not P:
            return x, None
        ctx = linear(x, w["per_layer_model_proj.weight"])  # [T, L*P]
        pl = scaled_add_rms_norm(rows[1].view(T * L, P), ctx.view(T * L, P), w["per_layer_proj_norm.weight"],
                                 cfg.rms_eps, math.sqrt(P), cfg.d_model ** -0.5, 2.0 ** -0.5,
                                 None if out[1] is None else out[1].view(T * L, P))
        return x, pl.view(T, L, P)

    def embed_into(self, tokens: torch.Tensor, x_out: torch.Tensor, pl_out: Optional[torch.Tensor]) -> None:
        if self._quant_tables() is not None:
            self._embed_kernels(tokens, (x_out, pl_out))
        else:
            super().embed_into(tokens, x_out, pl_out)

    def attention_limits(self, pos: torch.Tensor, media: Optional[MediaRows]) -> Optional[torch.Tensor]:
        """`last_key` [T] of a forward whose rows hold `media` when its images attend both ways
        (26B/31B: image_attention.py), else None (causal)."""
        if not self.cfg.image_bidirectional or media is None:
            return None
        return image_last_key(pos, media.image)

    def layer(self, i: int, x: torch.Tensor, pos: torch.Tensor, pl: Optional[torch.Tensor],
              cache: KVStore, trace: Trace = None, last_key: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decoder layer i (§3.4). x: [T, d]; pl: this layer's PLE slice [T, P] or None.
        `last_key` [T] (`attention_limits`): the sliding layers' image rows see their whole image.
        On the kernel path (ops.kernel_path) the same code runs fused kernels: the attention
        prologue in one launch, each residual update with the norm the next op needs."""
        cfg, w, b, eps = self.cfg, self.w, f"blk.{i}.", self.cfg.rms_eps
        hd, nh, nkv = cfg.head_dim[i], cfg.n_head[i], cfg.n_kv_head[i]
        a = self.pre_norm(x, w[b + "attn_norm.weight"])
        cos, sin = self.rope(i, pos, rope_dtype(x))
        # q/k norm + RoPE, v norm (no attn_v: V = raw K), K/V stored; KV-shared layers: q only
        q = attention_prologue(a, w, b, nh, nkv, hd, eps, cos, sin, cache, i, pos, has_kv=cfg.has_kv(i))
        o = attend(cache, i, cfg.kv_source(i), q, pos, cfg.window(i), scale=1.0,
                   last_key=last_key if cfg.is_sliding[i] else None)  # full layers stay causal (HF, llama.cpp)
        if trace:
            trace("attn_out", i, o)
        # The layer's last residual update also gives the next layer's attention norm (or the final norm).
        nxt = w[f"blk.{i + 1}.attn_norm.weight"] if i + 1 < cfg.n_layer else w["output_norm.weight"]
        scale = w.get(b + "layer_output_scale.weight")
        if b + "ffn_gate_inp.weight" not in w:  # dense: MLP, PLE injection (the gate reads the post-MLP residual)
            x, m = attn_residual(x, o, w[b + "attn_output.weight"], w[b + "post_attention_norm.weight"], eps,
                                 w[b + "ffn_norm.weight"])
            x, n = ffn_residual(x, rms_norm(x, w[b + "ffn_norm.weight"], eps) if m is None else m, w, b, eps, pl,
                                scale, nxt)
        else:
            x, _ = add_rms_norm(x, linear(o, w[b + "attn_output.weight"]), w[b + "post_attention_norm.weight"], eps)
            f = self._moe_ffn(i, x)
            if pl is not None:
                x, _ = add_rms_norm(x, f, w[b + "post_ffw_norm.weight"], eps)
                g = linear_gelu_mul(x, w[b + "inp_gate.weight"], pl)
                x, n = add_rms_norm(x, linear(g, w[b + "proj.weight"]), w[b + "post_norm.weight"], eps, scale, nxt)
            else:
                x, n = add_rms_norm(x, f, w[b + "post_ffw_norm.weight"], eps, scale, nxt)
        self.keep_norm(x, nxt, n)
        if trace:
            trace("l_out", i, x)
        return x

    def _mlp(self, i: int, m: torch.Tensor) -> torch.Tensor:
        return gated_mlp(m, self.w, f"blk.{i}.")

    def _moe_ffn(self, i: int, r: torch.Tensor) -> torch.Tensor:
        """26B-A4B block (§3.8): dense MLP + top-k of E experts, both reading the residual r [T, d].
        Torch (the reference, the cpu_torch and GPU runtimes): a loop over the chosen experts, each
        bank[e] dequantized from the file's bytes for its product (models/formats/experts.py)."""
        f = fused_moe_ffn(self, i, r)  # the ggml runtime: the whole block as one graph (gemma4_ggml.py)
        if f is not None:
            return f
        if i in self.host_expert_layers:  # banks in host RAM beside a GPU: the experts on the CPU
            return host_moe_ffn(self, i, r)
        cfg, w, b, eps = self.cfg, self.w, f"blk.{i}.", self.cfg.rms_eps
        h1 = rms_norm(self._mlp(i, rms_norm(r, w[b + "ffn_norm.weight"], eps)), w[b + "post_ffw_norm_1.weight"], eps)
        u = rms_norm(r, None, eps) * (cfg.d_model ** -0.5) * w[b + "ffn_gate_inp.scale"].to(r.dtype)
        probs = torch.softmax(linear(u, w[b + "ffn_gate_inp.weight"]), dim=-1)  # [T, E]
        top_p, top_e = probs.topk(cfg.n_expert_used, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        if b + "ffn_down_exps.scale" in w:
            top_p = top_p * w[b + "ffn_down_exps.scale"].to(r.dtype)[top_e]
        z = rms_norm(r, w[b + "pre_ffw_norm_2.weight"], eps)
        h2 = torch.zeros_like(r)
        I = cfg.expert_ffn_width
        banks = layer_banks(w, b)
        for e in top_e.unique().tolist():
            rows, slot = (top_e == e).nonzero(as_tuple=True)
            out = expert_ffn([bank[e] for bank in banks], z[rows], I)
            h2.index_add_(0, rows, out * top_p[rows, slot, None])
        return h1 + rms_norm(h2, w[b + "post_ffw_norm_2.weight"], eps)

    def decode_step(self, x: torch.Tensor, pos: torch.Tensor, caches: list, pl: Optional[torch.Tensor] = None
                    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """B embedded tokens x [B, d] at positions pos [B] (pl [B, L, P] their per-layer inputs),
        caches[b] row b's KV (one sequence a row, or one repeated for a verify's rows), through
        every layer, the final norm and the head as one ggml graph (models.token_graph) ->
        (logits [B, vocab], the last residual [B, d] for the caller's finite check, the final
        norm's rows [B, d]), or None where it does not apply (the layers then run one by one)."""
        return fused_decode_step(self, x, pl, pos, caches, True, 1.0)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Post-final-norm hidden state y (the LM-head input and the assistant's h)."""
        return self.pre_norm(x, self.w["output_norm.weight"])

    def head(self, y: torch.Tensor) -> torch.Tensor:
        """Logits (tied head + final softcap) for normed rows y [R, d] -> [R, V]."""
        return head_logits(y, self.head_w, self.cfg.final_softcap)


def load_gemma4(gguf, dtype=torch.float32, device="cpu", weight_dtype=None, quantized=False,
                host_embeddings=False, progress=None, cpu_quant=False, host_tensors=frozenset()) -> Gemma4Model:
    """Build a Gemma4Model from a `GGUFFile`: config, shape-checked dequantized weights.
    `host_tensors` (beside a GPU, the memory plan's placement): expert banks kept in host RAM and
    computed there (models/host_experts.py), and every tensor of whole layers, the first ones,
    loaded in the CPU runtime's form and run by the CPU (models/host_layers.py)."""
    gguf.check_architecture(("gemma4",))
    cfg = Gemma4Config.from_gguf(gguf)
    plan = tensor_plan(cfg, set(gguf.tensors))
    cpu_layers = whole_layers(plan, host_tensors)
    check_cpu_layers(cfg, cpu_layers)
    n = len(cpu_layers)
    on_host = host_plan(plan, n, cfg.n_layer) if n else {}
    device_plan = {k: v for k, v in plan.items() if layer_of(k) is None or layer_of(k) >= n}
    banks = frozenset(t for t in host_tensors if layer_of(t) is None or layer_of(t) >= n)
    parts = progress_parts(progress, gguf, [device_plan, on_host])
    weights = load_weights(gguf, device_plan, dtype, device, weight_dtype, quantized, host_embeddings, parts[0],
                           cpu_quant, banks)
    model = Gemma4Model(cfg, weights, dtype=dtype, device=device)
    model.host_expert_layers = frozenset(int(t.split(".")[1]) for t in banks)
    check_host_banks(model)
    if n:
        model.host_layers = load_host_layers(gguf, cfg, plan, on_host, n, model, parts[1])
    return model
