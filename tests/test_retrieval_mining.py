"""Hard negatives mined by BM25 and filtered by the starting encoder, worked through with embeddings made
by hand: the positive, the query's own text and the query's other positives never come back, a candidate
scoring above the margin times the positive is dropped as a likely false negative, and a pair with fewer
survivors than the negatives it takes is filled with random documents."""

import numpy as np
import pytest

from cram.stages import StageError
from cram.stages.retrieval.beir import Pair
from cram.stages.retrieval.mining import Encoded, mine

DOCS = [
    "cats purr and sleep",  # 0: the positive of the first pair
    "cats purr loudly at night",  # 1: lexically close, the encoder says relevant too: a false negative
    "cats hunt mice",  # 2: lexically close, the encoder says unrelated: a hard negative
    "stock markets fell",  # 3
    "rain over the weekend",  # 4
    "cats purr when fed",  # 5: the first query's second positive
]
PAIRS = [Pair("why do cats purr", DOCS[0]), Pair("weekend rain", DOCS[4]), Pair("why do cats purr", DOCS[5])]


def unit(*xs):
    v = np.array(xs, np.float32)
    return v / np.linalg.norm(v)


# 5, the first query's second positive, reads unlike its query to the encoder (0.2 of the way): no margin
# would drop it, only knowing it is a positive of the same query
VECTORS = [unit(1, 0.1, 0), unit(1, 0.12, 0), unit(0.3, 0, 1), unit(0, 0, 1), unit(0, 1, 0.1), unit(0.2, 0, 1)]
ENCODED = Encoded(
    queries=np.stack([unit(1, 0, 0), unit(0, 1, 0), unit(1, 0, 0)]),
    positives=np.stack([VECTORS[0], VECTORS[4], VECTORS[5]]),
    documents=lambda index: np.stack([VECTORS[d] for d in index]),
)


def test_the_query_s_positives_are_never_negatives_and_a_likely_relevant_one_is_dropped():
    mined = mine(PAIRS, DOCS, ENCODED)
    # Pair 1: BM25 finds 5 (its query's other positive: out, though the encoder would keep it), 0 (its positive:
    # out), 1 and 2; 1 scores 0.99 of the positive: dropped. Pair 3, the same query, 5 its positive (scored
    # 0.2): 1 and 2 both score above it, dropped; a random document, neither of the query's positives.
    assert mined.negatives[0] == (2,) and mined.negatives[2][0] not in (0, 5)
    # Pair 2: BM25 finds only its positive (4): nothing left, a random document, not the positive.
    assert mined.negatives[1][0] != 4
    assert mined.false_negatives_dropped == 3 and mined.random_fallback == 2


def test_a_random_fallback_is_the_same_for_the_same_seed():
    assert mine(PAIRS, DOCS, ENCODED, seed=3).negatives == mine(PAIRS, DOCS, ENCODED, seed=3).negatives


def test_n_negatives_a_pair_are_the_first_survivors_then_random_documents_each_text_once():
    mined = mine(PAIRS, DOCS, ENCODED, per_pair=2)
    # Pair 1: 2 survives the margin (1 is dropped, 0 and 5 are the query's positives): one random document
    # fills it. Pair 2 (BM25 finds only its positive) and pair 3 (1 and 2 dropped): two random documents each.
    assert len(mined.negatives) == 3 and all(len(found) == 2 for found in mined.negatives)
    assert mined.negatives[0][0] == 2 and mined.false_negatives_dropped == 3 and mined.random_fallback == 5
    for pair, found in zip(PAIRS, mined.negatives):
        texts = [DOCS[d] for d in found]
        assert len(set(texts)) == 2 and pair.positive not in texts
    for found in (mined.negatives[0], mined.negatives[2]):
        assert 0 not in found and 5 not in found
    assert mine(PAIRS, DOCS, ENCODED).negatives[0] == (2,)  # one a pair: the first survivor alone


def test_too_few_documents_for_n_negatives_a_pair_is_refused_naming_the_setting():
    # Pair 1 may take 1, 2, 3 and 4 (0 and 5 are its query's positives): four, not five.
    with pytest.raises(StageError, match="too few documents for negatives_per_pair"):
        mine(PAIRS, DOCS, ENCODED, per_pair=5)


def test_the_encoder_embeds_a_pair_s_candidates_only_as_far_as_it_needs_them():
    documents = [f"cats number {k}" for k in range(20)] + ["the answer"]
    asked: list[int] = []

    def embedded(index: list[int]) -> np.ndarray:
        asked.extend(index)
        return np.stack([unit(0, 1, 0) for _ in index])  # every candidate unrelated: each survives the margin

    encoded = Encoded(queries=np.stack([unit(1, 0, 0)]), positives=np.stack([unit(1, 0, 0)]), documents=embedded)
    mined = mine([Pair("cats", "the answer")], documents, encoded, per_pair=2)
    # 20 BM25 candidates; the first round embeds twice the two it lacks, and both of the first survive
    assert len(asked) == 4 and len(set(asked)) == 4 and set(mined.negatives[0]) <= set(asked)
