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
    false_negatives_dropped: int  # candidates examined that the encoder scored above margin x the positive
    random_fallback: int  # negatives drawn at random where fewer than `per_pair` candidates survived


def mine(
    pairs: Sequence[Pair],
    documents: Sequence[str],
    encoded: Encoded,
    seed: int = 0,
    per_pair: int = 1,
) -> Mined:
    """`per_pair` hard negatives for each pair among `documents` (module docstring). The encoder embeds a
    pair's candidates in BM25's order only as far as it needs them (`_examined`): most pairs take their
    negatives from their first few, and embedding every candidate of every pair cost several times that."""
    index, owns = bm25.index(documents), _own_texts(pairs)
    candidates = [_candidates(index, documents, pair.query, own) for pair, own in zip(pairs, owns)]
    kept, dropped = _examined(candidates, documents, owns, encoded, per_pair)
    rng = random.Random(seed)
    fallback = 0
    for own, negatives in zip(owns, kept):
        taken = set(own) | {documents[d].strip() for d in negatives}
        while len(negatives) < per_pair:
            negatives.append(_random_document(documents, taken, rng))
            taken.add(documents[negatives[-1]].strip())
            fallback += 1
    return Mined([tuple(negatives) for negatives in kept], dropped, fallback)


def _examined(
    candidates: list[list[int]], documents: Sequence[str], owns: list[frozenset[str]], encoded: Encoded, per_pair: int
) -> tuple[list[list[int]], int]:
    """Each pair's surviving candidates (at most `per_pair`, in BM25's order) and how many candidates scored
    above the margin, walking each pair's candidates in rounds: a round embeds, for every pair still short,
    twice as many of its next candidates as it lacks (the documents no earlier round embedded)."""
    vectors: dict[int, np.ndarray] = {}
    kept: list[list[int]] = [[] for _ in candidates]
    texts = [set(own) for own in owns]
    seen, dropped = [0] * len(candidates), 0
    bars = MARGIN * np.einsum("ph,ph->p", encoded.queries, encoded.positives)
    while short := [i for i, found in enumerate(candidates) if len(kept[i]) < per_pair and seen[i] < len(found)]:
        window = {i: candidates[i][seen[i] : seen[i] + 2 * (per_pair - len(kept[i]))] for i in short}
        new = sorted({d for found in window.values() for d in found} - vectors.keys())
        if new:
            vectors.update(zip(new, encoded.documents(new)))
        for i, found in window.items():
            for doc in found:
                seen[i] += 1
                if float(vectors[doc] @ encoded.queries[i]) > bars[i]:
                    dropped += 1
                elif documents[doc].strip() not in texts[i]:
                    kept[i].append(doc)
                    texts[i].add(documents[doc].strip())
                    if len(kept[i]) == per_pair:
                        break
    return kept, dropped


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
