"""Hard negatives mined by BM25 and filtered by the starting encoder, worked through with embeddings made
by hand: the positive and the query's own text never come back, a candidate scoring above the margin times
the positive is dropped as a likely false negative, and a pair with nothing left gets a random document."""

import numpy as np
import pytest

from cram.stages.retrieval.beir import Pair
from cram.stages.retrieval.mining import Mining, mine, with_negatives

DOCS = [
    "cats purr and sleep",  # 0: the positive of the first pair
    "cats purr loudly at night",  # 1: lexically close, the encoder says relevant too: a false negative
    "cats hunt mice",  # 2: lexically close, the encoder says unrelated: a hard negative
    "stock markets fell",  # 3
    "rain over the weekend",  # 4
]
PAIRS = [Pair("why do cats purr", DOCS[0]), Pair("weekend rain", DOCS[4])]


def unit(*xs):
    v = np.array(xs, np.float32)
    return v / np.linalg.norm(v)


# The encoder's view: a query and its positive point the same way; doc 1 as well (it is relevant).
VECTORS = {
    "why do cats purr": unit(1, 0, 0),
    "weekend rain": unit(0, 1, 0),
    DOCS[0]: unit(1, 0.1, 0),
    DOCS[1]: unit(1, 0.12, 0),
    DOCS[2]: unit(0.3, 0, 1),
    DOCS[3]: unit(0, 0, 1),
    DOCS[4]: unit(0, 1, 0.1),
}


def embed(texts):
    return np.stack([VECTORS[t] for t in texts])


def test_the_positive_is_never_a_negative_and_a_likely_relevant_candidate_is_dropped():
    mined = mine(PAIRS, DOCS, embed, embed, Mining(depth=10, margin=0.95))
    # Pair 1: BM25 finds 0 (its positive: out), 1 and 2; 1 scores 0.99 of the positive: dropped; 2 kept.
    assert mined.negatives[0] == DOCS[2]
    # Pair 2: BM25 finds only its positive (4): nothing left, a random document that is not the positive.
    assert mined.negatives[1] != DOCS[4] and mined.negatives[1] in DOCS
    assert mined.false_negatives_dropped == 1 and mined.random_fallback == 1
    assert [p.negative for p in with_negatives(PAIRS, mined)] == mined.negatives


def test_without_the_filter_the_first_bm25_candidate_is_taken():
    mined = mine(PAIRS[:1], DOCS, embed, embed, Mining(depth=10, margin=1.0))
    assert mined.negatives == [DOCS[1]] and mined.false_negatives_dropped == 0


def test_a_random_fallback_is_the_same_for_the_same_seed():
    first = mine(PAIRS, DOCS, embed, embed, seed=3).negatives
    assert mine(PAIRS, DOCS, embed, embed, seed=3).negatives == first


@pytest.mark.parametrize("kwargs, message", [({"depth": 0}, "depth: 0"), ({"margin": 0}, "margin: 0")])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Mining(**kwargs)
