"""Chat formatting (models/chat.py) against spec §5.3-5.4 and the real Gemma 4 chat templates.

Real templates: the one embedded in llama.cpp's `ggml-vocab-gemma-4.gguf` (an older revision) and
llama.cpp's `models/templates/google-gemma-4-31B-it.jinja` (newer revision, copied to tests/data/).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from models.chat import (GEMMA3_STOP_STRINGS, GEMMA4_STOP_STRINGS, ChatFormat, ChatTemplateError, Message,
                         split_thinking)

DATA = Path(__file__).parents[1] / "data"

EX1_MSGS = [Message("user", "Hello")]
EX1 = "<bos><|turn>user\nHello<turn|>\n<|turn>model\n"
EX2_MSGS = [Message("system", "You are a helpful assistant."), Message("user", "What is 2+2?"),
            Message("assistant", "4"), Message("user", "Thanks!")]
EX2 = ("<bos><|turn>system\nYou are a helpful assistant.<turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n"
       "<|turn>model\n4<turn|>\n<|turn>user\nThanks!<turn|>\n<|turn>model\n")
EMPTY_CHANNEL = "<|channel>thought\n<channel|>"   # spec Example 3: thinking-off prefill of the 31B/26B templates


def _gguf_meta(path: Path) -> dict:
    """GGUF key/values as a plain mapping, read by the project's reader (gguf.GGUFReader takes ~35 s here)."""
    from models.gguf import GGUFFile
    return GGUFFile(path).metadata


@pytest.fixture(scope="session")
def gemma4_meta(gemma4_vocab_path) -> dict:
    return _gguf_meta(gemma4_vocab_path)


@pytest.fixture(scope="session", params=["vocab-gguf", "31B-it.jinja"])
def real_fmt(request, gemma4_meta) -> ChatFormat:
    if request.param == "vocab-gguf":
        return ChatFormat.from_metadata(gemma4_meta)
    return ChatFormat((DATA / "google-gemma-4-31B-it.jinja").read_text(), family="gemma4")


# --- built-in Gemma 4 format (§5.4, E-series) ----------------------------------------------------

def test_builtin_gemma4_examples():
    fmt = ChatFormat.from_metadata({"general.architecture": "gemma4"})
    assert fmt.source == "builtin-gemma4" and fmt.bos_in_template
    assert fmt.render(EX1_MSGS) == EX1
    assert fmt.render(EX2_MSGS) == EX2
    assert fmt.render([{"role": "user", "content": "  Hello \n"}]) == EX1   # dicts; content trimmed
    assert fmt.render(EX1_MSGS, add_generation_prompt=False) == EX1[: -len("<|turn>model\n")]
    assert fmt.stop_strings == fmt.stop_token_names == GEMMA4_STOP_STRINGS == ("<turn|>", "<eos>", "<|tool_response>")
    # an empty template string counts as "no template"
    assert ChatFormat.from_metadata({"general.architecture": "gemma4", "tokenizer.chat_template": ""}).source \
        == "builtin-gemma4"


def test_builtin_gemma4_thinking():
    fmt = ChatFormat(family="gemma4")
    on = fmt.render(EX1_MSGS, thinking=True)
    assert on.startswith("<bos><|turn>system\n<|think|>")            # system turn emitted just for it
    assert on.endswith("<turn|>\n" + EX1[len("<bos>"):])
    on2 = fmt.render(EX2_MSGS, thinking=True)
    assert on2.startswith("<bos><|turn>system\n<|think|>") and "You are a helpful assistant.<turn|>" in on2
    assert on2.count("<|turn>system") == 1 and on2.endswith("<|turn>model\n")


def test_builtin_gemma4_strips_history_reasoning():
    fmt = ChatFormat(family="gemma4")
    msgs = [Message("user", "What is 2+2?"),
            Message("assistant", "<|channel>thought\nadd them<channel|>4", thinking="add them"),
            Message("user", "Thanks!")]
    out = fmt.render(msgs)
    assert "<|turn>model\n4<turn|>\n" in out and "add them" not in out and "<|channel>" not in out


# --- real Gemma 4 templates ------------------------------------------------------------------------

def test_real_template_from_vocab_gguf(gemma4_meta):
    assert "<|turn>" in gemma4_meta["tokenizer.chat_template"]
    fmt = ChatFormat.from_metadata(gemma4_meta)
    assert (fmt.source, fmt.family, fmt.bos_token, fmt.eos_token) == ("gguf", "gemma4", "<bos>", "<eos>")
    assert fmt.bos_in_template                                        # caller must not add a second BOS
    assert fmt.stop_token_ids == (106, 1, 50)                         # <turn|>, <eos>, <|tool_response>


def test_real_template_examples(real_fmt):
    one = real_fmt.render(EX1_MSGS)
    # Both revisions append the empty thought channel when thinking is off (the 31B/26B form of §5.4).
    assert one == EX1 + EMPTY_CHANNEL
    assert real_fmt.render(EX2_MSGS) == EX2 + EMPTY_CHANNEL
    assert real_fmt.render(EX2_MSGS, add_generation_prompt=False) == EX2[: -len("<|turn>model\n")]


def test_real_template_thinking(real_fmt):
    on = real_fmt.render(EX1_MSGS, thinking=True)
    assert on.startswith("<bos><|turn>system\n<|think|>")             # `\n` after it depends on revision
    assert on.endswith("<turn|>\n<|turn>user\nHello<turn|>\n<|turn>model\n")
    assert EMPTY_CHANNEL not in on
    on2 = real_fmt.render(EX2_MSGS, thinking=True)
    assert on2.startswith("<bos><|turn>system\n<|think|>") and on2.count("<|turn>system") == 1
    assert on2.endswith("<|turn>model\n") and "You are a helpful assistant.<turn|>" in on2


