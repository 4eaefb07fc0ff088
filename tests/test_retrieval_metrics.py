"""nDCG@10, Recall@100 and MRR@10 as trec_eval computes them: against a table worked out by hand, and
against pytrec_eval (trec_eval itself, wrapped) on random runs with tied scores."""

import math
import random

import pytest

from cram.stages.retrieval.metrics import ranking, score_run

QRELS = {
    "q1": {"a": 3, "b": 2, "c": 0, "d": 1, "z": 1},  # z is never retrieved
    "q2": {"x": 1},
    "q3": {"a": 1},
    "q4": {"m": 0},  # no relevant document: left out, counted
    "q5": {"y": 2},  # not in the run: ranks nothing
}
RUN = {
    "q1": {"a": 0.5, "b": 0.9, "c": 0.7, "d": 0.5, "e": 0.1},
    "q2": {**{f"p{i:02d}": 1.0 - i / 100 for i in range(11)}, "x": 0.5},  # x ranks 12th
    "q3": {"a": 0.5, "ab": 0.5},
    "q4": {"m": 0.3},
}


def test_the_ranking_breaks_ties_by_descending_id_as_trec_eval_does():
    assert ranking(RUN["q1"]) == ["b", "c", "d", "a", "e"]
    assert ranking({"a": 1.0, "ab": 1.0, "B": 1.0, "é": 1.0, "b": 2.0}) == ["b", "é", "ab", "a", "B"]


def test_scores_match_the_table_worked_by_hand():
    scores = score_run(RUN, QRELS)
    # q1 ranks b (2), c (0), d (1), a (3), e (unjudged): d before a, their scores tied, by id.
    # Ideal: 3, 2, 1, 1 (z's 1 counts though z is not retrieved).
    dcg = 2 / math.log2(2) + 1 / math.log2(4) + 3 / math.log2(5)
    ideal = 3 / math.log2(2) + 2 / math.log2(3) + 1 / math.log2(4) + 1 / math.log2(5)
    hand = {
        "q1": {"ndcg@10": dcg / ideal, "recall@100": 3 / 4, "mrr@10": 1.0},
        "q2": {"ndcg@10": 0.0, "recall@100": 1.0, "mrr@10": 0.0},  # x at 12: past 10, within 100
        "q3": {"ndcg@10": 1 / math.log2(3), "recall@100": 1.0, "mrr@10": 1 / 2},  # "ab" ties before "a"
        "q5": {"ndcg@10": 0.0, "recall@100": 0.0, "mrr@10": 0.0},
    }
    assert scores.per_query.keys() == hand.keys()
    for query, expected in hand.items():
        assert scores.per_query[query] == pytest.approx(expected, abs=1e-12), query
    assert scores.left_out == 1
    for metric in ("ndcg@10", "recall@100", "mrr@10"):
        assert scores.mean[metric] == pytest.approx(sum(h[metric] for h in hand.values()) / 4, abs=1e-12)
    assert round(scores.per_query["q1"]["ndcg@10"], 4) == 0.7303


def test_no_scorable_query_is_refused_not_a_nan_mean():
    with pytest.raises(ValueError, match="none of the 2 queries has a relevant document"):
        score_run({"q": {"a": 1.0}}, {"q": {"a": 0}, "r": {"b": -1}})


def random_case(rng: random.Random, queries: int) -> tuple[dict, dict]:
    # Ids that share prefixes and differ in case, and scores on a coarse grid, so ties are common.
    pool = [f"{stem}{tail}" for stem in ("d", "D", "doc", "é") for tail in ("", "1", "10", "2", "a", "_x")]
    qrels, run = {}, {}
    for q in range(queries):
        judged = rng.sample(pool, rng.randint(1, 12))
        qrels[f"q{q}"] = {doc: rng.choice([0, 0, 1, 1, 2, 3]) for doc in judged}
        retrieved = rng.sample(pool, rng.randint(1, len(pool)))
        run[f"q{q}"] = {doc: float(rng.randint(0, 6)) / 4 for doc in retrieved}
    return qrels, run


def test_scores_equal_pytrec_eval_on_random_runs_with_ties():
    pytrec_eval = pytest.importorskip("pytrec_eval")
    rng = random.Random(0)
    qrels, run = random_case(rng, 300)
    ours = score_run(run, qrels)
    theirs = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run)
    top10 = {q: {doc: run[q][doc] for doc in ranking(run[q])[:10]} for q in run}
    mrr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    assert len(ours.per_query) > 200 and ours.left_out > 0
    for query, mine in ours.per_query.items():
        assert mine["ndcg@10"] == pytest.approx(theirs[query]["ndcg_cut_10"], abs=1e-12), query
        assert mine["recall@100"] == pytest.approx(theirs[query]["recall_100"], abs=1e-12), query
        assert mine["mrr@10"] == pytest.approx(mrr[query]["recip_rank"], abs=1e-12), query
    # The queries left out are exactly those pytrec_eval scores with no relevant document to find.
    assert ours.left_out == sum(not any(r > 0 for r in judged.values()) for judged in qrels.values())
    # pytrec_eval scores those 0 and averages them in: its mean is ours scaled by the share scored.
    share = len(ours.per_query) / len(qrels)
    theirs_mean = sum(t["ndcg_cut_10"] for t in theirs.values()) / len(theirs)
    assert len(theirs) == len(qrels) and theirs_mean == pytest.approx(ours.mean["ndcg@10"] * share, abs=1e-12)


def test_a_document_whose_id_is_the_querys_is_dropped_as_beir_drops_it():
    # ArguAna's way: the query is a corpus document too and finds itself first.
    run = {"q1": {"q1": 9.0, "a": 5.0, "b": 4.0}}
    qrels = {"q1": {"a": 1}}
    assert score_run(run, qrels).mean == {"ndcg@10": 1.0, "recall@100": 1.0, "mrr@10": 1.0}
    kept = score_run(run, qrels, ignore_identical_ids=False).mean
    assert kept["mrr@10"] == 0.5 and kept["ndcg@10"] == pytest.approx(1 / math.log2(3))
