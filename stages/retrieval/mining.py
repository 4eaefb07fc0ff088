"""Hard negatives mined for a retrieval task's training pairs: each query's BM25 top `depth` over the
corpus, less its positive, less every candidate the starting encoder scores above `margin` times the
positive (a likely unjudged relevant document: NV-Retriever's "TopK-PercPos" rule, Moreira et al. 2024,
sentence-transformers' `mine_hard_negatives(relative_margin=...)`), the first of the rest in BM25's
order: one a pair, the column a pairs file's `negative` fills.

The fine-tune's hard-negative column is all or nothing (stages/retrieval/tuning.py), so a pair none of
whose candidates survives gets a corpus document drawn at random (a plain negative), counted as such.
Only the corpus's documents that no test query finds relevant are candidates: a test positive as a
training negative would teach the model to push away what the test asks it to find.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cram.stages.retrieval import bm25
from cram.stages.retrieval.beir import Pair

Embed = Callable[[list[str]], np.ndarray]  # texts -> [N, H] unit vectors


@dataclass(frozen=True)
class Mining:
    """`depth`: BM25 candidates a query; `margin`: a candidate scoring above `margin` x the positive's
    cosine is dropped as a likely false negative."""

    depth: int = 30
    margin: float = 0.95

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth: {self.depth} must be at least 1")
        if not 0.0 < self.margin <= 1.0:
            raise ValueError(f"margin: {self.margin} must be in (0, 1]")


@dataclass(frozen=True)
class Mined:
    """Each pair's mined negative (`negatives[i]`), and what the mining did."""

    negatives: list[str]
    false_negatives_dropped: int  # candidates (of every pair's depth) the encoder scored above margin x the positive
    random_fallback: int  # pairs that got a random document instead


def mine(
    pairs: Sequence[Pair],
    documents: Sequence[str],
    embed_queries: Embed,
    embed_documents: Embed,
    mining: Mining = Mining(),
    seed: int = 0,
) -> Mined:
    """Hard negatives for each pair among `documents` (module docstring)."""
    index = bm25.index(documents)
    candidates = [_candidates(index, documents, pair, mining.depth) for pair in pairs]
    queries = embed_queries([p.query for p in pairs])
    positives = embed_documents([p.positive for p in pairs])
    ranked = sorted({doc for found in candidates for doc in found})
    at = {doc: row for row, doc in enumerate(ranked)}
    vectors = embed_documents([documents[d] for d in ranked]) if ranked else np.zeros((0, queries.shape[1]))
    rng = random.Random(seed)
    negatives, dropped, fallback = [], 0, 0
    for i, (pair, found) in enumerate(zip(pairs, candidates)):
        bar = mining.margin * float(queries[i] @ positives[i])
        scores = vectors[[at[d] for d in found]] @ queries[i] if found else np.zeros(0)
        kept = next((documents[d] for d, s in zip(found, scores) if s <= bar), None)
        dropped += int((scores > bar).sum())
        if kept is None:
            kept = _random_document(documents, pair, rng)
            fallback += 1
        negatives.append(kept)
    return Mined(negatives, dropped, fallback)


def with_negatives(pairs: Sequence[Pair], mined: Mined) -> list[Pair]:
    """Each pair with its mined negative, as a pairs file's `negative` column gives it."""
    return [Pair(p.query, p.positive, negative) for p, negative in zip(pairs, mined.negatives)]


def _candidates(index: bm25.Index, documents: Sequence[str], pair: Pair, depth: int) -> list[int]:
    """BM25's top `depth` for the query, less any document that is the pair's positive or its query."""
    own = {pair.positive.strip(), pair.query.strip()}
    found, _ = bm25.search(index, pair.query, depth + 2)  # room for the pair's own texts
    return [int(d) for d in found if documents[d].strip() not in own][:depth]


def _random_document(documents: Sequence[str], pair: Pair, rng: random.Random) -> str:
    own = {pair.positive.strip(), pair.query.strip()}
    for _ in range(100):
        text = documents[rng.randrange(len(documents))]
        if text.strip() not in own:
            return text
    raise ValueError("no corpus document differs from the pair's own texts: nothing to mine")
