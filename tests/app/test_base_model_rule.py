"""One rule for base models in every front end (engine/request_params.py): `edgegem run` and `chat`
on the demo (Gemma 3 270M pretrained) continue the text, with no chat turns around it, at the
base-model defaults (DRY on, a blank-line stop), and a flag given wins over a default; the layering
of the defaults themselves. The server's completion endpoints: tests/server/test_server_openai.py and
tests/server/test_server_ollama.py."""
from __future__ import annotations

import json

import pytest

from engine.request_params import BASE_MODEL_DEFAULTS, generation_params

PROMPT = "Write one sentence about lighthouses."  # the issue's


def test_values_layer_engine_then_front_end_then_base_model_then_what_the_user_set():
    chat = generation_params({}, defaults={"temperature": 0.7, "dry_multiplier": 0.1})
    assert (chat.sampling.temperature, chat.sampling.dry_multiplier, chat.sampling.max_tokens) == (0.7, 0.1, 256)
    assert not chat.continue_text and not chat.stop_at_blank_line
    base = generation_params({"temperature": None}, base_model=True, defaults={"temperature": 0.7,
                                                                                "dry_multiplier": 0.1})
    s = base.sampling
    assert (s.temperature, s.dry_multiplier, s.dry_penalty_last_n) == (0.7, 0.8, -1)
    assert s.dry_sequence_breakers == BASE_MODEL_DEFAULTS["dry_sequence_breakers"]
    assert base.continue_text and base.stop_at_blank_line
    mine = generation_params({"dry_multiplier": 0.0, "stop_at_blank_line": False, "max_tokens": "9"},
                             base_model=True, thinking=True)
    assert (mine.sampling.dry_multiplier, mine.sampling.max_tokens, mine.stop_at_blank_line) == (0.0, 9, False)
    assert mine.continue_text and not mine.thinking  # a base model has no thinking turn
    with pytest.raises(ValueError, match="invalid sampling parameters"):
        generation_params({"top_p": 0})


@pytest.fixture
def submitted(monkeypatch):
    """Every (messages, GenerationParams, prompt ids) LocalClient.submit gets, in order."""
    from engine.client import LocalClient

    seen = []
    real = LocalClient.submit

    def spy(self, messages, params=None, **kw):
        rid = real(self, messages, params, **kw)
        seen.append((messages, params, self.last_prompt_ids(rid)))
        return rid
    monkeypatch.setattr(LocalClient, "submit", spy)
    return seen


def _run(path, capsys, *flags):
    from app.cli import main

    assert main(["run", "--model", str(path), "--prompt", PROMPT, "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_run_continues_a_base_models_text_at_its_defaults_and_a_flag_wins(gemma3_270m_path, submitted, capsys):
    from models.loader import open_gguf
    from models.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(open_gguf(gemma3_270m_path).metadata)
    out = _run(gemma3_270m_path, capsys, "--max-tokens", "40")
    (_, params, ids), = submitted
    assert out["prompt_ids"] == ids == tok.encode(PROMPT)  # BOS and the text: no <start_of_turn> around it
    assert params.continue_text and params.stop_at_blank_line
    s = params.sampling
    assert (s.dry_multiplier, s.dry_penalty_last_n, s.dry_sequence_breakers) == (0.8, -1, (":", "\"", "*"))
    assert s.max_tokens == 40 and out["finish_reason"] in ("stop", "length") and out["ids"]
    assert "\n\n" not in out["text"].strip()  # one paragraph: the blank-line stop

    _run(gemma3_270m_path, capsys, "--max-tokens", "8", "--dry-multiplier", "0", "--no-stop-at-blank-line",
         "--dry-sequence-breaker", "\n")
    params = submitted[-1][1]
    assert params.continue_text and not params.stop_at_blank_line  # still continued: flags change the defaults
    assert (params.sampling.dry_multiplier, params.sampling.dry_sequence_breakers) == (0.0, ("\n",))
    assert params.sampling.dry_penalty_last_n == -1  # the base default the flags left alone


def test_chat_continues_a_base_models_text_at_its_defaults_and_a_flag_wins(gemma3_270m_path, submitted,
                                                                         monkeypatch, capsys):
    from app.cli import main
    from models.loader import open_gguf
    from models.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(open_gguf(gemma3_270m_path).metadata)

    def chat(*flags):
        lines = iter([PROMPT, ""])
        monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
        assert main(["chat", "--model", str(gemma3_270m_path), "--max-tokens", "24", *flags]) == 0
        return capsys.readouterr().out

    shown = chat()
    (msgs, params, ids), = submitted
    assert ids == tok.encode(PROMPT) and msgs[0]["content"] == PROMPT  # no chat turns around it
    assert params.continue_text and params.stop_at_blank_line and params.sampling.dry_multiplier == 0.8
    assert params.sampling.temperature == 0.7  # chat's own default stays
    assert "your text is continued" in shown

    chat("--dry-multiplier", "0.25", "--temperature", "0", "--no-stop-at-blank-line")
    params = submitted[-1][1]
    assert params.continue_text and not params.stop_at_blank_line
    assert (params.sampling.dry_multiplier, params.sampling.temperature) == (0.25, 0.0)
