"""The runtime weight formats, one file each, behind one protocol (`base.Weight`):

- `half.HalfWeight`: a dense matrix in float16 (CPU and older GPUs: what stays dense),
- `packed.QuantWeight`: GGUF matrices repacked for the Triton GEMV (CUDA), or GGUF rows of a
  lookup table,
- `ggml.GGMLWeight`: GGUF bytes multiplied by llama.cpp's ggml (CPU); `is_ggml(w)` asks whether a
  weight is one (a product on llama.cpp's kernels),
- `int4.Int4Weight`: GGUF matrices repacked for torch's int4 CPU matmul,
- `int8_head.Int8Head`: the tied head ranked by an int8 GEMV, its top rows exact (CPU),
- `experts.ExpertBank`: MoE experts [E, out, in] as the file's bytes on every runtime
  (`ggml_mul_mat_id` on the ggml runtime, one expert dequantized at a time elsewhere).

models/weights.py loads a checkpoint into them; models/runtime.py says which runtime a loaded
model computes with.
"""
from .base import Weight
from .experts import ExpertBank, ExpertMatrix
from .ggml import GGMLWeight, is_ggml
from .half import HalfWeight
from .int4 import Int4Weight
from .int8_head import Int8Head
from .packed import QuantWeight

__all__ = ["ExpertBank", "ExpertMatrix", "GGMLWeight", "HalfWeight", "Int4Weight", "Int8Head", "QuantWeight", "Weight",
           "is_ggml"]
