"""Tiny random Gemma-4 GGUFs that llama.cpp loads, written with the `gguf` writer (and a tiny
random Gemma 3 built in memory, `tiny_gemma3`).

Weights are tame (norm weights near 1, small init) so random models stay numerically well
conditioned: the comparison with llama.cpp then measures structure, not noise amplification.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from gguf import GGUFWriter

from engine.cpu_runtime import default_threads  # the oracle's threads: as many as ours
from models.gemma3 import Gemma3Config, Gemma3Model

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>"]
USER_DEFINED = ["<|channel>", "<channel|>", "<|tool_response>"]
# Gemma-4's tool markers (spec §5.3), placed on `<unusedN>` ids of a 384-token tiny vocab
TOOL_TOKENS = {370: "<|tool>", 371: "<tool|>", 372: "<|tool_call>", 373: "<tool_call|>", 374: "<tool_response|>",
               375: '<|"|>'}
WORDS = ["\n", "\n\n", "▁", "▁t", "th", "▁th", "he", "▁the", "in", "er", "an", "▁a", "on", "re"]


def tiny_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A small `gemma4` BPE vocab: specials, 256 byte tokens, letters and a few merges."""
    tokens = list(SPECIALS) + list(USER_DEFINED)
    types = [3] * len(SPECIALS) + [4] * len(USER_DEFINED)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    chars += list("0123456789.,!?'-:;()")
    for t in WORDS + chars:
        if len(tokens) < n_vocab and t not in tokens:
            tokens.append(t)
            types.append(1)
    i = 0
    while len(tokens) < n_vocab:
        tokens.append(f"<unused{i}>")
        types.append(1)
        i += 1
    merges = ["▁ t", "t h", "▁ th", "h e", "▁th e", "i n", "e r", "a n", "▁ a", "o n", "r e", "\n \n"]
    return tokens, types, merges


def add_tiny_tokenizer(w: GGUFWriter, n_vocab: int, special: Optional[dict] = None,
                       user_defined: Optional[dict] = None) -> None:
    """The tiny `gemma4` tokenizer keys (llama.cpp needs a vocabulary to load a model); `special`:
    id -> text of extra control tokens (e.g. the image markers); `user_defined`: id -> text of
    extra USER_DEFINED tokens (e.g. TOOL_TOKENS)."""
    tokens, types, merges = tiny_vocab(n_vocab)
    for i, text in (special or {}).items():
        tokens[i], types[i] = text, 3
    for i, text in (user_defined or {}).items():
        tokens[i], types[i] = text, 4
    w.add_string("tokenizer.ggml.model", "gemma4")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", [-1000.0] * n_vocab)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)


def _tame_random(rng):
    """mat(out, in): N(0, 1/in) weights; norm(n): weights near 1 — keeps random models well conditioned."""
    def mat(out_dim, in_dim, gain=1.0):
        return (rng.standard_normal((out_dim, in_dim)) * gain / np.sqrt(in_dim)).astype(np.float32)

    def norm(n, spread=0.1):
        return (1.0 + spread * rng.standard_normal(n)).astype(np.float32)

    return mat, norm


