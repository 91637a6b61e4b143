"""Memory planner: where every byte of a budget goes, and how much context that leaves.

Order of placement inside the budget (device memory on CUDA, host memory with --device cpu):
  1. weights, in their GGUF quantized form (bytes = TensorInfo.n_bytes). With embed_weights="host"
     the per-layer-embedding (PLE) table lives in host memory and only the rows of the current
     tokens are copied over each step. token_embd moves to the host too when the file has its own
     `output.weight`; with a tied head (E2B/E4B) the matrix stays on the device as the LM head, and
     its host copy (the memory-mapped file) serves the row lookups, so it is counted on both sides.
  2. the draft model (all of its tensors), when given;
  3. the activation workspace of one step (`activation_workspace`) and a runtime reserve (CUDA
     context + caching-allocator slack; the torch runtime itself on the CPU);
  4. the staging buffers for gathered embedding rows (host embeddings only);
  5. the window pool: per running request W + chunk + spec margin slots (the W keys the first
     chunk token still sees, plus the chunk being written, plus draft tokens under
     verification), and `prefix_windows` more windows per request for cached prefixes;
  6. the full pool: everything left, up to what the running requests and the prefix cache can
     use: (max_running + prefix_contexts) x the model's context (`full_pool_cap`); the rest of a
     large budget stays free (an H200's 125 GiB gave E2B a 21.4M-token, 122 GiB pool, zero-filled
     at start). One request can use it all, so the longest context is min(model context, full
     pool tokens).
Beside a GPU the weights of 1 are split first (engine/placement.py, `plan_candidates`): expert
banks and then whole layers stay in host RAM, by llama.cpp's flags or auto, the CPU layers' KV in
host memory too; with banks in host RAM the GPU memory the target context (--ctx-size, else the
model's) leaves is the hot-expert cache, before the full pool takes the rest.
When the defaults do not fit (1-5 plus a `min_context`-token full pool), the planner fits the
settings the user left unset, like llama.cpp's `--fit`: it halves the prefill chunk (down to
MIN_FIT_CHUNK), and if even that is not enough lowers the running requests (down to 1), taking at
each count the largest chunk that fits; the plan's `fitted` line says what changed. A value the
user gave (`prefill_chunk`, `max_running` not None) is kept as given. Only when the smallest
settings do not fit either does it raise BudgetTooSmall, whose one-line message names the
shortfall and the flags (each checked by re-planning) that would fit, the user's own
--prefill-chunk / --max-running-requests among them.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from .sizes import GiB, MiB, BudgetTooSmall, fmt_size, parse_size  # noqa: F401 (re-exported)
from .kv.format import FORMAT_NAMES, FormatUnsupported, owning_layers, pool_unit_bytes, resolve_format
from .plan_refusal import too_small
from .placement import Placement, PlacementFlags, auto_steps, from_flags, is_expert_bank
from .plan_parts import audio_bytes, draft_bytes, vision_bytes  # noqa: F401 (vision_bytes, audio_bytes: API)

KEY_TILE = 2048  # keys per attention tile of a prefill chunk on full layers (online softmax)
KNOWN_MODELS = {(35, 1536): "E2B", (42, 2560): "E4B", (30, 2816): "26B-A4B", (60, 5376): "31B"}
DEFAULT_RUNNING = 4  # requests decoded together when the user does not say
# The fit's floor for the chunk (issue 14). Every prefill step reads all device weights once: for
# E4B Q4_K_M 2.8 GiB, ~10 ms at 300 GB/s, against ~0.4 ms of matmul per token (8 GFLOP at 20
# TFLOPS; estimates, not measured), so at 256 tokens ~10% of a step is weight reads, and the share
# doubles with each further halving.
MIN_FIT_CHUNK = 256




def _at(v, i: int) -> int:
    return v[i] if isinstance(v, (tuple, list)) else v


@dataclass(frozen=True)
class PlanOptions:
    budget: Optional[int] = None  # None: default_budget(device)
    device: str = "cuda"  # the target: "auto" formats and the chunk/dtype defaults follow it
    kv_format: str = "auto"  # full pool
    swa_format: str = "bf16"  # window pool
    embed_weights: str = "host"  # "host" | "device"
    prefill_chunk: Optional[int] = None  # None: 2048 on CUDA, 512 on the CPU, halved to fit the budget
    max_running: Optional[int] = None  # None: DEFAULT_RUNNING, lowered to fit the budget
    draft: Any = None  # path of a draft GGUF, or an opened layout
    mmproj: Any = None  # path of the image/audio encoders' mmproj GGUF, or an opened layout
    runtime_reserve: int = 300 * MiB
    dequantizes: bool = True  # prefill dequantizes a layer matrix (CUDA, the torch formats; not llama.cpp's kernels)
    spec_margin: int = 8  # draft tokens verified per request and step
    prefix_windows: int = 2  # cached prefix windows kept per running request
    prefix_contexts: int = DEFAULT_RUNNING  # whole contexts of cached prefixes the full pool keeps beyond
    # the running requests' own (the full pool's cap: full_pool_cap)
    min_context: int = 4096  # smallest full pool worth running
    share_kv: bool = True
    # beside a GPU (engine/placement.py): the flags as given (none: auto), the context the placement
    # keeps room for (--ctx-size; None: the model's for expert banks, min_context for whole layers),
    # and the hot-expert cache's cap (None: what the budget leaves, 0: off)
    placement: PlacementFlags = PlacementFlags()
    ctx_size: Optional[int] = None
    moe_cache: Optional[int] = None

    @property
    def chunk(self) -> int:
        return self.prefill_chunk if self.prefill_chunk is not None else default_chunk(self.device)

    @property
    def running(self) -> int:
        return self.max_running if self.max_running is not None else DEFAULT_RUNNING

    @property
    def step_tokens(self) -> int:
        """Most rows one forward step carries: a prefill chunk plus every running request's decode
        row and its draft tokens (a scheduler may mix them)."""
        return self.chunk + self.running * (1 + self.spec_margin)


def full_pool_cap(cfg, opt: PlanOptions) -> int:
    """The most full-pool tokens worth holding: every running request at the model's whole context,
    plus `prefix_contexts` contexts of cached prefixes (conversations to come back to)."""
    return (opt.running + opt.prefix_contexts) * cfg.context_length


def default_chunk(device: str) -> int:
    return 2048 if device == "cuda" else 512


def _proc_kib(path: str, key: str) -> Optional[int]:
    """Bytes of a "Key:   N kB" line of a /proc file, or None when it has no such line."""
    with open(path) as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def host_available() -> int:
    n = _proc_kib("/proc/meminfo", "MemAvailable")
    if n is None:
        raise RuntimeError("no MemAvailable in /proc/meminfo")
    return n


def process_anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon): what a model loaded into it holds
    outside the page cache (weights read into buffers; a mapped file's pages count as available)."""
    return _proc_kib("/proc/self/status", "RssAnon") or 0


