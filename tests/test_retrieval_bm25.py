"""BM25 (k1 0.9, b 0.4, Lucene's idf) on a corpus small enough to work out by hand."""

import json
import math

import numpy as np
import pytest

from cram.stages.retrieval.beir import read_beir
from cram.stages.retrieval.bm25 import index, load, save, search, words
from cram.stages.retrieval.metrics import score_run

# N = 3 documents, 8 words: avgdl = 8/3. df: the 2, cat 2, dog 2, sat 1.
CORPUS = ["The cat sat.", "the DOG", "cat, cat; dog!"]
IDF2 = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))  # df 2: log 1.6
K1, B = 0.9, 0.4


def saturated(tf: int, length: int) -> float:
    return tf * (K1 + 1) / (tf + K1 * (1 - B + B * length / (8 / 3)))


def test_words_are_lower_cased_word_runs():
    assert words("The cat's 2 DOGS, naïve-ly!") == ["the", "cat", "s", "2", "dogs", "naïve", "ly"]


def test_scores_match_the_hand_computation():
    idx = index(CORPUS)
    # "Cat?": d2 holds cat twice (length 3), d0 once (length 3); d1 shares no word and is not retrieved.
    # tf part: 2 * 1.9 / (2 + 0.9 * (0.6 + 0.4 * 3 / (8/3))) = 3.8 / 2.945; d0: 1.9 / 1.945.
    docs, scores = search(idx, "Cat?", 10)
    assert docs.tolist() == [2, 0]
    assert scores == pytest.approx([IDF2 * 3.8 / 2.945, IDF2 * 1.9 / 1.945], rel=1e-12)
    # "the dog dog": dog counts twice. d1 (length 2): (1 + 2) * 1.9 / 1.81; d2: 2 * 1.9 / 1.945;
    # d0: 1 * 1.9 / 1.945 (the). Cut at 2.
    docs, scores = search(idx, "the dog dog", 2)
    assert docs.tolist() == [1, 2]
    assert scores == pytest.approx([IDF2 * 3 * saturated(1, 2), IDF2 * 2 * saturated(1, 3)], rel=1e-12)
    assert scores[0] == pytest.approx(IDF2 * 3 * 1.9 / 1.81, rel=1e-12)


def test_a_rare_word_weighs_more_and_unknown_words_retrieve_nothing():
    idx = index(CORPUS)
    docs, scores = search(idx, "sat", 10)
    assert docs.tolist() == [0]
    assert scores[0] == pytest.approx(math.log(1 + 2.5 / 1.5) * saturated(1, 3), rel=1e-12)
    docs, scores = search(idx, "zebra ...", 10)
    assert docs.size == 0 and scores.size == 0


def test_equal_scores_keep_the_lower_index_first():
    docs, scores = search(index(["y x", "q", "x y", "x y"]), "x", 10)
    assert docs.tolist() == [0, 2, 3]
    assert np.all(scores == scores[0])


def test_bm25_on_a_beir_folder_scores_through_the_metrics(tmp_path):
    # The pieces as evaluate will join them: a folder read, BM25 over each document's title and text, a run.
    (tmp_path / "qrels").mkdir()
    corpus = [("d1", "Cats", "Cats purr."), ("d2", "", "Dogs bark."), ("d3", "Birds", "Birds sing at dawn.")]
    lines = [json.dumps({"_id": i, "title": t, "text": x}) for i, t, x in corpus]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    queries = [{"_id": "q1", "text": "what purrs"}, {"_id": "q2", "text": "dogs that bark"}]
    (tmp_path / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries), encoding="utf-8")
    (tmp_path / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n")
    beir = read_beir(tmp_path)
    ids = list(beir.corpus)
    idx = index([doc.full_text for doc in beir.corpus.values()])
    run = {}
    for query in beir.qrels["test"]:
        docs, scores = search(idx, beir.queries[query], 100)
        run[query] = {ids[d]: float(s) for d, s in zip(docs, scores)}
    scores = score_run(run, beir.qrels["test"])
    # No stemming: "purrs" does not find "purr", so q1 retrieves nothing; q2 finds d2 first.
    assert run["q1"] == {} and list(run["q2"]) == ["d2"]
    assert scores.mean == {"ndcg@10": 0.5, "recall@100": 0.5, "mrr@10": 0.5}


def _brute_force(corpus: list[str], query: str) -> np.ndarray:
    """Every document's BM25 score straight from the formula, one document at a time."""
    bags = [words(text) for text in corpus]
    avgdl = sum(map(len, bags)) / len(bags)
    scores = np.zeros(len(bags))
    for word in set(words(query)):
        df = sum(word in bag for bag in bags)
        idf = math.log(1 + (len(bags) - df + 0.5) / (df + 0.5))
        for d, bag in enumerate(bags):
            tf = bag.count(word)
            if tf:
                scores[d] += words(query).count(word) * idf * saturated_at(tf, len(bag), avgdl)
    return scores


def saturated_at(tf: int, length: int, avgdl: float) -> float:
    return tf * (K1 + 1) / (tf + K1 * (1 - B + B * length / avgdl))


def test_a_streamed_build_in_small_chunks_scores_as_the_formula(monkeypatch):
    # Postings of one word spread over several chunks must keep their documents in order and their counts.
    rng = np.random.default_rng(0)
    vocabulary = [f"w{i}" for i in range(40)]
    corpus = [" ".join(rng.choice(vocabulary, size=rng.integers(1, 12))) for _ in range(57)]
    monkeypatch.setattr("cram.stages.retrieval.bm25.CHUNK_DOCS", 5)
    idx = index(text for text in corpus)  # a generator: read once
    assert idx.docs.dtype == np.int32 and idx.tfs.dtype == np.uint16
    for query in ["w1 w2 w2", "w39", "w0 w5 w7 w11 w13"]:
        expected = _brute_force(corpus, query)
        docs, scores = search(idx, query, 100)
        assert np.allclose(scores, expected[docs], rtol=1e-12)
        assert sorted(docs.tolist()) == np.flatnonzero(expected > 0).tolist()


def test_a_count_past_uint16_widens_the_counts_not_clips_them():
    idx = index(["big " * 70_000, "big small"])
    assert idx.tfs.dtype == np.uint32 and int(idx.tfs.max()) == 70_000
    docs, scores = search(idx, "big", 2)
    assert scores[docs.tolist().index(0)] == pytest.approx(
        math.log(1 + 0.5 / 2.5) * saturated_at(70_000, 70_000, 35_001), rel=1e-12
    )


def test_a_saved_index_loads_mapped_and_searches_the_same(tmp_path):
    idx = index(CORPUS)
    save(idx, tmp_path / "bm25")
    loaded = load(tmp_path / "bm25")
    assert isinstance(loaded.docs, np.memmap) and loaded.vocabulary == idx.vocabulary
    for query in ["Cat?", "the dog dog", "sat", "zebra"]:
        expected, got = search(idx, query, 10), search(loaded, query, 10)
        assert got[0].tolist() == expected[0].tolist() and got[1].tolist() == expected[1].tolist()
