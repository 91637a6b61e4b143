"""Which code computes a loaded model: its `Runtime`, decided once at load and stored on the model
(`model.runtime`).

Five runtimes, by device, `--exact`, Triton support and llama.cpp's ggml:

| runtime | when | weights (models/formats/) | ops |
| --- | --- | --- | --- |
| reference | `--exact` on the CPU or on a GPU Triton does not run on | dense float32 tensors | torch (models/ops.py) |
| triton | a CUDA GPU of sm_75+ with triton installed (`--exact`: float32 activations, else bf16) | QuantWeight (packed) | Triton kernels (kernels/triton/) |
| gpu_torch | any other GPU, not `--exact` | HalfWeight (float16) | torch |
| ggml | the CPU, not `--exact`, a GGUF file, ggml loaded | GGMLWeight (the file's bytes) | ggml products and chains (kernels/ggml/) |
| cpu_torch | the CPU, not `--exact`, no ggml (or an HF folder) | Int4Weight, HalfWeight, Int8Head | torch |

On every runtime a GGUF file's MoE expert banks stay the file's bytes (formats/experts.ExpertBank):
`ggml_mul_mat_id` multiplies them on the ggml runtime, the others dequantize one expert at a time.

`choose_runtime` holds these rules (the front ends' `engine.api.open_model` asks it);
`Runtime.load_flags` turns a runtime into `models.loader.load_model`'s keyword flags, and
`runtime_of_flags` reads the runtime back from those flags for callers that pass flags themselves
(tests, tools): one inverts the other (tests/models/test_runtime.py). The availability probes
(`triton_available`, `ggml_available`) are here and nowhere else in models/. `attends_on_ggml`
says whether a decode step's attention runs on ggml's kernel: the engine asks it once and hands the
answer to every sequence's KV (engine/kv/sequence.py).
"""
from __future__ import annotations

import enum
from typing import Optional

import torch


class Runtime(enum.Enum):
    REFERENCE = "reference"
    TRITON = "triton"
    GPU_TORCH = "gpu_torch"
    GGML = "ggml"
    CPU_TORCH = "cpu_torch"

    @property
    def detail(self) -> str:
        """One line for `doctor`, `info`, the status panel and the benches."""
        return _DETAIL[self]

    def load_flags(self, exact: bool = False) -> dict:
        """`models.loader.load_model`'s keyword flags for this runtime (`exact`: float32 activations
        on the Triton runtime, which otherwise runs bf16)."""
        if self is Runtime.TRITON:
            return {"dtype": torch.float32 if exact else torch.bfloat16, "weight_dtype": None, "quantized": True,
                    "cpu_quant": False}
        half = None if self is Runtime.REFERENCE else torch.float16
        return {"dtype": torch.float32, "weight_dtype": half, "quantized": False,
                "cpu_quant": self in (Runtime.GGML, Runtime.CPU_TORCH)}

    def attends_on_ggml(self) -> bool:
        """A decode step's attention runs on ggml's flash attention (kernels/ggml/attention.py):
        the ggml runtime, unless EDGEGEM_CPU_ATTENTION=torch (the torch products over the slot
        runs: comparisons, tests). Asked once per engine, not per op."""
        from kernels.env import env

        return self is Runtime.GGML and env().cpu_attention != "torch"


_DETAIL = {
    Runtime.REFERENCE: "float32 reference: dense weights, torch ops",
    Runtime.TRITON: "Triton kernels on CUDA: GGUF matrices packed on the GPU",
    Runtime.GPU_TORCH: "torch on a GPU without Triton support: float16 matrices",
    Runtime.GGML: "llama.cpp's ggml on the CPU: the file's GGUF bytes, ggml graphs",
    Runtime.CPU_TORCH: "torch CPU formats: int4pack Q4_K, float16 5-8-bit types, int8-ranked head",
}


def triton_available(device: torch.device | str) -> bool:
    """The Triton kernels run on `device` (a CUDA GPU of sm_75+, triton importable)."""
    from kernels.arch import triton_supported

    return triton_supported(device)[0]


def ggml_available() -> bool:
    """llama.cpp's kernels are loaded and smoke-tested (kernels.ggml.available); False also under
    EDGEGEM_CPU_KERNELS=torch."""
    from kernels import ggml

    return ggml.available()


def choose_runtime(device: torch.device | str, exact: bool, gguf: bool = True, triton: Optional[bool] = None,
                   ggml: Optional[bool] = None) -> Runtime:
    """The runtime a model file loads with (module doc's table). `gguf`: a GGUF file (an HF folder
    has no GGUF bytes for ggml). `triton` / `ggml`: the availability, probed when None."""
    device = torch.device(device)
    if device.type == "cuda" and (triton if triton is not None else triton_available(device)):
        return Runtime.TRITON
    if exact:
        return Runtime.REFERENCE
    if device.type != "cpu":
        return Runtime.GPU_TORCH
    if gguf and (ggml if ggml is not None else ggml_available()):
        return Runtime.GGML
    return Runtime.CPU_TORCH


def runtime_of_flags(device: torch.device | str, weight_dtype: Optional[torch.dtype] = None, quantized: bool = False,
                     cpu_quant: bool = False, gguf: bool = True, ggml: Optional[bool] = None) -> Runtime:
    """The runtime `load_model`'s flags load (the inverse of `Runtime.load_flags`): `quantized`
    GGUF matrices are the Triton runtime's; `cpu_quant` on the CPU is ggml's when it is there (the
    loader then keeps every GGUF matrix as GGMLWeight), else the torch formats'; float16 matrices
    without either are the torch runtimes'; dense weights the reference."""
    device = torch.device(device)
    if quantized:
        return Runtime.TRITON
    if cpu_quant and gguf and device.type == "cpu":
        return Runtime.GGML if (ggml if ggml is not None else ggml_available()) else Runtime.CPU_TORCH
    if weight_dtype == torch.float16:
        return Runtime.CPU_TORCH if device.type == "cpu" else Runtime.GPU_TORCH
    return Runtime.REFERENCE
