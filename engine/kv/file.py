"""KV files: the KV of one token sequence on disk, so a conversation resumes with a file read
instead of a prefill.

A file is a safetensors file:
  tokens            [n] int64     the token ids whose KV it holds (positions 0..n-1)
  full.{L}.k / .v   [n, n_kv, hd] every position, in the full pool's value dtype (bytes as stored)
  full.{L}.k_scale  [n, n_kv]     fp32, 8-bit formats only (and .v_scale)
  window.pos        [w] int64     the positions kept for sliding layers: the last window + margin
  window.{L}.k ...  [w, n_kv, hd] those positions in the window pool's format
and string metadata: format version, model identity, layout (architecture, layers and their dims,
formats, window), token count and a sha256 of the payload. L runs over KV-owning layers only
(KV-shared layers read their source's slab), exactly the slabs of engine/kv/pool.HybridKVPool.

`snapshot` gathers from the pools on the engine thread (the only one touching them), `write` runs
anywhere (the writer thread): temporary name, fsync, rename, so a crash mid-save leaves no file a
restore would read. `restore` checks everything before it takes a slot and raises KVFileError
(one line) for a truncated, corrupted or foreign file; the caller then prefills as usual.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .. import failpoints

FORMAT_VERSION = "1"
_ID_BYTES = 1 << 20  # model identity: size + the first and last MiB of the file(s)


class KVFileError(ValueError):
    """A KV file that cannot serve this model or prompt (one line; the caller prefills instead)."""


# --- identity and layout --------------------------------------------------------------------------

def model_identity(path) -> str:
    """A cheap fingerprint of a model file (or HF folder): sizes and the first and last MiB of each
    weight file, hashed. Reads 2 MiB per file, not the weights."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("config.json")) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_ID_BYTES))
            if size > 2 * _ID_BYTES:
                fh.seek(size - _ID_BYTES)
                h.update(fh.read(_ID_BYTES))
    return h.hexdigest()[:32]


def pool_layout(pools, window: Optional[int], arch: str = "") -> dict:
    """What a file's KV must match to be read into these pools: the slabs (layer -> n_kv, hd) and
    format of each pool, KV sharing and the sliding window."""
    def one(pool):
        return {"format": pool.fmt.name,
                "layers": {str(i): list(pool.k[i].shape[1:]) for i in pool.layers}}

    return {"arch": arch, "share_kv": pools.share_kv, "window": window,
            "full": one(pools.full), "window_pool": one(pools.window)}


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


# --- save -----------------------------------------------------------------------------------------

@dataclass
class KVSnapshot:
    """The KV of `tokens` copied out of the pools (host tensors), ready to be written."""

    tokens: list[int]
    tensors: dict
    metadata: dict

    @property
    def n_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def snapshot(pools, cache, window: Optional[int], tokens: list[int], model_id: str, arch: str = "",
             margin: int = 64) -> Optional[KVSnapshot]:
    """The KV of the longest prefix of `tokens` the prefix cache holds (None if it holds nothing).
    Window positions: the last window + margin, where the cache still has them."""
    full_slots, win_slots = cache.lookup(tokens)
    n = len(full_slots)
    if n == 0:
        return None
    t: dict[str, torch.Tensor] = {"tokens": torch.tensor(tokens[:n], dtype=torch.long)}
    _gather(t, "full", pools.full, full_slots)
    pos = torch.empty(0, dtype=torch.long)
    if pools.window.layers and window:
        lo = max(0, n - window - margin)
        keep = win_slots[lo:] >= 0
        pos = torch.arange(lo, n)[keep]
        _gather(t, "window", pools.window, win_slots[pos])
    t["window.pos"] = pos
    meta = {"edgegem_kv": FORMAT_VERSION, "model": model_id,
            "layout": json.dumps(pool_layout(pools, window, arch), sort_keys=True),
            "n_tokens": str(n), "checksum": _checksum(t)}
    return KVSnapshot(tokens[:n], t, meta)


