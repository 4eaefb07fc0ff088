"""A retrieval encoder's runs scored, and the choices made on the validation split (validation.py), never on
the test: how its dense run is fused with BM25's (the `hybrid`), and whether a seed offers its fine-tuned
encoder or the encoder as it was (`selection`).

The fusions tried are the convex mixes of min-max scores at the dense weights WEIGHTS (0 to 1, finer near 0)
and reciprocal-rank fusion (fusion.py); the best validation nDCG@10 wins, ties going to the earlier in
FUSIONS (the even mix first). Without a validation split the even mix is taken.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cram.stages.retrieval.fusion import Fusion, fuse
from cram.stages.retrieval.metrics import METRICS, Qrels, Run, Scores, score_run

# finer near 0: where BM25 is strong (a title finding its article), a small dense share is what helps
WEIGHTS = (0.5, 0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0)
FUSIONS = (*(Fusion("convex", w) for w in WEIGHTS), Fusion("rrf"))
MAIN = METRICS[0]


@dataclass(frozen=True)
class Judged:
    """An encoder's mean scores by split and metric, dense alone and fused with BM25 by the fusion chosen."""

    dense: dict[str, dict[str, float]]
    fusion: Fusion
    hybrid: dict[str, dict[str, float]]
    queries_scored: int = 0  # test queries with a relevant document
    queries_left_out: int = 0  # test queries without one (metrics.score_run)

    def validation(self) -> float | None:
        """Its dense validation nDCG@10; None without a validation split."""
        return self.dense["validation"][MAIN] if "validation" in self.dense else None

    def record(self) -> dict:
        """As results.json holds it."""
        return {"scores": self.dense, "hybrid": {"fusion": asdict(self.fusion), **self.hybrid}}


def judge(
    dense: dict[str, Run], lexical: dict[str, Run], qrels: dict[str, Qrels], ignore_identical_ids: bool
) -> Judged:
    """Dense runs (`EmbeddingTuner.runs`) and BM25's, by split, scored against `qrels` (`ignore_identical_ids`:
    `metrics.score_run`'s); the fusion chosen on the validation split where there is one."""

    def scored(run: Run, split: str) -> Scores:
        return score_run(run, qrels[split], ignore_identical_ids)

    fusion, chosen = Fusion(), None
    if "validation" in dense:
        tried = [(scored(fused(dense["validation"], lexical["validation"], f), "validation"), f) for f in FUSIONS]
        chosen, fusion = max(tried, key=lambda pair: pair[0].mean[MAIN])  # max keeps the first of equals
    scores = {split: scored(run, split) for split, run in dense.items()}
    hybrid = {
        split: chosen.mean if split == "validation" else scored(fused(run, lexical[split], fusion), split).mean
        for split, run in dense.items()
    }
    test = scores["test"]
    means = {split: scored.mean for split, scored in scores.items()}
    return Judged(means, fusion, hybrid, len(test.per_query), test.left_out)


def fused(dense: Run, lexical: Run, fusion: Fusion) -> Run:
    """Every query's two runs fused."""
    return {
        query: fuse(dense.get(query, {}), lexical.get(query, {}), fusion) for query in dense.keys() | lexical.keys()
    }


def offers_untuned(tuned: Judged, untuned: Judged) -> bool:
    """Whether a seed offers the encoder as it was: only where its validation score beats the fine-tune's."""
    mine, start = tuned.validation(), untuned.validation()
    return mine is not None and start is not None and start > mine


def selection(tuned: Judged, untuned: Judged) -> dict[str, float]:
    """The score a seed's offer is kept by (`kept.main_score` reads it): its validation nDCG@10, the better
    of the fine-tune's and the start's; 0 for every seed without a validation split (the first is kept)."""
    mine, start = tuned.validation(), untuned.validation()
    return {MAIN: 0.0 if mine is None else max(mine, start if start is not None else mine)}
