"""Int8Head: the tied output head on the CPU (the cpu_torch runtime): an int8 GEMV ranks the
vocabulary, the top rows are exact.

Why: the head is the largest matrix a decode step reads. E2B's is 262144x1536 Q6_K (the Gemma 3
demo's 262144x640 Q8_0); held in float16 (models/cpu_quant.cpu_weight's choice for the 5- to
8-bit types) it is 805 MB a token, 18% of E2B's CPU decode step and ~45% of the demo's. fbgemm's
dynamic-quantized linear (aten's `quantized::linear_dynamic`, in every x86 torch build: no
compiler) reads int8 weights with one scale per row and quantizes the activations per call
(uint8, 7 bits with `reduce_range` so AVX2's vpmaddubsw cannot saturate): measured on this
project's 2-core AVX2 VM, 2 threads, E2B's head, 15.6 ms against float16's 46 ms (4 rows: 20 ms
against 153), half the bytes in RAM. Both roundings are lossy (logits within ~2% of their RMS),
so the int8 logits only rank: the EXACT_ROWS best of every row are recomputed in float32 from
the file's own bytes (`exact_rows`, the lookup table's pread rows), and the sampler only ever
looks at the top of the distribution (greedy, top-k, top-p over the top 256 tokens; plain
temperature sampling sees the int8 values in the tail, whose mass they barely move).

Cost: dequantizing and prepacking at load, in row chunks of CHUNK values (two at a time) so no
float32 copy of the whole matrix ever exists: E2B's head 4.3 s on the 2-core VM.
"""
from __future__ import annotations

import functools
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

EXACT_ROWS = 64  # rows of each logit row recomputed exactly (the sampler's top-k/top-p window is 256)
CHUNK = 1 << 24  # values per prepacked row chunk (a 64 MB float32 temporary at load)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """fbgemm's int8 linear is there (x86 builds); elsewhere the head stays float16."""
    try:
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            return False
        w = torch.randn(8, 32)
        Int8Head(w, lambda ids: w[ids]).linear(torch.randn(1, 32))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def _prepack(w: torch.Tensor):
    """float32 [rows, in] -> fbgemm's packed int8 weight, one symmetric scale per row."""
    s = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    with warnings.catch_warnings():  # the quantized-tensor API is marked deprecated; it is what fbgemm reads
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros(w.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, None)


def top_indices(y: torch.Tensor, c: int, block: int = 512) -> torch.Tensor:
    """Indices [rows, c] of the c largest values of each row of y [rows, n], unordered (ties
    broken arbitrarily). Two stages: every value of the top c lies in a block whose maximum is at
    least the c-th value, and at most c blocks have one, so the c blocks with the largest maxima
    hold them all; topk then runs over c·block values instead of n (262144: 0.25 ms, not 0.6)."""
    r, n = y.shape
    if n % block or n // block < c:
        return y.topk(c, dim=-1, sorted=False).indices
    blocks = y.view(r, n // block, block)
    best = blocks.amax(-1).topk(c, dim=-1, sorted=False).indices  # [r, c]
    cand = blocks.gather(1, best[..., None].expand(r, c, block)).view(r, c * block)
    j = cand.topk(c, dim=-1, sorted=False).indices
    return best.gather(1, j // block) * block + j % block


class Int8Head:
    """[vocab, d] head: `.linear(x)` -> logits [.., vocab] in x's dtype (module doc), `.rows(ids)`
    the exact float32 rows. `source`: float32 [rows, d] blocks by row range, `(r0, r1) -> tensor`
    (or a whole float32 matrix); `exact_rows(ids) -> float32 [len, d]`."""

    def __init__(self, source, exact_rows: Callable[[torch.Tensor], torch.Tensor], shape=None):
        if isinstance(source, torch.Tensor):
            matrix, shape = source, tuple(source.shape)
            source = lambda r0, r1: matrix[r0:r1].float()  # noqa: E731 - tests and small tables
        self.shape = tuple(shape)
        n, k = self.shape
        step = max(1, CHUNK // k)
        chunks = [(r0, min(r0 + step, n)) for r0 in range(0, n, step)]
        # two chunks at a time: dequantize and prepack release the GIL (E2B's head 5.6 -> 4.3 s at load)
        with ThreadPoolExecutor(max_workers=max(1, min(2, torch.get_num_threads()))) as pool:
            self.packed = list(pool.map(lambda c: _prepack(source(*c)), chunks))
        self.exact_rows = exact_rows
        self.nbytes = n * k + n * 8  # int8 values + a double scale per row (fbgemm keeps them)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return ()  # packed objects, not tensors: `nbytes` counts them

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def rank(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 logits [rows, vocab] of float32 x [rows, d]. fbgemm quantizes the activations
        with one scale per call: rows of another magnitude (a prompt's BOS row is ~50x the others
        in Gemma) would leave the rest a few levels, so each row is ranked at max |x| = 1 and
        scaled back (the product is linear per row): a 17-row `score` of the demo was 0.55 nats
        (KL) off the float32 head at its last row, now 0.01 (a row with one outlier channel of
        |x| ~ 480 against a median of 1.3 stays ~2.9 off: 7-bit activations)."""
        if x.shape[0] > 1:
            scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)  # [rows, 1]
            x = x / scale
        parts = [torch.ops.quantized.linear_dynamic(x, p, True) for p in self.packed]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return y.mul_(scale) if x.shape[0] > 1 else y

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        x2 = x.reshape(-1, k).float()
        # fbgemm quantizes the activations with one scale per call: rows of another magnitude (a
        # prompt's BOS row is ~50x the others in Gemma) would leave the rest a few levels, so each
        # row is ranked at max |x| = 1 and scaled back (the product is linear per row). Without
        # it a 17-row `score` of the demo was 0.55 nats (KL) off the float32 head, now 1e-4.
        y = self.rank(x2)
        top = top_indices(y, min(EXACT_ROWS, n))  # [rows, C]
        ids, where = torch.unique(top.reshape(-1), return_inverse=True)
        exact = x2 @ self.exact_rows(ids).t()  # [rows, unique ids]: the file's values in float32
        y.scatter_(1, top, exact.gather(1, where.view_as(top)))
        return y.to(x.dtype).reshape(*x.shape[:-1], n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.exact_rows(ids.reshape(-1))

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        """The whole exact matrix (tests and tools; the runtime never calls it)."""
        return self.exact_rows(torch.arange(self.shape[0])).to(dtype)
