"""Scores of fine-tuned predictions: numpy only, fractions (accuracy 0.91, not 91.0) as `sklearn` and
`evaluate` give them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    return float(np.mean(pred == gold))


def f1(pred: np.ndarray, gold: np.ndarray) -> float:
    """Binary F1 of class 1 (GLUE's "equivalent"/"duplicate")."""
    return _f1_of(1, pred, gold)


def macro_f1(pred: np.ndarray, gold: np.ndarray) -> float:
    """Mean F1 over the classes that occur in gold or pred (sklearn's default label set)."""
    return float(np.mean([_f1_of(c, pred, gold) for c in np.union1d(pred, gold)]))


def _f1_of(positive, pred: np.ndarray, gold: np.ndarray) -> float:
    tp = np.sum((pred == positive) & (gold == positive))
    wrong = np.sum((pred == positive) != (gold == positive))  # false positives + false negatives
    return float(2 * tp / (2 * tp + wrong)) if tp + wrong else 0.0


def matthews(pred: np.ndarray, gold: np.ndarray) -> float:
    """Matthews correlation, multi-class form (Gorodkin's R_K); 0 when either side is constant."""
    classes = np.union1d(pred, gold)
    confusion = np.zeros((len(classes), len(classes)))
    np.add.at(confusion, (np.searchsorted(classes, gold), np.searchsorted(classes, pred)), 1)
    true_k, pred_k = confusion.sum(1), confusion.sum(0)
    correct, n = np.trace(confusion), confusion.sum()
    denominator = np.sqrt((n**2 - pred_k @ pred_k) * (n**2 - true_k @ true_k))
    return float((correct * n - true_k @ pred_k) / denominator) if denominator else 0.0


def pearson(pred: np.ndarray, gold: np.ndarray) -> float:
    """Pearson correlation; 0 when either side is constant (a constant predictor explains nothing)."""
    x, y = pred - pred.mean(), gold - gold.mean()
    denominator = np.sqrt((x @ x) * (y @ y))
    return float(x @ y / denominator) if denominator else 0.0


def spearman(pred: np.ndarray, gold: np.ndarray) -> float:
    return pearson(rank(pred), rank(gold))


def rank(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given the mean of the ranks they span (scipy's rankdata "average")."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values))
    ranks[order] = np.repeat((starts + ends + 1) / 2, ends - starts)
    return ranks


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": accuracy,
    "f1": f1,
    "macro_f1": macro_f1,
    "matthews": matthews,
    "pearson": pearson,
    "spearman": spearman,
}
REGRESSION_METRICS = ("pearson", "spearman")


def score(metrics: Sequence[str], pred: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    return {m: METRICS[m](pred, gold) for m in metrics}
