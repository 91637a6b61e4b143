"""KV storage: where the K and V of every token live, in memory and on disk.

- `format.py`: the storage formats (bf16 / fp16 / fp32, 8-bit with per-token-head scales) and what
  one token costs in each;
- `pool.py`: the hybrid pools, a full-attention pool and a sliding-window pool of token slots;
- `sequence.py`: one sequence's KV over its slot lists (the models' `KVStore` protocol);
- `file.py`: a token sequence's KV as a safetensors file;
- `index.py`: which file of a managed folder serves a prompt (by the hashes of its tokens);
- `sessions.py`: conversations whose KV is saved to and restored from those files.

The prefix cache (engine/prefix_cache.py) stays beside the scheduler: it decides which slots a new
prompt may reuse and which to evict, over token ids, and never reads or writes K/V itself.
"""
from .file import KVFileError, model_identity
from .format import FORMAT_NAMES, FormatUnsupported, KVFormat, owning_layers, pool_unit_bytes, resolve_format
from .index import KVIndex
from .pool import HybridKVPool, KVPool, KVPoolFull
from .sequence import SequenceKV
from .sessions import KVDisk, KVSessions

__all__ = ["FORMAT_NAMES", "FormatUnsupported", "HybridKVPool", "KVDisk", "KVFileError", "KVFormat", "KVIndex",
           "KVPool", "KVPoolFull", "KVSessions", "SequenceKV", "model_identity", "owning_layers",
           "pool_unit_bytes", "resolve_format"]
