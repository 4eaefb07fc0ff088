"""A retrieval task in the evaluate stage: loaded from its config entry (its validation split carved from
its training pairs, BM25's runs made), one seed fine-tuned and searched, dense and fused with BM25, and its
results.json entry over the seeds beside BM25's scores and the encoder's own as it was, as
`finetuning/finetune.py` does a classification task's (`finetune_seed`, `task_result`).

    task = load_task(task_cfg, index, tokenize, settings)
    ready = loaded(task_cfg, task, tokenizer, special, settings)
    run = retrieve_seed(embedder, ready, seed, SeedRun(ctx, scratch, untuned), keep)   # per seed
    result = retrieval_result(ready, seeds, runs, ctx)                                 # per task
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from cram.stages import StageError
from cram.stages.retrieval.metrics import METRICS, Qrels, Run, score_run

if TYPE_CHECKING:
    from pathlib import Path

    from cram.stages import Context, Upstream
    from cram.stages.retrieval.beir import Document
    from cram.stages.retrieval.choosing import Judged
    from cram.stages.retrieval.metrics import Scores
    from cram.stages.retrieval.pairs import RetrievalTask
    from cram.stages.retrieval.settings import RetrievalSettings
    from cram.stages.retrieval.tuning import EmbeddingTuner, RetrievalLoaded
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
    from cram.stages.retrieval.validation import carve

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
    pairs, validation = carve(task.pairs, task.corpus, settings.batch_size)
    task = dataclasses.replace(task, pairs=pairs, validation=validation)
    distinct_batches([p.texts for p in task.pairs], settings.batch_size, 0, f"{where} ({task.source} pairs)")
    return task


def loaded(
    task_cfg: TaskConfig, task: RetrievalTask, tokenizer: Tokenizer, special: dict, settings: RetrievalSettings
) -> RetrievalLoaded:
    """The task tokenized, and BM25's runs on its queries made now, before any seed: the baseline, and the
    lexical half of every hybrid (its index is the one that grows with the corpus)."""
    from cram.stages.retrieval.tuning import RetrievalLoaded, encode_pairs

    data = encode_pairs(task, tokenizer, special, settings)
    return RetrievalLoaded(task_cfg, task, data, settings, bm25_runs(task))


def with_mined_negatives(loaded: RetrievalLoaded, embedder: EmbeddingTuner) -> RetrievalLoaded:
    """The task with `negatives_per_pair` mined hard negatives in each pair (mining.py), `embedder`'s start
    encoding the texts: corpus documents, never the query's own positives; the pairs file's own negatives give
    way."""
    import numpy as np

    from cram.stages.retrieval.beir import Pair
    from cram.stages.retrieval.loss import distinct_batches
    from cram.stages.retrieval.mining import Encoded, mine

    task, data, params = loaded.task, loaded.data, embedder.params
    corpus_rows, corpus_lengths = data.corpus
    encoded = Encoded(
        queries=embedder.embedded(params, *data.queries),
        positives=embedder.embedded(params, *data.positives),
        documents=lambda index: embedder.embedded(params, corpus_rows, corpus_lengths, np.asarray(index)),
    )
    texts = [doc.full_text for doc in task.corpus.values()]
    n = loaded.settings.negatives_per_pair
    mined = mine(task.pairs, texts, encoded, per_pair=n)
    pairs = tuple(Pair(p.query, p.positive, tuple(texts[d] for d in ds)) for p, ds in zip(task.pairs, mined.negatives))
    # refused here, before any seed, where n negatives a pair leave no batch without a text twice
    distinct_batches([p.texts for p in pairs], loaded.settings.batch_size, 0, f"{task.name}: with {n} mined negatives")
    flat = [d for ds in mined.negatives for d in ds]  # pair by pair, as EncodedPairs.negatives holds them
    negatives = ([corpus_rows[d] for d in flat], corpus_lengths[flat])
    data = dataclasses.replace(data, texts=[p.texts for p in pairs], negatives=negatives)
    stats = {"false_negatives_dropped": mined.false_negatives_dropped, "random_fallback": mined.random_fallback}
    return dataclasses.replace(loaded, task=dataclasses.replace(task, pairs=pairs), data=data, mining=stats)


def judged(runs: dict[str, Run], loaded: RetrievalLoaded) -> Judged:
    """An encoder's dense runs of the task (`EmbeddingTuner.runs`) judged beside BM25's (`choosing.judge`), by the
    task's identical-id rule."""
    from cram.stages.retrieval.choosing import judge

    return judge(runs, loaded.lexical, qrels_of(loaded.task), loaded.settings.ignore_identical_ids)


