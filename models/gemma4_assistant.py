"""The Gemma 4 assistant (MTP drafter) in plain torch: one draft step over the target's KV cache.

Spec: shared/design/gemma4-architecture.md §2.3, §2.7, §4. The assistant owns no KV: its sliding
layers attend over the K/V of the target's last KV-owning sliding layer and its full layer over the
target's last KV-owning full layer (E2B: 13 / 14). Its input embedding is the *target's*
`token_embd` (× √D_b); its own `token_embd` is only the tied LM head.

    cfg = Gemma4AssistantConfig.from_gguf(gguf); cfg.validate_against(target.cfg)
    asst = load_gemma4_assistant(gguf)
    logits, h_next, y = asst.draft_step(tokens, h, pos, target, kv_view)

`kv_view` is anything with `read(target_layer) -> (k [S, n_kv, hd], v, positions [S])` (a
`models.kv_cache.DenseKVCache` works as is); one view for every row, or a sequence of B views.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from .gemma4 import _per_layer
from .metadata import ConfigError, metadata_reader, vocab_size_of
from .ops import (
    apply_rope,
    cpu_chains,
    embedding_rows,
    gated_mlp,
    linear,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    rows_to_device,
)
from .runtime import Runtime, runtime_of_flags
from .weights import load_weights

ARCH = "gemma4-assistant"
CENTROIDS = "masked_embd_centroids.weight"
ORDERING = "masked_embd_ordering"


class KVView(Protocol):
    """Read-only access to the target's cached K/V of one sequence, by TARGET layer index."""

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k [S, n_kv, hd], v [S, n_kv, hd], positions [S]): already normed and roped."""
        ...


class ReadOnlyKV:
    """Wraps a cache (e.g. DenseKVCache) so the drafter can only `read` it."""

    __slots__ = ("_cache",)

    def __init__(self, cache) -> None:
        self._cache = cache

    def read(self, layer: int):
        return self._cache.read(layer)


@dataclass(frozen=True)
class Gemma4AssistantConfig:
    n_layer: int                 # draft layers (= nextn_predict_layers)
    d_model: int                 # d_a, the assistant's hidden size
    d_backbone: int              # D_b = embedding_length_out = the target's d_model
    vocab_size: int
    n_head: tuple[int, ...]
    n_kv_head: tuple[int, ...]   # = the target's (it reads the target's cache)
    head_dim: tuple[int, ...]
    is_sliding: tuple[bool, ...]
    sliding_window: int
    ffn_width: tuple[int, ...]
    rope_base: tuple[float, ...]
    rope_dims: tuple[int, ...]
    full_rope_freq_factors: Optional[tuple[float, ...]]
    rms_eps: float = 1e-6
    nextn_predict_layers: int = 0
    context_length: int = 131072
    n_centroids: int = 0         # 0: dense logits (llama.cpp-converted files have no centroids)
    centroid_top_k: int = 32

    def __post_init__(self):
        from .gemma4 import check_layer_arrays

        check_layer_arrays(self, "assistant ")
        if self.d_backbone == self.d_model:
            raise ConfigError("assistant embedding_length_out must carry the target hidden size "
                              f"(it equals embedding_length {self.d_model})")

    # --- constructors ----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gguf, arch: str = ARCH) -> "Gemma4AssistantConfig":
        """From a `GGUFFile` of arch `gemma4-assistant` (§2.3, §2.8)."""
        key = metadata_reader(gguf, arch)
        block_count = key.layer_count()
        L = key.int("nextn_predict_layers", block_count) or block_count
        if not 0 < L <= block_count:
            raise ConfigError(f"{L} draft layers of {block_count} blocks")
        pattern = key.bools("attention.sliding_window_pattern")
        if len(pattern) != block_count:   # checked first: the per-layer values below are block_count long
            raise ConfigError(f"sliding_window_pattern has {len(pattern)} entries for {block_count} layers")
        is_sliding = tuple(bool(b) for b in pattern)[:L]
        hd_f, hd_s = key.int("attention.key_length"), key.int("attention.key_length_swa")
        if key.int("attention.value_length", hd_f) != hd_f or key.int("attention.value_length_swa", hd_s) != hd_s:
            raise ConfigError("value_length must equal key_length (llama.cpp refuses otherwise)")
        n_head = _per_layer(key.int_or_ints("attention.head_count"), block_count, "head_count")[:L]
        n_kv = _per_layer(key.int_or_ints("attention.head_count_kv", n_head[0]), block_count, "head_count_kv")[:L]
        rot_f, rot_s = key.int("rope.dimension_count", hd_f), key.int("rope.dimension_count_swa", hd_s)
        base_f, base_s = key.float("rope.freq_base", 10000.0), key.float("rope.freq_base_swa", 10000.0)
        factors = None
        if "rope_freqs.weight" in gguf:
            factors = tuple(float(v) for v in gguf.load("rope_freqs.weight").flatten().tolist())
        n_centroids = 0
        if CENTROIDS in gguf and ORDERING in gguf:
            n_centroids = int(gguf.tensor(CENTROIDS).shape[0])
        return cls(
            n_layer=L,
            d_model=key.int("embedding_length"),
            d_backbone=key.int("embedding_length_out"),
            vocab_size=vocab_size_of(gguf, key.int("vocab_size", 0)),
            n_head=n_head,
            n_kv_head=n_kv,
            head_dim=tuple(hd_s if s else hd_f for s in is_sliding),
            is_sliding=is_sliding,
            sliding_window=key.int("attention.sliding_window"),
            ffn_width=_per_layer(key.int_or_ints("feed_forward_length"), block_count, "feed_forward_length")[:L],
            rope_base=tuple(base_s if s else base_f for s in is_sliding),
            rope_dims=tuple(rot_s if s else rot_f for s in is_sliding),
            full_rope_freq_factors=factors,
            rms_eps=key.float("attention.layer_norm_rms_epsilon", 1e-6),
            nextn_predict_layers=L,
            context_length=key.int("context_length", 131072),
            n_centroids=n_centroids,
        )

    @classmethod
    def from_hf(cls, config_json: Mapping[str, Any]) -> "Gemma4AssistantConfig":
        """From the assistant's HF `config.json` (§4.1): `backbone_hidden_size` + a text config."""
        from .gemma4 import Gemma4Config

        c = dict(config_json.get("text_config", config_json))
        c["num_kv_shared_layers"] = 0  # all assistant layers read the target's KV; no own plan
        t = Gemma4Config.from_hf(c)
        top = dict(config_json)
        d_b = top.get("backbone_hidden_size", c.get("backbone_hidden_size"))
        if d_b is None:
            raise ConfigError("assistant config.json lacks backbone_hidden_size")
        ordered = top.get("use_ordered_embeddings", c.get("use_ordered_embeddings", False))
        return cls(
            n_layer=t.n_layer, d_model=t.d_model, d_backbone=int(d_b), vocab_size=t.vocab_size,
            n_head=t.n_head, n_kv_head=t.n_kv_head, head_dim=t.head_dim, is_sliding=t.is_sliding,
            sliding_window=t.sliding_window, ffn_width=t.ffn_width, rope_base=t.rope_base,
            rope_dims=t.rope_dims, full_rope_freq_factors=t.full_rope_freq_factors, rms_eps=t.rms_eps,
            nextn_predict_layers=t.n_layer, context_length=t.context_length,
            n_centroids=int(top.get("num_centroids", c.get("num_centroids", 2048))) if ordered else 0,
            centroid_top_k=int(top.get("centroid_intermediate_top_k", c.get("centroid_intermediate_top_k", 32))),
        )

    # --- pairing with a target --------------------------------------------------------------
    def source_layers(self, target_cfg) -> tuple[int, ...]:
        """The TARGET layer whose K/V each draft layer reads: the target's last layer of the draft
        layer's type, resolved through the target's KV sharing (= its last KV-owning layer of that
        type; llama.cpp: n_layer−2 / n_layer−1 through the reuse map). E2B: 13 (sliding), 14 (full)."""
        out = []
        for j in range(self.n_layer):
            want = self.is_sliding[j]
            kind = "sliding" if want else "full"
            last = next((i for i in range(target_cfg.n_layer - 1, -1, -1)
                         if target_cfg.is_sliding[i] == want), None)
            if last is None:
                raise ValueError(f"target has no {kind} layer for assistant layer {j} to read KV from")
            src = target_cfg.kv_source(last)
            if not target_cfg.has_kv(src) or target_cfg.is_sliding[src] != want:
                raise ValueError(f"target has no KV-owning {kind} layer for assistant layer {j} to read")
            out.append(src)
        return tuple(out)

    def validate_against(self, target_cfg) -> tuple[int, ...]:
        """Raise a one-line ValueError if this assistant cannot draft for `target_cfg` (a
        Gemma4Config); returns the target source layer of every draft layer."""
        if self.d_backbone != target_cfg.d_model:
            raise ValueError(f"assistant embedding_length_out {self.d_backbone} != target embedding_length "
                             f"{target_cfg.d_model}: this assistant belongs to another target")
        if self.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"assistant vocabulary {self.vocab_size} != target vocabulary {target_cfg.vocab_size}")
        srcs = self.source_layers(target_cfg)
        for j, s in enumerate(srcs):
            kind = "sliding" if self.is_sliding[j] else "full"
            if (self.n_kv_head[j], self.head_dim[j]) != (target_cfg.n_kv_head[s], target_cfg.head_dim[s]):
                raise ValueError(
                    f"assistant {kind} layer {j} expects {self.n_kv_head[j]} KV heads x {self.head_dim[j]} dims "
                    f"but target layer {s} caches {target_cfg.n_kv_head[s]} x {target_cfg.head_dim[s]}")
            if self.is_sliding[j] and self.sliding_window != target_cfg.sliding_window:
                raise ValueError(f"assistant sliding window {self.sliding_window} != target's "
                                 f"{target_cfg.sliding_window}")
        return srcs


