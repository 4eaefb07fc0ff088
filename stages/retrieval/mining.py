"""Hard negatives mined for a retrieval task's training pairs (`hard_negatives = "mined"`): each query's BM25
top `depth` over the corpus, less its own text and every positive its query has among the pairs (a query
judged relevant to several documents takes none of them as a negative), less every candidate the starting encoder
scores above `margin` times the positive (a likely unjudged relevant document: NV-Retriever's "TopK-PercPos"
rule, Moreira et al. 2024; sentence-transformers' `mine_hard_negatives(relative_margin=...)`); the first
`per_pair` of the rest in BM25's order (distinct texts) are the pair's negatives, the columns a pairs file's
`negative` fills one of.

Every pair takes exactly `per_pair` negatives, so that a contrastive batch has one shape (batch x (1 + n)
documents: one compiled graph): a pair with fewer survivors is filled with documents drawn at random (plain
negatives, as the batch's other positives are), counted. Filling rather than masking the missing columns
keeps the loss model/embedder.py's as it is; a random document is no false negative any more than an
in-batch one is. The test's judgements play no part: a document a test query finds relevant may be a training
query's negative, as it may be an in-batch one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cram.stages import StageError
from cram.stages.retrieval import bm25
from cram.stages.retrieval.beir import Pair

DEPTH = 30  # BM25 candidates a query
MARGIN = 0.95  # NV-Retriever's: a candidate above 95% of the positive's score is dropped


@dataclass(frozen=True)
class Mined:
    """Each pair's mined negatives, as indices into the documents, and what the mining did."""

    negatives: list[tuple[int, ...]]  # `per_pair` a pair
    false_negatives_dropped: int  # candidates (of every pair's depth) the encoder scored above margin x the positive
    random_fallback: int  # negatives drawn at random where fewer than `per_pair` candidates survived


def mine(
    pairs: Sequence[Pair],
    documents: Sequence[str],
    encoded: Encoded,
    seed: int = 0,
    per_pair: int = 1,
) -> Mined:
    """`per_pair` hard negatives for each pair among `documents` (module docstring)."""
    index, owns = bm25.index(documents), _own_texts(pairs)
    candidates = [_candidates(index, documents, pair.query, own) for pair, own in zip(pairs, owns)]
    ranked = sorted({doc for found in candidates for doc in found})
    at = {doc: row for row, doc in enumerate(ranked)}
    vectors = encoded.documents(ranked) if ranked else np.zeros((0, encoded.queries.shape[1]), np.float32)
    rng = random.Random(seed)
    negatives, dropped, fallback = [], 0, 0
    for i, (own, found) in enumerate(zip(owns, candidates)):
        bar = MARGIN * float(encoded.queries[i] @ encoded.positives[i])
        scores = vectors[[at[d] for d in found]] @ encoded.queries[i] if found else np.zeros(0)
        dropped += int((scores > bar).sum())
        kept, texts = [], set(own)
        for doc in (d for d, s in zip(found, scores) if s <= bar):
            if len(kept) < per_pair and documents[doc].strip() not in texts:
                kept.append(doc)
                texts.add(documents[doc].strip())
        while len(kept) < per_pair:
            kept.append(_random_document(documents, texts, rng))
            texts.add(documents[kept[-1]].strip())
            fallback += 1
        negatives.append(tuple(kept))
    return Mined(negatives, dropped, fallback)


@dataclass(frozen=True)
class Encoded:
    """The starting encoder's unit vectors: each pair's query and positive ([pairs, H]), and the documents'
    at the indices asked for."""

    queries: np.ndarray
    positives: np.ndarray
    documents: Callable[[list[int]], np.ndarray]


def _own_texts(pairs: Sequence[Pair]) -> list[frozenset[str]]:
    """Each pair's texts that may never be its negatives: its query's and every positive that query has among
    the pairs."""
    positives: dict[str, set[str]] = {}
    for pair in pairs:
        positives.setdefault(pair.query.strip(), set()).add(pair.positive.strip())
    return [frozenset({pair.query.strip(), *positives[pair.query.strip()]}) for pair in pairs]


def _candidates(index: bm25.Index, documents: Sequence[str], query: str, own: frozenset[str]) -> list[int]:
    """BM25's top DEPTH for the query, less any document whose text is one of the pair's own."""
    found, _ = bm25.search(index, query, DEPTH + len(own) + 1)
    return [int(d) for d in found if documents[d].strip() not in own][:DEPTH]


def _random_document(documents: Sequence[str], taken: set[str], rng: random.Random) -> int:
    """A document drawn at random whose text is none of `taken` (the pair's own texts and the negatives it
    has): drawn from all of them, then from those left where 100 draws met taken ones."""
    for _ in range(100):
        doc = rng.randrange(len(documents)) if documents else -1
        if doc >= 0 and documents[doc].strip() not in taken:
            return doc
    left = [d for d in range(len(documents)) if documents[d].strip() not in taken]
    if not left:
        raise StageError(
            'hard_negatives = "mined": no corpus document differs from a pair\'s own texts (its query and its '
            "query's positives) and the negatives it has: too few documents for negatives_per_pair; lower it"
        )
    return left[rng.randrange(len(left))]