def _gather(out: dict, prefix: str, pool, slots: torch.Tensor) -> None:
    for i in pool.layers:
        s = slots.to(pool.k[i].device)  # the pool's device, or the host for the CPU's layers beside a GPU
        out[f"{prefix}.{i}.k"] = pool.k[i][s].cpu()
        out[f"{prefix}.{i}.v"] = pool.v[i][s].cpu()
        if pool.fmt.scaled:
            out[f"{prefix}.{i}.k_scale"] = pool.k_scale[i][s].cpu()
            out[f"{prefix}.{i}.v_scale"] = pool.v_scale[i][s].cpu()


def write(snap: KVSnapshot, path, before_rename=None) -> int:
    """Write `snap` to `path` atomically (temporary name in the same folder, fsync, rename, fsync
    the folder); returns the file size. On any error the temporary file is removed and the error
    raised; an existing file at `path` is left as it was."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if failpoints.ACTIVE:
            failpoints.maybe_fail("kv.write")
        save_file(snap.tensors, str(tmp), metadata=snap.metadata)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if before_rename is not None:  # tests: a crash between the write and the rename
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # folders cannot be fsynced on every platform
    return path.stat().st_size


# --- restore --------------------------------------------------------------------------------------

def read_header(path) -> dict:
    """The metadata of a KV file, checked for being one (one-line KVFileError otherwise)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise KVFileError(f"{path.name}: truncated (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 64 << 20):
                raise KVFileError(f"{path.name}: truncated or not a KV file")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise KVFileError(f"{path.name}: cannot read ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, KVFileError):
            raise
        raise KVFileError(f"{path.name}: corrupted header") from None
    meta = header.get("__metadata__") or {}
    if meta.get("edgegem_kv") is None:
        raise KVFileError(f"{path.name}: not an edgegem KV file")
    if meta["edgegem_kv"] != FORMAT_VERSION:
        raise KVFileError(f"{path.name}: KV file format version {meta['edgegem_kv']}, this edgegem "
                          f"reads version {FORMAT_VERSION}")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) > size:
        raise KVFileError(f"{path.name}: truncated ({size} bytes, {8 + n + max(ends)} expected)")
    return meta


def check_compatible(meta: dict, model_id: str, layout: dict, name: str = "KV file") -> None:
    if meta.get("model") != model_id:
        raise KVFileError(f"{name}: written for another model file")
    theirs = json.loads(meta.get("layout", "{}"))
    for key, what in (("arch", "architecture"), ("share_kv", "KV sharing"), ("window", "sliding window")):
        if theirs.get(key) != layout.get(key):
            raise KVFileError(f"{name}: written for another {what} ({theirs.get(key)} vs {layout.get(key)})")
    for pool in ("full", "window_pool"):
        a, b = theirs.get(pool, {}), layout[pool]
        if a.get("layers") != b["layers"]:
            raise KVFileError(f"{name}: written for another layer plan")
        if a.get("format") != b["format"] and b["layers"]:
            label = "KV" if pool == "full" else "sliding-window KV"
            raise KVFileError(f"{name}: {label} format {a.get('format')}, the engine uses {b['format']}")


def load(path, model_id: str, layout: dict) -> tuple[list[int], dict]:
    """Token ids and tensors of a KV file that fits this model and layout, checksum verified."""
    from safetensors import safe_open

    path = Path(path)
    meta = read_header(path)
    check_compatible(meta, model_id, layout, path.name)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types
        raise KVFileError(f"{path.name}: unreadable ({type(e).__name__})") from None
    if _checksum(tensors) != meta.get("checksum"):
        raise KVFileError(f"{path.name}: checksum mismatch (the file is corrupted)")
    tokens = tensors.pop("tokens", None)
    if tokens is None or int(meta.get("n_tokens", -1)) != len(tokens):
        raise KVFileError(f"{path.name}: token count does not match its header")
    _check_shapes(path.name, tensors, len(tokens), layout)
    return tokens.tolist(), tensors


def _check_shapes(name: str, t: dict, n: int, layout: dict) -> None:
    w = len(t.get("window.pos", ()))
    for prefix, pool, rows in (("full", "full", n), ("window", "window_pool", w)):
        scaled = layout[pool]["format"] in ("int8_per_token_head", "fp8_per_token_head")
        for i, dims in layout[pool]["layers"].items():
            for kv in ("k", "v"):
                want = {f"{prefix}.{i}.{kv}": [rows, *dims]}
                if scaled:
                    want[f"{prefix}.{i}.{kv}_scale"] = [rows, dims[0]]
                for key, shape in want.items():
                    if key not in t or list(t[key].shape) != shape:
                        raise KVFileError(f"{name}: tensor {key} missing or of the wrong shape")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    eq = (torch.tensor(a[:n]) == torch.tensor(b[:n])).long().cumprod(0)
    return int(eq.sum())


def restore(pools, cache, path, prompt_ids: list[int], model_id: str, layout: dict) -> int:
    """Read the KV of the longest common prefix of a file's tokens and `prompt_ids` (less its last
    token, which is always computed) into free slots and hand it to the prefix cache. Returns the
    number of tokens the cache gained from the file (0 when it already held as much). Raises
    KVFileError before touching the pools when the file cannot be used."""
    if cache.kind == "naive":
        raise KVFileError("--cache-type naive keeps no prefix: KV files need the radix cache")
    tokens, t = load(path, model_id, layout)
    c = common_prefix(tokens, prompt_ids[:-1])
    pos = t["window.pos"]
    if cache.has_window and c:  # a sliding layer's first query needs the window before it
        have_win = torch.full((c,), -1, dtype=torch.long)
        have_win[pos[pos < c]] = 1
        c = cache._servable(have_win, c)
    before = _served(cache, prompt_ids)
    if c <= before:
        return 0
    win_pos = pos[pos < c]
    need_full = c if pools.full.layers else 0
    need_win = len(win_pos) if pools.window.layers else 0
    if pools.full.n_free < need_full or pools.window.n_free < need_win:
        cache.evict(full_tokens=need_full, window_tokens=need_win)
        if pools.full.n_free < need_full or pools.window.n_free < need_win:
            raise KVFileError(f"{Path(path).name}: {c} tokens do not fit the free KV slots")
    full_slots = pools.full.alloc(need_full) if need_full else torch.full((c,), -1, dtype=torch.long)
    win_slots = pools.window.alloc(need_win) if need_win else torch.empty(0, dtype=torch.long)
    _scatter(t, "full", pools.full, full_slots, slice(0, c))
    _scatter(t, "window", pools.window, win_slots, slice(0, len(win_pos)))
    by_pos = torch.full((c,), -1, dtype=torch.long)
    if need_win:
        by_pos[win_pos] = win_slots
    nodes, full_taken, win_taken = cache.insert(prompt_ids[:c], full_slots, by_pos)
    if need_full:
        pools.full.free(full_slots[~full_taken])
    if need_win:
        pools.window.free(by_pos[(by_pos >= 0) & ~win_taken])
    cache.release(nodes)
    try:
        os.utime(path)  # least recently used goes first when the disk budget is tight
    except OSError:
        pass
    return _served(cache, prompt_ids) - before


def _served(cache, prompt_ids: list[int]) -> int:
    """Prompt tokens the prefix cache would serve now."""
    m = cache.match(prompt_ids, exact=False)
    cache.release(m.nodes)
    return m.length


def _scatter(t: dict, prefix: str, pool, slots: torch.Tensor, rows: slice) -> None:
    if not len(slots):
        return
    for i in pool.layers:
        dev = pool.k[i].device  # the pool's device, or the host for the CPU's layers beside a GPU
        s = slots.to(dev)
        pool.k[i][s] = t[f"{prefix}.{i}.k"][rows].to(dev)
        pool.v[i][s] = t[f"{prefix}.{i}.v"][rows].to(dev)
        if pool.fmt.scaled:
            pool.k_scale[i][s] = t[f"{prefix}.{i}.k_scale"][rows].to(dev)
            pool.v_scale[i][s] = t[f"{prefix}.{i}.v_scale"][rows].to(dev)
