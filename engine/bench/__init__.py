"""Measurements of the engine, one module each; `edgegem bench` and `edgegem kv-check` call them
through the names below.

  throughput.py       prefill / decode tok/s through the engine, bytes a decode step reads, share
                      of peak bandwidth (`bench --device cuda`)
  spec.py             decode with and without the assistant draft (`bench --spec-draft-model`)
  cpu.py              the CPU side by side (`bench --device cpu`): edgegem beside llama.cpp, each
                      run in its own process, tok/s, peak RSS and how many greedy tokens agree
  cpu_profile.py      where one CPU decode step's time goes, per op (`bench --device cpu --profile`)
  static.py           what a GPU decode step costs, compiled not run (`bench --static`)
  dry_run.py          the CUDA path on the meta device: every launch of a step, recorded
  gemv.py             per-format decode GEMV bandwidth (packaging/gpu_check.py)
  kv_resume.py        reopening a conversation from its KV file against prefilling it (`--kv-resume`)
  kv_quality.py       each KV format's next-token KL divergence on a model (`edgegem kv-check`)
  constraint_mask.py  the structured-output token mask's cost per token (`bench --constraints`)
  audio_encode.py     the audio tower's encode time per clip length (`bench --audio`)
  expert_mix.py       one 26B-A4B layer's expert mix on this CPU: ms, GB/s, fixed cost, read roof
  offload_model.py    decode time of GPU + host-experts systems from measured parts (`--offload-model`)
  table.py            the fixed-width columns the reports print

The names are looked up lazily (PEP 562), so `import engine.bench` imports none of the modules
and each caller pays only for the one it uses: static.py must see how this process imports the
kernels (a process under TRITON_INTERPRET=1 hands its compiles to a spawned worker).
"""
from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "gpu_bench": "throughput", "peak_bandwidth_gbps": "throughput", "device_weight_bytes": "throughput",
    "has_experts": "throughput",
    "kv_bytes_read": "throughput",
    "spec_bench": "spec",
    "cpu_side_by_side": "cpu", "synthetic_gguf": "cpu", "bench_prompt": "cpu",
    "batched_side_by_side": "batched",
    "profile_decode": "cpu_profile",
    "static_report": "static", "compile_engine_kernels": "static", "compile_summary": "static",
    "decode_step": "dry_run", "dry_model": "dry_run", "prefill_chunk": "dry_run",
    "gemv_bandwidth": "gemv", "gemv_sweep": "gemv", "sweep_table": "gemv",
    "kv_resume_bench": "kv_resume",
    "kv_check": "kv_quality", "save_result": "kv_quality", "load_result": "kv_quality",
    "constraint_bench": "constraint_mask",
    "audio_bench": "audio_encode",
    "offload_model_bench": "offload_model", "measure_expert_mix": "expert_mix",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