def qrels_of(task: RetrievalTask) -> dict[str, Qrels]:
    """The judgements by split: the test's, and the validation split's where the task has one."""
    return {"test": task.qrels, **({"validation": task.validation.qrels} if task.validation is not None else {})}


def retrieve_seed(
    embedder: EmbeddingTuner, task: RetrievalLoaded, seed: int, run: SeedRun, keep: Callable | None = None
) -> dict:
    """Fine-tune one seed of a retrieval task from the pretrained encoder and score it, dense and hybrid, on
    the test and validation queries; `keep`, when given, is offered the fine-tuned encoder, or the encoder as
    it was (`run.untuned`) where that scores better on validation (choosing.py)."""
    from cram.stages.retrieval.choosing import offers_untuned, selection

    began = time.perf_counter()
    name, ctx = task.task.name, run.ctx
    log = ctx.log.bind(task=name, seed=seed)
    params, loss = embedder.train(task, seed, f"evaluate task {name}", f"{name} seed {seed}", log)
    dense = embedder.runs(params, task, run.scratch)
    tuned = judged(dense, task)
    ctx.log.info("finetuned", task=name, seed=seed, train_loss=round(loss, 4), **_rounded(tuned))
    chosen = selection(tuned, run.untuned)
    record = {
        "train_loss": loss,
        **tuned.record(),
        "queries_scored": tuned.queries_scored,
        "queries_left_out": tuned.queries_left_out,
        "time_s": time.perf_counter() - began,
    }
    untuned = offers_untuned(tuned, run.untuned)
    record["scores"] = {"selection": chosen, **record["scores"]}
    record["offers"] = "untuned" if untuned else "fine-tuned"
    record["selected_by"] = "validation" if "validation" in tuned.dense else "none: no validation split"
    record["untuned"] = run.untuned.record()
    if task.mining is not None:
        record["mining"] = task.mining
    if keep is not None:
        kept, offered = (embedder.params, run.untuned) if untuned else (params, tuned)
        meta = {"encoder": record["offers"], "fusion": offered.record()["hybrid"]["fusion"]}
        keep(kept, {"scores": {"selection": chosen, **offered.dense}, "meta": meta})
    return record


@dataclass(frozen=True)
class SeedRun:
    """What every seed of a task shares: the run's context, the scratch folder for the corpus embeddings, and
    the encoder as it was, judged (what a seed must beat on validation to be kept)."""

    ctx: Context
    scratch: Path
    untuned: Judged


def retrieval_result(task: RetrievalLoaded, seeds: list[int], runs: list[dict], ctx: Context) -> dict[str, Any]:
    """A retrieval task's results from its seeds' runs (in seed order): per-seed scores and medians, dense and
    hybrid, on test and validation; the encoder as it was; BM25; which seed is kept, and as what."""
    from cram.stages.tasks.config import FINETUNE_OPTIMIZER

    settings, validation = task.settings, task.task.validation
    baseline = score_run(task.lexical["test"], task.task.qrels, settings.ignore_identical_ids)
    result = {
        "kind": task.config.kind,
        "metrics": list(METRICS),
        "train_pairs": len(task.task.pairs),
        "pairs_source": task.task.source,
        "pairs_dropped": task.task.pairs_dropped,
        "validation_queries": 0 if validation is None else len(validation.queries),
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
        "ignore_identical_ids": settings.ignore_identical_ids,
        "seeds": seeds,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in FINETUNE_OPTIMIZER.items()},
        "train_loss": [r["train_loss"] for r in runs],
        **_by_seed(runs, lambda r: r["scores"]),
        "validation": _by_seed(runs, lambda r: r["scores"], "validation"),
        "hybrid": {"fusion": [r["hybrid"]["fusion"] for r in runs], **_by_seed(runs, lambda r: r["hybrid"])},
        "untuned": runs[0]["untuned"],
        "hard_negatives": {
            "source": settings.hard_negatives,
            **({"per_pair": settings.negatives_per_pair} if settings.hard_negatives == "mined" else {}),
            **runs[0].get("mining", {}),
        },
        "kept": _kept(seeds, runs),
        "baseline": {"test": baseline.mean},
        "baseline_method": BASELINE,
        "time_s": round(sum(r["time_s"] for r in runs), 3),
    }
    result["figures"] = {
        "hybrid": round(result["hybrid"]["median"]["test"][METRICS[0]], 4),
        "untuned": round(result["untuned"]["scores"]["test"][METRICS[0]], 4),
    }
    _say(task, result, ctx)
    return result


