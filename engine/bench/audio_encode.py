"""`edgegem bench --audio`: how long the audio tower takes to encode 1 s, 10 s and 30 s of audio.

The tower is an mmproj's (`--mmproj FILE`) or, without one, the E2B/E4B geometry (H 1024, 12
layers, 8 heads, SSCP 128/32, P 1536, d 1536) with random weights: the time does not depend on
the values. Each length is encoded once to warm up, then `repeats` times (the best is reported,
with the median); features and tower are timed apart, in wall time and in the process's CPU time
(all threads: on a machine shared with other jobs the wall time grows with the load, the CPU time
much less). The memory column is the tower's planned activation peak (engine/memory_plan.py); the
process's peak resident size is printed after the run.
"""
from __future__ import annotations

import resource
import statistics
import time
from typing import Optional

import numpy as np
import torch

E2B_AUDIO = dict(d_model=1024, n_layer=12, n_head=8, ffn_width=4096, sscp_channels=(128, 32), out_width=1536,
                 text_width=1536)


def random_tower(dtype=torch.float32, device: str = "cpu", seed: int = 0, **geometry):
    """The E2B/E4B audio tower with random weights (clip bounds absent: ±inf)."""
    from models.gemma4_audio import Gemma4Audio, Gemma4AudioConfig, tensor_plan

    cfg = Gemma4AudioConfig(**{**E2B_AUDIO, **geometry})
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in tensor_plan(cfg, set()).items():
        if name.endswith("norm.weight") or name.endswith("per_dim_scale.weight"):
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / (shape[-1] if len(shape) > 1 else 1) ** 0.5
        weights[name] = t.to(device, dtype)
    return Gemma4Audio(cfg, weights, dtype=dtype, device=device)


def _clip(seconds: float):
    from models.audio import audio_from_samples

    rng = np.random.default_rng(int(seconds))
    t = np.arange(int(seconds * 16000)) / 16000
    x = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.shape)
    return audio_from_samples(x.astype(np.float32), 16000, name=f"{seconds:g}s")


def audio_bench(lengths=(1.0, 10.0, 30.0), mmproj: Optional[str] = None, device: str = "cpu",
                repeats: int = 3, progress=None) -> dict:
    from models.audio import log_mel

    if mmproj:
        from models.gemma4_audio import Gemma4AudioConfig, load_audio_tower
        from models.gguf import GGUFFile
        f = GGUFFile(mmproj)
        tower = load_audio_tower(f, Gemma4AudioConfig.from_gguf(f), dtype=torch.bfloat16 if device == "cuda"
                                 else torch.float32, device=device)
        source = str(mmproj)
    else:
        tower = random_tower(torch.bfloat16 if device == "cuda" else torch.float32, device)
        source = "E2B/E4B geometry, random weights"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for seconds in lengths:
        clip = _clip(seconds)
        feats = [log_mel(p) for p in clip.pieces()]
        tower.encode([clip])  # warm-up
        feat_s, tower_s, cpu_s = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            feats = [log_mel(p) for p in clip.pieces()]
            t1, c1 = time.perf_counter(), time.process_time()
            for f in feats:
                tower.encode_features(f[None])
            sync()
            t2, c2 = time.perf_counter(), time.process_time()
            feat_s.append(t1 - t0)
            tower_s.append(t2 - t1)
            cpu_s.append(c2 - c1)
        rows.append({"seconds": seconds, "tokens": clip.n_tokens, "features_s": min(feat_s),
                     "tower_s": min(tower_s), "tower_median_s": statistics.median(tower_s),
                     "tower_cpu_s": min(cpu_s),
                     "tokens_per_s": clip.n_tokens / min(tower_s),
                     "planned_peak_bytes": tower.activation_bytes(min(feats[0].shape[0], 2999))})
        if progress:
            progress(f"{seconds:g} s: {min(tower_s):.2f} s")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    lines = [f"audio tower: {source}; {tower.n_params / 1e6:.0f} M weights, {tower.nbytes / 2**20:.0f} MiB "
             f"{str(tower.dtype).replace('torch.', '')} on {device}, {torch.get_num_threads()} threads",
             "| audio | tokens | features | tower (best) | tower (median) | tower CPU time | tokens/s | planned peak |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['seconds']:g} s | {r['tokens']} | {r['features_s'] * 1000:.0f} ms | {r['tower_s']:.2f} s | "
              f"{r['tower_median_s']:.2f} s | {r['tower_cpu_s']:.2f} s | {r['tokens_per_s']:.0f} | "
              f"{r['planned_peak_bytes'] / 2**20:.0f} MiB |" for r in rows]
    lines.append(f"process peak resident: {rss / 2**20:.0f} MiB")
    return {"source": source, "device": device, "threads": torch.get_num_threads(), "rows": rows,
            "weights_bytes": tower.nbytes, "peak_rss_bytes": rss, "table": "\n".join(lines)}
