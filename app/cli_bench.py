"""`edgegem bench`: the benchmarks of engine/bench/ from the command line (GPU engine, CPU beside
llama.cpp, per-op profile, static kernel report, GEMV, KV resume, speculative, constraints, audio,
the API server, the host-experts decode model)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .cli_options import _int_list


def cmd_bench(a) -> int:
    if a.model and a.synthetic:
        raise ValueError("give --model or --synthetic, not both")
    _int_list(a.prompt_lengths, "--prompt-lengths")  # bad lists fail before any work starts
    _int_list(a.contexts, "--contexts")
    if a.offload_model:  # one expert mix timed here, decode tok/s predicted for GPU + host systems
        from engine.bench import offload_model_bench
        from engine.cpu_runtime import default_threads
        if a.measure_seconds <= 0 or not 0 <= a.hit_rate <= 1 or a.offload_context < 1:
            raise ValueError("--offload-model needs --measure-seconds > 0, --hit-rate in [0, 1] and "
                             "--offload-context >= 1")
        threads = sorted({1, a.threads or default_threads()})
        out = offload_model_bench(a.measure_seconds, threads, a.offload_context, a.hit_rate)
    elif a.constraints:  # the grammar mask per token on the model's vocabulary (no weights loaded)
        from engine import api
        from engine.bench import constraint_bench
        out = constraint_bench(api.resolve_model(a.model), threads=a.threads)
    elif a.serve:  # the API server beside llama-cpp-python's, each in its own process
        from engine import api

        from .server.bench import serve_bench
        out = serve_bench(api.resolve_model(a.model), list(_int_list(a.clients, "--clients")), a.serve_tokens,
                          a.long_words, a.threads, not a.no_llama_cpp, a.max_running_requests,
                          progress=lambda s: print(s, file=sys.stderr))
    elif a.static:  # compiled, not run: kernels per step, bytes per token, GEMV instructions per byte
        if not a.synthetic:  # the variant itself is checked by static_report
            raise ValueError("--static needs --synthetic e2b, e4b or 26b-a4b")
        from engine.bench import static_report
        out = static_report(a.synthetic, a.arch, kv=a.kv_cache_dtype)
    elif a.audio:  # the audio tower's encode time per clip length
        from engine.bench import audio_bench
        if a.threads:
            import torch
            torch.set_num_threads(a.threads)
        try:
            lengths = [float(x) for x in a.audio_seconds.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--audio-seconds must be comma-separated numbers, got {a.audio_seconds!r}") from None
        if not lengths or min(lengths) <= 0.01:
            raise ValueError("--audio-seconds needs lengths over 0.01 s")
        out = audio_bench(lengths, a.mmproj, "cuda" if a.device == "cuda" else "cpu",
                          progress=lambda s: print(s, file=sys.stderr))
    elif a.kv_resume:  # restore from a KV file vs cold prefill, through the engine
        from engine import api
        from engine.bench import kv_resume_bench
        from engine.cpu_runtime import set_threads
        set_threads(a.threads)
        dev = "cuda" if a.device == "cuda" else "cpu"
        lm = api.open_model(api.resolve_model(a.model), exact=False, device=dev)
        out = kv_resume_bench(lm, _int_list(a.kv_lengths, "--kv-lengths"), a.kv_cache_dtype,
                              progress=lambda s: print(s, file=sys.stderr))
    elif a.spec_draft_model:  # with vs without the assistant draft, through the engine
        from engine import api
        from engine.bench import spec_bench
        out = spec_bench(api.resolve_model(a.model), Path(a.spec_draft_model), a.prompt_tokens, a.decode_tokens,
                         a.spec_tokens, device=a.device)
        out.pop("ids", None)
    elif a.batch:  # B sequences decoded together, beside llama.cpp's batched decode
        if a.device != "cpu":
            raise ValueError("--batch measures the CPU: use --device cpu")
        from engine import api
        from engine.bench import batched_side_by_side
        out = batched_side_by_side(path=None if a.synthetic else api.resolve_model(a.model), synthetic=a.synthetic,
                                   batches=_int_list(a.batch, "--batch"), n_prompt=a.prompt_tokens,
                                   n_steps=a.decode_tokens, threads=a.threads,
                                   kinds=("engine",) if a.no_llama_cpp else ("llama.cpp", "engine"),
                                   keep=Path(a.keep_gguf) if a.keep_gguf else None)
    elif a.device == "cpu" and a.profile:  # one decode step, piece by piece
        from engine import api
        from engine.bench import synthetic_gguf
        from engine.bench import profile_decode
        from engine.cpu_runtime import set_threads
        set_threads(a.threads)
        with synthetic_gguf(a.synthetic, Path(a.keep_gguf) if a.keep_gguf else None) as written:
            path = written or api.resolve_model(a.model)
            out = profile_decode(api.open_model(path, exact=False, device="cpu"), a.prompt_tokens, a.decode_tokens)
    elif a.device == "cpu":  # beside llama.cpp, each run in its own process
        from engine import api
        from engine.bench import cpu_side_by_side
        kinds = ["loop", "engine", "engine-plain"] if a.both else ["engine" if a.engine else "loop"]
        out = cpu_side_by_side(path=None if a.synthetic else api.resolve_model(a.model), synthetic=a.synthetic,
                               n_prompt=a.prompt_tokens, n_decode=a.decode_tokens,
                               threads=a.threads, kinds=([] if a.no_llama_cpp else ["llama.cpp"]) + kinds,
                               keep=Path(a.keep_gguf) if a.keep_gguf else None)
    else:
        import torch
        if a.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        if a.threads:
            torch.set_num_threads(a.threads)
        from engine import api
        from engine.bench import gpu_bench, has_experts, synthetic_gguf
        # On CUDA a synthetic layout with --keep-gguf is written to a GGUF and opened as `run` opens
        # a file (the plan keeps expert banks / first layers in host RAM); an MoE layout, or one with
        # placement flags, is built in memory with the plan's expert banks in host RAM; the others
        # are built in memory on the device.
        from .cli_options import placement_options
        place = placement_options(a)
        flags_given = place["placement"].given or place["ctx_size"] is not None or place["moe_cache"] is not None
        on_file = a.device == "cuda" and bool(a.synthetic) and bool(a.keep_gguf)
        placed = a.device == "cuda" and bool(a.synthetic) and (flags_given or has_experts(a.synthetic))
        with synthetic_gguf(a.synthetic if on_file else None, Path(a.keep_gguf) if a.keep_gguf else None) as written:
            model = written if on_file else None if a.synthetic else api.resolve_model(a.model)
            options = None
            if a.device == "cuda" and (model is not None or placed):
                options = api.EngineOptions(gpu_memory_budget=a.gpu_memory_budget, kv_cache_dtype=a.kv_cache_dtype,
                                            swa_kv_cache_dtype=a.swa_kv_cache_dtype, embed_weights=a.embed_weights,
                                            **place)
            out = gpu_bench(model, device=a.device, budget=a.gpu_memory_budget, kv_cache_dtype=a.kv_cache_dtype,
                            on_row=_print_row if a.rows else None,
                            swa_kv_cache_dtype=a.swa_kv_cache_dtype, embed_weights=a.embed_weights,
                            fast_prefill=a.fast_prefill == "on",
                            prompts=_int_list(a.prompt_lengths, "--prompt-lengths"),
                            contexts=_int_list(a.contexts, "--contexts"), decode_steps=a.decode_steps,
                            synthetic=None if on_file else a.synthetic, peak_bandwidth=a.peak_bandwidth,
                            options=options, profile=a.profile)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(out["table"])
    return 0


def _print_row(kind: str, row: dict) -> None:
    """`bench --rows`: one JSON line per measured row, flushed at once (packaging/gpu_check.py
    collects them from the stream, so a bench killed at its time limit keeps what it finished)."""
    print(json.dumps({"row": kind, **row}), flush=True)
