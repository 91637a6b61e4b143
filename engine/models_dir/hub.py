"""`edgegem pull owner/name[:QUANT]`: pick a GGUF (and its assistant draft) from a Hugging Face
repo, download it into the models directory, verify it and check that it opens as GGUF.

Why not `hf_hub_download`: since huggingface_hub 1.x it downloads into a process-unique temporary
file and deletes it when the download fails (`_download_to_tmp_and_move`, PR #4228), so a 3 GB
download cut at 90% starts again from zero. Here the bytes go to `<file>.part` next to the
destination, and a later pull continues it with an HTTP Range request through huggingface_hub's
own `http_get` (same HTTP client, token, proxy settings, retries and progress bar). A file that
the huggingface_hub cache already holds at the same revision is linked (or copied), not fetched.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from .local import (DEFAULT_QUANT, SPLIT_SUFFIX, best_quant_matches, is_draft_name, is_mmproj_name,
                          local_models, quant_label)

DRAFT_QUANTS = ("Q8_0", "BF16", "F16", DEFAULT_QUANT)  # a draft is small: prefer its precise forms
# The image encoder (~0.3-0.6 GB at 16 bits for E2B/E4B) is dequantized to the activation dtype at
# load anyway, so a 16-bit file loses nothing; F32 doubles the download for no gain.
MMPROJ_QUANTS = ("F16", "BF16", "Q8_0", "F32")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# Short names for the Gemma-4 GGUF repos (`edgegem pull 26b-a4b[:QUANT]`); any owner/name works too.
# Their Q4_K_M files: E2B 3.4 GB, E4B 5.3 GB, 26B-A4B 16.9 GB, 31B 18.7 GB (models/synthetic.py
# computes the mix: 16.78 / 18.67 GB).
KNOWN_REPOS = {"e2b": "unsloth/gemma-4-E2B-it-GGUF", "e4b": "unsloth/gemma-4-E4B-it-GGUF",
               "26b-a4b": "unsloth/gemma-4-26B-A4B-it-GGUF", "31b": "unsloth/gemma-4-31B-it-GGUF"}
_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RepoSpec:
    repo: str
    quant: Optional[str] = None

    @classmethod
    def parse(cls, text: str) -> "RepoSpec":
        """`owner/name`, `owner/name:Q4_K_M`, also with an hf.co/ or https://huggingface.co/ prefix,
        or a short name of KNOWN_REPOS (`26b-a4b`, `31b:Q8_0`, any case)."""
        s = text.strip()
        for p in _PREFIXES:
            if s.lower().startswith(p):
                s = s[len(p):]
        repo, _, quant = s.partition(":")
        repo = KNOWN_REPOS.get(repo.lower(), repo).rstrip("/")
        if not _REPO.fullmatch(repo) or (quant and not re.fullmatch(r"[A-Za-z0-9._-]+", quant)):
            raise ValueError(f"expected REPO[:QUANT] like unsloth/gemma-4-E2B-it-GGUF:Q4_K_M, or one of "
                             f"{', '.join(KNOWN_REPOS)}, got {text!r}")
        return cls(repo, quant or None)


@dataclass(frozen=True)
class RemoteFile:
    name: str  # path in the repo
    size: Optional[int]
    sha256: Optional[str] = None  # LFS files only

    @property
    def base(self) -> str:
        return Path(self.name).name


@dataclass(frozen=True)
class PullResult:
    model: Path
    draft: Optional[Path]
    revision: Optional[str]
    mmproj: Optional[Path] = None  # the image encoder, beside the model (where load_model looks)


def list_remote(repo: str, revision: Optional[str] = None) -> tuple[str, list[RemoteFile]]:
    """The commit and files (with sizes and LFS sha256) of a model repo."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except GatedRepoError:
        raise RuntimeError(f"{repo} is gated: accept its license on huggingface.co, then `hf auth login`") from None
    except RepositoryNotFoundError:
        raise RuntimeError(f"no model repo {repo} on the Hugging Face Hub (or it is private: `hf auth login`)") from None
    except RevisionNotFoundError:
        raise RuntimeError(f"{repo} has no revision {revision!r}") from None
    files = [RemoteFile(s.rfilename, s.lfs.size if s.lfs else s.size, s.lfs.sha256 if s.lfs else None)
             for s in info.siblings or []]
    return info.sha, files


def _ggufs(files: list[RemoteFile]) -> list[RemoteFile]:
    return [f for f in files if f.name.lower().endswith(".gguf") and "mmproj" not in f.base.lower()]


def _quants(files: list[RemoteFile]) -> str:
    labels = sorted({quant_label(f.name) or f.base for f in files})
    return ", ".join(labels)


def _pick(files: list[RemoteFile], quant: str) -> list[RemoteFile]:
    names = set(best_quant_matches([f.name for f in files], quant))
    return [f for f in files if f.name in names]


