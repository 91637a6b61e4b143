"""KV files found by their tokens: which file of a managed folder (`--kv-dir`) serves a prompt.

API clients resend a whole conversation every turn and name no file, so a request that asks for it
(`kv_auto`) is served by the file whose tokens are the longest prefix of its prompt, and the KV of
prompt + answer is saved as `api-<sha256 of its tokens>.safetensors`. Each file is indexed under the
sha256 of its whole token list and of its prompt part (a regenerated answer, or a history whose
answer re-tokenizes differently, still finds the prompt); a prompt is looked up at each length the
index has, longest first (one hash per length). A request's new file replaces the file it was
served from (the same conversation one turn shorter, or a regenerated answer), so a conversation
keeps one file. The folder is scanned once (a restart finds
every file written for this model); the writer thread adds files, the engine thread looks up.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Optional

import torch

from . import file as kv_file
from .file import KVFileError

log = logging.getLogger("edgegem")
PREFIX = "api-"


def digest(tokens: list[int]) -> str:
    """sha256 of token keys (int64: image positions carry negative content keys)."""
    return hashlib.sha256(torch.tensor(tokens, dtype=torch.long).numpy().tobytes()).hexdigest()


def file_tokens(path: Path) -> list[int]:
    """The token keys a KV file holds (its small `tokens` tensor only)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor("tokens").tolist()
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types
        raise KVFileError(f"{path.name}: unreadable ({type(e).__name__})") from None


class KVIndex:
    def __init__(self, folder, model_id: str):
        self.folder, self.model_id = Path(folder), model_id
        self._lock = threading.Lock()
        self._by_key: dict[tuple[int, str], Path] = {}  # (length, digest of that prefix) -> file
        self._keys: dict[Path, list[tuple[int, str]]] = {}  # file -> its keys, the whole list first
        for p in sorted(self.folder.glob("*.safetensors")):
            try:
                meta = kv_file.read_header(p)
                if meta.get("model") != model_id:
                    continue  # another model's file: never served here
                tokens = file_tokens(p)
            except KVFileError as e:
                log.info("KV index: %s", e)
                continue
            n_prompt = int(meta["n_prompt"]) if str(meta.get("n_prompt", "")).isdigit() else None
            self._add(p, tokens, n_prompt)

    def path_for(self, tokens: list[int]) -> Path:
        return self.folder / f"{PREFIX}{digest(tokens)[:32]}.safetensors"

    def find(self, prompt: list[int]) -> Optional[Path]:
        """The file indexed under the longest prefix of `prompt` (less its last token, which is
        always computed), or None."""
        with self._lock:
            lengths = sorted({n for n, _ in self._by_key if n < len(prompt)}, reverse=True)
            for n in lengths:
                path = self._by_key.get((n, digest(prompt[:n])))
                if path is not None:
                    return path
        return None

    def added(self, path: Path, tokens: list[int], n_prompt: Optional[int], replaces: Optional[str]) -> None:
        """Writer thread, after `path` was written: index it, and retire `replaces` (the file its
        request was served from: the same conversation, one turn shorter, or a regenerated answer):
        its keys that are prefixes of the new tokens now find the new file, and it is deleted."""
        with self._lock:
            self._add(Path(path), tokens, n_prompt)
            old = Path(replaces) if replaces else None
            if old is None or old == Path(path) or old not in self._keys:
                return
            for n, d in self._keys.pop(old):
                if self._by_key.get((n, d)) == old:
                    del self._by_key[(n, d)]
                    if n <= len(tokens) and digest(tokens[:n]) == d:
                        self._by_key[(n, d)] = Path(path)
                        self._keys[Path(path)].append((n, d))
        old.unlink(missing_ok=True)

    def removed(self, paths) -> None:
        """Files the disk budget deleted."""
        with self._lock:
            for p in paths:
                for key in self._keys.pop(Path(p), []):
                    if self._by_key.get(key) == Path(p):
                        del self._by_key[key]

    def _add(self, path: Path, tokens: list[int], n_prompt: Optional[int]) -> None:
        keys = [(len(tokens), digest(tokens))]
        if n_prompt and n_prompt < len(tokens):
            keys.append((n_prompt, digest(tokens[:n_prompt])))
        for key in self._keys.pop(path, []):
            self._by_key.pop(key, None)
        self._keys[path] = keys
        for key in keys:
            self._by_key[key] = path
