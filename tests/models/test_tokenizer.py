"""`models.tokenizer` against llama.cpp (llama-cpp-python 0.3.36 is the oracle).

Vocabs: llama.cpp's `ggml-vocab-gemma-4.gguf` (`gemma4` BPE) with its test vectors, the real Gemma 3
270M (`llama`/SPM), llama.cpp's `ggml-vocab-llama-spm.gguf` (SPM with a prefix space) and tiny
hand-made vocabs with broken merges. Tokenizers are built once per module.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.gguf import GGUFFile
from models.tokenizer import Tokenizer, TokenizerError, UnsupportedTokenizer

BUILD_SECONDS: dict[str, float] = {}
_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ = settings(max_examples=1000, **_SETTINGS)  # ~3 s per vocab (4 encodes on each side per example)
FUZZ_RT = settings(max_examples=600, **_SETTINGS)


def _build(path: Path) -> Tokenizer:
    f = GGUFFile(path)
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(f)
    BUILD_SECONDS[Path(path).name] = time.perf_counter() - t0
    return tok


def _llama(path: Path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from tiny_models import quiet_llama_cpp

    quiet_llama_cpp()
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def g4(gemma4_vocab_path) -> Tokenizer:
    return _build(gemma4_vocab_path)


@pytest.fixture(scope="module")
def g3(gemma3_270m_path) -> Tokenizer:
    return _build(gemma3_270m_path)


@pytest.fixture(scope="module")
def g4_llama(gemma4_vocab_path):
    return _llama(gemma4_vocab_path)


@pytest.fixture(scope="module")
def g3_llama(gemma3_270m_path):
    return _llama(gemma3_270m_path)


def read_vectors(gguf_path: Path) -> list[tuple[str, list[int]]]:
    """`<vocab>.inp`/`.out` read as llama.cpp's tests/test-tokenizer-0.cpp does: inputs separated by
    "\\n__ggml_vocab_test__\\n", one line of space-separated ids per input (no BOS: the C++ test
    tokenizes with add_special=false, parse_special=false)."""
    raw = Path(f"{gguf_path}.inp").read_bytes().decode("utf-8")  # bytes: keep any '\r' as is
    inputs = raw.split("\n__ggml_vocab_test__\n")
    lines = Path(f"{gguf_path}.out").read_bytes().decode("utf-8").split("\n")
    assert len(lines) >= len(inputs) and not any(x.strip() for x in lines[len(inputs):])
    return [(s, [int(t) for t in o.split()]) for s, o in zip(inputs, lines)]


def llama_tokenize(llm, text: str, add_bos: bool, special: bool) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)


def llama_piece(llm, token: int, special: bool = True) -> bytes:
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token, buf, 256, 0, special)
    assert 0 <= n <= 256
    return buf.raw[:n]


# --- 1. llama.cpp's own test vectors ----------------------------------------------------------
def test_gemma4_llama_cpp_vectors(gemma4_vocab_path, g4):
    cases = read_vectors(gemma4_vocab_path)
    assert len(cases) >= 40
    bad = [(s, g4.encode(s, add_bos=False, parse_special=False), ids) for s, ids in cases
           if g4.encode(s, add_bos=False, parse_special=False) != ids]
    assert bad == []
    # with the model default (add_special) llama.cpp forces BOS for Gemma 4
    assert all(g4.encode(s) == [2] + ids for s, ids in cases)


def test_llama_spm_vectors(llama_vocab_dir):
    """SPM path with `add_space_prefix` (LLaMA 1/2 vocab), against llama.cpp's vectors."""
    path = llama_vocab_dir / "ggml-vocab-llama-spm.gguf"
    tok = Tokenizer.from_gguf(path)
    assert tok.add_space_prefix and tok.add_bos
    cases = read_vectors(path)
    assert [s for s, ids in cases if tok.encode(s, add_bos=False, parse_special=False) != ids] == []
    assert [s for s, _ in cases if "▁" not in s and tok.decode(tok.encode(s), skip_special=True) != s] == []


# --- 5. examples of the design doc (§5.2, §5.4) -----------------------------------------------
@pytest.mark.parametrize("text, ids, pieces", [
    ("Hello world", [9259, 1902], ["Hello", "▁world"]),
    (" Hello world", [26352, 1902], ["▁Hello", "▁world"]),
    ("  Hello", [138, 9259], ["▁▁", "Hello"]),
    (" this is 🦙.cpp", [672, 563, 236743, 478, 397, 404, 391, 236761, 12362],
     ["▁this", "▁is", "▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>", ".", "cpp"]),
    ("333", [236800] * 3, ["3"] * 3),
    ("\t\n", [255968, 107], ["\t", "\n"]),
])
def test_spec_table(g4, text, ids, pieces):
    assert g4.encode(text, add_bos=False) == ids
    assert [g4.token_to_piece(i) for i in ids] == pieces
    assert [g4.piece_to_id(p) for p in pieces] == ids
    assert g4.decode(ids) == text


