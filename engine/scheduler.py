"""The engine loop: admit waiting requests (reusing cached prefixes), prefill in chunks, decode,
stream, stop, and give KV back. `Engine.step()` is schedule -> run -> postprocess.

Prefill chunks run one sequence per forward. Decode-phase requests step together through
`BatchDecoder` (engine/batch_decode.py: static buffers, a CUDA graph per batch shape on CUDA) when
`batched_decode` is on (the default on CUDA, unless the first layers run on the CPU beside it:
models/host_layers.py; it also runs on the CPU), else one forward each.
Outputs are the same either way: a request's tokens depend only on its own KV.

Preemption: when a forward needs KV slots the pools cannot give even after evicting cached
prefixes, the newest running request gives its KV up (its computed tokens go to the prefix cache,
where they may still be found) and goes back to the head of the queue with its output kept; it is
re-admitted once an older request has finished and recomputes prompt + output so far, so its
stream only pauses. Only a request that does not fit the pools alone ends with an error.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from . import failpoints
from .attention_backend import get_attention_backend
from .batch_decode import BUCKETS, BatchDecoder
from .dry import breaker_table
from .kv.canonical import exact_chunk
from .kv.format import resolve_format
from .kv.pool import HybridKVPool, KVPoolFull
from .media import describe_counts, media_kinds, prompt_media
from .kv.sessions import KVDisk, KVSessions
from .paragraph_stop import blank_line_hold, blank_line_stop
from .prefix_cache import make_prefix_cache
from .request import ErrorKind, Request, RequestState, StreamEvent
from .runner import ModelRunner
from .sampler import SamplingParams
from .kv.sequence import SequenceKV, ggml_attention_for
from models.token_graph import MAX_ROWS as TOGETHER  # decode tokens in one CPU forward
from .speculative import SpecConfig, SpecStats, accept, check_draft, draft_policy, draft_tokens, max_draft


class ContextOverflowError(ValueError):
    """A prompt longer than the context (one-line message)."""


@dataclass
class EngineConfig:
    max_running_requests: int = 4
    prefill_chunk: int = 512  # tokens per prefill step (the GPU default is 2048)
    fast_prefill: bool = True
    cache_type: str = "radix"
    kv_cache_dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on the CPU
    swa_kv_cache_dtype: str = "auto"
    full_tokens: int = 8192  # full-pool slots (the memory planner sizes this)
    window_tokens: Optional[int] = None  # default: per running request window + chunk + margin
    context_length: Optional[int] = None  # default: the model's, capped by the full pool
    share_kv: bool = True  # False: debug mode, shared layers keep their own KV copies
    attention_backend: str = "auto"  # auto: triton on CUDA, torch (the reference) otherwise
    window_margin: int = 64
    batched_decode: Optional[bool] = None  # None: on when the model is on CUDA (works on the CPU too)
    cuda_graphs: bool = True  # capture the batched decode per (batch, verify width) on CUDA + triton
    kv_save: str = "answer"  # KV files: save after each answer, or "evict": when leaving the cache
    kv_dir: Optional[str] = None  # a managed folder of KV files, capped by kv_disk_budget
    kv_disk_budget: int = 4 << 30

    def __post_init__(self):
        if self.max_running_requests < 1 or self.prefill_chunk < 1 or self.full_tokens < 1:
            raise ValueError(f"invalid engine settings: {self}")

    @classmethod
    def from_options(cls, options, **planned) -> "EngineConfig":
        """From a front end's engine options (engine.api.EngineOptions: its flags), every field the
        two share by name, then `planned`: what the memory plan decided (pool sizes, prefill chunk,
        running requests, the KV formats `auto` resolved to)."""
        shared = {f.name: getattr(options, f.name) for f in fields(cls) if hasattr(options, f.name)}
        return cls(**{**shared, **planned})


class Engine:
    def __init__(self, model, tokenizer=None, config: Optional[EngineConfig] = None,
                 spec: Optional[SpecConfig] = None, model_id: str = "", vision=None, audio=None):
        self.model, self.tokenizer, self.config = model, tokenizer, config or EngineConfig()
        self.vision = vision  # models.gemma4_vision.Gemma4Vision or None (no images)
        self.audio = audio  # models.gemma4_audio.Gemma4Audio or None (no audio)
        self.media_kinds = media_kinds(vision, audio)  # engine/media.py: what requests may carry
        # 26B/31B: a prefill chunk never ends inside an image (`_chunk_size`)
        self.images_bidirectional = bool(getattr(model.cfg, "image_bidirectional", False))
        if spec is not None:
            check_draft(spec.draft, model.cfg)
        self.spec, self.spec_stats = spec, SpecStats()
        # on/off and k from measured costs and the acceptance (None: always spec.tokens)
        self.draft_policy = draft_policy(spec) if spec is not None else None
        self.draft_k = 0  # draft tokens this step (0: plain decode)
        self.window = model.cfg.sliding_window if any(model.cfg.is_sliding) else None
        self.runner = ModelRunner(model, self.config.fast_prefill)
        backend = get_attention_backend(self.config.attention_backend, model.device, getattr(model, "runtime", None))
        self.attention_backend = None if backend.name == "torch" else backend
        self.ggml_attention = ggml_attention_for(model, self.attention_backend)  # each SequenceKV's, once
        # beside a GPU, the first layers on the CPU (models/host_layers.py): their slabs in host memory
        self.host_layers = getattr(model, "host_layers", None)
        self.host_ggml_attention = self.host_layers is not None and ggml_attention_for(self.host_layers.cpu)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.finished_running = 0  # requests that left `running` finished (preempted ones wait for it)
        c = self.config
        self.sessions = KVSessions(self, c.kv_save, KVDisk(c.kv_dir, c.kv_disk_budget) if c.kv_dir else None,
                                   model_id)
        self._build_pools()

    # --- pools ------------------------------------------------------------------------------
    def _build_pools(self) -> None:
        c, dev = self.config, self.model.device
        win_tokens = c.window_tokens
        if win_tokens is None:  # each running sequence: window + chunk + margin, plus cached windows
            win_tokens = 2 * c.max_running_requests * ((self.window or 0) + c.prefill_chunk + c.window_margin)
        self.pools = HybridKVPool(self.model.cfg, c.full_tokens, win_tokens,
                                  resolve_format(c.kv_cache_dtype, dev), resolve_format(c.swa_kv_cache_dtype, dev),
                                  dev, share_kv=c.share_kv,
                                  host_layers=() if self.host_layers is None else self.host_layers.layers)
        self.cache = make_prefix_cache(c.cache_type, self.pools, self.window)
        if c.kv_save == "evict":  # a conversation's KV goes to disk before the cache lets it go
            self.cache.before_evict = self.sessions.save_dirty
        batched = c.batched_decode if c.batched_decode is not None else self.model.device.type == "cuda"
        batched = batched and self.host_layers is None  # a graph cannot capture the host's layers
        # Its graphs hold the slab addresses, so it is rebuilt with the pools.
        self.decoder = BatchDecoder(self.model, self.pools, self.attention_backend, c.cuda_graphs) \
            if batched else None

    def rebuild(self, **changes) -> None:
        """Rebuild the pools with a new size or format (drops the prefix cache). Only when idle."""
        if self.running or self.waiting:
            raise RuntimeError("cannot rebuild the KV pools while requests are running")
        for k in changes:
            if not hasattr(self.config, k):
                raise ValueError(f"unknown engine setting {k}")
        self.config = replace(self.config, **changes)  # checked again by its __post_init__
        self.sessions.save_dirty()
        self.sessions.flush()
        self.cache.clear()
        self._build_pools()

    @property
    def context_limit(self) -> int:
        n = self.config.context_length or self.model.cfg.context_length
        return min(n, self.pools.full.capacity) if self.pools.full.layers else n

    # --- requests ----------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], params: SamplingParams, stop_strings=(),
            kv_session: Optional[str] = None, images=(), audio=(), grammar=None, kv_auto: bool = False,
            cache_prompt: bool = True, stop_at_blank_line: bool = False) -> Request:
        """`images` (models.gemma4_vision.ImageInput) and `audio` (models.audio.AudioInput), one per
        `<|image|>` / `<|audio|>` run of `prompt_ids` (each item's N placeholders, in order);
        encoded at admission unless the cache covers them. `grammar`: an
        engine.constraints.GrammarState that masks every token sampled for it. `kv_auto`: the KV
        file of the prompt's longest saved prefix in `kv_dir` serves it, and the KV of prompt +
        answer is saved there after (engine/kv/sessions.py). `cache_prompt` False: the prefix cache
        serves none of it. `stop_at_blank_line`: finish at the first blank line after some text
        (engine/paragraph_stop.py: the base-model continuation mode)."""
        limit = self.context_limit
        media = {"image": list(images), "audio": list(audio)}
        pmedia = prompt_media(prompt_ids, media, self.media_kinds)
        if len(prompt_ids) >= limit:
            what = f" ({describe_counts(media)})" if images or audio else ""
            raise ContextOverflowError(
                f"prompt of {len(prompt_ids)} tokens{what} does not fit the {limit}-token context")
        breakers = None
        if params.dry_on and self.tokenizer is not None:  # the table is built once per breaker list
            breakers = breaker_table(self.tokenizer, params.dry_sequence_breakers)
        req = Request(list(prompt_ids), params, tuple(stop_strings), kv_session=kv_session, grammar=grammar,
                      kv_auto=kv_auto and self.sessions.disk is not None, cache_prompt=cache_prompt,
                      dry_breakers=breakers, stop_at_blank_line=stop_at_blank_line)
        req.media = pmedia
        if self.tokenizer is not None:
            req.detok = self.tokenizer.stream_decoder()
        self.requests[req.id] = req
        self.waiting.append(req)
        return req

    def abort(self, req_id: int) -> None:
        req = self.requests.get(req_id)
        if req is not None and req.state != RequestState.FINISHED:
            self._finish(req, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit, run one prefill chunk or decode token per running request, post-process.
        An exception leaves the engine consistent for `recover` (the client calls it)."""
        if failpoints.ACTIVE:
            failpoints.maybe_fail("step.error")
        self._admit()
        if self.spec is not None:
            self.draft_k = self.draft_policy.tokens() if self.draft_policy is not None else self.spec.tokens
        budget = self.config.prefill_chunk
        touched, decoding, together = [], [], []
        for req in list(self.running):
            if req.state not in (RequestState.PREFILL, RequestState.DECODE):
                continue  # preempted (or finished) by an earlier forward of this step
            if req.state == RequestState.PREFILL:
                if budget <= 0:
                    continue
                n = self._chunk_size(req, budget)
                budget -= n
                if n > 1 and req.computed_len + n == req.prefill_end:
                    # The prompt's last token is a forward of its own, as it is when the prefix
                    # cache serves the rest: its logits (and the draft's h) are then the same
                    # whether or not the prompt was cached, so a seed repeats (a 1-row and an
                    # N-row product may round differently: ggml's kernels, fast prefill's GEMM).
                    self._run(req, req.all_ids[req.computed_len:req.computed_len + n - 1])
                    if req.state != RequestState.PREFILL:
                        continue  # preempted or finished meanwhile
                    n = 1
                self._run(req, req.all_ids[req.computed_len:req.computed_len + n])
            elif self.decoder is not None:
                decoding.append(req)  # stepped together below
            elif self.draft_k:
                self._spec_round(req)
            else:
                together.append(req)  # one forward for all of them below
            touched.append(req)
        decoding = [r for r in decoding if r.state == RequestState.DECODE]  # not preempted meanwhile
        for i in range(0, len(decoding), BUCKETS[-1]):
            self._decode_batch([r for r in decoding[i:i + BUCKETS[-1]] if r.state == RequestState.DECODE])
        together = [r for r in together if r.state == RequestState.DECODE]
        if len(together) == 1:
            self._run(together[0], [together[0].all_ids[-1]])
        for i in range(0, len(together) if len(together) > 1 else 0, TOGETHER):
            self._decode_together([r for r in together[i:i + TOGETHER] if r.state == RequestState.DECODE])
        return touched

    def _chunk_size(self, req: Request, budget: int) -> int:
        """Prompt tokens of `req`'s next prefill forward, the last token included when the rows
        before it are done with this one (`step` runs it alone): engine/kv/canonical.py
        `exact_chunk` (about `budget`, never a short forward where a cached prompt would compute a
        long one), never ending inside an image when the model's image tokens attend both ways
        (26B/31B: engine/media.py `whole_images_end`): then fewer (up to the image), or more
        when the image starts the chunk and is longer."""
        c, last = req.computed_len, req.prefill_end - 1
        end = c + exact_chunk(last - c, budget)
        if req.media is not None and self.images_bidirectional:
            end = req.media.whole_images_end(c, end)
        return end - c + 1 if end >= last else end - c

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if req.preemptions and self.running and self.finished_running <= req.resume_after:
                return  # preempted: back only once an older request made room (else at once again)
            if (req.kv_session or req.kv_auto) and not req.kv_checked:  # a KV file serves the common prefix
                req.kv_checked = True
                self.sessions.restore(req)
            end = req.prefill_end
            # leaves at least the last of them to compute; nothing cached when the request says so
            match = self.cache.match(req.key_ids[:end] if req.cache_prompt else req.key_ids[:1],
                                     exact=req.params.seed is not None)  # a seed repeats: engine/kv/canonical.py
            need = end - match.length + 1
            if self.pools.full.layers and self.pools.full.n_free < need:
                self.cache.evict(full_tokens=need)
                if self.pools.full.n_free < need:
                    self.cache.release(match.nodes)
                    if not self.running:  # nothing will free up: this prompt can never fit
                        self.waiting.popleft()
                        self._finish(req, "error", f"KV cache full: {need} slots needed, "
                                                   f"{self.pools.full.n_free} free", ErrorKind.CAPACITY)
                        continue
                    return
            self.waiting.popleft()
            if req.media is not None and match.length <= req.media.last_media_pos:
                try:  # once per request, before its prefill: each kind's encoder over all its items
                    req.media.encode()
                except Exception as e:  # noqa: BLE001 (an encoder failure ends this request only)
                    self.cache.release(match.nodes)
                    kinds = " and ".join(req.media.items)
                    # the media the request sent, unless the device ran out of memory
                    kind = ErrorKind.OUT_OF_MEMORY if isinstance(e, torch.OutOfMemoryError) else ErrorKind.BAD_INPUT
                    self._finish(req, "error", f"{kinds} encoder: {str(e).splitlines()[0] if str(e) else e!r}", kind)
                    continue
            req.kv = SequenceKV(self.pools, self.window, self.model.dtype, self.config.window_margin,
                                self.attention_backend, self.ggml_attention, self.host_ggml_attention)
            if match.length:
                req.kv.attach_prefix(match.full_slots, match.win_pos, match.win_slots)
            req.locked, req.cached_len, req.computed_len = match.nodes, match.length, match.length
            if req.first_cached is None:
                req.first_cached = match.length
            req.state = RequestState.PREFILL
            self.running.append(req)

    def _run(self, req: Request, tokens: list[int]) -> None:
        last_of_prompt = req.state == RequestState.DECODE or req.computed_len + len(tokens) == req.prefill_end
        resumed = req.state == RequestState.PREFILL and bool(req.output_ids)  # recomputing after a preemption
        hidden = self.spec is not None and last_of_prompt  # the draft's first h
        if not self._room_for([(req, len(tokens))]):
            return  # preempted, or finished: it does not fit alone
        try:
            media = None
            if req.media is not None and req.state == RequestState.PREFILL:
                media = req.media.chunk(req.computed_len, len(tokens))
            t0 = time.perf_counter()
            logits = self._retry_oom(lambda: self.runner.forward(req.kv, tokens, req.computed_len,
                                                                 want_logits=last_of_prompt, return_hidden=hidden,
                                                                 media=media),
                                     lambda: req.kv.truncate(req.computed_len))
            if req.state == RequestState.DECODE:
                self._record_forward(1, t0)
        except KVPoolFull as e:
            self._finish(req, "error", str(e), ErrorKind.CAPACITY)
            return
        if hidden:
            logits, req.h = logits
        req.computed_len += len(tokens)
        req.check()
        if req.state == RequestState.PREFILL and req.computed_len == req.prefill_end:
            self._hand_to_cache(req, req.prefill_end)  # "regenerate" can reuse the whole prompt
            req.state = RequestState.DECODE
            if resumed:
                return  # its next token was sampled before the preemption: the next step feeds it
        if logits is not None:
            self._postprocess(req, logits)

    def _reserve(self, n: int) -> None:
        """Make room for n new tokens in both pools, evicting cached prefixes if needed."""
        full = n if self.pools.full.layers and self.pools.full.n_free < n else 0
        win = n if self.pools.window.layers and self.pools.window.n_free < n else 0
        if full or win:
            self.cache.evict(full_tokens=full, window_tokens=win)

    def _fits(self, n: int) -> bool:
        return ((not self.pools.full.layers or self.pools.full.n_free >= n)
                and (not self.pools.window.layers or self.pools.window.n_free >= n))

    def _room_for(self, needs: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Free slots for each (running request, new tokens) of one forward: evict unlocked cached
        prefixes, then preempt the newest running request until the rest fit. Returns the needs
        still to run; a request alone in the engine that does not fit ends with an error."""
        needs = list(needs)
        while needs:
            n = sum(k for _, k in needs)
            self._reserve(n)
            if self._fits(n):
                break
            victim = max(self.running, key=lambda r: r.id)  # ids grow with arrival: the newest
            if len(self.running) == 1:
                cap = self.pools.full.capacity if self.pools.full.layers else self.pools.window.capacity
                self._finish(victim, "error", f"KV cache full: {len(victim.all_ids)} tokens of this request "
                                              f"do not fit the {cap}-token KV pool alone", ErrorKind.CAPACITY)
            else:
                self._preempt(victim)
            needs = [(r, k) for r, k in needs if r is not victim]
        return needs

    def _preempt(self, req: Request) -> None:
        """Give `req`'s KV back and queue it first again, output kept; re-admitted, it recomputes
        prompt + output so far (Request.prefill_end) and its stream goes on where it paused."""
        if len(req.kv) > req.computed_len:  # a forward that began (speculative verify rows)
            req.kv.truncate(req.computed_len)
        if req.computed_len:
            self._hand_to_cache(req, req.computed_len)  # evictable, but a later re-admission may hit it
        req.kv.release()
        self.cache.release(req.locked)
        req.kv, req.locked, req.h = None, [], None
        self.running.remove(req)
        req.state, req.computed_len, req.cached_len = RequestState.WAITING, 0, 0
        req.preemptions += 1
        req.resume_after = self.finished_running
        self.waiting.appendleft(req)

    def _hand_to_cache(self, req: Request, n: int) -> None:
        nodes, full_taken, win_taken = self.cache.insert(
            req.key_ids[:n], req.kv.full_slots[:n], req.kv.window_slots_by_position()[:n], req.kv.exact[:n])
        req.kv.hand_over(full_taken, win_taken)
        self.cache.release(req.locked)
        req.locked = nodes

    def _decode_batch(self, reqs: list[Request]) -> None:
        """One batched forward for up to 4 decode-phase requests: a token each, or with a draft
        model [last] + drafts each, padded to a verify width of 1 + spec.tokens rows."""
        rows = {req: [req.all_ids[-1]] + self._drafts(req) for req in reqs}
        batch = []
        for req, _ in self._room_for([(req, len(t)) for req, t in rows.items()]):
            tokens = rows[req]
            try:  # SequenceKV stays the owner of the slots; the decoder copies them into its tables
                req.kv.begin(torch.arange(req.computed_len, req.computed_len + len(tokens)))
            except KVPoolFull as e:
                self._finish(req, "error", str(e), ErrorKind.CAPACITY)
                continue
            batch.append((req, tokens))
        if not batch:
            return
        T = 1 + self.draft_k
        try:
            t0 = time.perf_counter()
            logits, ys = self._retry_oom(
                lambda: self.decoder.forward([r.kv for r, _ in batch], [t for _, t in batch], T))
            self._record_forward(T, t0)
        finally:
            for req, _ in batch:
                req.kv.end()
        for (req, tokens), lg, y in zip(batch, logits, ys):
            if self.draft_k:
                self._commit_verified(req, req.computed_len, tokens[1:], lg[:len(tokens)], y)
            else:
                req.computed_len += 1
                if self.spec is not None:
                    req.h = y[0]  # the draft's h, should it come back on
                req.check()
                self._postprocess(req, lg[0])

    def _decode_together(self, reqs: list[Request]) -> None:
        """Decode-phase requests without the batched decoder (the CPU) in one forward, a token
        each (ModelRunner.decode_together: one token graph of B rows on llama.cpp's kernels)."""
        batch = []
        for req, _ in self._room_for([(req, 1) for req in reqs]):
            try:
                req.kv.begin(torch.tensor([req.computed_len]))
            except KVPoolFull as e:
                self._finish(req, "error", str(e), ErrorKind.CAPACITY)
                continue
            batch.append(req)
        if not batch:
            return
        try:
            t0 = time.perf_counter()
            logits = self._retry_oom(lambda: self.runner.decode_together([r.kv for r in batch],
                                                                         [r.all_ids[-1] for r in batch]))
            self._record_forward(1, t0)
        except BaseException:
            for req in batch:
                req.kv.end()
                req.kv.truncate(req.computed_len)
            raise
        for req in batch:
            req.kv.end()
        for req, lg in zip(batch, logits):
            req.computed_len += 1
            req.check()
            self._postprocess(req, lg)

    def _drafts(self, req: Request) -> list[int]:
        if not self.draft_k:
            return []
        k = max_draft(self.draft_k, len(req.all_ids), len(req.output_ids), req.params.max_tokens,
                      self.context_limit)
        t0 = time.perf_counter()
        drafts = draft_tokens(self.spec, self.model, req.kv, req.all_ids[-1], req.h, req.computed_len, k) if k else []
        if self.draft_policy is not None:  # steps run: the drafts, and one a p_min cut stopped
            self.draft_policy.record_draft(min(k, len(drafts) + 1), self._elapsed(t0))
        if req.grammar is not None:  # a draft the grammar forbids is never accepted: verify only the valid prefix
            drafts = drafts[:req.grammar.valid_prefix(drafts)]
        return drafts

    def _spec_round(self, req: Request) -> None:
        """Draft, verify in one target forward, accept by sample-then-match, roll back (speculative.py)."""
        start, last = req.computed_len, req.all_ids[-1]
        drafts = self._drafts(req)
        tokens = [last] + drafts
        if not self._room_for([(req, len(tokens))]):
            return
        try:
            t0 = time.perf_counter()
            logits, ys = self._retry_oom(lambda: self.runner.forward(req.kv, tokens, start, want_logits=True,
                                                                     all_rows=True, return_hidden=True),
                                         lambda: req.kv.truncate(start))
            self._record_forward(len(tokens), t0)
        except KVPoolFull as e:
            self._finish(req, "error", str(e), ErrorKind.CAPACITY)
            return
        self._commit_verified(req, start, drafts, logits, ys)

    def _commit_verified(self, req: Request, start: int, drafts: list[int], logits: torch.Tensor,
                         ys: torch.Tensor) -> None:
        """Accept over verify rows logits [1+k, V] (post-norm ys [>= 1+k, d]) and roll back the rest."""
        out = accept(req.sampler.sample, logits, drafts, req.all_ids, self._eog)
        n_acc = len(out) - 1
        req.kv.truncate(start + 1 + n_acc)  # drop the rejected drafts' KV
        req.computed_len, req.h = start + 1 + n_acc, ys[n_acc]
        if self.draft_policy is not None:
            self.draft_policy.record_round(len(drafts), n_acc)
        st = self.spec_stats
        st.rounds, st.drafted, st.accepted, st.emitted = (st.rounds + 1, st.drafted + len(drafts),
                                                          st.accepted + n_acc, st.emitted + len(out))
        for tok in out:
            self._accept_token(req, tok)
            if req.state == RequestState.FINISHED:
                break

    def _elapsed(self, t0: float) -> float:
        if self.model.device.type == "cuda":  # the forward's kernels, not their launches
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter() - t0

    def _record_forward(self, rows: int, t0: float) -> None:
        """A decode-phase forward of `rows` rows a sequence, for the draft's cost (draft_policy.py)."""
        if self.draft_policy is not None:
            self.draft_policy.record_forward(rows, self._elapsed(t0))

    # --- failures ------------------------------------------------------------------------------
    def _retry_oom(self, forward, undo=None):
        """Run a model forward; on a CUDA out-of-memory error give the allocator's cached blocks
        back and try once more (`undo` first drops the slots the failed forward took)."""
        try:
            return forward()
        except torch.OutOfMemoryError:
            if self.model.device.type != "cuda":
                raise
            if undo is not None:
                undo()
            torch.cuda.empty_cache()
            return forward()

    def recover(self, exc: BaseException) -> str:
        """After a step raised: end the running requests with a one-line reason (their KV slots go
        back to the pools; waiting requests stay queued) and return the reason."""
        kind = ErrorKind.INTERNAL
        if isinstance(exc, torch.OutOfMemoryError):
            kind = ErrorKind.OUT_OF_MEMORY
            reason = ("out of memory in a model forward: lower --gpu-memory-budget (or the context, or use "
                      "int8_per_token_head KV) and try again")
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        for req in list(self.running):
            if req.kv is not None and len(req.kv) > req.computed_len:
                req.kv.truncate(req.computed_len)  # a forward that began and failed
            self._finish(req, "error", reason, kind)
        return reason

    def check(self) -> None:
        """Consistency of pools and prefix cache (AssertionError naming what is wrong): every slot
        is free, cached, or held by a running sequence, exactly once; idle: no lock is held."""
        for pool, cached_of, held_of in ((self.pools.full, lambda n: n.full, lambda kv: kv.full_slots[kv.full_owned]),
                                         (self.pools.window, lambda n: n.win[n.win >= 0],
                                          lambda kv: kv.win_slots[kv.win_owned])):
            if not pool.layers:
                continue
            seen = pool.free_slots().tolist()
            for node in self.cache._nodes():
                seen += cached_of(node).tolist()
            for req in self.running:
                if req.kv is not None:
                    seen += held_of(req.kv).tolist()
            dup = len(seen) - len(set(seen))
            assert dup == 0, f"{pool.name} pool: {dup} slots counted twice"
            assert sorted(seen) == list(range(pool.capacity)), \
                f"{pool.name} pool: {pool.capacity - len(set(seen))} slots leaked"
        for node in self.cache._nodes():
            assert len(node.tokens) == len(node.full) == len(node.win), "prefix-cache node of mixed lengths"
            assert node.lock >= 0, "negative prefix-cache lock"
            if not self.running:
                assert node.lock == 0, "prefix-cache node locked with nothing running"

    # --- after a forward ---------------------------------------------------------------------
    @property
    def _eog(self) -> frozenset:
        return frozenset(self.tokenizer.eog_ids) if self.tokenizer is not None else frozenset()

    def _postprocess(self, req: Request, logits: torch.Tensor) -> None:
        self._accept_token(req, req.sampler.sample(logits, req.all_ids))

    def _accept_token(self, req: Request, tok: int) -> None:
        """Append one sampled token: stream it, or finish on end-of-generation / stops / limits."""
        if req.t_first is None:
            req.t_first = time.perf_counter()
        picked = req.sampler.picked.popleft() if req.sampler.picked else None  # its logprobs, when asked
        if tok in self._eog:
            self._finish(req, "stop")
            return
        req.output_ids.append(tok)
        if req.detok is not None:
            req.text += req.detok.push(tok)
        reason = None
        for stop in req.stop_strings:
            at = req.text.find(stop)
            if at >= 0:
                req.text, reason = req.text[:at], "stop"
        if reason is None and req.stop_at_blank_line and (at := blank_line_stop(req.text)) >= 0:
            req.text, reason = req.text[:at], "stop"
        if reason is None and req.grammar is not None and req.grammar.complete_after(len(req.output_ids)):
            reason = "stop"  # the grammar is complete and allows only the end: no step spent sampling it
        if reason is None and (len(req.output_ids) >= req.params.max_tokens
                               or len(req.all_ids) >= self.context_limit):
            reason = "length"
        # Hold back text that could still become a stop string, so none is ever streamed.
        hold = 0 if reason else max((len(s) - 1 for s in req.stop_strings), default=0)
        if not reason and req.stop_at_blank_line:
            hold = max(hold, blank_line_hold(req.text))
        upto = max(req.emitted, len(req.text) - hold)
        req.events.put(StreamEvent(req.id, [tok], req.text[req.emitted:upto],
                                   logprobs=None if picked is None else [picked]))
        req.emitted = upto
        if reason:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str, error: Optional[str] = None,
                kind: Optional[ErrorKind] = None) -> None:
        assert (reason == "error") == (error is not None) == (kind is not None), (reason, error, kind)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.finished_running += 1
        req.sampler.picked.clear()  # rows a speculative round sampled past the end
        if req.kv is not None:
            if len(req.kv) > len(req.all_ids):  # a speculative round committed fewer tokens
                req.kv.truncate(len(req.all_ids))
            n = len(req.kv)
            if reason != "error" and n:
                self._hand_to_cache(req, n)  # the next turn reuses the conversation
                self.sessions.finished(req, n)
            req.kv.release()
        self.cache.release(req.locked)
        req.locked = []
        if req.detok is not None and reason != "stop":
            req.text += req.detok.flush()
        tail, req.emitted = req.text[req.emitted:], len(req.text)
        req.state, req.finish_reason = RequestState.FINISHED, reason
        req.t_done = time.perf_counter()
        self.requests.pop(req.id, None)  # a server runs for days: finished requests are not kept
        req.events.put(StreamEvent(req.id, [], tail, True, reason, error, req.stats(), kind))

    # --- status --------------------------------------------------------------------------------
    def status(self) -> dict:
        return {"pools": self.pools.status(), "cache_type": self.cache.kind,
                "attention_backend": "torch" if self.attention_backend is None else self.attention_backend.name,
                "cached_prefix_tokens": self.cache.cached_tokens(), "running": len(self.running),
                "waiting": len(self.waiting), "context_limit": self.context_limit,
                "images": self.vision is not None,  # whether requests may carry images
                "audio": self.audio is not None,  # and audio clips
                "speculative": self._spec_status(),
                "device_memory": self._device_memory(),
                "host_experts": self._host_experts(),
                "cpu_layers": self._cpu_layers()}

    def _host_experts(self) -> Optional[dict]:
        """Beside a GPU with expert banks in host RAM: the layers, the bytes that crossed, the hot-
        expert cache's slots and hit rate (models/host_experts.py, expert_cache.py); else None."""
        layers = getattr(self.model, "host_expert_layers", ())
        if not layers:
            return None
        out = {"layers": len(layers), **getattr(self.model, "host_traffic", {})}
        cache = getattr(self.model, "expert_cache", None)
        if cache is not None:
            st = cache.stats
            out.update(cache_slots=cache.slots, hit_rate=round(st.hit_rate, 4), lookups=st.lookups,
                       hits=st.hits, copies=st.copies)
        return out

    def _cpu_layers(self) -> Optional[dict]:
        """Beside a GPU with the first layers on the CPU: how many, their runtime, the forwards, the
        residual's crossings and bytes, the host's milliseconds (models/host_layers.py); else None."""
        host = self.host_layers
        if host is None:
            return None
        return {"layers": host.n, "runtime": host.runtime.value, **host.traffic}

    def _spec_status(self) -> Optional[dict]:
        if self.spec is None:
            return None
        policy = self.draft_policy.as_dict() if self.draft_policy is not None else {"draft": "draft on (fixed)"}
        return {**self.spec_stats.as_dict(), **policy}

    def _device_memory(self) -> Optional[dict]:
        """CUDA: bytes torch has allocated now and at peak (weights, pools, workspace); None on the CPU."""
        dev = self.model.device
        if dev.type != "cuda":
            return None
        return {"allocated": torch.cuda.memory_allocated(dev), "peak": torch.cuda.max_memory_allocated(dev)}

    def close(self) -> None:
        """Save conversations' KV not on disk yet and wait for the writer."""
        self.sessions.close()

    def run_to_completion(self) -> None:
        while self.has_work:
            self.step()