def _add_attention_keys(w: GGUFWriter, arch: str, spec: "TinySpec", sliding: list[bool], n_shared: int) -> None:
    """Head dims, RoPE, norm epsilon and sliding-window keys: the same for a target and its
    assistant (which shares the target's head dims and window)."""
    for suffix, hd in (("", spec.hd_full), ("_swa", spec.hd_sliding)):
        w.add_uint32(f"{arch}.attention.key_length{suffix}", hd)
        w.add_uint32(f"{arch}.attention.value_length{suffix}", hd)
        w.add_uint32(f"{arch}.rope.dimension_count{suffix}", hd)
    w.add_float32(f"{arch}.rope.freq_base", 1_000_000.0)
    w.add_float32(f"{arch}.rope.freq_base_swa", 10_000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{arch}.attention.sliding_window", spec.sliding_window)
    w.add_array(f"{arch}.attention.sliding_window_pattern", [bool(s) for s in sliding])
    w.add_uint32(f"{arch}.attention.shared_kv_layers", n_shared)


@dataclass
class TinySpec:
    """Shape of a tiny Gemma-4. Defaults: an E-series-like 8-layer model with every feature on."""

    n_layer: int = 8
    d_model: int = 256
    n_vocab: int = 384
    n_head: int = 2
    n_kv_head: int | list[int] = 1
    hd_sliding: int = 64
    hd_full: int = 128
    pattern: Optional[list[bool]] = None  # True = sliding; default [S,S,S,F] repeated
    sliding_window: int = 8
    ffn: int | list[int] = 512
    n_kv_shared: int = 4
    ple_width: int = 32
    partial_rotary: float = 0.25
    softcap: Optional[float] = 30.0
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn: int = 0
    tool_tokens: bool = False  # the Gemma-4 tool markers as USER_DEFINED tokens (TOOL_TOKENS)
    v_on_full_layers: bool = True  # False: 31B-style, no attn_v on full layers (V = raw K)
    double_wide: bool = True  # E2B-style 2x FFN on KV-shared layers (written as an array)
    tied: bool = True
    fused_qkv: bool = False  # write attn_qkv (rows Q, K, V) instead of attn_q/k/v on KV-owning layers
    fused_gate_up_exps: bool = True  # MoE: ffn_gate_up_exps, else ffn_gate_exps + ffn_up_exps
    extra: dict = field(default_factory=dict)

    def layer_pattern(self) -> list[bool]:
        if self.pattern is not None:
            return list(self.pattern)
        return [(i + 1) % 4 != 0 for i in range(self.n_layer - 1)] + [False]


def write_tiny_gemma4(path: Path, spec: TinySpec, seed: int = 0) -> Path:
    """Write an F32 GGUF of a random Gemma-4 text model shaped by `spec`; returns `path`."""
    rng = np.random.default_rng(seed)
    arch = "gemma4"
    L, d, V, P = spec.n_layer, spec.d_model, spec.n_vocab, spec.ple_width
    sliding = spec.layer_pattern()
    first = L - spec.n_kv_shared
    n_kv = spec.n_kv_head if isinstance(spec.n_kv_head, list) else [spec.n_kv_head] * L
    if isinstance(spec.ffn, list):
        ffn = spec.ffn
    else:
        ffn = [spec.ffn * 2 if spec.double_wide and i >= first else spec.ffn for i in range(L)]

    mat, norm = _tame_random(rng)

    w = GGUFWriter(str(path), arch=arch)
    w.add_name("tiny-gemma4")
    w.add_string("general.finetune", "it")  # a chat model (models/model_kind.py), as E2B-it
    w.add_uint32(f"{arch}.block_count", L)
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.embedding_length", d)
    if len(set(ffn)) == 1:
        w.add_uint32(f"{arch}.feed_forward_length", ffn[0])
    else:
        w.add_array(f"{arch}.feed_forward_length", [int(f) for f in ffn])
    w.add_uint32(f"{arch}.attention.head_count", spec.n_head)
    if len(set(n_kv)) == 1:
        w.add_uint32(f"{arch}.attention.head_count_kv", n_kv[0])
    else:
        w.add_array(f"{arch}.attention.head_count_kv", [int(n) for n in n_kv])
    _add_attention_keys(w, arch, spec, sliding, spec.n_kv_shared)
    w.add_uint32(f"{arch}.embedding_length_per_layer_input", P)
    if spec.softcap:
        w.add_float32(f"{arch}.final_logit_softcapping", spec.softcap)
    if spec.n_expert:
        w.add_uint32(f"{arch}.expert_count", spec.n_expert)
        w.add_uint32(f"{arch}.expert_used_count", spec.n_expert_used)
        w.add_uint32(f"{arch}.expert_feed_forward_length", spec.expert_ffn)
    add_tiny_tokenizer(w, V, user_defined=TOOL_TOKENS if spec.tool_tokens else None)
    for k, v in spec.extra.items():
        w.add_key_value(k, v[0], v[1])

    t = {}
    t["token_embd.weight"] = (rng.standard_normal((V, d)) * 0.15).astype(np.float32)
    if not spec.tied:
        t["output.weight"] = mat(V, d)
    t["output_norm.weight"] = norm(d)
    n_rot_pairs = int(spec.partial_rotary * spec.hd_full / 2)
    t["rope_freqs.weight"] = np.array([1.0 if j < n_rot_pairs else 1e30 for j in range(spec.hd_full // 2)],
                                      dtype=np.float32)
    if P:
        t["per_layer_token_embd.weight"] = (rng.standard_normal((V, L * P)) * 0.05).astype(np.float32)
        t["per_layer_model_proj.weight"] = mat(L * P, d)
        t["per_layer_proj_norm.weight"] = norm(P)
    for i in range(L):
        b = f"blk.{i}."
        hd = spec.hd_sliding if sliding[i] else spec.hd_full
        nh, nk = spec.n_head, n_kv[i]
        t[b + "attn_norm.weight"] = norm(d)
        t[b + "attn_q.weight"] = mat(nh * hd, d)
        # q·k with scale 1.0: q/k norm weights of hd^-1/4 keep attention logits ~N(0, 1) instead of
        # ~N(0, hd), so the random model is not chaotic (4-bit noise would otherwise flip softmaxes).
        qk_gain = hd ** -0.25
        t[b + "attn_q_norm.weight"] = norm(hd) * qk_gain
        if i < first:
            t[b + "attn_k.weight"] = mat(nk * hd, d)
            t[b + "attn_k_norm.weight"] = norm(hd) * qk_gain
            if sliding[i] or spec.v_on_full_layers:
                t[b + "attn_v.weight"] = mat(nk * hd, d)
        t[b + "attn_output.weight"] = mat(d, nh * hd)
        t[b + "post_attention_norm.weight"] = norm(d)
        t[b + "ffn_norm.weight"] = norm(d)
        t[b + "ffn_gate.weight"] = mat(ffn[i], d)
        t[b + "ffn_up.weight"] = mat(ffn[i], d)
        t[b + "ffn_down.weight"] = mat(d, ffn[i])
        t[b + "post_ffw_norm.weight"] = norm(d)
        t[b + "layer_output_scale.weight"] = np.array([0.6 + 0.4 * rng.random()], dtype=np.float32)
        if P:
            t[b + "inp_gate.weight"] = mat(P, d)
            t[b + "proj.weight"] = mat(d, P)
            t[b + "post_norm.weight"] = norm(d)
        if spec.n_expert:
            E, I = spec.n_expert, spec.expert_ffn
            t[b + "ffn_gate_inp.weight"] = mat(E, d, gain=4.0)
            t[b + "ffn_gate_inp.scale"] = norm(d)
            t[b + "pre_ffw_norm_2.weight"] = norm(d)
            t[b + "post_ffw_norm_1.weight"] = norm(d)
            t[b + "post_ffw_norm_2.weight"] = norm(d)
            gate_up = np.stack([mat(2 * I, d) for _ in range(E)])
            if spec.fused_gate_up_exps:
                t[b + "ffn_gate_up_exps.weight"] = gate_up
            else:
                t[b + "ffn_gate_exps.weight"] = np.ascontiguousarray(gate_up[:, :I])
                t[b + "ffn_up_exps.weight"] = np.ascontiguousarray(gate_up[:, I:])
            t[b + "ffn_down_exps.weight"] = np.stack([mat(d, I) for _ in range(E)])
            t[b + "ffn_down_exps.scale"] = (0.5 + rng.random(E)).astype(np.float32)
    if spec.fused_qkv:
        for i in range(first):
            b = f"blk.{i}."
            t[b + "attn_qkv.weight"] = np.concatenate(
                [t.pop(b + "attn_q.weight"), t.pop(b + "attn_k.weight"), t.pop(b + "attn_v.weight")])
    for name, arr in t.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)



def load_tiny_pair(d: Path, spec: TinySpec, seeds: tuple[int, int] = (31, 32)):
    """(target LoadedModel, assistant draft) of `spec` written under folder d: speculative tests."""
    from models.gemma4_assistant import load_gemma4_assistant
    from models.gguf import GGUFFile
    from models.loader import load_model

    target = load_model(write_tiny_gemma4(d / "t.gguf", spec, seed=seeds[0]))
    return target, load_gemma4_assistant(GGUFFile(write_tiny_assistant(d / "a.gguf", spec, seed=seeds[1])))


def write_tiny_assistant(path: Path, target_spec: TinySpec, seed: int = 0, *, n_layer: int = 4,
                         d_model: int = 64, n_head: int = 4, ffn: int = 128, n_centroids: int = 0,
                         d_backbone: Optional[int] = None, n_kv_head: Optional[int] = None) -> Path:
    """Write an F32 GGUF of a random Gemma-4 assistant (MTP drafter, §2.3/§2.7) for a target shaped
    by `target_spec`: layers [S,..,S,F], the target's head dims, window and vocab, and per layer the
    KV-head count of the target layer it reads (the last sliding / the last full one; written as an
    array when they differ, as for a 26B-A4B-like target with per-layer KV heads).
    `n_centroids` > 0 adds `masked_embd_centroids.weight` + `masked_embd_ordering` (HF-style sparse
    head). `d_backbone` / `n_kv_head` override the target's values (to build mismatched drafts)."""
    rng = np.random.default_rng(seed)
    arch = "gemma4-assistant"
    L, d, V = n_layer, d_model, target_spec.n_vocab
    D = target_spec.d_model if d_backbone is None else d_backbone
    sliding = [True] * (L - 1) + [False]
    if n_kv_head is not None:
        nk = [n_kv_head] * L
    elif isinstance(target_spec.n_kv_head, int):
        nk = [target_spec.n_kv_head] * L
    else:
        t_sliding = target_spec.layer_pattern()
        last = {s: max(i for i, ts in enumerate(t_sliding) if ts == s) for s in (True, False)}
        nk = [target_spec.n_kv_head[last[s]] for s in sliding]

    mat, norm = _tame_random(rng)

    w = GGUFWriter(str(path), arch=arch)
    w.add_name("tiny-gemma4-assistant")
    w.add_uint32(f"{arch}.block_count", L)
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.embedding_length", d)
    w.add_uint32(f"{arch}.embedding_length_out", D)
    w.add_uint32(f"{arch}.nextn_predict_layers", L)
    w.add_uint32(f"{arch}.feed_forward_length", ffn)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    if len(set(nk)) == 1:
        w.add_uint32(f"{arch}.attention.head_count_kv", nk[0])
    else:
        w.add_array(f"{arch}.attention.head_count_kv", nk)
    _add_attention_keys(w, arch, target_spec, sliding, L)
    w.add_uint32(f"{arch}.embedding_length_per_layer_input", 0)
    add_tiny_tokenizer(w, V)

    t = {}
    t["token_embd.weight"] = (rng.standard_normal((V, d)) * 0.15).astype(np.float32)
    t["output_norm.weight"] = norm(d)
    # Columns 0..D-1 multiply the (x sqrt(D)-scaled) target embedding, D..2D-1 the target state h.
    t["nextn.pre_projection.weight"] = mat(d, 2 * D)
    t["nextn.post_projection.weight"] = mat(D, d)
    n_rot_pairs = int(target_spec.partial_rotary * target_spec.hd_full / 2)
    t["rope_freqs.weight"] = np.array([1.0 if j < n_rot_pairs else 1e30 for j in range(target_spec.hd_full // 2)],
                                      dtype=np.float32)
    for i in range(L):
        b = f"blk.{i}."
        hd = target_spec.hd_sliding if sliding[i] else target_spec.hd_full
        t[b + "attn_norm.weight"] = norm(d)
        t[b + "attn_q.weight"] = mat(n_head * hd, d)
        t[b + "attn_q_norm.weight"] = norm(hd) * hd ** -0.25
        t[b + "attn_output.weight"] = mat(d, n_head * hd)
        t[b + "post_attention_norm.weight"] = norm(d)
        t[b + "ffn_norm.weight"] = norm(d)
        t[b + "ffn_gate.weight"] = mat(ffn, d)
        t[b + "ffn_up.weight"] = mat(ffn, d)
        t[b + "ffn_down.weight"] = mat(d, ffn)
        t[b + "post_ffw_norm.weight"] = norm(d)
        t[b + "layer_output_scale.weight"] = np.array([0.6 + 0.4 * rng.random()], dtype=np.float32)
    if n_centroids:
        if V % n_centroids:
            raise ValueError(f"{n_centroids} centroids do not divide a {V}-token vocabulary")
        t["masked_embd_centroids.weight"] = mat(n_centroids, d)
        t["masked_embd_ordering"] = rng.permutation(V).astype(np.int32)
    for name, arr in t.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


_QUIET = []


def quiet_llama_cpp() -> None:
    """Silence llama.cpp's C log (its Python callback chokes on non-UTF-8 log bytes)."""
    import ctypes

    import llama_cpp

    if not _QUIET:
        @llama_cpp.llama_log_callback
        def _noop(level, text, user_data):
            pass

        _QUIET.append(_noop)  # keep the ctypes callback alive
        llama_cpp.llama_log_set(_noop, ctypes.c_void_p(0))


def quantize_gguf(src: Path, dst: Path, ftype: str = "Q4_K_M") -> Path:
    """Quantize with llama.cpp's own quantizer (`llama_cpp.llama_model_quantize`)."""
    import llama_cpp

    quiet_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed with {rc}")
    return Path(dst)


def llama_cpp_logits(path: Path, tokens: list[int], n_ctx: int = 512) -> np.ndarray:
    """llama.cpp's logits for every position of `tokens` ([n_tokens, vocab] float32), F32 KV cache."""
    import llama_cpp

    quiet_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          logits_all=True, type_k=0, type_v=0, n_threads=default_threads(), verbose=False,
                          flash_attn=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def llama_cpp_greedy(path: Path, prompt: list[int], n: int, n_ctx: int = 512) -> list[int]:
    """llama.cpp's greedy continuation of `prompt` (argmax of each step's logits), F32 KV cache: the
    prompt in one batch, then one token a decode, as llama.cpp's own generation runs."""
    import llama_cpp

    quiet_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          type_k=0, type_v=0, n_threads=default_threads(), verbose=False, flash_attn=False)
    try:
        llm.eval(prompt)
        out = []
        for _ in range(n):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        return out
    finally:
        llm.close()


def tiny_gemma3(seed: int = 5) -> Gemma3Model:
    """A random 4-layer Gemma 3 (S, S, S, F), window 6, GQA 4/2, built in memory (no GGUF needed)."""
    cfg = Gemma3Config(n_layer=4, d_model=128, vocab_size=384, n_head=4, n_kv_head=2, head_dim=32, ffn_width=256,
                       is_sliding=(True, True, True, False), sliding_window=6, rope_base_full=1e6,
                       rope_base_sliding=1e4, query_scale=32 ** -0.5, final_softcap=30.0)
    g = torch.Generator().manual_seed(seed)

    def mat(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    d, hd = cfg.d_model, cfg.head_dim
    w = {"token_embd.weight": 0.15 * torch.randn(cfg.vocab_size, d, generator=g), "output_norm.weight": norm(d)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        w.update({b + "attn_norm.weight": norm(d), b + "attn_q.weight": mat(cfg.n_head * hd, d),
                  b + "attn_k.weight": mat(cfg.n_kv_head * hd, d), b + "attn_v.weight": mat(cfg.n_kv_head * hd, d),
                  b + "attn_q_norm.weight": norm(hd), b + "attn_k_norm.weight": norm(hd),
                  b + "attn_output.weight": mat(d, cfg.n_head * hd), b + "post_attention_norm.weight": norm(d),
                  b + "ffn_norm.weight": norm(d), b + "ffn_gate.weight": mat(cfg.ffn_width, d),
                  b + "ffn_up.weight": mat(cfg.ffn_width, d), b + "ffn_down.weight": mat(d, cfg.ffn_width),
                  b + "post_ffw_norm.weight": norm(d)})
    return Gemma3Model(cfg, w)


def greedy_forward(model, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens: the prompt in one forward, then one token a forward (as llama.cpp's
    generation runs), over a DenseKVCache."""
    from models.kv_cache import DenseKVCache

    cache, out = DenseKVCache(), []
    logits = model.forward(torch.tensor(prompt), cache=cache)[-1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward(torch.tensor([out[-1]]), torch.tensor([len(prompt) + len(out) - 1]), cache)[-1]
    return out


def llama_cpp_greedy_until_near_tie(path, prompt: list[int], n: int, tie: float) -> list[int]:
    """llama.cpp's greedy tokens up to (not including) the first whose top-2 logit gap is below `tie`
    (a gap one flipped 8-bit activation rounding can close)."""
    ref = llama_cpp_greedy(path, prompt, n)
    logits = np.sort(llama_cpp_logits(path, prompt + ref)[len(prompt) - 1:], axis=-1)
    gaps = logits[:, -1] - logits[:, -2]
    return ref[:next((i for i, g in enumerate(gaps[:n]) if g < tie), n)]
