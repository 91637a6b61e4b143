"""Tokenizer built from GGUF metadata, matching llama.cpp token for token.

Two GGUF tokenizer models are supported (design doc §5 and §8):

* ``gemma4``: BPE with an explicit merge list (rank = index), on raw UTF-8 with SentencePiece-style
  whitespace (' ' -> '▁'), pre-split only into newline runs / non-newline runs, byte fallback to
  ``<0xXX>`` tokens. A newline run that is itself a token is emitted whole (llama.cpp PR 21343).
* ``llama`` (Gemma 3): llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm``): repeatedly join
  the adjacent pair whose concatenation is the highest-scoring token, byte fallback for the rest.
  It is run as a BPE whose merges are derived from the scores, as HF's SentencePiece converters do.

The BPE itself runs in HF ``tokenizers``. Around it, in Python, as llama.cpp does:

* Special-token partition (``tokenizer_st_partition``): llama.cpp splits the text at special tokens
  longest token first *over the whole text*, whereas HF added tokens match leftmost-longest, and a
  per-call "parse specials" switch would need shared mutable state on the HF tokenizer. CONTROL and
  UNKNOWN tokens are matched only when ``parse_special``; USER_DEFINED tokens always.
* llama.cpp's token attribute fix-ups: tokens whose text marks end-of-generation (``<eos>``,
  ``<turn|>``, ``<|tool_response>``, ``<end_of_turn>``, ``</s>``...) become CONTROL as well, so e.g.
  ``<|tool_response>`` (USER_DEFINED in the file) is *not* matched when ``parse_special=False``,
  and Gemma 3's ``</s>`` is an EOG token; ``</s>`` reverts to NORMAL when ``<|tool_response>`` exists.
* Merges whose parts or result are not tokens (possible in hand-made vocabs) still merge in
  llama.cpp, whose leftover non-token symbols then fall back to bytes; such strings get extra HF
  ids beyond the vocab that are expanded to byte tokens afterwards.

Decoding concatenates piece bytes (NORMAL: '▁' -> ' '; BYTE: the byte; CONTROL/USER_DEFINED: the
text) like llama.cpp's ``token_to_piece``. llama.cpp's ``clean_spaces`` pass (``" ?"`` -> ``"?"``,
applied by ``llama_detokenize`` to gemma4) is deliberately not copied: it breaks round trips and
llama.cpp's own streaming output does not use it either.
"""
from __future__ import annotations

import codecs
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _models
from tokenizers import normalizers as _normalizers
from tokenizers import pre_tokenizers as _pre_tokenizers

from .metadata import MetadataReader

SUPPORTED_MODELS = ("gemma4", "llama")

# GGUF token types (llama.h LLAMA_TOKEN_TYPE_*) -> llama.cpp attribute bits (LLAMA_TOKEN_ATTR_*).
UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 2, 4, 8, 16, 32
_TYPE_TO_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

# Token texts llama.cpp treats as end-of-generation (llama-vocab.cpp, `special_eog_ids`).
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
_NEWLINE_RUNS = re.compile(r"(\n+)")


class TokenizerError(ValueError):
    """Tokenizer metadata that cannot be used. `str(err)` is one line."""


class UnsupportedTokenizer(TokenizerError):
    """`tokenizer.ggml.model` is not one we implement."""


class _SpecialTokens:
    """Special tokens in llama.cpp's partition order (longest first; equal lengths by id), and a
    fast test of which of them occur in a text: a trie-shaped regex finds, at every position, the
    longest special token starting there; the others starting there are its prefixes."""

    def __init__(self, tokens: list[str], ids: list[int]):
        order = sorted(ids, key=lambda i: (-len(tokens[i]), i))
        self._rank = {tokens[i]: (r, i) for r, i in enumerate(order)}
        trie: dict = {}
        for tok in self._rank:
            node = trie
            for ch in tok:
                node = node.setdefault(ch, {})
            node[""] = {}
        self._regex = re.compile(f"(?=({self._pattern(trie)}))") if trie else None

    @classmethod
    def _pattern(cls, node: dict) -> str:
        alts = []
        for ch, child in node.items():
            if ch:
                while len(child) == 1 and "" not in child:  # fold single-child chains
                    (c2, child), = child.items()
                    ch += c2
                alts.append(re.escape(ch) + cls._pattern(child))
        if not alts:
            return ""
        pat = alts[0] if len(alts) == 1 else f"(?:{'|'.join(alts)})"
        return f"(?:{pat})?" if "" in node else pat

    def present(self, text: str) -> list[tuple[str, int]]:
        """(text, id) of the special tokens occurring in `text`, in partition order."""
        if self._regex is None:
            return []
        longest = set(self._regex.findall(text))
        found = {w[:k] for w in longest for k in range(1, len(w) + 1) if w[:k] in self._rank}
        return [(w, self._rank[w][1]) for w in sorted(found, key=self._rank.__getitem__)]


