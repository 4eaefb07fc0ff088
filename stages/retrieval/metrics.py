"""Retrieval scores as the field reports them: nDCG@10, Recall@100 and MRR@10 per query and their mean,
computed as trec_eval (and pytrec_eval, which wraps it) computes them, so a figure here reads against
any published BEIR table.

trec_eval's rules, read in its source (usnistgov/trec_eval: form_res_rels.c, m_ndcg_cut.c, m_recall.c):
- the ranking: a run's documents sorted by score, descending; equal scores by document id, descending,
  compared as byte strings (`strcmp(ptr2->docno, ptr1->docno)`): the submitted rank is ignored.
- nDCG@k: gain = the qrels' relevance (graded; a document scored <= 0 or unjudged gives nothing),
  discounted by log2(rank + 1); the ideal DCG orders the query's judged relevance values, highest
  first, over every judged document, retrieved or not; both cut at k.
- Recall@k: relevant documents (relevance >= 1) in the first k, over all the query's relevant ones.
MRR@10 is trec_eval's recip_rank on the run cut at 10 (trec_eval has no cut of its own for it; BEIR's
MRR@k is the same): 1 / the rank of the first relevant document, 0 where none is in the first 10.

A query whose qrels hold no relevant document has nothing to find: it is left out of the means and
counted. trec_eval (pytrec_eval, and so BEIR's evaluator) scores it 0 on every metric and averages the
zeros in: where queries are left out, its mean is this one times scored / (scored + left out). A run
where no query has a relevant document has no score at all: `score_run` refuses it (ValueError) rather
than report a mean of nothing (NaN); the BEIR reader refuses such qrels first (`beir.read_beir`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Run = dict[str, dict[str, float]]  # query id -> document id -> score
Qrels = dict[str, dict[str, int]]  # query id -> document id -> relevance
METRICS = ("ndcg@10", "recall@100", "mrr@10")


@dataclass(frozen=True)
class Scores:
    per_query: dict[str, dict[str, float]]  # query id -> metric -> score
    mean: dict[str, float]  # metric -> mean over the scored queries
    left_out: int  # test queries with no relevant document in their qrels


def ranking(scores: dict[str, float]) -> list[str]:
    """The documents in trec_eval's order: score descending, ties by id descending (byte order)."""
    by_id = sorted(scores, key=str.encode, reverse=True)  # strcmp compares UTF-8 bytes
    return sorted(by_id, key=lambda doc: -scores[doc])  # stable: equal scores keep the id order


def score_run(run: Run, qrels: Qrels, ignore_identical_ids: bool = True) -> Scores:
    """Every metric of every query in `qrels` with a relevant document; a query the run lacks ranks
    nothing and scores 0. ValueError where no query has a relevant document. `ignore_identical_ids`: a
    retrieved document whose id is the query's is dropped first, as BEIR's evaluator drops it (in
    ArguAna and Quora a query is also a corpus document, which would find itself first); retrieve one
    more than the deepest cut (Recall@100) so that the cut stays full."""
    per_query = {}
    for query, judged in qrels.items():
        if not any(relevance > 0 for relevance in judged.values()):
            continue
        found = run.get(query, {})
        if ignore_identical_ids and query in found:
            found = {doc: score for doc, score in found.items() if doc != query}
        ranked = [judged.get(doc, 0) for doc in ranking(found)]
        per_query[query] = {
            "ndcg@10": ndcg(ranked, judged, 10),
            "recall@100": recall(ranked, judged, 100),
            "mrr@10": reciprocal_rank(ranked, 10),
        }
    if not per_query:
        raise ValueError(f"none of the {len(qrels)} queries has a relevant document (a judgement above 0): no score")
    mean = {metric: math.fsum(s[metric] for s in per_query.values()) / len(per_query) for metric in METRICS}
    return Scores(per_query, mean, len(qrels) - len(per_query))


def ndcg(ranked: list[int], judged: dict[str, int], k: int) -> float:
    """nDCG@k of one query: `ranked` the relevance of each retrieved document in rank order."""
    ideal = sorted((r for r in judged.values() if r > 0), reverse=True)
    return _dcg(ranked[:k]) / _dcg(ideal[:k])


def recall(ranked: list[int], judged: dict[str, int], k: int) -> float:
    relevant = sum(r > 0 for r in judged.values())
    return sum(r > 0 for r in ranked[:k]) / relevant


def reciprocal_rank(ranked: list[int], k: int) -> float:
    return next((1 / rank for rank, r in enumerate(ranked[:k], 1) if r > 0), 0.0)


def _dcg(gains: list[int]) -> float:
    return math.fsum(g / math.log2(rank + 1) for rank, g in enumerate(gains, 1) if g > 0)
