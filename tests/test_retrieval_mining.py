"""Hard negatives mined by BM25 and filtered by the starting encoder, worked through with embeddings made
by hand: the positive, the query's own text and the excluded (test answers) never come back, a candidate
scoring above the margin times the positive is dropped as a likely false negative, and a pair with nothing
left gets a random document."""

import numpy as np

from cram.stages.retrieval.beir import Pair
from cram.stages.retrieval.mining import Encoded, mine

DOCS = [
    "cats purr and sleep",  # 0: the positive of the first pair
    "cats purr loudly at night",  # 1: lexically close, the encoder says relevant too: a false negative
    "cats hunt mice",  # 2: lexically close, the encoder says unrelated: a hard negative
    "stock markets fell",  # 3
    "rain over the weekend",  # 4
    "cats purr when fed",  # 5: a test answer: excluded
]
PAIRS = [Pair("why do cats purr", DOCS[0]), Pair("weekend rain", DOCS[4])]


def unit(*xs):
    v = np.array(xs, np.float32)
    return v / np.linalg.norm(v)


VECTORS = [unit(1, 0.1, 0), unit(1, 0.12, 0), unit(0.3, 0, 1), unit(0, 0, 1), unit(0, 1, 0.1), unit(1, 0, 0)]
ENCODED = Encoded(
    queries=np.stack([unit(1, 0, 0), unit(0, 1, 0)]),
    positives=np.stack([VECTORS[0], VECTORS[4]]),
    documents=lambda index: np.stack([VECTORS[d] for d in index]),
)


def test_the_positive_and_the_excluded_are_never_negatives_and_a_likely_relevant_one_is_dropped():
    mined = mine(PAIRS, DOCS, ENCODED, excluded={5})
    # Pair 1: BM25 finds 0 (its positive: out), 5 (excluded), 1 and 2; 1 scores 0.99 of the positive: dropped.
    assert mined.negatives[0] == 2
    # Pair 2: BM25 finds only its positive (4): nothing left, a random document, not the positive or excluded.
    assert mined.negatives[1] not in (4, 5)
    assert mined.false_negatives_dropped == 1 and mined.random_fallback == 1


def test_a_random_fallback_is_the_same_for_the_same_seed():
    assert mine(PAIRS, DOCS, ENCODED, seed=3).negatives == mine(PAIRS, DOCS, ENCODED, seed=3).negatives
