"""Where edgegem keeps its data and models, and how a model name finds its GGUF file.

data directory: `--data-dir`, else $EDGEGEM_DATA_DIR, else platformdirs' user data dir
(~/.local/share/edgegem on Linux). models directory: `--models-dir`, else $EDGEGEM_MODELS_DIR,
else <data dir>/models. `edgegem pull owner/name:QUANT` stores <models dir>/owner/name/<file>.gguf;
a GGUF copied anywhere under the folder counts as well.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kernels.env import env

DEFAULT_QUANT = "Q4_K_M"  # the quant most Gemma GGUF repos publish and llama.cpp users pick
DRAFT_WORDS = ("assistant", "mtp")  # Gemma-4 assistant (MTP drafter) files carry one of these
# Quant labels in GGUF file names: Q4_K_M, UD-Q4_K_XL, IQ4_XS, Q8_0, BF16, MXFP4_MOE ...
_QUANT_LABEL = re.compile(r"(?i)(?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32|MXFP4(?:_MOE)?|TQ\d_\d)")
_REPO_SPEC = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(?<!\.gguf)(:[\w.-]+)?", re.IGNORECASE)
SPLIT_SUFFIX = re.compile(r"(?i)-\d{5}-of-\d{5}$")  # llama.cpp shards: name-00001-of-00003.gguf


def data_dir(override: Optional[str | Path] = None) -> Path:
    if override:
        return Path(override).expanduser()
    if env().data_dir is not None:
        return env().data_dir
    from platformdirs import user_data_dir
    return Path(user_data_dir("edgegem"))  # same call as app/store.py: one folder on every platform


def models_dir(override: Optional[str | Path] = None, data: Optional[str | Path] = None) -> Path:
    """`override` (--models-dir), else $EDGEGEM_MODELS_DIR, else <data dir>/models."""
    if override:
        return Path(override).expanduser()
    if env().models_dir is not None:
        return env().models_dir
    return data_dir(data) / "models"


def is_draft_name(name: str) -> bool:
    low = Path(name).name.lower()
    return any(w in low for w in DRAFT_WORDS)


def is_mmproj_name(name: str) -> bool:
    """llama.cpp's image encoder files (mmproj-F16.gguf ...): they go with the model beside them."""
    return "mmproj" in Path(name).name.lower()


def _stem(name: str) -> str:
    base = Path(name).name
    return base[:-5] if base.lower().endswith(".gguf") else base


def quant_label(name: str) -> Optional[str]:
    """The quant a GGUF file name advertises: `gemma-4-E2B-it-UD-Q4_K_XL.gguf` -> `UD-Q4_K_XL`."""
    found = _QUANT_LABEL.findall(SPLIT_SUFFIX.sub("", _stem(name)))
    return found[-1] if found else None


def quant_matches(name: str, quant: str) -> bool:
    """`Q4_K_M` matches `gemma-4-E2B-it-Q4_K_M.gguf` (any case) but `Q4_K` does not: the quant
    must stand between separators other than `_`."""
    pattern = rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])"
    return re.search(pattern, _stem(name), re.IGNORECASE) is not None


def best_quant_matches(names: list[str], quant: str) -> list[str]:
    """Names matching `quant`; when several do, those whose label is exactly the quant (so
    `Q4_K_M` picks `x-Q4_K_M.gguf` over `x-UD-Q4_K_M.gguf`)."""
    hits = [n for n in names if quant_matches(n, quant)]
    exact = [n for n in hits if (quant_label(n) or "").lower() == quant.lower()]
    return exact if len(hits) > 1 and exact else hits


@dataclass(frozen=True)
class LocalModel:
    path: Path
    rel: str  # path under the models directory, '/'-separated
    size: int

    @property
    def name(self) -> str:
        return _stem(self.path.name)

    @property
    def repo(self) -> Optional[str]:
        """owner/name when the file sits where `edgegem pull` puts it."""
        parts = self.rel.split("/")
        return "/".join(parts[:2]) if len(parts) == 3 else None

    @property
    def is_draft(self) -> bool:
        return is_draft_name(self.path.name)

    @property
    def is_mmproj(self) -> bool:
        return is_mmproj_name(self.path.name)