def loaded_budget(device: str) -> tuple[int, str]:
    """`default_budget` for a plan made after the model is loaded into this process: the weights
    already took their share of available memory, so what they hold (RssAnon on the CPU, torch's
    allocated bytes on CUDA) is counted back in (the plan counts the weights in what it needs), and
    the plan made before the load (which placed the weights) is the plan made after it."""
    budget, source = default_budget(device)
    if device == "cuda":
        import torch

        if torch.cuda.is_available():  # the loaded weights are allocated already: count them back in
            return budget + torch.cuda.memory_allocated(), f"{source}, plus what this process has allocated there"
        return budget, source
    if device != "cpu":
        return budget, source
    return budget + process_anon_bytes(), f"{source}, plus what this process holds (the loaded weights)"


def default_budget(device: str) -> tuple[int, str]:
    """90% of free memory: the other 10% is left to the desktop, other processes and fragmentation."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0] * 0.9), "90% of free CUDA memory"
    where = " (no CUDA device here)" if device == "cuda" else ""
    return int(host_available() * 0.9), f"90% of available host memory{where}"


def activation_workspace(cfg, opt: PlanOptions) -> dict[str, int]:
    """Peak scratch of one step of T = opt.step_tokens rows, every buffer counted as live at once
    (a preallocated arena, so no overlap is assumed). a = 2 bytes (bf16) on CUDA, 4 on the CPU."""
    T, a, L = opt.step_tokens, 2 if opt.device == "cuda" else 4, cfg.n_layer
    d, P, W = cfg.d_model, getattr(cfg, "ple_width", 0), cfg.sliding_window or 0
    nh = max(_at(cfg.n_head, i) for i in range(L))
    q_w = max(_at(cfg.n_head, i) * _at(cfg.head_dim, i) for i in range(L))
    qkv_w = max((_at(cfg.n_head, i) + 2 * _at(cfg.n_kv_head, i)) * _at(cfg.head_dim, i) for i in range(L))
    ff = max(_at(cfg.ffn_width, i) for i in range(L))
    rows = opt.running * (1 + opt.spec_margin)
    return {
        # residual stream, normed input, sublayer output, PLE branch: 4 rows of d
        "hidden": 4 * T * d * a,
        # q/k/v of the widest layer plus the attention output before o_proj
        "qkv": T * (qkv_w + q_w) * a,
        # fp32 scores of the chunk against one key tile: a sliding layer sees at most W + T keys,
        # a full layer walks its context in KEY_TILE-key tiles, so the context length never enters
        "scores": nh * T * max(W + T, KEY_TILE) * 4,
        # gate and up of the widest FFN (the GELU product overwrites gate)
        "ffn": 2 * T * ff * a,
        # per-layer inputs [T, L, P]: gathered token rows and the projected context, fp32
        "ple": 2 * T * L * P * 4,
        # fp32 logits of the sampled rows: each running request's decode row and its draft tokens
        "logits": rows * cfg.vocab_size * 4,
        # one quantized layer matrix dequantized for the prefill GEMM (the head is never expanded)
        "dequant": _largest_layer_matrix(cfg) * a if opt.dequantizes else 0,
        # MoE (26B-A4B): fp32 router probabilities [T, E], and gate/up of the top-k experts of
        # every row [T, k, 2I] (26B at T = 2084: 1.0 + 44.8 MiB in bf16)
        "experts": (T * getattr(cfg, "n_expert", 0) * 4
                    + T * getattr(cfg, "n_expert_used", 0) * 2 * getattr(cfg, "expert_ffn_width", 0) * a),
    }


def _largest_layer_matrix(cfg) -> int:
    L, d = cfg.n_layer, cfg.d_model
    return max(max(_at(cfg.ffn_width, i), _at(cfg.n_head, i) * _at(cfg.head_dim, i)) * d for i in range(L))


def _model_label(layout, cfg) -> str:
    return KNOWN_MODELS.get((cfg.n_layer, cfg.d_model), layout.path.name)


def layout_config(layout):
    """The model config of a GGUF (or synthetic) layout, for its architecture."""
    if layout.architecture == "gemma4":
        from models.gemma4 import Gemma4Config
        return Gemma4Config.from_gguf(layout)
    from models.gemma3 import Gemma3Config
    return Gemma3Config.from_gguf(layout)


def read_tensors(layout, cfg) -> set[str]:
    """Names the model reads (K/V of KV-shared layers are skipped even when the file has them)."""
    if layout.architecture == "gemma4":
        from models.gemma4 import tensor_plan
        return (set(tensor_plan(cfg, set(layout.tensors))) | {"rope_freqs.weight"}) & set(layout.tensors)
    return set(layout.tensors)


@dataclass
class MemoryPlan:
    model: str
    device: str
    budget: int
    budget_source: str
    options: dict
    components: list[dict] = field(default_factory=list)  # name, device_bytes, host_bytes, detail
    kv: dict = field(default_factory=dict)  # "full"/"window": format, unit_bytes, layers, tokens, bytes
    context_length: int = 0
    max_context: int = 0
    fitted: str = ""  # "fitted to the budget: prefill chunk 2048 -> 512, ..." when the fit lowered a default
    capped: str = ""  # "full pool capped at ... tokens ..." when the budget holds more than the cap
    placement: dict = field(default_factory=dict)  # beside a GPU: what stays in host RAM (engine/placement.py)

    @property
    def device_total(self) -> int:
        return sum(c["device_bytes"] for c in self.components)

    @property
    def host_total(self) -> int:
        return sum(c["host_bytes"] for c in self.components)

    def to_dict(self) -> dict:
        return {**asdict(self), "device_total": self.device_total, "host_total": self.host_total,
                "unused_bytes": self.budget - self.device_total}


class _Short(Exception):
    """`_place` ran out of budget: `needed` bytes for the weights, workspace and min_context pool."""

    def __init__(self, needed: int):
        self.needed = needed


def plan_memory(layout, opt: PlanOptions = PlanOptions(), cfg=None, _suggest: bool = True) -> MemoryPlan:
    """Plan one model layout (a GGUFFile or a synthetic layout) under the options' budget, fitting
    the prefill chunk and running requests the user left unset (module docstring)."""
    if opt.embed_weights not in ("host", "device"):
        raise ValueError(f"--embed-weights must be host or device, not {opt.embed_weights!r}")
    if opt.chunk <= 0 or opt.running <= 0:
        raise ValueError("--prefill-chunk and --max-running-requests must be positive")
    if opt.ctx_size is not None and opt.ctx_size <= 0:
        raise ValueError(f"--ctx-size must be positive, not {opt.ctx_size}")
    cfg = cfg or layout_config(layout)
    budget, source = (opt.budget, "--gpu-memory-budget") if opt.budget is not None else default_budget(opt.device)
    sizes = {n: layout.tensor(n).n_bytes for n in read_tensors(layout, cfg)}  # once: ~15 ms for E4B
    for placed, tried, need in plan_candidates(cfg, opt, list(sizes)):
        try:
            plan = _place(layout, tried, cfg, budget, source, dict(sizes), placed, need)
        except _Short as short:
            needed = short.needed
            continue
        plan.fitted = fitted_note(opt, tried)
        return plan
    raise too_small(cfg, opt, tried, needed, budget, _suggest, placed, _model_label(layout, cfg),
                    lambda o: plan_memory(layout, o, cfg, _suggest=False))


def target_context(cfg, opt: PlanOptions) -> int:
    """The context a placement keeps room for before the hot-expert cache takes the rest."""
    return min(opt.ctx_size or cfg.context_length, cfg.context_length)


def plan_candidates(cfg, opt: PlanOptions, names: list[str]) -> list[tuple[Optional[Placement], PlanOptions, int]]:
    """(placement, options, the context that must fit) in the order plan_memory tries them. Off a
    GPU: no placement, the fit's steps. Flags: their placement, the fit's steps. Auto: expert banks
    leave the GPU while the target context (--ctx-size, else the model's) does not fit (all at once,
    the cache taking their room, or from the first layer up with --moe-cache off); with every bank
    on the host the fit's steps (chunk, requests) at the floor
    context (--ctx-size, else min_context); then whole layers, one more each time the fit's steps
    are exhausted: a layer leaves the GPU only when no smaller chunk or request count lets it stay."""
    steps = fit_steps(opt)
    floor = min(opt.ctx_size or opt.min_context, cfg.context_length)
    if opt.device != "cuda":
        return [(None, t, floor) for t in steps]
    if opt.placement.given:
        placed = from_flags(names, cfg.n_layer, opt.placement)
        return [(placed, t, floor) for t in steps]
    auto = list(auto_steps(names, cfg.n_layer, partial=opt.moe_cache == 0, layers=not getattr(cfg, "n_kv_shared", 0)))
    kept = [p for p in auto if not p.cpu_layers]
    return ([(p, steps[0], target_context(cfg, opt)) for p in kept[:-1]]
            + [(kept[-1], t, floor) for t in steps] + [(p, t, floor) for p in auto[len(kept):] for t in steps])


def fit_steps(opt: PlanOptions) -> list[PlanOptions]:
    """The settings plan_memory tries, in order: the options as given first, then for each running
    count from the default down to 1 every chunk from the default halving down to MIN_FIT_CHUNK,
    so requests are given up only when no chunk fits. Values the user set are never changed."""
    steps = _chunks_then_running(opt)
    if opt.device == "cpu" and "auto" in (opt.kv_format, opt.swa_format):
        # the CPU's "auto" KV is fp32 (exact numerics); where that does not fit with a smaller
        # chunk, bf16 (llama.cpp's default is f16) before any request is given up: a 31B on 24 GB
        narrow = replace(opt, kv_format="bf16" if opt.kv_format == "auto" else opt.kv_format,
                         swa_format="bf16" if opt.swa_format == "auto" else opt.swa_format)
        steps = [t for t in steps if t.running == opt.running] + _chunks_then_running(narrow)
    return steps


def _chunks_then_running(opt: PlanOptions) -> list[PlanOptions]:
    chunks = [opt.chunk]
    if opt.prefill_chunk is None:
        while chunks[-1] // 2 >= MIN_FIT_CHUNK:
            chunks.append(chunks[-1] // 2)
    runs = [opt.running] if opt.max_running is not None else range(opt.running, 0, -1)
    return [replace(opt, prefill_chunk=c, max_running=r) for r in runs for c in chunks]


def fitted_note(asked: PlanOptions, got: PlanOptions) -> str:
    """One line naming what the fit lowered ("" when the options fit as asked)."""
    changes = [f"{what} {a} -> {b}" for what, a, b in (("prefill chunk", asked.chunk, got.chunk),
                                                       ("running requests", asked.running, got.running),
                                                       ("KV", asked.kv_format, got.kv_format),
                                                       ("window KV", asked.swa_format, got.swa_format)) if a != b]
    return "fitted to the budget: " + ", ".join(changes) if changes else ""


def _place(layout, opt: PlanOptions, cfg, budget: int, source: str, sizes: dict[str, int],
           placed: Optional[Placement] = None, need: int = 0) -> MemoryPlan:
    """Place every component for exactly these options and placement (`sizes`: bytes of each weight
    the model reads, consumed); _Short when the budget cannot hold them with a `need`-token pool."""
    full_fmt, win_fmt = resolve_format(opt.kv_format, opt.device), resolve_format(opt.swa_format, opt.device)
    host_embed, tied = opt.embed_weights == "host", "output.weight" not in layout
    name = _model_label(layout, cfg)
    plan = MemoryPlan(name, opt.device, budget, source, {**asdict(replace(
                      opt, draft=str(opt.draft) if opt.draft is not None else None,
                      mmproj=str(getattr(opt.mmproj, "path", opt.mmproj)) if opt.mmproj is not None else None)),
                      "prefill_chunk": opt.chunk, "max_running": opt.running,
                      "step_tokens": opt.step_tokens}, context_length=cfg.context_length)

    def add(what, dev, host=0, detail=""):
        plan.components.append({"name": what, "device_bytes": int(dev), "host_bytes": int(host), "detail": detail})

    placed = placed or Placement(source="")
    host_w = {n: sizes.pop(n) for n in placed.host if n in sizes and n not in _TABLES}
    emb, head = sizes.pop("token_embd.weight", 0), sizes.pop("output.weight", 0)
    ple = sizes.pop("per_layer_token_embd.weight", 0)
    blk = sum(v for n, v in sizes.items() if n.startswith("blk."))
    head_host = ("output.weight" if not tied else "token_embd.weight") in placed.host
    if tied:
        add("token_embd (tied LM head)", 0 if head_host else emb, emb if host_embed or head_host else 0,
            "head on the host (--override-tensor)" if head_host else
            "head on the device; lookups from the host copy" if host_embed else "")
    else:
        add("token_embd + output head", (0 if head_host else head) + (0 if host_embed else emb),
            (emb if host_embed else 0) + (head if head_host else 0))
    if ple:
        add("per-layer embeddings (PLE)", 0 if host_embed else ple, ple if host_embed else 0,
            "rows gathered per step" if host_embed else "")
    on_gpu = f"{placed.gpu_layers(cfg.n_layer)} of {cfg.n_layer} on the GPU" if placed.source else str(cfg.n_layer)
    add(f"layers ({on_gpu})", blk)
    add("other weights", sum(sizes.values()) - blk, 0, "norms and other non-layer tensors")
    host_experts = sum(host_w.get(n, 0) for n in placed.host_banks)
    if host_w:
        add("weights in host RAM", 0, sum(host_w.values()), placed.describe(cfg.n_layer))
    biggest = max((host_w[n] for n in placed.host_banks), default=0)
    if host_experts:  # two buffers of the largest host bank (models/expert_stream.py)
        add("expert streaming buffers", 2 * biggest, 0, f"two of {fmt_size(biggest)}: prefill chunks of 32+ rows "
            "multiply the host layers' experts on the GPU, the banks copied in double-buffered")
    if opt.draft is not None:
        add("draft model", draft_bytes(opt.draft))
    if opt.mmproj is not None:
        vw, va = vision_bytes(opt.mmproj, opt.device)
        if vw:
            add("image encoder (mmproj)", vw + va, 0,
                f"weights {fmt_size(vw)} + activation peak {fmt_size(va)} (one image at 1120 tokens)")
        aw, aa = audio_bytes(opt.mmproj, opt.device)
        if aw:
            add("audio encoder (mmproj)", aw + aa, 0,
                f"weights {fmt_size(aw)} + activation peak {fmt_size(aa)} (one 30 s piece, 750 tokens)")
    ws = activation_workspace(cfg, opt)
    add("activation workspace", sum(ws.values()), 0,
        f"{opt.step_tokens} tokens/step: " + ", ".join(f"{k} {fmt_size(v)}" for k, v in ws.items()))
    add("runtime reserve", opt.runtime_reserve, 0, "CUDA context + allocator slack" if opt.device == "cuda" else "torch runtime")
    if host_embed:
        rows = opt.step_tokens * (cfg.d_model + cfg.n_layer * getattr(cfg, "ple_width", 0)) * 4
        add("embedding staging", rows, rows, "gathered fp32 rows: pinned host + device landing buffer")

    W = cfg.sliding_window or 0
    cpu = set(placed.cpu_layers)
    win_unit, full_unit = _unit(cfg, win_fmt, True, opt.share_kv), _unit(cfg, full_fmt, False, opt.share_kv)
    win_host = _unit(cfg, win_fmt, True, opt.share_kv, placed.cpu_layers) if cpu else 0
    full_host = _unit(cfg, full_fmt, False, opt.share_kv, placed.cpu_layers) if cpu else 0
    win_tokens = (opt.running * (W + opt.chunk + opt.spec_margin + opt.prefix_windows * W)
                  if win_unit else 0)
    add("window KV pool", win_tokens * (win_unit - win_host), win_tokens * win_host,
        f"{win_fmt.name}, {win_unit} B/token, {win_tokens} tokens" + (", host part: the CPU layers'" if cpu else ""))

    fixed, dev_unit = plan.device_total, full_unit - full_host
    needed = fixed + dev_unit * need
    if needed > budget:
        raise _Short(needed)
    cache, slot = 0, 0
    if host_experts and opt.moe_cache != 0:  # the hot-expert cache: what the target context leaves
        kept = min(target_context(cfg, opt), (budget - fixed) // dev_unit if dev_unit else cfg.context_length)
        cache = min(budget - fixed - kept * dev_unit, host_experts,
                    opt.moe_cache if opt.moe_cache is not None else host_experts)
        slot = _expert_slot_bytes(layout, cfg, placed)
        cache = cache // slot * slot  # whole slots
        add("hot-expert cache", cache, 0, f"{cache // slot} expert slots of {fmt_size(slot)} (one expert's "
            f"gate/up and down), after a {kept:,}-token context")
        fixed += cache
    cap = full_pool_cap(cfg, opt)
    full_tokens = (budget - fixed) // dev_unit if dev_unit else (cap if full_host else 0)
    if full_tokens > cap:
        full_tokens = cap
        plan.capped = (f"full pool capped at {cap:,} tokens: ({opt.running} running requests + {opt.prefix_contexts} "
                       f"cached prefixes) x {cfg.context_length:,}-token context; "
                       f"{fmt_size(budget - fixed - cap * dev_unit)} of the budget left unused")
    add("full KV pool", full_tokens * dev_unit, full_tokens * full_host,
        f"{full_fmt.name}, {full_unit} B/token, {full_tokens} tokens" + (", host part: the CPU layers'" if cpu else ""))
    for key, fmt, unit, toks, sliding in (("full", full_fmt, full_unit, full_tokens, False),
                                          ("window", win_fmt, win_unit, win_tokens, True)):
        plan.kv[key] = {"format": fmt.name, "unit_bytes": unit, "tokens": toks, "bytes": unit * toks,
                        "layers": owning_layers(cfg, sliding, opt.share_kv)}
    plan.kv["full"]["cap"] = cap
    if placed.source:
        plan.placement = {"source": placed.source, "gpu_layers": placed.gpu_layers(cfg.n_layer),
                          "cpu_layers": list(placed.cpu_layers), "host_expert_layers": list(placed.expert_layers),
                          "host_weight_bytes": sum(host_w.values()), "host_expert_bytes": host_experts,
                          "expert_cache_bytes": cache, "expert_slot_bytes": slot,
                          "stream_buffer_bytes": 2 * biggest,
                          "target_context": target_context(cfg, opt),
                          "host_tensors": sorted(placed.host), "summary": placed.describe(cfg.n_layer)}
    # No full-attention owner (all layers sliding): the context is bounded by the model only.
    plan.max_context = min(cfg.context_length, full_tokens) if full_unit else cfg.context_length
    return plan


@functools.lru_cache(maxsize=256)
def _unit(cfg, fmt, sliding: bool, share_kv: bool, layers: Optional[tuple] = None) -> int:
    """pool_unit_bytes, memoized: the auto placement plans a model up to ~700 times."""
    return pool_unit_bytes(cfg, fmt, sliding, share_kv, None if layers is None else set(layers))


_TABLES = ("token_embd.weight", "output.weight", "per_layer_token_embd.weight")  # placed by the tables' own rules


def _expert_slot_bytes(layout, cfg, placed: Placement) -> int:
    """Bytes of one expert of one host layer (its share of the gate/up and down banks): a cache slot."""
    b = f"blk.{placed.expert_layers[0]}."
    return max(1, sum(layout.tensor(n).n_bytes for n in placed.host if is_expert_bank(n) and n.startswith(b))
               // max(cfg.n_expert, 1))


def max_context_by_format(layout, opt: PlanOptions = PlanOptions(), cfg=None) -> dict[str, Optional[dict]]:
    """The plan's full pool and max context for every full-pool format the device can store
    (None: does not fit; fp8 is left out below sm_80)."""
    cfg = cfg or layout_config(layout)
    if opt.budget is None:
        opt = replace(opt, budget=default_budget(opt.device)[0])
    out: dict[str, Optional[dict]] = {}
    for f in FORMAT_NAMES[1:]:
        try:
            p = plan_memory(layout, replace(opt, kv_format=f), cfg, _suggest=False)
            out[f] = {"unit_bytes": p.kv["full"]["unit_bytes"], "full_pool_tokens": p.kv["full"]["tokens"],
                      "max_context": p.max_context}
        except BudgetTooSmall:
            out[f] = None
        except FormatUnsupported:
            continue
    return out