# HF `Gemma4AssistantForCausalLM` names -> GGUF names (layer names as the target's HF_LAYER_NAMES).
# HF name (after a `model.` prefix, or at the top level) -> GGUF name; layers use the target's
# per-layer table (models/gemma4.HF_LAYER_NAMES).
HF_ASSISTANT_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "pre_projection.weight": "nextn.pre_projection.weight",
    "post_projection.weight": "nextn.post_projection.weight",
    "masked_embedding.centroids.weight": CENTROIDS,
    "masked_embedding.token_ordering": ORDERING,
}


def assistant_tensor_plan(cfg: Gemma4AssistantConfig) -> dict[str, Optional[tuple[int, ...]]]:
    """GGUF tensor name -> torch shape of every float tensor the assistant reads (§2.7)."""
    d, D = cfg.d_model, cfg.d_backbone
    plan: dict[str, Optional[tuple[int, ...]]] = {
        "token_embd.weight": (cfg.vocab_size, d),
        "output_norm.weight": (d,),
        "nextn.pre_projection.weight": (d, 2 * D),
        "nextn.post_projection.weight": (D, d),
    }
    if cfg.n_centroids:
        plan[CENTROIDS] = (cfg.n_centroids, d)
    for i in range(cfg.n_layer):
        b, hd, nh, ff = f"blk.{i}.", cfg.head_dim[i], cfg.n_head[i], cfg.ffn_width[i]
        plan.update({
            b + "attn_norm.weight": (d,), b + "attn_q.weight": (nh * hd, d), b + "attn_q_norm.weight": (hd,),
            b + "attn_output.weight": (d, nh * hd), b + "post_attention_norm.weight": (d,),
            b + "ffn_norm.weight": (d,), b + "ffn_gate.weight": (ff, d), b + "ffn_up.weight": (ff, d),
            b + "ffn_down.weight": (d, ff), b + "post_ffw_norm.weight": (d,),
            b + "layer_output_scale.weight": (1,),
        })
    return plan