@pytest.mark.parametrize("text, ids", [
    ("<bos><|turn>user\nHello<turn|>\n<|turn>model\n", [2, 105, 2364, 107, 9259, 106, 107, 105, 4368, 107]),
    ("<bos><|turn>system\nYou are a helpful assistant.<turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n"
     "<|turn>model\n4<turn|>\n<|turn>user\nThanks!<turn|>\n<|turn>model\n",
     [2, 105, 9731, 107, 3048, 659, 496, 11045, 16326, 236761, 106, 107, 105, 2364, 107, 3689, 563,
      236743, 236778, 236862, 236778, 236881, 106, 107, 105, 4368, 107, 236812, 106, 107, 105, 2364,
      107, 12879, 236888, 106, 107, 105, 4368, 107]),
    ("<|turn>model\n<|channel>thought\n<channel|>", [105, 4368, 107, 100, 45518, 107, 101]),
])
def test_spec_chat_examples(g4, text, ids):
    assert g4.encode(text, add_bos=False) == ids
    assert g4.decode(ids) == text
    assert g4.decode(ids, skip_special=True) == text.replace("<bos>", "").replace("<|turn>", "").replace(
        "<turn|>", "")  # CONTROL tokens vanish; USER_DEFINED `<|channel>` stays


def test_metadata_and_special_ids(g4, g3):
    for tok in (g4, g3):
        assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos, tok.add_space_prefix) == \
            (262144, 2, 1, True, False)
    assert {1, 106, 50} <= g4.eog_ids and {1, 106} <= g3.eog_ids
    assert g4.is_control(105) and g4.is_control(106) and not g4.is_control(100) and not g4.is_control(9259)
    assert g4.piece_to_id("no such piece") is None
    with pytest.raises(TokenizerError, match="out of range"):
        g4.decode([262144])
    with pytest.raises(TokenizerError, match="out of range"):
        g4.token_to_piece(-1)


