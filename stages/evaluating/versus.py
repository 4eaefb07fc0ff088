"""The continued model beside the checkpoint it started from (`[evaluate] baseline = "init"`): per task
and test set, each metric's median over the seeds for both, their difference (`gain`: continued less
starting), and each one's spread over the seeds (the largest per-seed score less the smallest), which
says whether the difference is more than the seeds' noise. Both were fine-tuned with the same tasks,
seeds and settings, so each seed's pair differs in the encoder alone.

    results = beside_start(results, start)    # evaluate's results.json, the baseline stage's
    figures = start_figures(results["tasks"]["topic"], "test", "topic")
"""

from __future__ import annotations

from typing import Any


def spread(scores: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Per test set and metric, the largest per-seed score less the smallest."""
    return {
        test: {m: max(values) - min(values) for m, values in by_metric.items()} for test, by_metric in scores.items()
    }


def beside_start(results: dict[str, Any], start: dict[str, Any]) -> dict[str, Any]:
    """`results` with each task that `start` (the starting checkpoint's results) scored too given its
    `spread`, the starting checkpoint's `start` (median, spread, per-seed scores, seeds) and the `gain`
    of its medians over the start's."""
    for name, task in results["tasks"].items():
        begun = start["tasks"].get(name)
        if begun is None:
            continue
        task["spread"] = spread(task["scores"])
        task["start"] = {
            "median": begun["median"],
            "spread": spread(begun["scores"]),
            "scores": begun["scores"],
            "seeds": begun["seeds"],
        }
        task["gain"] = {
            test: {m: value - begun["median"][test][m] for m, value in medians.items()}
            for test, medians in task["median"].items()
        }
    return results


def start_figures(task: dict[str, Any], test: str, prefix: str) -> dict[str, float]:
    """A task's headline figures beside its start, on its main metric: the starting score (`_start`),
    the gain, and the spread of each (`_spread`, `_start_spread`); none for a task scored alone."""
    if "start" not in task:
        return {}
    metric = task["metrics"][0]
    return {
        f"{prefix}_start": round(task["start"]["median"][test][metric], 4),
        f"{prefix}_gain": round(task["gain"][test][metric], 4),
        f"{prefix}_spread": round(task["spread"][test][metric], 4),
        f"{prefix}_start_spread": round(task["start"]["spread"][test][metric], 4),
    }
