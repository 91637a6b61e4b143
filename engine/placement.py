"""Which weights stay in host RAM beside a GPU, and which the GPU holds (the memory planner's
placement; engine/memory_plan.py sizes everything else around it).

llama.cpp's flags, with llama.cpp's meanings (users bring their habits):
  --cpu-moe             the expert banks of every MoE layer in host RAM (computed by the CPU)
  --n-cpu-moe N         the expert banks of the first N layers in host RAM
  --n-gpu-layers N      N layers on the GPU: the last N, as llama.cpp's -ngl (the first L - N whole
                        layers, their KV included, stay on the CPU, so the residual crosses once,
                        CPU layers -> GPU layers -> the head on the GPU)
  --override-tensor RE=cpu|cuda[,RE=...]  every weight whose GGUF name matches RE (re.search) is
                        placed there, after the flags above (llama.cpp's -ot "exps=CPU")
Auto, when none is given, on a GPU: nothing offloaded, then the expert banks from the first layer
up (a token reads 8 of 128 experts: the banks are the cheapest bytes to leave in host RAM), then
whole layers from the first up; `auto_steps` yields those placements in that order and the planner
takes the first one that fits. The host embeddings (--embed-weights host) are the planner's own
first step and are not part of a placement.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

_LAYER = re.compile(r"^blk\.(\d+)\.")
_WHERE = {"cpu": "cpu", "host": "cpu", "cuda": "cuda", "gpu": "cuda"}


def layer_of(name: str) -> Optional[int]:
    """The layer index of a `blk.N.` tensor name, else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def is_expert_bank(name: str) -> bool:
    """`ffn_gate_up_exps`, `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` weights (not their
    per-expert `.scale` vectors, which the GPU's router reads)."""
    return "_exps." in name and name.endswith(".weight")


def parse_overrides(specs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """("exps=CPU", "blk\\.1[0-9]\\.=cuda0") -> ((regex, "cpu"|"cuda"), ...); each spec may hold
    several comma-separated pairs, as llama.cpp's -ot does. A bad one is a one-line ValueError."""
    out = []
    for spec in specs:
        for part in (p for p in str(spec).split(",") if p.strip()):
            pattern, eq, where = part.rpartition("=")
            dev = _WHERE.get(re.sub(r"\d+$", "", where.strip().lower()))
            if not eq or not pattern or dev is None:
                raise ValueError(f"--override-tensor {part!r}: give PATTERN=cpu or PATTERN=cuda (e.g. exps=cpu)")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"--override-tensor {part!r}: the pattern is not a regular expression ({e})") from None
            out.append((pattern, dev))
    return tuple(out)


@dataclass(frozen=True)
class PlacementFlags:
    """The placement flags as given (None / False / (): not given)."""

    cpu_moe: bool = False
    n_cpu_moe: Optional[int] = None
    n_gpu_layers: Optional[int] = None
    overrides: tuple[tuple[str, str], ...] = ()

    @property
    def given(self) -> bool:
        return self.cpu_moe or self.n_cpu_moe is not None or self.n_gpu_layers is not None or bool(self.overrides)

    def names(self) -> str:
        """The flags given, as typed ("--cpu-moe --n-gpu-layers 40")."""
        parts = (["--cpu-moe"] if self.cpu_moe else []) + \
                ([f"--n-cpu-moe {self.n_cpu_moe}"] if self.n_cpu_moe is not None else []) + \
                ([f"--n-gpu-layers {self.n_gpu_layers}"] if self.n_gpu_layers is not None else []) + \
                [f"--override-tensor {p}={d}" for p, d in self.overrides]
        return " ".join(parts)


@dataclass(frozen=True)
class Placement:
    """`host`: the weights (GGUF names) held in host RAM and computed by the CPU; `expert_layers`
    the layers whose expert banks are there; `cpu_layers` the layers held whole (their KV in host
    memory too). `source`: "auto" or the flags that made it."""

    host: frozenset = field(default_factory=frozenset)
    expert_layers: tuple[int, ...] = ()
    cpu_layers: tuple[int, ...] = ()
    source: str = "auto"
    host_banks: frozenset = field(default_factory=frozenset)  # the expert banks of expert_layers
    n_other: int = 0  # host tensors neither in cpu_layers nor banks of expert_layers (--override-tensor)

    @property
    def offloads(self) -> bool:
        return bool(self.host)

    def gpu_layers(self, n_layer: int) -> int:
        return n_layer - len(self.cpu_layers)

    def describe(self, n_layer: int) -> str:
        """"expert banks of layers 0-29 and whole layers 0-3 in host RAM (26 of 30 layers on the GPU)"."""
        parts = []
        if self.expert_layers:
            parts.append(f"expert banks of layers {spans(self.expert_layers)}")
        if self.cpu_layers:
            parts.append(f"whole layers {spans(self.cpu_layers)}")
        if self.n_other:
            parts.append(f"{self.n_other} more tensor{'s' if self.n_other > 1 else ''} (--override-tensor)")
        if not parts:
            return f"every layer on the GPU ({self.source})"
        return (" and ".join(parts) + f" in host RAM; {self.gpu_layers(n_layer)} of {n_layer} layers on the GPU "
                f"({self.source})")


