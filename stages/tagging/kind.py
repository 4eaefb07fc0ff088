"""The token-classification kind (`kind = "token-classification"`: a folder of CoNLL, JSON-lines or `datasets`
files) as the evaluate side's orchestration calls it (stages/tasks/kind.py): its entry's checks, what it reads,
its fine-tunes (`Taggers`), its results beside the all-O and dictionary baselines, and what its kept taggers'
classifier.json holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cram.stages.shared.files import files_under
from cram.stages.tasks.kind import Start, TokenizeSettings, count

if TYPE_CHECKING:
    from cram.stages import Context, Upstream
    from cram.stages.shared.precision import Difference, Precision
    from cram.stages.shared.tokenizer import Tokenizer
    from cram.stages.tagging.results import TagLoaded
    from cram.stages.tagging.tuning import Tagger, TagGraph
    from cram.stages.tasks.config import TaskConfig, TaskSettings, Tuning


class Tagging:
    """Token-classification tasks: a fresh token head per seed, entity F1 beside the all-O and dictionary taggers."""

    name = "tagging"
    kinds = ("token-classification",)
    fields = ()  # name, path and the shared settings alone
    unkeyed = ()
    lengths = ()
    takes_head = False

    def check_entry(self, task: TaskConfig) -> None:
        if not task.path:
            raise ValueError("path: a token-classification task needs the folder holding its train and test files")

    def settings(self, task: TaskConfig, stage: TaskSettings) -> TaskSettings:
        return stage

    def linked(self, task: TaskConfig, init_pooling: str | None) -> TaskConfig:
        return task

    def defaults(self, task: TaskConfig, lengths: tuple[int, ...]) -> dict[str, int | float]:
        return {}  # the stage's: cramming's GLUE rules

    def files(self, task: TaskConfig) -> list[Path]:
        root = Path(task.path).expanduser()
        return files_under(root) if root.is_dir() else []

    def plan_gap(
        self,
        task: TaskConfig,
        settings: TaskSettings,
        tokenize: TokenizeSettings,
        buckets: tuple[int, ...],
        positions: int | None,
    ) -> str | None:
        return None

    def gap(
        self, task: TaskConfig, settings: TaskSettings, tokenize: Upstream, buckets: tuple[int, ...], positions: int
    ) -> str | None:
        return None

    def check(self, task: TaskConfig, index: int, settings: TaskSettings, gap: str | None) -> None:
        """Its folder read in full: every file's tags checked."""
        from cram.stages.tagging.reading import read_task

        read_task(task.path, f"evaluate.tasks[{index}]")

    def steps(self, task: TaskConfig, index: int, settings: TaskSettings, batch_size: int) -> str:
        """epochs x ceil(training sentences / batch_size): a sentence past max_length adds a row per window."""
        from cram.stages.tagging.reading import read_task

        sentences = len(read_task(task.path, f"evaluate.tasks[{index}]").splits["train"].words)
        batches = math.ceil(sentences / batch_size)
        steps = f"{count(settings.epochs * batches, 'step')} ({count(settings.epochs, 'epoch')} x "
        return steps + f"{count(batches, 'batch', 'batches')} of {batch_size}; more where a sentence is windowed)"

    def load(
        self, task: TaskConfig, index: int, settings: TaskSettings, tokenize: Upstream, tokenizer: Tokenizer
    ) -> TagLoaded:
        from cram.stages.tagging.results import load

        return load(task, index, settings, tokenizer, tokenize.outputs["special_ids"])

    def cost(self, loaded: TagLoaded) -> float:
        return len(loaded.rows["train"].ids) * loaded.settings.epochs

    def runner(self, loaded: list[TagLoaded], start: Start) -> Taggers:
        from cram.stages.tagging.tuning import TaggedSplits, tag_graphs
        from cram.stages.tasks.config import task_seeds

        tasks = [
            TaggedSplits(
                len(t.data.labels),
                t.rows["train"],
                t.settings.epochs,
                task_seeds(start.seed, t.settings),
                t.rows["test"],
            )
            for t in loaded
        ]
        return Taggers(start, tag_graphs(tasks, start.tuning))

    def result(self, loaded: TagLoaded, seeds: list[int], runs: list[dict], tuning: Tuning, ctx: Context) -> dict:
        from cram.stages.tagging.results import tag_result

        return tag_result(loaded, seeds, runs, tuning, ctx)

    def totals(self, tasks: dict[str, dict]) -> dict[str, Any]:
        return {}

    def meta(self, loaded: TagLoaded, tuning: Tuning, tokenizer: dict) -> dict:
        from cram.stages.tagging.results import tagger_meta

        return tagger_meta(loaded, tuning, tokenizer)


@dataclass
class Taggers:
    """The token-classification tasks' fine-tunes in a stage: a tagger per precision, made once each, and the
    graphs the canary checks (the steps' packed row counts, the predictions' buckets)."""

    start: Start
    shapes: list[TagGraph]
    made: dict[Precision, Tagger] = field(default_factory=dict)

    def tagger(self, precision: Precision) -> Tagger:
        from cram.stages.tagging.tuning import Tagger

        if precision not in self.made:
            self.made[precision] = Tagger.make(self.start, precision, self.start.tuning.compile)
        return self.made[precision]

    def graphs(self) -> int:
        return len(self.shapes)

    def canary(self, precision: Precision, steps: int, tolerance: float) -> Difference:
        from cram.stages.shared.precision import worst_graph
        from cram.stages.tagging.tuning import Tagger

        tagger, eager = self.tagger(precision), Tagger.make(self.start, precision, compile=False)
        seed = self.start.seed
        return worst_graph(self.shapes, lambda g: tagger.graph_difference(eager, g, steps, seed), tolerance)

    def run_seed(self, precision: Precision, loaded: TagLoaded, seed: int, ctx: Context, keep: Callable) -> dict:
        from cram.stages.tagging.results import tag_seed

        return tag_seed(self.tagger(precision), loaded, seed, ctx, keep)


TAGGING = Tagging()
