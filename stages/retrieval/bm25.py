"""BM25, the lexical baseline every retrieval table carries beside a model's scores, as classification
carries its majority baseline.

Scoring is Lucene's and Anserini's BM25 with BEIR's settings, k1 0.9 and b 0.4:
    idf(t)   = log(1 + (N - df + 0.5) / (df + 0.5))
    w(t, d)  = idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * |d| / avgdl))
    s(q, d)  = sum over q's words t of qtf(t) * w(t, d)      (qtf: how often t is in the query)
Lucene 8 and later drop the constant (k1 + 1), which changes no ranking, and store |d| rounded to one
byte, which changes scores slightly; this keeps exact lengths.

Text is split into words the plain way, not by the pipeline's tokenizer: lower-cased, runs of Unicode
word characters (`\\w+`), no stemming and no stop words (Anserini stems and drops stop words, so its
BEIR figures run a little higher). The baseline then needs no model and reads every corpus alike.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

K1, B = 0.9, 0.4
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Index:
    """The corpus as postings: for the term with id t, documents `docs[starts[t]:starts[t + 1]]` (in
    document order) and how often t occurs in each, `tfs[...]`. A posting costs 6 bytes (int32 document,
    uint16 count; uint32 where a count passes 65,535); BM25's weight is made from it at search time, from
    the term's `idf` and the document's length factor `norm`, exactly as an index of weights would hold it."""

    vocabulary: dict[str, int]
    starts: np.ndarray  # int64, one more than the vocabulary
    docs: np.ndarray  # int32 document indices
    tfs: np.ndarray  # uint16 (or uint32) term counts
    idf: np.ndarray  # float64, one a term
    norm: np.ndarray  # float64, one a document: k1 * (1 - b + b * |d| / avgdl)
    k1: float

    @property
    def n_docs(self) -> int:
        return len(self.norm)


CHUNK_DOCS = 20_000  # documents gathered in Python lists before they become compact arrays


@dataclass(frozen=True)
class _Chunk:
    terms: np.ndarray  # int32 term id of each (document, term) pair, documents in order
    tfs: np.ndarray
    postings: np.ndarray  # int32 distinct terms of each document
    first_doc: int


def index(texts: Iterable[str], k1: float = K1, b: float = B) -> Index:
    """BM25's index of `texts`, read once as a stream: the build holds each posting in at most 12 bytes
    (the chunks' compact arrays, then the index's own), so a corpus need not fit in Python objects."""
    vocabulary: dict[str, int] = {}
    chunks: list[_Chunk] = []
    lengths: list[int] = []
    for batch in _batched(texts, CHUNK_DOCS):
        chunks.append(_chunk(batch, vocabulary, lengths, first_doc=len(lengths)))
    df = np.zeros(len(vocabulary), np.int64)
    for chunk in chunks:
        df += np.bincount(chunk.terms, minlength=len(vocabulary))
    starts = np.concatenate(([0], np.cumsum(df)))
    docs = np.empty(int(starts[-1]), np.int32)
    tfs = np.empty(int(starts[-1]), np.result_type(np.uint16, *(chunk.tfs.dtype for chunk in chunks)))
    filled = starts[:-1].copy()
    while chunks:
        _place(chunks.pop(0), docs, tfs, filled)  # each chunk freed as soon as its postings are placed
    length = np.array(lengths, np.float64)
    avgdl = length.mean() if len(length) else 0.0
    idf = np.log1p((len(length) - df + 0.5) / (df + 0.5))
    norm = k1 * (1 - b + b * length / max(avgdl, 1e-12))
    return Index(vocabulary, starts, docs, tfs, idf, norm, k1)


def _batched(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _chunk(texts: list[str], vocabulary: dict[str, int], lengths: list[int], first_doc: int) -> _Chunk:
    terms: list[int] = []
    tfs: list[int] = []
    postings: list[int] = []
    for text in texts:
        counts = Counter(words(text))
        lengths.append(sum(counts.values()))
        postings.append(len(counts))
        terms.extend(vocabulary.setdefault(word, len(vocabulary)) for word in counts)
        tfs.extend(counts.values())
    wide = max(tfs, default=0) > np.iinfo(np.uint16).max
    return _Chunk(
        np.array(terms, np.int32),
        np.array(tfs, np.uint32 if wide else np.uint16),
        np.array(postings, np.int32),
        first_doc,
    )


def _place(chunk: _Chunk, docs: np.ndarray, tfs: np.ndarray, filled: np.ndarray) -> None:
    """Write a chunk's postings after those of earlier chunks, term by term; a stable sort keeps each
    term's documents in order."""
    doc_of = np.repeat(
        np.arange(chunk.first_doc, chunk.first_doc + len(chunk.postings), dtype=np.int32), chunk.postings
    )
    order = np.argsort(chunk.terms, kind="stable")
    terms = chunk.terms[order]
    present, first, count = np.unique(terms, return_index=True, return_counts=True)
    at = filled[terms] + (np.arange(len(terms)) - np.repeat(first, count))
    docs[at] = doc_of[order]
    tfs[at] = chunk.tfs[order]
    filled[present] += count


def search(idx: Index, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top `k` documents for `query` that share a word with it: (indices, scores), best first, equal
    scores by lower index. A document that shares no word is not retrieved (Lucene's way), so fewer
    than `k` may come back."""
    scores = np.zeros(idx.n_docs)
    for word, qtf in Counter(words(query)).items():
        t = idx.vocabulary.get(word)
        if t is not None:
            lo, hi = idx.starts[t], idx.starts[t + 1]
            docs, tf = idx.docs[lo:hi], idx.tfs[lo:hi].astype(np.float64)
            weight = idx.idf[t] * tf * (idx.k1 + 1) / (tf + idx.norm[docs])
            scores[docs] += qtf * weight  # a term lists a document once
    hit = np.flatnonzero(scores > 0)
    best = hit[np.lexsort((hit, -scores[hit]))[:k]]
    return best, scores[best]


_ARRAYS = ("starts", "docs", "tfs", "idf", "norm")
_VOCABULARY = "vocabulary.json"  # the words in id order
_SETTINGS = "bm25.json"


def save(idx: Index, folder: Path) -> None:
    """The index as files in `folder` (made here): one `.npy` per array, the words in id order, k1."""
    folder.mkdir(parents=True)
    for name in _ARRAYS:
        np.save(folder / f"{name}.npy", getattr(idx, name))
    (folder / _VOCABULARY).write_text(json.dumps(list(idx.vocabulary), ensure_ascii=False), encoding="utf-8")
    (folder / _SETTINGS).write_text(json.dumps({"k1": idx.k1}), encoding="utf-8")


def load(folder: Path) -> Index:
    """An index `save` wrote, its arrays mapped from disk (pages read as queries touch them), not read."""
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
    words_in_order = json.loads((folder / _VOCABULARY).read_text(encoding="utf-8"))
    k1 = float(json.loads((folder / _SETTINGS).read_text(encoding="utf-8"))["k1"])
    return Index({word: t for t, word in enumerate(words_in_order)}, k1=k1, **arrays)