class Tokenizer:
    """Encode/decode exactly like llama.cpp for the `gemma4` and `llama` (SPM) GGUF tokenizers."""

    @classmethod
    def from_gguf(cls, gguf_file: Any) -> "Tokenizer":
        """From a `models.gguf.GGUFFile` (or a path to a .gguf file)."""
        if isinstance(gguf_file, (str, Path)):
            from .gguf import GGUFFile
            gguf_file = GGUFFile(gguf_file)
        return cls.from_metadata(gguf_file.metadata)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """From a GGUF metadata mapping (scalars, numpy arrays, lists of str)."""
        return cls(meta)

    def __init__(self, meta: Mapping[str, Any]):
        key = MetadataReader(meta, "tokenizer.ggml.", error=TokenizerError)   # wrong GGUF types: one line
        model = key.str("model", None)
        if model not in SUPPORTED_MODELS:
            raise UnsupportedTokenizer(
                f"unsupported tokenizer model {model!r} (supported: {', '.join(SUPPORTED_MODELS)})")
        tokens = key.strs("tokens", None)
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        n = len(tokens)
        # llama.cpp renames empty tokens; on duplicate texts the last id wins.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = key.ints("token_type", None)
        types = [1] * n if types is None else np.asarray(types).tolist()
        if len(types) < n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        self.model, self.vocab_size = model, n
        self._tokens = tokens
        self._ids: dict[str, int] = {t: i for i, t in enumerate(tokens)}
        attrs = [_TYPE_TO_ATTR.get(int(t), 0) for t in types[:n]]

        def token_id(name: str) -> int | None:
            v = key.int(name, None)
            return v if v is not None and 0 <= v < n else None

        self.bos_id, self.eos_id = token_id("bos_token_id"), token_id("eos_token_id")
        spm = model == "llama"
        # Defaults as llama.cpp: SPM adds BOS and a prefix space; Gemma 4 always adds BOS.
        self.add_bos = key.bool("add_bos_token", spm) or model == "gemma4"
        self.add_eos = key.bool("add_eos_token", False)
        self.add_space_prefix = spm and key.bool("add_space_prefix", True)

        # End-of-generation ids and llama.cpp's attribute fix-ups (see the module docstring).
        eog = {self._ids[t] for t in _EOG_TEXTS if t in self._ids}
        if "</s>" in self._ids and ({"<|tool_response>", "<|plamo:eos|>"} & set(self._ids)):
            eog.discard(s := self._ids["</s>"])
            attrs[s] = NORMAL
        for i in eog:
            attrs[i] |= CONTROL
        eog |= {i for i in (self.eos_id, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
        self.eog_ids: frozenset[int] = frozenset(eog)
        self._attrs = attrs

        # Special-token partition tables: all specials, and those matched without parse_special.
        special = [i for i, a in enumerate(attrs) if a & (CONTROL | USER_DEFINED | UNKNOWN)]
        self._specials = {
            True: _SpecialTokens(tokens, special),
            False: _SpecialTokens(tokens, [i for i in special if not attrs[i] & (CONTROL | UNKNOWN)]),
        }

        # Piece bytes per id, as llama.cpp's token_to_piece(special=True).
        def piece(text: str, a: int) -> bytes:
            if a & (UNKNOWN | CONTROL | USER_DEFINED):
                return text.encode()
            if a & NORMAL:
                return text.replace("▁", " ").encode()
            if a & BYTE:
                return bytes([int(text[3:5], 16)])
            return b""  # UNUSED/UNDEFINED render as nothing

        self._pieces = [piece(t, a) for t, a in zip(tokens, attrs)]
        self._hidden = frozenset(i for i, a in enumerate(attrs) if a & (UNKNOWN | CONTROL))
        self._byte_ids = [self._ids.get(f"<0x{b:02X}>") for b in range(256)]

        merges = self._gemma4_merges(key) if model == "gemma4" else self._spm_merges(key)
        self._hf = self._build_hf(merges)

    # --- construction -------------------------------------------------------------------------
    def _gemma4_merges(self, key) -> list[tuple[str, str]]:
        merges = key.strs("merges", None)
        if merges is None:
            raise TokenizerError("gemma4 tokenizer without tokenizer.ggml.merges")
        # llama.cpp splits at the first space at index >= 1 (a merge with none never applies)
        pairs = [tuple(m.split(" ", 1)) if m[:1] != " " else (m[:p], m[p + 1:])
                 for m in merges if (p := m.find(" ", 1)) > 0]
        if len(set(merges)) != len(merges):  # a repeated merge keeps its first rank, as in llama.cpp
            pairs = list(dict.fromkeys(pairs))
        return pairs

    def _spm_merges(self, key) -> list[tuple[str, str]]:
        """Every split of every token into two possible symbols (a token or a single character),
        ordered by the token's score, highest first (llama.cpp's SPM bigram priority)."""
        scores = key.floats("scores", None)
        scores = np.zeros(self.vocab_size, np.float32) if scores is None else np.asarray(scores, np.float32)
        if len(scores) < self.vocab_size:
            raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {self.vocab_size} tokens")
        ids = self._ids
        tok_ids, cuts = [], []
        for s, i in ids.items():
            last = len(s) - 1
            for k in range(1, last + 1):
                if (k == 1 or s[:k] in ids) and (k == last or s[k:] in ids):
                    tok_ids.append(i)
                    cuts.append(k)
        tok_ids, cuts = np.array(tok_ids, np.int64), np.array(cuts, np.int64)
        # Score descending. llama.cpp takes the leftmost of equal-score pairs; BPE ranks must be
        # distinct, so ties go by token id, then split point. That differs only when two tokens of
        # equal score compete for the same characters, which Gemma 3 does not have (its NORMAL
        # scores are distinct; the -1000 ones are special strings matched before the BPE).
        order = np.lexsort((cuts, tok_ids, -scores[tok_ids].astype(np.float64)))
        toks = self._tokens
        return [(toks[i][:k], toks[i][k:]) for i, k in zip(tok_ids[order].tolist(), cuts[order].tolist())]

    def _build_hf(self, merges: list[tuple[str, str]]) -> _HFTokenizer:
        vocab = dict(self._ids)
        # Strings a merge needs but the vocab lacks get extra ids (>= vocab_size): llama.cpp merges
        # them anyway and byte-falls back what is left; `encode` expands them to byte tokens.
        self._extra: dict[int, list[int]] = {}
        for a, b in merges:
            for s in (a, b, a + b):
                if s not in vocab:
                    vocab[s] = len(vocab)
                    self._extra[vocab[s]] = [t for t in map(self._byte_ids.__getitem__, s.encode())
                                             if t is not None]
        hf = _HFTokenizer(_models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
        hf.normalizer = _normalizers.Replace(" ", "▁")
        if self.model == "gemma4":  # regex `[^\n]+|[\n]+`; SPM works on the whole fragment
            hf.pre_tokenizer = _pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated")
        return hf

    # --- encoding -----------------------------------------------------------------------------
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp `tokenizer_st_partition`: for each special token, longest first, split every
        remaining text fragment at its non-overlapping occurrences, left to right."""
        frags: list[str | int] = [text] if text else []
        for tok, tid in self._specials[parse_special].present(text):
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                for k, part in enumerate(f.split(tok)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize`. `add_bos=None` is its
        `add_special=True` (BOS, and EOS if the model asks for it); True/False add BOS or nothing.
        `parse_special=False` leaves CONTROL token strings as plain text."""
        special = add_bos is None
        want_bos = self.add_bos if special else add_bos
        out: list[int] = []
        if want_bos and self.bos_id is not None:
            out.append(self.bos_id)
        chunks: list[str] = []  # text handed to the HF BPE; `out` holds -1-index placeholders
        prev_special = True
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.append(-1 - len(chunks))
                chunks.append(frag)
            else:
                for k, part in enumerate(_NEWLINE_RUNS.split(frag)):
                    if not part:
                        continue
                    tid = self._ids.get(part) if k % 2 else None  # odd parts are newline runs
                    if tid is not None:
                        out.append(tid)
                    else:
                        out.append(-1 - len(chunks))
                        chunks.append(part)
            prev_special = False
        if special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        if not chunks:
            return out
        batch = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)  # fast: tokenizers >= 0.21
        encoded = [e.ids for e in batch(chunks, add_special_tokens=False)]
        ids: list[int] = []
        for t in out:
            if t >= 0:
                ids.append(t)
            else:
                ids.extend(encoded[-1 - t])
        if self._extra:
            ids = [x for t in ids for x in self._extra.get(t, (t,))]
        return ids

    # --- decoding -----------------------------------------------------------------------------
    def _check(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise TokenizerError(f"token id {bad} out of range (vocab size {self.vocab_size})")
        return ids

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes a token decodes to (CONTROL tokens: b'' when `skip_special`)."""
        (i,) = self._check((token_id,))
        return b"" if skip_special and i in self._hidden else self._pieces[i]

    def pieces(self) -> tuple[bytes, ...]:
        """Every token's bytes by id, as `token_bytes` gives them (CONTROL tokens' text included)."""
        return tuple(self._pieces)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`: the pieces' bytes joined, as llama.cpp's `token_to_piece` gives them.
        `skip_special` renders CONTROL tokens (BOS, EOS, turn markers) as nothing. Invalid UTF-8
        (a cut multi-byte character) becomes U+FFFD. With `add_space_prefix` (not Gemma) the space
        the encoder put in front of the text is dropped."""
        ids = self._check(ids)
        if skip_special:
            pieces = [b"" if i in self._hidden else self._pieces[i] for i in ids]
        else:
            pieces = [self._pieces[i] for i in ids]
        if self.add_space_prefix:
            k = 1 if ids and ids[0] == self.bos_id else 0
            if k < len(pieces) and pieces[k][:1] == b" ":
                pieces[k] = pieces[k][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def token_to_piece(self, token_id: int) -> str:
        """The vocabulary string of a token (e.g. '▁world', '<0xF0>', '<turn|>')."""
        (i,) = self._check((token_id,))
        return self._tokens[i]

    def piece_to_id(self, piece: str) -> int | None:
        return self._ids.get(piece)

    def special_ids(self) -> list[int]:
        """Ids no text encodes to by accident: CONTROL and UNKNOWN tokens, and USER_DEFINED ones
        written `<...>` (`<|tool_call>`, `<|"|>`, ...): grammars name them as tokens, never as text."""
        return [i for i, (t, a) in enumerate(zip(self._tokens, self._attrs))
                if a & (CONTROL | UNKNOWN) or (a & USER_DEFINED and t.startswith("<") and t.endswith(">"))]

    def is_control(self, token_id: int) -> bool:
        (i,) = self._check((token_id,))
        return bool(self._attrs[i] & CONTROL)

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, vocab_size={self.vocab_size})"


class StreamDecoder:
    """Incremental detokenization: `push` returns only complete UTF-8 characters, so a character
    spread over several byte-fallback tokens (e.g. 🦙 = 4 tokens) appears once it is whole. The
    concatenation of all `push` results and `flush()` equals `Tokenizer.decode` of the same ids."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok, self._skip = tokenizer, skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._n, self._bos_first = 0, False  # tokens pushed since the last flush; was the first BOS

    def push(self, token_id: int) -> str:
        tok = self._tok
        data = tok.token_bytes(token_id, self._skip)
        # as `decode`: drop the prefix space of the first token (of the second, after a BOS)
        first_text = self._n == 0 and token_id != tok.bos_id or self._n == 1 and self._bos_first
        if tok.add_space_prefix and first_text and data[:1] == b" ":
            data = data[1:]
        if self._n == 0:
            self._bos_first = token_id == tok.bos_id
        self._n += 1
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is pending (an incomplete character becomes U+FFFD); resets the decoder."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._n = 0
        return out