def draft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, P: int,
                    window: Optional[int]) -> torch.Tensor:
    """One draft query at position P over the target's cached keys (§4.4, llama.cpp rule): key p' is
    visible iff p' < P (the draft token itself is not in the cache) and, sliding, P − p' < W.
    q: [n_h, hd]; k, v: [S, n_kv, hd]. Scale 1.0. Returns [n_h * hd]."""
    n_h, hd = q.shape
    n_kv = k.shape[1]
    diff = P - k_pos.to(q.device)
    mask = diff > 0
    if window is not None:
        mask &= diff < window
    if not bool(mask.any()):
        raise ValueError(f"draft query at position {P} sees no cached target key")
    qg = q.reshape(n_kv, n_h // n_kv, hd)  # head h reads KV head h // group
    o = F.scaled_dot_product_attention(qg, k.permute(1, 0, 2).to(q.dtype), v.permute(1, 0, 2).to(q.dtype),
                                       attn_mask=mask[None, None, :], scale=1.0)
    return o.reshape(n_h * hd)


class Gemma4Assistant:
    """The draft step of §4.3 over a weight dict keyed by GGUF names."""

    runtime = Runtime.REFERENCE  # set at load (models/runtime.py); on ggml the ops run ggml chains

    def __init__(self, cfg: Gemma4AssistantConfig, weights: Mapping[str, Any], dtype=torch.float32,
                 device="cpu", ordering: Optional[torch.Tensor] = None):
        self.cfg, self.w, self.dtype, self.device = cfg, dict(weights), dtype, torch.device(device)
        # Centroid-masked logits (§4.5) only when both the centroids and the token ordering exist.
        self.ordering = None
        if cfg.n_centroids and ordering is not None and CENTROIDS in self.w:
            self.ordering = ordering.to(self.device, torch.long).reshape(cfg.n_centroids, -1)
        freqs: dict = {}
        self.inv_freq = [
            freqs.setdefault((cfg.rope_dims[i], cfg.rope_base[i], cfg.is_sliding[i]), rope_inv_freq(
                cfg.rope_dims[i], cfg.rope_base[i],
                None if cfg.is_sliding[i] else cfg.full_rope_freq_factors).to(self.device))
            for i in range(cfg.n_layer)
        ]
        self._sources: Optional[tuple[int, ...]] = None
        self._sources_for = None

    def kv_source(self, j: int, target_cfg) -> int:
        """The target layer draft layer j reads (memoized per target config)."""
        if self._sources_for is not target_cfg:
            self._sources = self.cfg.validate_against(target_cfg)
            self._sources_for = target_cfg
        return self._sources[j]

    # --- pieces ----------------------------------------------------------------------------
    def _target_rows(self, target, tokens: torch.Tensor) -> torch.Tensor:
        """Unscaled rows of the TARGET's token_embd for `tokens` [B] -> [B, D_b]."""
        if hasattr(target, "w"):
            table = target.w.get("token_embd.host", target.w["token_embd.weight"])
            rows = embedding_rows(table, tokens)
        else:
            rows = target(tokens)
        return rows_to_device(rows, self.device, self.dtype)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """Tied-head logits for y [B, d_a] (no softcap): dense, or centroid-masked when the file has
        the centroids (top-k centroids -> their token ids; every other id gets min − 1)."""
        E = self.w["token_embd.weight"]
        if self.ordering is None:
            return linear(y, E)
        c = linear(y, self.w[CENTROIDS])                              # [B, n_c]
        top = c.topk(min(self.cfg.centroid_top_k, c.shape[-1]), dim=-1).indices
        cand = self.ordering[top].reshape(y.shape[0], -1)            # [B, k * V/n_c]
        Ed = E if isinstance(E, torch.Tensor) else None
        rows = Ed[cand] if Ed is not None else embedding_rows(E, cand.reshape(-1)).reshape(*cand.shape, -1)
        sel = torch.einsum("bd,bkd->bk", y, rows.to(y.dtype))
        out = (sel.amin(-1, keepdim=True) - 1).expand(-1, self.cfg.vocab_size).clone()
        return out.scatter_(1, cand, sel)

    def layer(self, j: int, z: torch.Tensor, pos: torch.Tensor, target_cfg,
              kv_views: Sequence[KVView]) -> torch.Tensor:
        cfg, w, b, eps = self.cfg, self.w, f"blk.{j}.", self.cfg.rms_eps
        B, hd, nh = z.shape[0], cfg.head_dim[j], cfg.n_head[j]
        a = rms_norm(z, w[b + "attn_norm.weight"], eps)
        cos, sin = rope_cos_sin(pos, self.inv_freq[j], z.dtype)
        q = apply_rope(rms_norm(linear(a, w[b + "attn_q.weight"]).reshape(B, nh, hd),
                                w[b + "attn_q_norm.weight"], eps), cos, sin)
        src = self.kv_source(j, target_cfg)
        window = cfg.sliding_window if cfg.is_sliding[j] else None
        reads = {}
        o = []
        for r in range(B):
            view = kv_views[r]
            if id(view) not in reads:
                reads[id(view)] = view.read(src)
            k, v, kpos = reads[id(view)]
            o.append(draft_attention(q[r], k, v, kpos, int(pos[r]), window))
        o = torch.stack(o)
        z = z + rms_norm(linear(o, w[b + "attn_output.weight"]), w[b + "post_attention_norm.weight"], eps)
        f = gated_mlp(rms_norm(z, w[b + "ffn_norm.weight"], eps), w, b)
        z = z + rms_norm(f, w[b + "post_ffw_norm.weight"], eps)
        return z * w[b + "layer_output_scale.weight"].to(z.dtype)

    @torch.no_grad()
    def draft_step(self, tokens: torch.Tensor, h: torch.Tensor, pos: torch.Tensor,
                   target: Union[Any, Callable[[torch.Tensor], torch.Tensor]],
                   kv_view: Union[KVView, Sequence[KVView]], target_cfg=None):
        """One draft step (§4.3) for B rows.

        tokens [B]: τ (the last sampled token, then the previous draft); h [B, D_b]: the target's
        post-final-norm state at P−1, then the previous step's h′; pos [B]: P, the same for every
        step of a round. `target`: the target model (its `token_embd` and `cfg` are used) or a
        function ids -> unscaled target embedding rows (then pass `target_cfg`). `kv_view`: one
        read-only view of the target's cache, or one per row.
        Returns (logits [B, V], h′ [B, D_b], y [B, d_a]).
        """
        with cpu_chains(self):
            return self._draft_step(tokens, h, pos, target, kv_view, target_cfg)

    def _draft_step(self, tokens, h, pos, target, kv_view, target_cfg):
        target_cfg = target_cfg if target_cfg is not None else target.cfg
        tokens = tokens.reshape(-1).to(self.device)
        pos = pos.reshape(-1).to(self.device)
        B = tokens.shape[0]
        views = list(kv_view) if isinstance(kv_view, (list, tuple)) else [kv_view] * B
        if len(views) != B or h.shape != (B, self.cfg.d_backbone) or pos.shape[0] != B:
            raise ValueError(f"draft_step: {B} tokens, h {tuple(h.shape)}, {pos.shape[0]} positions, "
                             f"{len(views)} KV views")
        e = self._target_rows(target, tokens) * math.sqrt(self.cfg.d_backbone)
        z = linear(torch.cat([e, h.to(self.device, self.dtype)], dim=-1), self.w["nextn.pre_projection.weight"])
        for j in range(self.cfg.n_layer):
            z = self.layer(j, z, pos, target_cfg, views)
        y = rms_norm(z, self.w["output_norm.weight"], self.cfg.rms_eps)
        return self.logits(y), linear(y, self.w["nextn.post_projection.weight"]), y


def _load_ordering(gguf) -> Optional[torch.Tensor]:
    if ORDERING not in gguf:
        return None
    info = gguf.tensor(ORDERING)
    np_dtype = {26: np.int32, 27: np.int64, 24: np.int8, 25: np.int16}.get(int(info.ggml_type))
    if np_dtype is None:
        return torch.from_numpy(gguf.load(ORDERING).numpy().astype(np.int64))
    return torch.from_numpy(np.frombuffer(info.data, dtype=np_dtype).astype(np.int64))


def load_gemma4_assistant(gguf, dtype=torch.float32, device="cpu", weight_dtype=None,
                          cpu_quant: bool = False) -> Gemma4Assistant:
    """Build a Gemma4Assistant from a `GGUFFile` of arch `gemma4-assistant`. `cpu_quant`: the CPU
    runtime format, as the target's (models/weights.load_weights: on llama.cpp's kernels every
    matrix stays its GGUF bytes and the draft's chains run as ggml graphs)."""
    gguf.check_architecture((ARCH,))
    cfg = Gemma4AssistantConfig.from_gguf(gguf)
    weights = load_weights(gguf, assistant_tensor_plan(cfg), dtype, device, weight_dtype,
                           cpu_quant=cpu_quant and torch.device(device).type == "cpu")
    ordering = _load_ordering(gguf) if cfg.n_centroids else None
    draft = Gemma4Assistant(cfg, weights, dtype=dtype, device=device, ordering=ordering)
    draft.runtime = runtime_of_flags(device, weight_dtype, cpu_quant=cpu_quant)
    return draft


def load_gemma4_assistant_hf(folder, dtype=torch.float32, device="cpu") -> Gemma4Assistant:
    """The assistant from an HF checkpoint folder (Gemma4AssistantForCausalLM naming)."""
    from .gemma4 import HF_LAYER_NAMES
    from .hf import HFCheckpoint

    ckpt = HFCheckpoint(folder, HF_ASSISTANT_NAMES, HF_LAYER_NAMES)
    cfg = Gemma4AssistantConfig.from_hf(ckpt.config)
    weights = load_weights(ckpt, assistant_tensor_plan(cfg), dtype, device)
    ordering = ckpt.load(ORDERING, dtype=torch.long) if cfg.n_centroids and ORDERING in ckpt else None
    return Gemma4Assistant(cfg, weights, dtype=dtype, device=device, ordering=ordering)