def _single(repo: str, what: str, hits: list[RemoteFile]) -> RemoteFile:
    if any(SPLIT_SUFFIX.search(f.base[:-5]) for f in hits):
        raise ValueError(f"{repo}: the {what} is split into shards ({hits[0].base}); pick a single-file quant")
    if len(hits) > 1:
        raise ValueError(f"{repo}: {len(hits)} files match the {what}: "
                         + ", ".join(f.name for f in hits) + "; name the quant exactly")
    return hits[0]


def choose_model(repo: str, files: list[RemoteFile], quant: Optional[str]) -> RemoteFile:
    """The GGUF matching `quant` (case-insensitive); without one, the Q4_K_M or the only file."""
    mains = [f for f in _ggufs(files) if not is_draft_name(f.name)]
    if not mains:
        raise ValueError(f"{repo} has no GGUF model file")
    hits = _pick(mains, quant or DEFAULT_QUANT)
    if not hits and not quant and len(mains) == 1:
        hits = mains
    if not hits:
        have = _quants(mains)
        if quant:
            raise ValueError(f"{repo} has no {quant} GGUF (it has: {have})")
        raise ValueError(f"{repo} has no {DEFAULT_QUANT} GGUF: name one, e.g. {repo}:{quant_label(mains[0].name)} "
                         f"(it has: {have})")
    return _single(repo, f"quant {quant or DEFAULT_QUANT}", hits)


def choose_draft(repo: str, files: list[RemoteFile], quant: Optional[str],
                 any_gguf: bool = False) -> Optional[RemoteFile]:
    """The assistant draft (file names with "assistant" or "mtp"); `any_gguf`: in a repo given by
    --draft, every GGUF counts when none is named so. Prefers the model's quant, then Q8_0."""
    drafts = [f for f in _ggufs(files) if is_draft_name(f.name)] or (_ggufs(files) if any_gguf else [])
    if not drafts:
        return None
    hits = _pick(drafts, quant) if quant else []
    if not hits and len(drafts) == 1:
        hits = drafts
    for q in DRAFT_QUANTS:
        hits = hits or _pick(drafts, q)
    if not hits:
        raise ValueError(f"{repo}: several assistant drafts ({_quants(drafts)}); pick one with --draft {repo}:QUANT")
    return _single(repo, "assistant draft", hits)


def choose_mmproj(files: list[RemoteFile]) -> Optional[RemoteFile]:
    """The repo's image encoder (`mmproj*.gguf`), None when it has none: the 16-bit one first
    (MMPROJ_QUANTS), else the first by name."""
    found = sorted((f for f in files if f.name.lower().endswith(".gguf") and is_mmproj_name(f.name)),
                   key=lambda f: f.name)
    for q in MMPROJ_QUANTS:
        if hits := _pick(found, q):
            return hits[0]
    return found[0] if found else None


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(path: Path, remote: RemoteFile, log: Log = _stderr) -> None:
    """Size first (cheap), then the LFS sha256 the hub lists (seconds per GB)."""
    size = path.stat().st_size
    if remote.size is not None and size != remote.size:
        raise ValueError(f"{remote.base}: downloaded {size} bytes but the hub lists {remote.size}; "
                         "the bad copy was removed, run the pull again")
    if remote.sha256:
        log(f"verifying sha256 of {remote.base}")
        got = sha256_of(path)
        if got != remote.sha256:
            raise ValueError(f"{remote.base}: sha256 {got[:12]}... differs from the hub's {remote.sha256[:12]}...; "
                             "the bad copy was removed, run the pull again")


def check_gguf(path: Path, architectures: tuple[str, ...]) -> str:
    """Open the header (and tensor table) to make sure the file is a GGUF we can run."""
    from models.gguf import GGUFFile
    return GGUFFile(path).check_architecture(architectures)


@contextmanager
def _exclusive(part: Path) -> Iterator[None]:
    """One pull per file at a time: two writers appending to one .part would corrupt it."""
    lock = part.with_name(part.name + ".lock")
    with open(lock, "w") as fh:
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks; the size and sha256 checks still catch a mix-up
            yield
            return
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another edgegem pull is downloading {part.name[:-5]} right now") from None
        try:
            yield
        finally:  # still holding it: a late opener of the old inode fails above, a new one finds dest
            lock.unlink(missing_ok=True)


def _from_hf_cache(repo: str, remote: RemoteFile, revision: str) -> Optional[Path]:
    from huggingface_hub import try_to_load_from_cache
    hit = try_to_load_from_cache(repo, remote.name, revision=revision)
    if isinstance(hit, str) and (remote.size is None or os.path.getsize(hit) == remote.size):
        return Path(hit)
    return None


