"""Image tokens that attend both ways inside their image (26B-A4B and 31B).

Spec: shared/design/gemma4-architecture.md §3.6, gemma4-vision.md §4.4. With the text config's
`use_bidirectional_attention == "vision"`, transformers 5.24 (`create_masks_for_vision_model`)
builds, for the **sliding** layers only, AND(sliding window, OR(causal, same image block)); full
layers stay causal. A block is a contiguous run of image soft tokens (`mm_token_type_ids` 1/2;
`<|image>` / `<image|>` are text and stay causal). So a query inside an image sees every later
token of its own image, however far (a later key passes `kv > q - W` trivially), and earlier keys
only within the window, as on any sliding layer.

llama.cpp does the same: mtmd decodes an image's embeddings in one batch with causal attention
off, and the gemma4 model's `LLAMA_NON_CAUSAL_TYPE_SWA_ONLY` makes only the SWA cache's mask
non-causal, still applying `is_masked_swa` to earlier keys (llama-kv-cache.cpp
`set_input_kq_mask`). It decides the switch on the width instead of the config (on unless
n_embd is 1536 or 2560, mtmd.cpp `mtmd_decode_use_non_causal`), which is the same choice for the
four published models. A GGUF carries no key for it; `Gemma4Config.from_gguf` takes it from the
structure that tells the two families apart (no per-layer embeddings: 26B/31B).

Every attention implementation here reads the rule as one number per query: `last_key`, the last
position it may see (its own position for text, the end of its image run for an image token).
Keys before the query keep the causal/window rule on the query's own position.
"""
from __future__ import annotations

from typing import Optional

import torch


def image_last_key(pos: torch.Tensor, image: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The last key position each query of a forward may attend to on a sliding layer: pos [T]
    (consecutive positions of one sequence), `image` CPU bool [T] the image soft-token positions
    of this forward (None or none set: None, plain causal attention).

    Each contiguous run of image positions is one image (prompt blocks are begin + N x image +
    end, so two images are never adjacent). The engine never cuts an image between two forwards
    (engine/media.py `whole_images_end`), so a run's end is its image's end; a run that starts at the
    forward's first row may be the tail of an image whose head is in the cache (a prefix hit):
    those keys are earlier, visible anyway."""
    if image is None or not bool(image.any()):
        return None
    image = image.cpu()  # the run bookkeeping stays on the host: no device sync per forward
    T = image.shape[0]
    assert pos.shape == (T,), f"pos {tuple(pos.shape)} for {T} image flags"
    idx = torch.arange(T)
    starts = image & ~torch.cat([image.new_zeros(1), image[:-1]])
    run = torch.cumsum(starts.long(), 0) - 1  # run index of each image position
    ends = torch.zeros(int(starts.sum()), dtype=torch.long)
    ends.scatter_reduce_(0, run[image], idx[image], reduce="amax")
    last = idx.clone()
    last[image] = ends[run[image]]
    return pos[last.to(pos.device)]
