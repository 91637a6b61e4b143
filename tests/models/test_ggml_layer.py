"""A Gemma 3 decode layer as one ggml graph (models/gemma3_ggml.py) against the four graph runs it
replaces (the attention prologue, ggml attention, the residual after attention, the MLP residual):
the same nodes in the same order, so the engine's tokens and log-probabilities are bit for bit the
same, on the real demo model (Gemma 3 270M Q4_K_M), two requests decoded together."""
from __future__ import annotations

import pytest
import torch

from kernels import ggml
from kernels.env import reload

pytestmark = pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")


def decode_greedy(lm, prompts, max_tokens: int = 12) -> list[tuple[list[int], list[float]]]:
    """The engine's greedy tokens and their log-probabilities for `prompts`, decoded together."""
    from engine.sampler import SamplingParams
    from engine.scheduler import Engine, EngineConfig

    engine = Engine(lm.model, config=EngineConfig(full_tokens=2048))
    reqs = [engine.add(list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)) for p in prompts]
    engine.run_to_completion()
    engine.check()
    return [(r.output_ids, picked_logprobs(r)) for r in reqs]


def picked_logprobs(req) -> list[float]:
    """The log-probabilities of a finished request's sampled tokens, from its events (drained)."""
    events = []
    while not req.events.empty():
        events.append(req.events.get_nowait())
    return [lp.logprob for ev in events for lp in (ev.logprobs or [])]


def test_one_graph_a_layer_gives_the_four_runs_bits(gemma3_270m_path, monkeypatch):
    import models.gemma3 as g3
    from engine.api import open_model

    monkeypatch.setenv("EDGEGEM_CPU_STEP_GRAPH", "0")  # the layer graphs, not the whole-token one
    reload()
    lm = open_model(gemma3_270m_path, exact=False)
    text = lm.tokenizer.encode("The lighthouse keeper climbed the stairs and")
    prompts = (text, text[:5] + [236743] * 3)
    fused = g3.fused_decode_layer
    ran = []
    monkeypatch.setattr(g3, "fused_decode_layer", lambda *a, **k: (lambda r: (ran.append(r is not None), r)[1])(
        fused(*a, **k)))
    one = decode_greedy(lm, prompts)
    assert sum(ran) >= 2 * 11 * lm.model.cfg.n_layer  # every decode step's every layer (the prompt rows: not)
    monkeypatch.setattr(g3, "fused_decode_layer", lambda *a, **k: None)
    four = decode_greedy(lm, prompts)
    assert one == four


def test_bad_inputs_are_one_line_errors():
    from models.gemma3_ggml import decode_layer

    x = torch.zeros(2, 8)  # two rows: decode_layer takes one token
    with pytest.raises(ValueError, match="ggml decode_layer: one row"):
        decode_layer(x, x, None, None, 1, 1, 8, torch.ones(8), torch.ones(8), 1e-6, torch.ones(1, 4),
                     torch.zeros(1, 4), False, torch.zeros(4, 1, 8), torch.zeros(4, 1, 8),
                     torch.zeros(1, dtype=torch.long), torch.zeros(4, 1, 8), torch.zeros(4, 1, 8),
                     torch.zeros(1, 4, dtype=torch.float16), 1.0, None, torch.ones(8), torch.ones(8), None, None,
                     torch.ones(8), torch.ones(8))
