"""A token-classification task in evaluate: its folder read and encoded (`load`), a seed fine-tuned and scored on
validation and test (`tag_seed`), the task's entry of results.json (`tag_result`: medians, the seed validation
chooses, both baselines) and what its kept taggers' classifier.json holds (`tagger_meta`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from cram.stages.tagging.reading import Sentences, Tagged, read_task
from cram.stages.tagging.scores import baselines, entity_scores
from cram.stages.tagging.tuning import TAGGER_OPTIMIZER
from cram.stages.tagging.windows import Rows, spaced, windowed

if TYPE_CHECKING:
    from cram.stages import Context
    from cram.stages.shared.tokenizer import Tokenizer
    from cram.stages.tagging.tuning import Tagger
    from cram.stages.tasks.config import TaskConfig, TaskSettings, Tuning

METRICS = ("f1", "precision", "recall", "accuracy")  # entity micro F1 first: the keeper's and the headline's
SCORED = ("validation", "test")  # validation first: the seed kept is the one validation scores best
SETTINGS = ("batch_size", "warmup", "weight_decay", "dropout", "buckets")


@dataclass(frozen=True)
class TagTask:
    """What the keeper reads of a task (`Scored`): its name, its metrics, and the splits scored in order."""

    name: str
    metrics: tuple[str, ...]
    tests: dict[str, Sentences]


@dataclass(frozen=True)
class TagLoaded:
    """A token-classification task ready to fine-tune: its entry, its data, its settings and its rows."""

    config: TaskConfig
    task: TagTask
    settings: TaskSettings
    data: Tagged
    rows: dict[str, Rows]  # train, validation, test


def load(task: TaskConfig, index: int, settings: TaskSettings, tokenizer: Tokenizer, special: dict) -> TagLoaded:
    """Task `index` read (`read_task`) and each split's words encoded into rows of `settings.max_length`."""
    data = read_task(task.path, f"evaluate.tasks[{index}]")
    ids = {label: i for i, label in enumerate(data.labels)}
    rows = {}
    for name, split in data.splits.items():
        encoded = tokenizer.encode([w for words in split.words for w in spaced(words)])
        tags = [[ids[t] for t in sentence] for sentence in split.tags]
        rows[name] = windowed(encoded, [len(w) for w in split.words], tags, special, settings.max_length)
    tests = {name: data.splits[name] for name in SCORED}
    return TagLoaded(task, TagTask(task.name, METRICS, tests), settings, data, rows)


def tag_seed(tagger: Tagger, loaded: TagLoaded, seed: int, ctx: Context, keep: Callable | None = None) -> dict:
    """One seed fine-tuned and scored on validation and test: its run record; `keep` gets the params and it."""
    began = time.perf_counter()
    task, settings = loaded.task, loaded.settings
    log = ctx.log.bind(task=task.name, seed=seed)
    schedule = (settings.epochs, settings.lr, seed)
    params, loss = tagger.train(
        len(loaded.data.labels), loaded.rows["train"], schedule, f"{task.name} seed {seed}", log
    )
    scores, by_type = {}, {}
    for split in SCORED:
        ids, _ = tagger.tags(params, loaded.rows[split])
        predicted = [[loaded.data.labels[i] for i in sentence] for sentence in ids]
        found = entity_scores(loaded.data.splits[split].tags, predicted)
        by_type[split] = found.pop("by_type")
        scores[split] = found
    flat = {f"{s}_{m}": round(v, 4) for s, ms in scores.items() for m, v in ms.items()}
    ctx.log.info("finetuned", task=task.name, seed=seed, train_loss=round(loss, 4), **flat)
    run = {"train_loss": loss, "scores": scores, "by_type": by_type, "time_s": time.perf_counter() - began}
    run["meta"] = {"head": tagger.head}  # the kept tagger's head: its model's family's (model/tagger.py)
    if keep is not None:
        keep(params, run)
    return run