@pytest.mark.parametrize("name", ["gemma4", "gemma3"])
def test_eog_control_and_pieces_match_llama_cpp(request, name):
    """eog_ids (Gemma 3 also stops on `</s>`: llama.cpp's EOG text list), CONTROL attribute after
    llama.cpp's fix-ups (`<|tool_response>` becomes CONTROL) and every piece's bytes."""
    import llama_cpp

    tok = request.getfixturevalue("g4" if name == "gemma4" else "g3")
    llm = request.getfixturevalue("g4_llama" if name == "gemma4" else "g3_llama")
    vocab = llm._model.vocab
    ids = range(tok.vocab_size)
    assert tok.eog_ids == {i for i in ids if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert {i for i in ids if tok.is_control(i)} == \
        {i for i in ids if llama_cpp.llama_vocab_is_control(vocab, i)}
    sample = list(range(0, tok.vocab_size, 61)) + list(range(300)) + sorted(tok.eog_ids)
    for special in (True, False):
        assert [tok.token_bytes(i, skip_special=not special) for i in sample] == \
            [llama_piece(llm, i, special) for i in sample]


def test_parse_special_switch(g4, g4_llama):
    text = "<|turn>user<|channel>x<channel|><|tool_response>r<tool_response|><turn|>"
    on, off = g4.encode(text, add_bos=False), g4.encode(text, add_bos=False, parse_special=False)
    assert on == [105, 2364, 100, 236781, 101, 50, 236750, 51, 106]
    # CONTROL tokens are plain text without parse_special, USER_DEFINED ones always match, except
    # `<|tool_response>`, which llama.cpp makes CONTROL because it ends generation.
    assert 105 not in off and 106 not in off and 50 not in off and {100, 101, 51} <= set(off)
    assert off == llama_tokenize(g4_llama, text, False, False)
    assert on == llama_tokenize(g4_llama, text, False, True)


def test_unsupported_tokenizer():
    for model in ("gpt2", "bert", None):
        with pytest.raises(UnsupportedTokenizer) as e:
            Tokenizer.from_metadata({"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": ["a"]})
        assert isinstance(e.value, ValueError) and "\n" not in str(e.value) and "gemma4" in str(e.value)
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b"]})


def test_build_time(g4, g3):
    """The 262144-token vocabs (514906 merges each) build in a few seconds (GGUF parsing excluded)."""
    assert set(BUILD_SECONDS) >= {"ggml-vocab-gemma-4.gguf", "gemma-3-270m-q4_k_m.gguf"}
    assert max(BUILD_SECONDS.values()) < 15, BUILD_SECONDS


# --- 2. Gemma 3 on fixed strings ----------------------------------------------------------------
FIXED = [
    "", " ", "Hello world", " Hello world", "The quick brown fox jumps over the lazy dog. It's 3:45pm!",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++ <vector> && <map>",
    "🦙 llama.cpp 🚀✨ 👩‍👩‍👧‍👦 🇫🇷 😀😃😄", "日本語のテキスト、中文字符和한국어 텍스트。",
    "Ünïcödé façade naïve — “quotes” …", "   leading", "trailing   ", "a  b   c    d     e", " " * 40 + "x",
    "\n\n\nx\n\n", "\n" * 40, "\t\t\tindent\t", "ctrl \x00\x01\x07\x08\x1b[0m \x7f \x0b\x0c",
    "\r\n windows \r\n\r\n", "\u00a0nbsp\u3000ideographic\u2028ls",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text</s><eos><table><tr>x</tr>",
    "<0x41> <unused0> [multimodal] <start_of_image><|turn>", "▁literal ▁▁ lower▁line", "x" * 300,
    " ".join(["word"] * 60), "1234567890 3.14159 1e-10 0xFF", "<<>><</>>< b>",
]


@pytest.mark.parametrize("add_bos", [True, False])
@pytest.mark.parametrize("special", [True, False])
def test_gemma3_fixed_strings(g3, g3_llama, add_bos, special):
    got = [g3.encode(s, add_bos=add_bos, parse_special=special) for s in FIXED]
    assert got == [llama_tokenize(g3_llama, s, add_bos, special) for s in FIXED]


@pytest.mark.parametrize("name", ["gemma4", "gemma3"])
def test_long_source_texts_vs_llama_cpp(request, name):
    """Whole source files (code, prose, unicode, special-token strings) in one call."""
    tok = request.getfixturevalue("g4" if name == "gemma4" else "g3")
    llm = request.getfixturevalue("g4_llama" if name == "gemma4" else "g3_llama")
    root = Path(__file__).resolve().parents[2]
    text = (root / "tests" / "models" / "test_tokenizer.py").read_text() + (root / "models" / "tokenizer.py").read_text()
    for special in (True, False):
        ids = tok.encode(text, parse_special=special)
        assert ids == llama_tokenize(llm, text, True, special)
    assert tok.decode(ids[1:]) == text.replace("▁", " ")


# --- 3. fuzz against llama.cpp ----------------------------------------------------------------
_CHARS = st.one_of(
    st.characters(blacklist_categories=("Cs",)),                       # anything encodable
    st.sampled_from(" \t\n\r\x00\x01\x0b\x0c\x1b\x7f\u00a0\u3000  "),  # whitespace, control
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),           # CJK
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),         # emoji (byte fallback)
    st.sampled_from("abcdefghij XYZ 0123456789 .,;:!?'\"()[]{}<>|=_-+*/#▁"),
)
G4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|tool>", "<tool|>", "<|tool_call>",
               "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|think|>", "<|channel>",
               "<channel|>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio|>",
               "<|video|>", "</s>", "<|", "|>", "<0x41>", "[multimodal]", "\n\n\n", "  "]
G3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "</s>",
               "<s>", "<table>", "</td>", "<h1>", "<unused0>", "<unused6241>", "<start_of_image>",
               "[multimodal]", "<0x41>", "  ", "    ", "\t\t", "\n\n", "\n" * 33, " " * 33, "<|turn>", "<"]


def texts(specials: list[str], chars=_CHARS):
    piece = st.one_of(st.text(chars, max_size=16), st.sampled_from(specials))
    return st.lists(piece, max_size=8).map("".join)


def _check_vs_llama(tok: Tokenizer, llm, text: str) -> None:
    for add_bos in (False, True):
        for special in (False, True):
            assert tok.encode(text, add_bos=add_bos, parse_special=special) == \
                llama_tokenize(llm, text, add_bos, special), (text, add_bos, special)


@FUZZ
@given(text=texts(G4_SPECIALS))
def test_fuzz_gemma4_vs_llama_cpp(g4, g4_llama, text):
    _check_vs_llama(g4, g4_llama, text)