def fetch(repo: str, revision: str, remote: RemoteFile, dest: Path, log: Log = _stderr) -> Path:
    """Download `remote` to `dest` (resuming `dest`.part), verify it, move it into place."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with _exclusive(part):
        if dest.exists() and (remote.size is None or dest.stat().st_size == remote.size):
            try:
                verify(dest, remote, log)
                log(f"{dest.name}: already here")
                return dest
            except ValueError:  # replaced only once the new copy checks out
                log(f"{dest.name}: the local copy differs from the hub's; downloading it again")
        have = part.stat().st_size if part.exists() else 0
        if remote.size is not None and have > remote.size:
            part.unlink()
            have = 0
        cached = None if have else _from_hf_cache(repo, remote, revision)
        if cached is not None:
            log(f"{remote.base}: taking the copy in the huggingface_hub cache ({cached})")
            try:
                os.link(cached.resolve(), part)
            except OSError:
                shutil.copyfile(cached, part)
        else:
            log(f"downloading {repo}/{remote.name}" + (f" ({remote.size / 2**30:.2f} GiB)" if remote.size else "")
                + (f", resuming at {have / 2**20:.0f} MiB" if have else ""))
            url = hf_hub_url(repo, remote.name, revision=revision)
            with open(part, "ab") as fh:
                try:
                    http_get(url, fh, resume_size=have, headers=build_hf_headers(), expected_size=remote.size,
                             displayed_filename=remote.base)
                except KeyboardInterrupt:
                    fh.flush()
                    log(f"\ninterrupted: {part.stat().st_size} of {remote.size} bytes kept in {part}; "
                        "run the same pull again to resume")
                    raise
                except Exception as e:  # the HTTP stack's own errors are not OSErrors: one line either way
                    fh.flush()
                    got = part.stat().st_size
                    if remote.size is not None and got > remote.size:  # nothing to resume from
                        part.unlink()
                        raise ValueError(f"{remote.base}: the server sent {got} bytes but the hub lists "
                                         f"{remote.size}; the bad copy was removed") from None
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise RuntimeError(f"download of {remote.base} stopped at {got} of {remote.size} bytes "
                                       f"({first}); run the same pull again to resume") from e
        try:
            verify(part, remote, log)
        except ValueError:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, dest)
    return dest


def _listing(repo: str, revision: Optional[str], root: Path, log: Log) -> tuple[Optional[str], list[RemoteFile]]:
    """The hub's listing; offline (HF_HUB_OFFLINE=1, DNS, refused connection) the files pulled
    before into root/owner/name, with no commit (None) to check them against."""
    from huggingface_hub import is_offline_mode

    try:
        return list_remote(repo, revision)
    except RuntimeError:
        raise
    except Exception as e:  # the HTTP stack's connection errors are not OSErrors
        local = [RemoteFile(m.rel, None) for m in local_models(root / repo)]
        if not local:
            why = "offline mode (HF_HUB_OFFLINE)" if is_offline_mode() else (str(e).splitlines() or [type(e).__name__])[0]
            raise RuntimeError(f"cannot list {repo}: {why}") from e
        log(f"cannot reach the hub; using the files already in {root / repo}")
        return None, local


def pull(spec: str, root: Path, draft: Optional[str] = None, no_draft: bool = False,
         revision: Optional[str] = None, log: Log = _stderr, no_mmproj: bool = False) -> PullResult:
    """Resolve `spec`, download the model (its draft, and its image encoder when the repo has an
    mmproj file, unless `no_mmproj`) into root/owner/name/, check the headers."""
    want = RepoSpec.parse(spec)
    draft_spec = RepoSpec.parse(draft) if draft else None
    if draft_spec and no_draft:
        raise ValueError("--draft and --no-draft contradict each other")
    sha, files = _listing(want.repo, revision, root, log)
    model_file = choose_model(want.repo, files, want.quant)
    draft_repo, draft_sha, draft_files = want.repo, sha, files
    if draft_spec and draft_spec.repo.lower() != want.repo.lower():
        draft_repo = draft_spec.repo
        draft_sha, draft_files = _listing(draft_repo, None, root, log)
    draft_file = None
    if not no_draft:
        try:
            draft_file = choose_draft(draft_repo, draft_files, (draft_spec and draft_spec.quant) or want.quant,
                                      any_gguf=draft_spec is not None)
        except ValueError as e:
            if draft_spec:
                raise
            log(f"no draft: {e}")
        if draft_spec and draft_file is None:
            raise ValueError(f"{draft_repo} has no GGUF draft file")
    mmproj_file = None if no_mmproj else choose_mmproj(files)
    model_path = _get(want.repo, sha, model_file, root, ("gemma4", "gemma3"), log)
    draft_path = None
    if draft_file is not None:
        draft_path = _get(draft_repo, draft_sha, draft_file, root, ("gemma4-assistant",), log)
    mmproj_path = None
    if mmproj_file is not None:  # beside the model: load_model finds mmproj*.gguf there by itself
        mmproj_path = _get(want.repo, sha, mmproj_file, root, ("clip",), log)
    return PullResult(model_path, draft_path, sha, mmproj_path)


def _get(repo: str, sha: Optional[str], remote: RemoteFile, root: Path, archs: tuple[str, ...], log: Log) -> Path:
    if sha is None:  # offline: the local copy, checked as far as we can without the hub's listing
        dest = root / repo / remote.name
    else:
        dest = fetch(repo, sha, remote, root / repo / remote.base, log)
    arch = check_gguf(dest, archs)
    log(f"{dest.name}: GGUF {arch}, {dest.stat().st_size / 2**30:.2f} GiB")
    return dest