def local_models(root: Path) -> list[LocalModel]:
    """Every *.gguf under `root` (hidden folders skipped; downloads in progress end in .part)."""
    if not root.is_dir():
        return []
    out = []
    for p in root.rglob("*.gguf"):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        out.append(LocalModel(p, rel.as_posix(), p.stat().st_size))
    return sorted(out, key=lambda m: m.rel.lower())


def _looks_like_path(query: str) -> bool:
    return query.lower().endswith(".gguf") or (os.sep in query and ":" not in query) or query.startswith((".", "~"))


def find_model(query: str, root: Optional[Path] = None) -> Path:
    """The local GGUF a `--model` value names: its path under the models directory, file name or
    stem, `owner/name[:QUANT]` of a pulled repo, or a unique case-insensitive piece of its path.
    Drafts (assistant/mtp) only match a piece that names them. One-line ValueError otherwise."""
    from models.gguf import GGUFError

    root = models_dir() if root is None else root
    models = local_models(root)
    q = query.strip()
    ql = q.lower()
    for key in (lambda m: m.rel, lambda m: m.path.name, lambda m: m.name):
        for same in (lambda a: a == q, lambda a: a.lower() == ql):
            hits = [m for m in models if same(key(m))]
            if hits:
                return _one(q, hits, root)
    repo, _, quant = q.partition(":")
    pulled = [m for m in models if m.repo and m.repo.lower() == repo.lower() and not m.is_draft and not m.is_mmproj]
    if pulled:
        names = best_quant_matches([m.rel for m in pulled], quant or DEFAULT_QUANT)
        if not quant and not names and len(pulled) == 1:
            names = [pulled[0].rel]
        hits = [m for m in pulled if m.rel in names]
        if hits:
            return _one(q, hits, root)
    hits = [m for m in models if ql in m.rel.lower()]
    if not is_draft_name(ql):
        hits = [m for m in hits if not m.is_draft] or hits
    if not is_mmproj_name(ql):  # a pulled repo's image encoder is no model of its own
        hits = [m for m in hits if not m.is_mmproj] or hits
    if hits:
        return _one(q, hits, root)
    if _REPO_SPEC.fullmatch(q) and not Path(repo).expanduser().parent.exists():
        raise ValueError(f"{q} is not pulled yet (nothing for it in {root}): edgegem pull {q}")
    if _looks_like_path(q):
        raise GGUFError(q, f"no such file (nor a local model of that name in {root})")
    have = ", ".join(m.name for m in models[:8]) + (", ..." if len(models) > 8 else "")
    raise ValueError(f"no local model matches {q!r} in {root} "
                     + (f"(local models: {have})" if models else "(none there yet)")
                     + "; `edgegem pull REPO:QUANT` downloads one")


def _one(query: str, hits: list[LocalModel], root: Path) -> Path:
    if len(hits) == 1:
        return hits[0].path
    raise ValueError(f"{query!r} matches {len(hits)} models in {root}: "
                     + ", ".join(m.rel for m in hits[:8]) + "; give more of the name")


def gguf_summary(path: Path) -> dict:
    """Architecture, name and quant of a GGUF from its header (no weights read). The quant is
    llama.cpp's `general.file_type` label (Q4_K_M) when the file has one, else the tensor type
    holding the most bytes among matrices (norm vectors are F32 in every quant)."""
    from models.gguf import GGUFFile

    f = GGUFFile(path)
    by_bytes: Counter = Counter()
    for t in f:
        if len(t.shape) >= 2:
            by_bytes[t.type_name] += t.n_bytes
    majority = by_bytes.most_common(1)[0][0] if by_bytes else None
    quant = None
    ftype = f.metadata.get("general.file_type")
    if isinstance(ftype, int):
        try:
            from gguf import LlamaFileType
            quant = LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    return {"architecture": f.architecture, "general_name": f.get("general.name"), "quant": quant or majority,
            "majority_tensor_type": majority, "tensor_bytes": sum(t.n_bytes for t in f)}
