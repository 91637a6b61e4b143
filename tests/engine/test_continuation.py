"""Base models: told from chat models (models/model_kind.py), continued as text (engine.prompt
continuation_text), stopped at a blank line after a paragraph (engine/paragraph_stop.py); and the
demo at the app's base-model defaults (DRY on) does not loop."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from engine.prompt import continuation_text
from engine.paragraph_stop import blank_line_hold, blank_line_stop
from models.model_kind import model_kind

PROMPT = "Write one sentence about lighthouses."  # the first message


# --- which kind -------------------------------------------------------------------------------

@pytest.mark.parametrize("meta, template, kind", [
    ({"general.name": "Gemma 3 270m"}, None, "base"),  # the demo: no template, no fine-tune word
    ({"general.name": "Gemma 3 270m"}, "{{ messages }}", "chat"),
    ({"general.finetune": "it", "general.name": "Gemma 4 E2B"}, None, "chat"),  # the name wins over no template
    ({"general.name": "gemma-3-270m-it"}, None, "chat"),
    ({"general.name": "Gemma 4 E2B Instruct"}, None, "chat"),
    ({"general.finetune": "pt"}, "{{ messages }}", "base"),  # a pretrained checkpoint that ships a template
    ({"general.basename": "gemma-4-base"}, "{{ messages }}", "base"),
    ({"general.name": "Italy 7B"}, "{{ messages }}", "chat"),  # "it" only as a whole word
    ({"general.name": "Italy 7B"}, None, "base"),
    ({"general.name": 3}, None, "base"),  # a malformed field reads as absent
])
def test_model_kind_rule(meta, template, kind):
    got, why = model_kind(meta, template)
    assert got == kind and why


def test_the_demo_file_is_a_base_model(gemma3_270m_path):
    from models.loader import open_gguf

    meta = open_gguf(gemma3_270m_path).metadata
    assert model_kind(meta, meta.get("tokenizer.chat_template")) == ("base", "no chat template in the file")


# --- the text it continues, and where it stops ----------------------------------------------------

def test_continuation_text_joins_answers_as_written_and_starts_user_turns_on_a_new_paragraph():
    msgs = [{"role": "user", "content": "The lighthouse stood"},
            {"role": "assistant", "content": " on the cliff."},
            {"role": "user", "content": "At night"}]
    assert continuation_text(msgs) == "The lighthouse stood on the cliff.\n\nAt night"
    assert continuation_text([{"role": "user", "content": "a\n"}, {"role": "user", "content": "b"}]) == "a\nb"
    assert continuation_text([{"role": "user", "content": [{"type": "text", "text": "x"}]}]) == "x"


@pytest.mark.parametrize("text, cut", [
    ("One paragraph.\n\nAnother", len("One paragraph.")),
    ("One paragraph.\n  \t\nAnother", len("One paragraph.")),  # a blank line may hold spaces
    ("\n\nStarts on a new paragraph.\n\nNext", len("\n\nStarts on a new paragraph.")),  # leading ones don't count
    ("Line one\nline two", -1),
    ("  \n\n \n", -1),  # nothing written yet
    ("", -1),
])
def test_blank_line_stop_cuts_at_the_first_blank_line_after_text(text, cut):
    assert blank_line_stop(text) == cut


@pytest.mark.parametrize("text, hold", [
    ("A paragraph.\n", 1), ("A paragraph.\n  ", 3), ("A paragraph.", 0), ("\n", 0), ("a\nb", 0),
])
def test_blank_line_hold_keeps_back_what_could_start_a_blank_line(text, hold):
    assert blank_line_hold(text) == hold


# --- the demo, through the engine, at the app's base-model defaults ------------------------------

@pytest.fixture(scope="module")
def demo_client(gemma3_270m_path):
    from engine import api

    lm = api.open_model(gemma3_270m_path, exact=False, device="cpu")
    client = api.start_client(lm, api.EngineOptions(max_running_requests=10))
    yield lm, client
    client.close()


def _base_params(**settings):
    from app.screens.chat import sampling_params
    from app.screens.settings import BASE_SETTINGS

    return sampling_params({**BASE_SETTINGS, **settings}, continue_text=True)


def _max_ngram_count(ids: list[int], n: int = 8) -> int:
    grams = Counter(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
    return max(grams.values(), default=0)


def test_demo_at_base_defaults_repeats_no_8_gram_more_than_twice_in_200_tokens(demo_client):
    """10 seeds at once (batched decode), 200 tokens each, no blank-line stop: the loop the issue
    saw ("The The The ...") at temperature 0.7 is what DRY is for."""
    lm, client = demo_client
    msgs = [{"role": "user", "content": PROMPT}]
    rids = {seed: client.submit(msgs, _base_params(seed=seed, max_tokens=200, stop_at_blank_line=False))
            for seed in range(10)}
    runs = {seed: [t for ev in client.stream(rid) for t in ev.token_ids] for seed, rid in rids.items()}
    counts = {seed: _max_ngram_count(ids) for seed, ids in runs.items()}
    assert all(c <= 2 for c in counts.values()), counts
    # they really write: some seeds end with the end-of-text token (after 62-179 tokens, 1451 in
    # all, measured), none in the first few
    assert sum(len(ids) for ids in runs.values()) >= 10 * 100 and min(len(ids) for ids in runs.values()) >= 20


def test_demo_continues_the_text_and_stops_at_a_blank_line(demo_client):
    lm, client = demo_client
    rid = client.submit([{"role": "user", "content": PROMPT}], _base_params(seed=1))
    events = list(client.stream(rid))
    text = "".join(ev.text for ev in events)
    assert client.last_prompt_ids(rid) == lm.tokenizer.encode(PROMPT)  # no chat turns around it
    assert events[-1].finish_reason in ("stop", "length")
    assert blank_line_stop(text) == -1 and not text.endswith("\n\n")  # never shown past a blank line
    if events[-1].finish_reason == "stop":
        assert text.strip()  # stopped after a paragraph, not before one
    base = _base_params(seed=1)
    chat = replace(base, continue_text=False, sampling=replace(base.sampling, max_tokens=1))  # its prompt is all we need
    rid = client.submit([{"role": "user", "content": PROMPT}], chat)
    list(client.stream(rid))
    assert client.last_prompt_ids(rid) != lm.tokenizer.encode(PROMPT)  # the chat format wraps it
