"""The classification kind (`kind = "heldout-topic"`: tokenize's held-out articles' topics; `"glue"`; `"custom"`:
CSV / JSON-lines files) as the evaluate side's orchestration calls it (stages/tasks/kind.py): its entry's
checks, what it reads, its fine-tunes (`Classifiers`), its results and the GLUE average, and what its kept
classifiers' classifier.json holds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cram.stages import StageError
from cram.stages.finetuning import finetune
from cram.stages.finetuning.metrics import METRICS, REGRESSION_METRICS
from cram.stages.shared.files import files_under
from cram.stages.shared.taskfiles import GLUE
from cram.stages.tasks.kind import Start, TokenizeSettings, count

if TYPE_CHECKING:
    from cram.stages import Context, Upstream
    from cram.stages.finetuning.finetune import ClassificationLoaded, Graph, Tuner
    from cram.stages.finetuning.tasks import Task
    from cram.stages.shared.precision import Difference, Precision
    from cram.stages.shared.tokenizer import Tokenizer
    from cram.stages.tasks.config import TaskConfig, TaskSettings, Tuning

_TOPIC_REMEDY = "drop this task, or give tokenize labelled documents to hold out"


class Classification:
    """Classification and regression tasks: a fresh head per seed, their metrics beside the majority class."""

    name = "classification"
    kinds = ("heldout-topic", "glue", "custom")
    fields = ("text_fields", "label_field", "metrics")
    unkeyed = ()  # in the key from the start
    lengths = ()
    takes_head = True

    def check_entry(self, task: TaskConfig) -> None:
        if task.kind == "glue" and task.name not in GLUE:
            raise ValueError(f"name: {task.name!r} is no GLUE task; choose one of {', '.join(GLUE)}")
        if task.kind != "custom":
            if task.text_fields or task.metrics:
                raise ValueError(f"text_fields, metrics: only a custom task takes them; {task.kind} sets its own")
            return
        if not task.path:
            raise ValueError("path: a custom task needs the folder holding its train and test files")
        if len(task.text_fields) not in (1, 2):
            raise ValueError(f"text_fields: {list(task.text_fields)} must name one text field or two (a pair)")
        if not task.metrics:
            raise ValueError(f"metrics: a custom task needs at least one of {', '.join(METRICS)}")
        unknown = [m for m in task.metrics if m not in METRICS]
        if unknown:
            raise ValueError(f"metrics: unknown metric {unknown[0]!r}; choose from {', '.join(METRICS)}")
        if len({m in REGRESSION_METRICS for m in task.metrics}) > 1:
            raise ValueError(
                f"metrics: {list(task.metrics)} mixes regression ({', '.join(REGRESSION_METRICS)}) and classification"
            )

    def settings(self, task: TaskConfig, stage: TaskSettings) -> TaskSettings:
        return stage

    def linked(self, task: TaskConfig, init_pooling: str | None) -> TaskConfig:
        return task  # its pooling is the stage's (`Config.linked`)

    def defaults(self, task: TaskConfig, lengths: tuple[int, ...]) -> dict[str, int | float]:
        return {}  # the stage's: cramming's GLUE rules

    def files(self, task: TaskConfig) -> list[Path]:
        """A custom task's folder's files, or a local GLUE folder's."""
        root = Path(task.path).expanduser()
        return files_under(root) if task.kind != "heldout-topic" and task.path and root.is_dir() else []

    def plan_gap(
        self,
        task: TaskConfig,
        settings: TaskSettings,
        tokenize: TokenizeSettings,
        buckets: tuple[int, ...],
        positions: int | None,
    ) -> str | None:
        return topic_gap(tokenize) if task.kind == "heldout-topic" else None

    def gap(
        self, task: TaskConfig, settings: TaskSettings, tokenize: Upstream, buckets: tuple[int, ...], positions: int
    ) -> str | None:
        """No held-out articles, or none with a topic."""
        from cram.stages.finetuning.tasks import has_topics

        heldout = tokenize.outputs.get("heldout")
        if heldout is None:
            return "classifies the articles tokenize holds out, and it held out none"
        labelled = has_topics(tokenize.dir / heldout)
        return None if labelled else "needs labelled documents, and the held-out articles have no labels"

    def check(self, task: TaskConfig, index: int, settings: TaskSettings, gap: str | None) -> None:
        """A local task's files read in full (GLUE from the hub is fetched when the stage runs, not to check a
        config); a held-out-topic task's `gap` refused."""
        if task.kind != "heldout-topic":
            if task.path:
                finetune.load_task(task, index, None)
        elif gap:
            raise StageError(f"evaluate.tasks[{index}]: kind '{task.kind}' {gap}; {_TOPIC_REMEDY}")

    def steps(self, task: TaskConfig, index: int, settings: TaskSettings, batch_size: int) -> str:
        """epochs x ceil(train examples / batch_size), where its local files tell them."""
        if task.kind == "heldout-topic":
            return "steps known after tokenize"
        if not task.path:
            return "steps known once fetched from the hub"
        epochs = settings.epochs
        batches = math.ceil(len(finetune.load_task(task, index, None).train.labels) / batch_size)
        steps = f"{count(epochs * batches, 'step')} ({count(epochs, 'epoch')} x "
        return steps + f"{count(batches, 'batch', 'batches')} of {batch_size})"

    def load(
        self, task: TaskConfig, index: int, settings: TaskSettings, tokenize: Upstream, tokenizer: Tokenizer
    ) -> ClassificationLoaded:
        found = finetune.load_task(task, index, tokenize)
        encoded = finetune.encode(found, tokenizer, tokenize.outputs["special_ids"], settings.max_length)
        return finetune.ClassificationLoaded(task, found, encoded, settings)

    def cost(self, loaded: ClassificationLoaded) -> float:
        return len(loaded.data.train[0]) * loaded.settings.epochs

    def runner(self, loaded: list[ClassificationLoaded], start: Start) -> Classifiers:
        return Classifiers(start, finetune.graphs(loaded, start.tuning))

    def result(
        self, loaded: ClassificationLoaded, seeds: list[int], runs: list[dict], tuning: Tuning, ctx: Context
    ) -> dict:
        return finetune.task_result(tuning, loaded, seeds, runs, ctx)

    def totals(self, tasks: dict[str, dict]) -> dict[str, Any]:
        """The GLUE average over every GLUE evaluation set scored (MNLI's two count apart)."""
        from cram.stages.finetuning.tasks import glue_average

        glue = {
            f"{name}/{test}": r["median"][test]
            for name, r in tasks.items()
            if r["kind"] == "glue"
            for test in r["median"]
        }
        return {"glue": {"average": glue_average(glue), "sets": sorted(glue)}} if glue else {}

    def meta(self, loaded: ClassificationLoaded, tuning: Tuning, tokenizer: dict) -> dict:
        return describe(tuning, loaded.config, loaded.task, loaded.settings.max_length, tokenizer)


