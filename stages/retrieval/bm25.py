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

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

K1, B = 0.9, 0.4
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Index:
    """The corpus as postings: for the term with id t, documents `docs[starts[t]:starts[t + 1]]` and
    their BM25 weights `weights[...]` (idf and saturated tf already multiplied)."""

    vocabulary: dict[str, int]
    starts: np.ndarray  # int64, one more than the vocabulary
    docs: np.ndarray  # int64 document indices
    weights: np.ndarray  # float64
    n_docs: int


def index(texts: Sequence[str], k1: float = K1, b: float = B) -> Index:
    vocabulary: dict[str, int] = {}
    terms, docs, tfs, lengths = [], [], [], []
    for d, text in enumerate(texts):
        counts = Counter(words(text))
        lengths.append(sum(counts.values()))
        for word, tf in counts.items():
            terms.append(vocabulary.setdefault(word, len(vocabulary)))
            docs.append(d)
            tfs.append(tf)
    term_of, doc_of, tf = np.array(terms, np.int64), np.array(docs, np.int64), np.array(tfs, np.float64)
    df = np.bincount(term_of, minlength=len(vocabulary))
    length = np.array(lengths, np.float64)
    avgdl = length.mean() if len(texts) else 0.0
    idf = np.log1p((len(texts) - df + 0.5) / (df + 0.5))
    norm = k1 * (1 - b + b * length[doc_of] / max(avgdl, 1e-12))
    weights = idf[term_of] * tf * (k1 + 1) / (tf + norm)
    order = np.argsort(term_of, kind="stable")
    starts = np.concatenate(([0], np.cumsum(df)))
    return Index(vocabulary, starts, doc_of[order], weights[order], len(texts))


def search(idx: Index, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top `k` documents for `query` that share a word with it: (indices, scores), best first, equal
    scores by lower index. A document that shares no word is not retrieved (Lucene's way), so fewer
    than `k` may come back."""
    scores = np.zeros(idx.n_docs)
    for word, qtf in Counter(words(query)).items():
        t = idx.vocabulary.get(word)
        if t is not None:
            lo, hi = idx.starts[t], idx.starts[t + 1]
            scores[idx.docs[lo:hi]] += qtf * idx.weights[lo:hi]  # a term lists a document once
    hit = np.flatnonzero(scores > 0)
    best = hit[np.lexsort((hit, -scores[hit]))[:k]]
    return best, scores[best]