def _by_seed(runs: list[dict], part: Callable[[dict], dict], split: str = "test") -> dict[str, Any]:
    """`part` of each run on `split` as per-seed lists and medians: {"scores": {split: ...}, "median": {...}}."""
    import numpy as np

    if split not in part(runs[0]):
        return {}
    scores = {m: [part(r)[split][m] for r in runs] for m in METRICS}
    return {"scores": {split: scores}, "median": {split: {m: float(np.median(v)) for m, v in scores.items()}}}


def _kept(seeds: list[int], runs: list[dict]) -> dict[str, Any]:
    """The seed the keeper keeps (the best selection score, the lower seed of equals: `kept.best_jobs`), and
    whether it offered its fine-tune or the encoder as it was."""
    best = max(range(len(runs)), key=lambda k: (runs[k]["scores"]["selection"][METRICS[0]], -k))
    return {"seed": seeds[best], "encoder": runs[best]["offers"], "by": runs[best]["selected_by"]}


def _say(task: RetrievalLoaded, result: dict, ctx: Context) -> None:
    name = task.task.name
    ctx.log.info(
        "task", task=name, median=result["median"], hybrid=result["figures"]["hybrid"],
        untuned=result["figures"]["untuned"], baseline=result["baseline"]["test"], time_s=result["time_s"],
    )  # fmt: skip
    if result["kept"]["encoder"] == "untuned":
        ctx.log.info("kept the encoder as it was: no fine-tuned seed beat it on the validation queries", task=name)
    if not result["validation_queries"]:
        ctx.log.info(
            "no validation split: too few training queries; the first seed is kept, fused half and half", task=name
        )
    if task.task.pairs_dropped:
        ctx.log.info(
            "training pairs dropped: their query is a test query's text",
            task=name,
            dropped=task.task.pairs_dropped,
            kept=len(task.task.pairs),
        )
    if result["queries_left_out"]:
        ctx.log.info(
            "test queries left out: no relevant document in their qrels",
            task=name,
            left_out=result["queries_left_out"],
            scored=result["queries_scored"],
        )


def bm25_runs(task: RetrievalTask) -> dict[str, Run]:
    """BM25's runs (bm25.py), by split: the test queries over the corpus; the validation queries over the
    corpus and the validation positives it lacks."""
    runs = {"test": _bm25_run(task.corpus, task.queries)}
    if task.validation is not None:
        runs["validation"] = _bm25_run({**task.corpus, **task.validation.documents}, task.validation.queries)
    return runs


def bm25_scores(task: RetrievalTask) -> Scores:
    """BM25's scores on the task's test queries, over its corpus."""
    return score_run(_bm25_run(task.corpus, task.queries), task.qrels)


def _bm25_run(corpus: dict[str, Document], queries: dict[str, str]) -> Run:
    """Each query's TOP_K documents of `corpus` by BM25."""
    from cram.stages.retrieval import bm25
    from cram.stages.retrieval.tuning import TOP_K

    ids, index = list(corpus), bm25.index(doc.full_text for doc in corpus.values())
    run = {}
    for query, text in queries.items():
        found, scores = bm25.search(index, text, TOP_K)
        run[query] = {ids[d]: float(s) for d, s in zip(found, scores)}
    return run


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


def _rounded(judged: Judged) -> dict[str, float]:
    return {f"{split}_{m}": round(v, 4) for split, means in judged.dense.items() for m, v in means.items()}