@dataclass
class Classifiers:
    """The classification tasks' fine-tunes in a stage: a fine-tuner per precision, made once each, and the
    graphs (head shape and bucket) the canary checks."""

    start: Start
    shapes: list[Graph]
    made: dict[Precision, Tuner] = field(default_factory=dict)

    def tuner(self, precision: Precision) -> Tuner:
        if precision not in self.made:
            self.made[precision] = self._make(precision, self.start.tuning.compile)
        return self.made[precision]

    def _make(self, precision: Precision, compile: bool) -> Tuner:
        start = self.start
        settings = dataclasses.replace(start.tuning, compile=compile)
        return finetune.Tuner.make(
            settings, start.cfg, start.params, start.special, start.device, precision, start.attention
        )

    def graphs(self) -> int:
        return len(self.shapes)

    def canary(self, precision: Precision, steps: int, tolerance: float) -> Difference:
        eager = self._make(precision, compile=False)
        return self.tuner(precision).canary(eager, self.shapes, steps, self.start.seed, tolerance)

    def run_seed(
        self, precision: Precision, loaded: ClassificationLoaded, seed: int, ctx: Context, keep: Callable
    ) -> dict:
        return finetune.finetune_seed(self.tuner(precision), loaded, seed, ctx, keep)


def describe(tuning: Tuning, task_cfg: TaskConfig, task: Task, max_length: int, tokenizer: dict) -> dict:
    """The classifier.json fields a task's kept seeds share: the task, its labels and text fields, how
    its examples were cut (at `max_length`, the task's) and batched, the head, and the run's tokenizer
    (`tokenizer`: `kept.tokenizer_fields`)."""
    fields = {"custom": task_cfg.text_fields, "glue": GLUE[task.name].hf_text if task_cfg.kind == "glue" else ()}
    return {
        "task": task.name,
        "kind": task_cfg.kind,
        "labels": list(task.label_names),
        "regression": task.regression,
        "num_outputs": task.num_outputs,
        "metric": task.metrics[0],
        "text_fields": list(fields.get(task_cfg.kind) or ("text",)),
        "max_length": max_length,
        "buckets": list(tuning.buckets),
        "pooling": tuning.pooling,
        "head": tuning.head,
        "head_width": tuning.head_width,
        "tokenizer": tokenizer,
    }


def topic_gap(tokenize: TokenizeSettings) -> str | None:
    """Why tokenize's settings (its Config) leave a held-out-topic task no articles to classify; None
    when they do not."""
    if tokenize.task_text == "only":
        return 'classifies the articles tokenize holds out, and tokenize.task_text = "only" reads no corpus'
    if tokenize.heldout_fraction == 0:
        return "classifies the articles tokenize holds out, and tokenize.heldout_fraction = 0 holds out none"
    plain_text = tokenize.corpus.kind in ("files", "package") and tokenize.corpus.format == "text"
    if not tokenize.corpus.label_field or plain_text:
        return "needs labelled documents, and the corpus has no labels (tokenize.corpus.label_field, or text files)"
    return None


CLASSIFICATION = Classification()