def tag_result(loaded: TagLoaded, seeds: list[int], runs: list[dict], tuning: Tuning, ctx: Context) -> dict:
    """The task's results from its seeds' runs (in seed order): per-seed scores and medians on validation and
    test, each type's median F1, the seed validation chooses and its test scores, both baselines."""
    data, settings = loaded.data, loaded.settings
    scores = {s: {m: [r["scores"][s][m] for r in runs] for m in METRICS} for s in SCORED}
    chosen = max(range(len(runs)), key=lambda i: (runs[i]["scores"]["validation"]["f1"], -i))
    train = (data.splits["train"].words, data.splits["train"].tags)
    found = {s: baselines(train, data.splits[s].words, data.splits[s].tags) for s in SCORED}
    result = {
        "kind": loaded.config.kind,
        "metrics": list(METRICS),
        "labels": list(data.labels),
        "scheme": data.scheme,
        "repaired": data.repaired,  # I- tags that continued nothing, read as B- (conlleval's reading), per file
        "untrained_types": data.untrained(),
        "validation": "carved from the training file" if data.carved else "file",
        "sentences": {s: len(split.words) for s, split in data.splits.items()},
        "rows": {s: len(rows.ids) for s, rows in loaded.rows.items()},
        "epochs": settings.epochs,
        "lr": settings.lr,
        "max_length": settings.max_length,
        "seeds": seeds,
        "settings": {**{k: _listed(getattr(tuning, k)) for k in SETTINGS}, **TAGGER_OPTIMIZER},
        "train_loss": [r["train_loss"] for r in runs],
        "scores": scores,
        "median": {s: {m: float(np.median(v)) for m, v in ms.items()} for s, ms in scores.items()},
        "by_type": {s: _median_types([r["by_type"][s] for r in runs]) for s in SCORED},
        "chosen": {"seed": seeds[chosen], "by": "validation f1", **runs[chosen]["scores"]},
        "baseline": {s: _plain(found[s]["dictionary"]) for s in SCORED},  # the headline's: the dictionary's
        "baselines": {s: {name: _plain(b) for name, b in found[s].items()} for s in SCORED},
        "figures": {"chosen_f1": round(runs[chosen]["scores"]["test"]["f1"], 4)},
        "time_s": round(sum(r["time_s"] for r in runs), 3),
    }
    ctx.log.info("task", task=loaded.task.name, median=result["median"], baseline=result["baseline"])
    return result


def _plain(scores: dict) -> dict:
    return {k: v for k, v in scores.items() if k != "by_type"}


def _listed(value: object) -> object:
    """Tuples as lists: results read back from results.json compare equal."""
    return list(value) if isinstance(value, tuple) else value


def _median_types(runs: list[dict]) -> dict:
    """Each type's median precision, recall and F1 over the seeds, and its support."""
    types = sorted({t for run in runs for t in run})
    empty = {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
    return {
        t: {
            **{m: float(np.median([run.get(t, empty)[m] for run in runs])) for m in ("precision", "recall", "f1")},
            "support": max(run.get(t, empty)["support"] for run in runs),
        }
        for t in types
    }


def tagger_meta(loaded: TagLoaded, tuning: Tuning, tokenizer: dict) -> dict:
    """The classifier.json fields a task's kept taggers share: the task, its tags, how its texts are cut into
    rows and batched, and the run's tokenizer; each seed's run adds its head (`tag_seed`)."""
    return {
        "task": loaded.task.name,
        "kind": loaded.config.kind,
        "labels": list(loaded.data.labels),
        "regression": False,
        "per_token": True,  # a tag per token: what export and predict read it by (stages/kept/, cram predict)
        "num_outputs": len(loaded.data.labels),
        "metric": METRICS[0],
        "text_fields": ["text"],
        "max_length": loaded.settings.max_length,
        "buckets": list(tuning.buckets),
        "scheme": "IOB2",
        "pooling": "first",  # none: every position is read (the field the classifiers' checks ask for)
        "head_width": 0,
        "tokenizer": tokenizer,
    }
