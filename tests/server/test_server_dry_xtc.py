"""DRY and XTC in both APIs' requests (app/server/dry_xtc.py): llama-server's names map onto the
engine's SamplingParams, unset ones keep llama.cpp's defaults (off), bad ones are refused by the
schema (a 400 naming the field: tests/server/test_server_openai.py's BAD cases run them end to end)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.server import params
from app.server.ollama_schemas import GenerateRequest
from app.server.schemas import ChatCompletionRequest
from engine.sampler import SamplingParams


class _Cfg:
    default_max_tokens = None
    max_image_pixels = 1 << 20
    image_tokens = 280
    kv_auto = False


DRY = {"dry_multiplier": 0.8, "dry_base": 1.5, "dry_allowed_length": 3, "dry_penalty_last_n": -1,
       "dry_sequence_breakers": ["\n", "###"], "xtc_probability": 0.5, "xtc_threshold": 0.2}


def _picked(s: SamplingParams) -> dict:
    return {k: getattr(s, k) for k in DRY}


def test_openai_request_fields_reach_the_sampling_params():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **DRY)
    _, gen = params.openai_chat(req, 4096, _Cfg())
    assert _picked(gen.sampling) == {**DRY, "dry_sequence_breakers": ("\n", "###")}


def test_ollama_options_take_the_same_names():
    req = GenerateRequest(prompt="hi", options=DRY)
    _, _, gen = params.ollama_generate(req, 4096, _Cfg())
    assert _picked(gen.sampling) == {**DRY, "dry_sequence_breakers": ("\n", "###")}


def test_unset_fields_keep_llama_cpps_defaults_off():
    _, gen = params.openai_chat(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), 4096, _Cfg())
    assert _picked(gen.sampling) == _picked(SamplingParams())
    assert not gen.sampling.dry_on and gen.sampling.xtc_probability == 0.0


@pytest.mark.parametrize("bad", [{"dry_base": 0.9}, {"dry_multiplier": -1}, {"dry_allowed_length": -1},
                                 {"dry_penalty_last_n": -2}, {"dry_sequence_breakers": []},
                                 {"dry_sequence_breakers": "\n"}, {"xtc_probability": 1.1},
                                 {"xtc_threshold": -0.1}])
def test_bad_values_are_refused_by_both_schemas(bad):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **bad)
    with pytest.raises(ValidationError):
        GenerateRequest(prompt="hi", options=bad)
