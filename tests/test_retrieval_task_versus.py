"""A retrieval task's results beside the starting checkpoint's (`baseline = "init"`, versus.py) and its
headline figures: the same code as a classification task's, on retrieval's metrics and BM25's baseline."""

from cram.stages.evaluating.scoring import headline
from cram.stages.evaluating.versus import beside_start


def retrieval(ndcg: list[float]) -> dict:
    scores = {"ndcg@10": ndcg, "recall@100": [1.0] * len(ndcg), "mrr@10": ndcg}
    return {
        "kind": "heldout-retrieval",
        "metrics": ["ndcg@10", "recall@100", "mrr@10"],
        "seeds": list(range(len(ndcg))),
        "scores": {"test": scores},
        "median": {"test": {m: sorted(v)[len(v) // 2] for m, v in scores.items()}},
        "baseline": {"test": {"ndcg@10": 0.25, "recall@100": 0.5, "mrr@10": 0.2}},
        "time_s": 12.0,
    }


def test_a_retrieval_task_is_set_beside_its_start_on_ndcg():
    results = beside_start(
        {"tasks": {"retrieval": retrieval([0.5, 0.7, 0.6])}}, {"tasks": {"retrieval": retrieval([0.3, 0.4, 0.2])}}
    )
    task = results["tasks"]["retrieval"]
    assert round(task["gain"]["test"]["ndcg@10"], 6) == 0.3 and round(task["spread"]["test"]["ndcg@10"], 6) == 0.2
    figures = headline(results)
    assert figures["retrieval_ndcg@10"] == 0.6 and figures["retrieval_baseline"] == 0.25
    assert figures["retrieval_start"] == 0.3 and figures["retrieval_gain"] == 0.3
    assert figures["retrieval_recall@100"] == 1.0 and figures["retrieval_mrr@10"] == 0.6
