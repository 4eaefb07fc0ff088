"""Byte-level BPE (GPT-2, RoBERTa and ModernBERT's tokenizer.json) encoded with the ids the `tokenizers`
library gives, several times faster on one core.

The library spends most of its time splitting text into words (its regex and the offsets it keeps per
byte; bench/README.md, "a given tokenizer"); the words of a corpus repeat. Here Python's `re` splits
with the same pattern, each distinct word is encoded once by the library's own BPE model, and a
document's ids are gathered from those words' ids with numpy, without a Python object per token.

Exactness is checked, not assumed: `ByteLevelEncoder.of` is None unless the tokenizer is a plain
byte-level BPE (no normalizer or NFC, the ByteLevel pre-tokenizer with its regex, BPE without dropout),
and a probe of every character of the Basic Multilingual Plane in several contexts, encoded both ways,
finds the characters on which Python's Unicode tables and the library's disagree. A text holding one of
them, a character beyond that plane, or the content of an added token, is encoded by the library.
"""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cram.stages.shared.runs import gather_runs

if TYPE_CHECKING:
    import numpy as np
    from tokenizers import Tokenizer

# The library's own pattern (tokenizers' pre_tokenizers/byte_level.rs), with \p{L}, \p{N} and \s spelled
# out as classes built from Python's Unicode tables (`re` has no \p{...}).
_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+"
# Unicode's White_Space characters, what the library's \s matches.
_SPACES = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_PLANE = 0x10000
_PROBE_CONTEXTS = ("a{c}b", " {c}{c} ", "1{c}2", "{c}'s", "x {c}\n")
_MAX_WORDS = 1 << 20  # distinct words cached per encoder before it starts afresh: memory stays bounded


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as the ByteLevel pre-tokenizer maps them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_CHARS = _bytes_to_unicode()


class _Words(dict):
    """Word -> its index in the encoder's tables; a new word is encoded by the BPE model when first seen."""

    def __init__(self, tokenize: Callable[[str], list[int]]):
        super().__init__()
        self.tokenize = tokenize
        self.ids: list[int] = []  # every word's ids, one after another
        self.starts: list[int] = []
        self.lengths: list[int] = []

    def __missing__(self, word: str) -> int:
        ids = self.tokenize(_mapped(word))
        self.starts.append(len(self.ids))
        self.lengths.append(len(ids))
        self.ids.extend(ids)
        index = self[word] = len(self.lengths) - 1
        return index