def spans(ids: Iterable[int]) -> str:
    """(0, 1, 2, 5, 7, 8) -> "0-2, 5, 7-8"."""
    out, run = [], []
    for i in sorted(set(ids)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _moe_layers(names: Iterable[str]) -> list[int]:
    return sorted({layer_of(n) for n in names if is_expert_bank(n)})


def build(names: Iterable[str], n_layer: int, expert_layers: Iterable[int] = (), cpu_layers: Iterable[int] = (),
          overrides: tuple = (), source: str = "auto") -> Placement:
    """The placement of these weights: banks of `expert_layers`, every tensor of `cpu_layers`,
    then the overrides in order (a later pattern wins over an earlier one and over the flags)."""
    names = list(names)
    exp, whole = set(expert_layers), set(cpu_layers)
    host = {n for n in names if layer_of(n) in whole or (is_expert_bank(n) and layer_of(n) in exp)}
    for pattern, dev in overrides:
        rx = re.compile(pattern)
        hit = {n for n in names if rx.search(n)}
        host = host | hit if dev == "cpu" else host - hit
    by_layer: dict[int, list[str]] = {}
    for n in names:
        if layer_of(n) is not None:
            by_layer.setdefault(layer_of(n), []).append(n)
    cpu_l = tuple(sorted(i for i, ns in by_layer.items() if all(n in host for n in ns)))
    exp_layers = tuple(sorted(i for i, ns in by_layer.items() if any(map(is_expert_bank, ns))
                              and all(n in host for n in ns if is_expert_bank(n))))
    exp_l = tuple(i for i in exp_layers if i not in set(cpu_l))
    banks = frozenset(n for i in exp_l for n in by_layer[i] if is_expert_bank(n))
    n_other = len(host) - len(banks) - sum(len(by_layer[i]) for i in cpu_l)
    return Placement(frozenset(host), exp_l, cpu_l, source, banks, n_other)


def from_flags(names: Iterable[str], n_layer: int, flags: PlacementFlags) -> Placement:
    """The placement the flags ask for (one-line ValueError for counts out of range)."""
    names = list(names)
    moe = _moe_layers(names)
    if flags.n_cpu_moe is not None and flags.n_cpu_moe < 0:
        raise ValueError(f"--n-cpu-moe must be 0 or more, not {flags.n_cpu_moe}")
    if flags.n_gpu_layers is not None and flags.n_gpu_layers < 0:
        raise ValueError(f"--n-gpu-layers must be 0 or more, not {flags.n_gpu_layers}")
    if (flags.cpu_moe or flags.n_cpu_moe) and not moe:
        raise ValueError(f"{'--cpu-moe' if flags.cpu_moe else '--n-cpu-moe'}: this model has no expert banks "
                         "(it is not a mixture of experts); --n-gpu-layers places dense layers")
    n_exp = n_layer if flags.cpu_moe else min(flags.n_cpu_moe or 0, n_layer)
    gpu = n_layer if flags.n_gpu_layers is None else min(flags.n_gpu_layers, n_layer)
    placed = build(names, n_layer, [i for i in moe if i < n_exp], range(n_layer - gpu), flags.overrides,
                   source=flags.names())
    split = sorted({layer_of(n) for n in placed.host if is_expert_bank(n)} - set(placed.expert_layers)
                   - set(placed.cpu_layers))
    if split:  # gate/up on one side and down on the other would cross [T, k, I] activations a layer
        raise ValueError(f"{flags.names()}: layer {split[0]}'s expert banks would be split between host RAM and "
                         "the GPU; place a layer's banks together (e.g. -ot 'blk\\.N\\..*_exps=cpu')")
    return placed


def auto_steps(names: Iterable[str], n_layer: int, partial: bool = False, layers: bool = True) -> Iterator[Placement]:
    """Auto placements, least offloaded first: nothing; every expert bank on the host (`partial`:
    the banks of layers 0..k-1 for k = 1..(MoE layers), the static split of --n-cpu-moe); then,
    every bank on the host, whole layers 0..j-1 for j = 1..L-1 (at least one layer stays on the
    GPU: all of them on the CPU is `--device cpu`). Without `partial` the memory the banks would
    have kept on the GPU is the hot-expert cache's: a cache as large holds whatever a static split
    would and follows the routing instead of the layer order. `layers` False: no whole layers
    (E2B/E4B, built to fit small cards whole, their embedding tables in host RAM already)."""
    names = list(names)
    moe = _moe_layers(names)
    yield Placement(source="auto")
    for k in range(1 if partial else len(moe), len(moe) + 1):
        yield build(names, n_layer, moe[:k])
    for j in range(1, n_layer if layers else 1):
        yield build(names, n_layer, moe, range(j))