def test_real_template_strips_history_reasoning(real_fmt):
    msgs = [Message("user", "What is 2+2?"),
            Message("assistant", "<|channel>thought\nadd them<channel|>4", thinking="add them"),
            Message("user", "Thanks!")]
    out = real_fmt.render(msgs)
    assert "<|turn>model\n4<turn|>\n" in out and "add them" not in out
    assert out == ChatFormat(family="gemma4").render(msgs) + EMPTY_CHANNEL   # built-in agrees


# --- Gemma 3 -------------------------------------------------------------------------------------

def test_builtin_gemma3():
    fmt = ChatFormat.from_metadata({"general.architecture": "gemma3",
                                    "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "<end_of_turn>"],
                                    "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1})
    assert fmt.source == "builtin-gemma3" and fmt.bos_in_template
    assert fmt.stop_strings == GEMMA3_STOP_STRINGS and fmt.stop_token_ids == (3, 1)
    assert fmt.render([Message("user", "Hi")]) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    out = fmt.render([Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello!"),
                      Message("user", "Bye")], thinking=True)
    assert out == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                   "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="alternate"):
        fmt.render([Message("user", "a"), Message("user", "b")])


def test_gemma3_270m_file(gemma3_270m_path):
    meta = _gguf_meta(gemma3_270m_path)
    assert "tokenizer.chat_template" not in meta                      # base model: no template (§8)
    fmt = ChatFormat.from_metadata(meta)
    assert fmt.source == "builtin-gemma3" and fmt.bos_token == "<bos>"
    assert len(fmt.stop_token_ids) == 2 and fmt.render(EX1_MSGS).startswith("<bos><start_of_turn>user\n")


# --- template context and runtime errors -------------------------------------------------------

def test_context_variables():
    fmt = ChatFormat("{{ enable_thinking is defined }}|{{ enable_thinking }}|{{ add_generation_prompt }}|"
                     "{{ bos_token }}{{ eos_token }}|{{ messages | length }}|{{ messages[0] | tojson }}")
    assert fmt.render(EX1_MSGS) == 'True|False|True|<bos><eos>|1|{"role": "user", "content": "Hello"}'
    assert fmt.render(EX1_MSGS, thinking=True, add_generation_prompt=False).startswith("True|True|False|")
    assert not fmt.bos_in_template
    assert ChatFormat("{{ strftime_now('%Y') }}").render(EX1_MSGS).isdigit()


@pytest.mark.parametrize("src, msg", [
    ("{{ raise_exception('System role not supported') }}", "System role not supported"),
    ("{{ foo.bar }}", "'foo' is undefined"),
    ("{{ messages[0].content.nope.deeper }}", "has no attribute 'nope'"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for i in range(10**9) %}{% endfor %}", "MAX_RANGE"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{% if %}", "syntax error"),
])
def test_runtime_errors(src, msg):
    with pytest.raises(ChatTemplateError, match=msg) as ei:
        ChatFormat(src).render(EX1_MSGS)
    assert "\n" not in str(ei.value)


# --- sandbox: template injection never runs code ------------------------------------------------

SSTI = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ joiner.__init__.__globals__['os'].popen('touch PWNED').read() }}",
    "{% set ns = namespace() %}{{ ns.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ lipsum.__globals__['os'].system('touch PWNED') }}",
    "{{ range.__init__.__globals__ }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ ''['__class__']['__base__'] }}",
    "{{ messages|attr('\\x5f\\x5fclass\\x5f\\x5f') }}",
    # names built at run time get past the static check; the sandbox must stop them
    "{{ (cycler|attr('__in' ~ 'it__')|attr('__glo' ~ 'bals__'))['os'].system('touch PWNED') }}",
    "{{ lipsum[('_' * 2) ~ 'globals' ~ ('_' * 2)]['os'].system('touch PWNED') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ messages.append({'role': 'user'}) }}",                       # immutable context
    "{{ 'x' * 10000000000 }}",                                        # memory bomb
]


@pytest.mark.parametrize("payload", SSTI)
def test_ssti_payloads_are_refused(payload, tmp_path):
    marker = tmp_path / "PWNED"
    src = payload.replace("PWNED", str(marker))
    with pytest.raises(ChatTemplateError) as ei:
        ChatFormat(src).render([Message("user", "hi")])
    assert not marker.exists()
    assert "\n" not in str(ei.value) and str(ei.value).startswith("unsafe chat template")


def test_ssti_in_gguf_metadata(tmp_path):
    marker = tmp_path / "PWNED"
    meta = {"general.architecture": "gemma4",
            "tokenizer.chat_template": f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"}
    with pytest.raises(ChatTemplateError, match="__globals__"):
        ChatFormat.from_metadata(meta)
    assert not marker.exists()


# --- split_thinking ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("<|channel>thought\nLet me add.\n<channel|>The answer is 4.", ("Let me add.", "The answer is 4.")),
    ("<|channel>thought\nLet me add.<channel|>\n4<turn|>", ("Let me add.", "4")),        # stop token dropped
    ("<|channel>thought\nstill thin", ("still thin", "")),                                # streaming
    ("<|channel>thought\nstill thinking<chan", ("still thinking", "")),                   # partial close marker
    ("<|chan", (None, "")),                                                               # partial open marker
    ("<|channel>thou", (None, "")),
    ("<|channel>thought\n<channel|>Hi there", (None, "Hi there")),                        # empty channel
    ("<|channel><channel|>Hi", (None, "Hi")),
    ("Just an answer.<eos>", (None, "Just an answer.")),
    ("", (None, "")),
])
def test_split_thinking(text, expected):
    assert split_thinking(text) == expected