class ByteLevelEncoder:
    """`encode(texts)` -> (offsets, ids) as numpy arrays: text i's ids are ids[offsets[i]:offsets[i + 1]],
    equal to the library's `encode_batch(texts, add_special_tokens=False)`."""

    def __init__(self, library: Tokenizer, settings: dict[str, Any]):
        self._library = library
        self._nfc = settings["nfc"]
        self._prefix_space = settings["add_prefix_space"]
        letters, numbers = _classes()
        self._split = re.compile(_PATTERN.format(L=letters, N=numbers, S=_SPACES)).findall
        added = sorted({t for c in settings["added"] for t in (c, unicodedata.normalize("NFC", c))}, key=len)
        self._added = re.compile("|".join(map(re.escape, added))).search if added else None
        self._fresh()
        self._unsure = self._probe()

    @classmethod
    def of(cls, file: Path, library: Tokenizer) -> ByteLevelEncoder | None:
        """The encoder for the tokenizer.json `file` (already loaded as `library`), or None when it is not
        a tokenizer this module reproduces."""
        settings = _settings(json.loads(file.read_text(encoding="utf-8")))
        return None if settings is None else cls(library, settings)

    def _fresh(self) -> None:
        import numpy as np

        self._words = _Words(lambda word: [t.id for t in self._library.model.tokenize(word)])
        self._tables = (np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        import numpy as np

        if len(self._words) > _MAX_WORDS:
            self._fresh()
        words: list[str] = []
        counts = np.zeros(len(texts), np.int64)
        by_library = []
        for i, text in enumerate(texts):
            prepared = self._prepared(text)
            if prepared is None:
                by_library.append(i)
                continue
            found = self._split(prepared)
            words.extend(found)
            counts[i] = len(found)
        codes = np.fromiter(map(self._words.__getitem__, words), np.int64, len(words))
        ids, starts, lengths = self._grown()
        word_lengths = lengths[codes]
        values = ids[gather_runs(starts[codes], word_lengths)]
        ends = np.zeros(len(words) + 1, np.int64)
        np.cumsum(word_lengths, out=ends[1:])
        per_text = np.diff(ends[np.concatenate([[0], np.cumsum(counts)])])
        if by_library:
            values, per_text = self._merge(texts, by_library, values, per_text)
        offsets = np.zeros(len(texts) + 1, np.int64)
        np.cumsum(per_text, out=offsets[1:])
        return offsets, values

    def _prepared(self, text: str) -> str | None:
        """The text as the pre-tokenizer sees it, or None when the library must encode it."""
        if self._added is not None and self._added(text):
            return None
        if not text.isascii():
            if self._unsure(text):
                return None
            if self._nfc:
                text = unicodedata.normalize("NFC", text)
                if self._added is not None and self._added(text):
                    return None
        return self._spaced(text)

    def _spaced(self, text: str) -> str:
        return " " + text if self._prefix_space and text and not text.startswith(" ") else text

    def _grown(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The word tables as numpy arrays, with the words first seen since the last call appended."""
        import numpy as np

        ids, starts, lengths = self._tables
        words = self._words
        if len(lengths) < len(words.lengths):
            ids = np.concatenate([ids, np.array(words.ids[len(ids) :], np.int32)])
            starts = np.concatenate([starts, np.array(words.starts[len(starts) :], np.int64)])
            lengths = np.concatenate([lengths, np.array(words.lengths[len(lengths) :], np.int64)])
            self._tables = (ids, starts, lengths)
        return ids, starts, lengths

    def _merge(
        self, texts: list[str], by_library: list[int], values: np.ndarray, per_text: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The library's ids for the texts `by_library` put in their places among the others'."""
        import numpy as np

        encoded = [e.ids for e in self._library.encode_batch([texts[i] for i in by_library], add_special_tokens=False)]
        per_text = per_text.copy()
        per_text[by_library] = [len(e) for e in encoded]
        ours = np.ones(len(texts), bool)
        ours[by_library] = False
        merged = np.empty(int(per_text.sum()), np.int32)
        token_is_ours = np.repeat(ours, per_text)
        merged[token_is_ours] = values
        merged[~token_is_ours] = np.fromiter((i for e in encoded for i in e), np.int32, int((~token_is_ours).sum()))
        return merged, per_text

    def _probe(self) -> Callable[[str], Any]:
        """A search for the characters on which this encoder's split (and NFC) and the library's pre-tokenizer
        (and normalizer) disagree, each tried in a few contexts; every character past the Basic
        Multilingual Plane is among them. The BPE model that encodes each word is the library's own."""
        normalizer, pre_tokenizer = self._library.normalizer, self._library.pre_tokenizer
        bad = []
        for c in (chr(c) for c in range(_PLANE) if not 0xD800 <= c < 0xE000):
            text = "".join(ctx.format(c=c) for ctx in _PROBE_CONTEXTS)
            theirs = normalizer.normalize_str(text) if normalizer is not None else text
            ours = unicodedata.normalize("NFC", text) if self._nfc else text
            mapped = [_mapped(w) for w in self._split(self._spaced(ours))]
            if ours != theirs or mapped != [w for w, _ in pre_tokenizer.pre_tokenize_str(theirs)]:
                bad.append(c)
        return re.compile("[" + "".join(re.escape(c) for c in bad) + "\U00010000-\U0010ffff]").search


def _mapped(word: str) -> str:
    """`word` as the ByteLevel pre-tokenizer hands it to the model: each UTF-8 byte as its stand-in."""
    return "".join(_BYTE_CHARS[b] for b in word.encode("utf-8"))


def _classes() -> tuple[str, str]:
    """\\p{L} and \\p{N} of the Basic Multilingual Plane as `re` character-class bodies."""
    letters, numbers = [], []
    for c in range(_PLANE):
        category = unicodedata.category(chr(c))
        (letters if category[0] == "L" else numbers if category[0] == "N" else []).append(c)
    return _ranges(letters), _ranges(numbers)


def _ranges(points: list[int]) -> str:
    parts, start = [], None
    for i, c in enumerate(points):
        if start is None:
            start = c
        if i + 1 == len(points) or points[i + 1] != c + 1:
            parts.append(re.escape(chr(start)) + ("" if start == c else "-" + re.escape(chr(c))))
            start = None
    return "".join(parts)


def _settings(spec: dict[str, Any]) -> dict[str, Any] | None:
    """What the encoder needs of a tokenizer.json, or None when it is not a plain byte-level BPE."""
    normalizer, pre, model = spec.get("normalizer"), spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    if normalizer is not None and normalizer.get("type") != "NFC":
        return None
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        return None
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return None
    added = [t["content"] for t in spec.get("added_tokens") or [] if t.get("content")]
    return {"nfc": normalizer is not None, "add_prefix_space": bool(pre.get("add_prefix_space")), "added": added}
