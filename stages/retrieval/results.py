"""A retrieval task in the evaluate stage: loaded from its config entry, one seed fine-tuned and searched,
and its results.json entry over the seeds beside BM25's scores on the same queries, as
`finetuning/finetune.py` does a classification task's (`finetune_seed`, `task_result`).

    loaded = load(task_cfg, index, tokenize, tokenizer, special, settings)
    run = retrieve_seed(embedder, loaded, seed, ctx, scratch, keep)          # per seed
    result = retrieval_result(loaded, seeds, runs, ctx)                       # per task
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from cram.stages import StageError
from cram.stages.retrieval.metrics import METRICS

if TYPE_CHECKING:
    from pathlib import Path

    from cram.stages import Context, Upstream
    from cram.stages.retrieval.metrics import Scores
    from cram.stages.retrieval.pairs import RetrievalTask
    from cram.stages.retrieval.settings import RetrievalSettings
    from cram.stages.retrieval.tuning import Embedder, RetrievalLoaded
    from cram.stages.shared.tokenizer import Tokenizer
    from cram.stages.tasks.config import TaskConfig

# What the baseline is, written beside its scores: bm25.py's settings and its tokenisation.
BASELINE = "BM25 (k1 0.9, b 0.4, Lucene's idf) over a plain lower-cased word split (\\w+), not the model's tokenizer"


def load_task(
    task_cfg: TaskConfig, index: int, tokenize: Upstream | None, settings: RetrievalSettings
) -> RetrievalTask:
    """Task `index`'s test set and training pairs, checked: a BEIR folder's, or tokenize's held-out
    documents' (`tokenize` None: not known yet, only a BEIR task can be loaded). A task whose pairs fill no
    batch of `settings.batch_size` without a text twice is refused."""
    from cram.stages.retrieval import pairs
    from cram.stages.retrieval.loss import distinct_batches

    where = f"evaluate.tasks[{index}]"
    if task_cfg.kind == "retrieval":
        task = pairs.load_beir_task(task_cfg.name, task_cfg.path, task_cfg.pairs, where)
    else:
        heldout = None if tokenize is None else tokenize.outputs.get("heldout")
        if heldout is None:
            raise StageError(
                f"{where}: kind 'heldout-retrieval' needs the tokenize stage's held-out documents, and it kept none "
                "(set tokenize.heldout_fraction above 0, or drop this task)"
            )
        task = pairs.load_heldout_task(task_cfg.name, tokenize.dir / heldout, task_cfg.test_fraction)
    distinct_batches([p.texts for p in task.pairs], settings.batch_size, 0, f"{where} ({task.source} pairs)")
    return task


def loaded(
    task_cfg: TaskConfig, task: RetrievalTask, tokenizer: Tokenizer, special: dict, settings: RetrievalSettings
) -> RetrievalLoaded:
    from cram.stages.retrieval.tuning import RetrievalLoaded, encode_pairs

    return RetrievalLoaded(task_cfg, task, encode_pairs(task, tokenizer, special, settings), settings)


def retrieve_seed(
    embedder: Embedder, task: RetrievalLoaded, seed: int, ctx: Context, scratch: Path, keep: Callable | None = None
) -> dict:
    """Fine-tune one seed of a retrieval task from the pretrained encoder and score it on the test
    queries; `keep`, when given, is called with the fine-tuned params and the run's record."""
    began = time.perf_counter()
    name = task.task.name
    log = ctx.log.bind(task=name, seed=seed)
    where = f"evaluate task {name}"
    params, loss = embedder.train(task, seed, where, f"{name} seed {seed}", log)
    scores = embedder.search(params, task, scratch)
    ctx.log.info("finetuned", task=name, seed=seed, train_loss=round(loss, 4), **_rounded(scores.mean))
    run = {
        "train_loss": loss,
        "scores": {"test": scores.mean},
        "queries_scored": len(scores.per_query),
        "queries_left_out": scores.left_out,
        "time_s": time.perf_counter() - began,
    }
    if keep is not None:
        keep(params, run)
    return run


def retrieval_result(task: RetrievalLoaded, seeds: list[int], runs: list[dict], ctx: Context) -> dict[str, Any]:
    """A retrieval task's results from its seeds' runs (in seed order): per-seed scores, medians, BM25."""
    import numpy as np

    from cram.stages.tasks.config import FINETUNE_OPTIMIZER

    settings = task.settings
    scores = {"test": {m: [r["scores"]["test"][m] for r in runs] for m in METRICS}}
    baseline = bm25_scores(task.task)
    result = {
        "kind": task.config.kind,
        "metrics": list(METRICS),
        "train_pairs": len(task.task.pairs),
        "pairs_source": task.task.source,
        "pairs_dropped": task.task.pairs_dropped,
        "corpus_documents": len(task.task.corpus),
        "test_queries": len(task.task.queries),
        "queries_scored": runs[0]["queries_scored"],
        "queries_left_out": runs[0]["queries_left_out"],
        "epochs": settings.epochs,
        "lr": settings.lr,
        "max_length": settings.max_length,
        "query_max_length": settings.query_max_length,
        "batch_size": settings.batch_size,
        "pooling": settings.pooling,
        "seeds": seeds,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in FINETUNE_OPTIMIZER.items()},
        "train_loss": [r["train_loss"] for r in runs],
        "scores": scores,
        "median": {"test": {m: float(np.median(v)) for m, v in scores["test"].items()}},
        "baseline": {"test": baseline.mean},
        "baseline_method": BASELINE,
        "time_s": round(sum(r["time_s"] for r in runs), 3),
    }
    ctx.log.info("task", task=task.task.name, median=result["median"], baseline=baseline.mean, time_s=result["time_s"])
    if task.task.pairs_dropped:
        ctx.log.info(
            "training pairs dropped: their query is a test query's text",
            task=task.task.name,
            dropped=task.task.pairs_dropped,
            kept=len(task.task.pairs),
        )
    if result["queries_left_out"]:
        ctx.log.info(
            "test queries left out: no relevant document in their qrels",
            task=task.task.name,
            left_out=result["queries_left_out"],
            scored=result["queries_scored"],
        )
    return result


def bm25_scores(task: RetrievalTask) -> Scores:
    """BM25's scores on the task's test queries, over its corpus (bm25.py)."""
    from cram.stages.retrieval import bm25
    from cram.stages.retrieval.metrics import score_run
    from cram.stages.retrieval.tuning import TOP_K

    ids = list(task.corpus)
    index = bm25.index([doc.full_text for doc in task.corpus.values()])
    run = {}
    for query, text in task.queries.items():
        found, scores = bm25.search(index, text, TOP_K)
        run[query] = {ids[d]: float(s) for d, s in zip(found, scores)}
    return score_run(run, task.qrels)


def embedder_meta(task: RetrievalLoaded, buckets: tuple[int, ...], tokenizer: dict) -> dict[str, Any]:
    """The embedder.json fields a retrieval task's kept seeds share (`tokenizer`: classifier.json's)."""
    settings = task.settings
    return {
        "kind": "embedder",
        "task": task.task.name,
        "task_kind": task.config.kind,
        "pooling": settings.pooling,
        "normalize": True,
        "max_length": settings.max_length,
        "query_max_length": settings.query_max_length,
        "buckets": list(buckets),
        "tokenizer": tokenizer,
        "metric": METRICS[0],
    }


def _rounded(means: dict[str, float]) -> dict[str, float]:
    return {f"test_{m}": round(v, 4) for m, v in means.items()}
