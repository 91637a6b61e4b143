"""A Gemma 3 decode token as one ggml graph (models/token_graph.py: every layer, the final norm and
the head) against one graph a layer and against the four graph runs a layer: the same nodes in the
same order, so the engine's tokens and log-probabilities are bit for bit the same, on the real demo
model (Gemma 3 270M Q4_K_M), two requests decoded together, past a window bucket (64 keys) so the
step's graph is rebuilt on the way."""
from __future__ import annotations

import pytest

from kernels import ggml
from kernels.env import reload
from tests.models.test_ggml_layer import decode_greedy

pytestmark = pytest.mark.skipif(not ggml.available(), reason=f"ggml binding unavailable: {ggml.reason()}")


def test_one_graph_a_token_gives_the_layer_graphs_bits(gemma3_270m_path, monkeypatch):
    from engine.api import open_model
    from models import gemma3

    lm = open_model(gemma3_270m_path, exact=False)
    text = lm.tokenizer.encode("The lighthouse keeper climbed the stairs and")
    prompts = (text + [236743] * 52, text[:5] + [236743] * 3)  # the first crosses 64 keys while decoding
    ran = step_rows(monkeypatch, gemma3.Gemma3Model)
    whole = decode_greedy(lm, prompts, 14)
    assert sum(ran) >= 2 * 13 and all(ran) and max(ran) == 2  # every decode token, the two together
    monkeypatch.setenv("EDGEGEM_CPU_STEP_GRAPH", "0")
    reload()
    layers = decode_greedy(lm, prompts, 14)
    monkeypatch.setenv("EDGEGEM_CPU_LAYER_GRAPH", "0")
    reload()
    four = decode_greedy(lm, prompts, 14)
    assert whole == layers == four
    assert all(len(ids) == 14 for ids, _ in whole)


def step_rows(monkeypatch, cls) -> list[int]:
    """Rows of each `cls.decode_step` call, as they happen (0: the token graph did not apply)."""
    ran: list[int] = []
    step = cls.decode_step

    def spy(self, x, *a):
        out = step(self, x, *a)
        ran.append(0 if out is None else x.shape[0])
        return out
    monkeypatch.setattr(cls, "decode_step", spy)
    return ran