@FUZZ
@given(text=texts(G3_SPECIALS))
def test_fuzz_gemma3_vs_llama_cpp(g3, g3_llama, text):
    _check_vs_llama(g3, g3_llama, text)


# --- 4. decode round trip and streaming ----------------------------------------------------------
# '▁' (U+2581) decodes to a space in SentencePiece-style vocabs (llama.cpp too), and U+FFFD is what a
# broken stream would show, so the round-trip text leaves both out.
_RT_CHARS = st.one_of(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="▁\ufffd"),
    st.sampled_from(" \t\n\r\x00\x1b\x7f🦙🫠𝕏"),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
)


def _check_round_trip(tok: Tokenizer, text: str) -> None:
    for special in (False, True):
        ids = tok.encode(text, add_bos=False, parse_special=special)
        assert tok.decode(ids) == text
        sd = tok.stream_decoder()
        chunks = [sd.push(i) for i in ids] + [sd.flush()]
        assert "".join(chunks) == text
        assert not any("\ufffd" in c for c in chunks)


@FUZZ_RT
@given(text=texts(G4_SPECIALS, _RT_CHARS))
def test_round_trip_gemma4(g4, text):
    _check_round_trip(g4, text)


@FUZZ_RT
@given(text=texts(G3_SPECIALS, _RT_CHARS))
def test_round_trip_gemma3(g3, text):
    _check_round_trip(g3, text)


def test_stream_decoder_waits_for_whole_characters(g4, g3):
    for tok in (g4, g3):
        ids = tok.encode("a🦙b", add_bos=False)
        assert [tok.token_to_piece(i) for i in ids[1:5]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
        sd = tok.stream_decoder()
        assert [sd.push(i) for i in ids] + [sd.flush()] == ["a", "", "", "", "🦙", "b", ""]
        # skip_special hides CONTROL tokens; the decoder is reusable after flush
        sd = tok.stream_decoder(skip_special=True)
        assert "".join(sd.push(i) for i in tok.encode("x<eos>y")) + sd.flush() == "xy"
    # an unfinished character only shows up (as U+FFFD) when flushed
    sd = g4.stream_decoder()
    assert sd.push(g4.piece_to_id("<0xF0>")) == "" and sd.push(g4.piece_to_id("<0x9F>")) == ""
    assert sd.flush() == "\ufffd"
    assert sd.push(9259) == "Hello"
    assert g4.decode([g4.piece_to_id("<0xF0>"), 9259]) == "\ufffdHello"


def test_literal_lower_one_eighth_block_decodes_to_space(g4, g4_llama):
    ids = g4.encode("a▁b", add_bos=False)
    assert ids == llama_tokenize(g4_llama, "a▁b", False, False)
    assert g4.decode(ids) == "a b"


# --- quirky vocabs: merges whose parts or results are not tokens ------------------------------
def _write_vocab(path: Path, model: str, tokens: list[str], types: list[int], merges, scores) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")  # smallest architecture llama.cpp loads with vocab_only
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_string("tokenizer.ggml.model", model)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    if merges is not None:
        w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model", ["gemma4", "llama"])
def test_quirky_vocab_vs_llama_cpp(tmp_path, model):
    # specials: "<U>" is a prefix of "<U>>"; "<Vw" and "w>>>" overlap, where llama.cpp's longest-first
    # partition differs from a leftmost-longest match
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<|x>", "<|xy>", "<U>", "<U>>", "<Vw", "w>>>"]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    tokens += list("abcdefgh") + ["\n", "\n\n", "▁", "ab", "▁a", "cd", "abc"]
    types = [3] * 6 + [4] * 4 + [6] * 256 + [1] * 15
    scores = [0.0 if t != 1 else -float(i) for i, t in enumerate(types)]
    # "abcd", "eé", "éf", "gh" are not tokens; "é" is not a token; "a b" is repeated
    merges = ["a b", "ab c", "abc d", "c d", "▁ a", "e é", "é f", "a b", "\n \n", "g h", "cd ab"]
    path = _write_vocab(tmp_path / f"{model}.gguf", model, tokens, types,
                        merges if model == "gemma4" else None, scores)
    tok, llm = Tokenizer.from_gguf(path), _llama(path)
    for text in ["abcd", "abc", "eéf", "ghab", " a ab\n\n\n\n\nx", "<|xy><|x><U>", "zéé", "cdcd abcd",
                 "cdab", "\n\n\n", "", "<|x", "<U>>", "<U>x<U>>", "<Vw>>>", "<Vw<Vw>>>w>>>"]:
        _check_vs_llama(tok, llm, text)
