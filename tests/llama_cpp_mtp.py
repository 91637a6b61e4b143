"""llama.cpp's own Gemma-4 assistant (arch `gemma4-assistant`) as a test oracle for the draft step.

llama.cpp runs the assistant as a second context of type LLAMA_CONTEXT_TYPE_MTP whose `ctx_other`
is the target's context: the assistant's KV cache shares the target's layers n_layer-2 (sliding)
and n_layer-1 (full), and its graph reads the target's `token_embd`. Through llama-cpp-python
0.3.36's public C API:

* the draft's conditioning vector h goes in with `llama_batch_ext_set_embd_token` (the row beside
  the token id; `llama_batch_ext_set_embd_state`, whose comment names MTP, returns false and stores
  nothing in this build);
* the target's post-norm rows (h) and the draft's h' are read with the eval callback (the graph
  nodes `result_norm` and `h_nextn`), not with the nextn-embedding getters, which are C++-only
  symbols (llama-ext.h) that the Python binding does not wrap;
* the assistant context must be created BEFORE the target decodes anything: creating it empties
  the shared KV cache (the target's `llama_memory_seq_pos_max(mem, 0)` goes from P-1 to -1, and
  every draft attention row is then fully masked: NaN logits).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from engine.cpu_runtime import default_threads

CACHE_VIEWS = ("cache_k_l", "cache_v_l")  # llama.cpp's names of the KV views an attention reads


class LlamaCppDraftPair:
    """A target and its assistant in llama.cpp (CPU, F32 KV, no flash attention)."""

    def __init__(self, target: Path, assistant: Path, n_ctx: int = 256):
        import llama_cpp as L

        from kernels import ggml
        from tiny_models import quiet_llama_cpp

        quiet_llama_cpp()
        L.llama_backend_init()
        self.L, self.nodes = L, {}

        @L.ggml_backend_sched_eval_callback
        def observe(t, ask, user_data):  # keep the last value of the nodes that carry h, h' and the KV read
            name = ggml.node_info(t)[1]
            if name not in ("result_norm", "h_nextn") and not name.startswith(CACHE_VIEWS):
                return bool(not ask)
            if not ask:
                self.nodes[name] = np.frombuffer(ggml.tensor_bytes(t), dtype=np.float32).copy()
            return True

        self._observe = observe  # the ctypes callback must outlive the contexts
        mp = L.llama_model_default_params()
        self.target = L.llama_model_load_from_file(str(target).encode(), mp)
        self.draft = L.llama_model_load_from_file(str(assistant).encode(), mp)
        if not self.target or not self.draft:
            raise RuntimeError("llama.cpp could not load the target or the assistant")
        self.ctx = L.llama_init_from_model(self.target, self._params(n_ctx))
        dp = self._params(n_ctx)
        dp.ctx_type, dp.ctx_other = L.LLAMA_CONTEXT_TYPE_MTP, self.ctx
        self.dctx = L.llama_init_from_model(self.draft, dp)  # before any target decode (see above)
        if not self.ctx or not self.dctx:
            raise RuntimeError("llama.cpp could not create the target or the assistant context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.target))
        self.d_backbone = L.llama_model_n_embd(self.target)
        self.n_past = 0

    def _params(self, n_ctx: int):
        p = self.L.llama_context_default_params()
        p.n_ctx = p.n_batch = p.n_ubatch = n_ctx
        p.n_threads = p.n_threads_batch = default_threads()
        p.type_k = p.type_v = 0  # F32 KV
        p.flash_attn_type = 0
        p.cb_eval, p.cb_eval_user_data = self._observe, None
        return p

    def prefill(self, tokens: list[int]) -> np.ndarray:
        """Decode `tokens` on the target at positions n_past..; returns their post-norm rows h
        [len(tokens), D_b] (llama.cpp's `result_norm`, every row output)."""
        L = self.L
        batch = L.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, tok in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, self.n_past + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1
            batch.n_tokens = len(tokens)
            if L.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode (target) failed")
        finally:
            L.llama_batch_free(batch)
        self.n_past += len(tokens)
        return self.nodes["result_norm"].reshape(len(tokens), self.d_backbone)

    def draft_step(self, token: int, h: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """One assistant step for token `token` at position `pos`, h [D_b]: (logits [V], h' [D_b],
        {target layer: (K, V)} the KV the draft's attention read, each [cells, n_kv * head_dim] in
        cell order (named after the TARGET layer whose cache it is: the sharing llama.cpp did)."""
        L = self.L
        for name in [n for n in self.nodes if n.startswith(CACHE_VIEWS)]:
            del self.nodes[name]
        h32 = np.ascontiguousarray(h, dtype=np.float32)
        b = L.llama_batch_ext_init(self.dctx)
        try:
            idx = L.llama_batch_ext_add_token(b, 0, int(token))
            p = L.llama_pos(pos)
            embd = L.llama_embd(h32.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, h32.size)
            if idx < 0 or not (L.llama_batch_ext_set_pos(b, idx, ctypes.byref(p))
                               and L.llama_batch_ext_set_embd_token(b, idx, embd)
                               and L.llama_batch_ext_set_output_logits(b, idx, True)):
                raise RuntimeError("llama_batch_ext refused the draft row")
            if L.llama_process(self.dctx, L.LLAMA_PROCESS_TYPE_DECODE, b) != 0:
                raise RuntimeError("llama_process (assistant) failed")
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.dctx, -1), shape=(self.n_vocab,)).copy()
        finally:
            L.llama_batch_ext_free(b)
        kv = {}
        for name, data in self.nodes.items():
            if name.startswith("cache_k_l") and name.endswith("(view)"):
                layer = int(name[len("cache_k_l"):].split()[0])
                kv[layer] = (data, self.nodes[f"cache_v_l{layer} (view)"])
        return logits, self.nodes["h_nextn"].copy(), kv

    def close(self) -> None:
        L = self.L
        L.llama_free(self.dctx)
        L.llama_free(self.ctx)
        L.llama_model_free(self.draft)
        L.llama_model_free(self.target)
