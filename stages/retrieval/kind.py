"""The retrieval kind (`kind = "retrieval"`: a BEIR folder; `"heldout-retrieval"`: tokenize's held-out
documents' titles against their texts) as the evaluate side's orchestration calls it (stages/tasks/kind.py):
its entry's checks and settings, what it reads, its contrastive fine-tunes (`Retrievers`) and its results.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cram.stages import StageError
from cram.stages.kept.batches import bucket
from cram.stages.retrieval.settings import (
    BEIR_DEFAULTS,
    BEIR_MAX_LENGTH,
    EMBEDDING_POOLINGS,
    MAX_NEGATIVES_PER_PAIR,
    QUERY_MAX_LENGTH,
    RETRIEVAL_BATCH_SIZE,
    RetrievalSettings,
)
from cram.stages.shared.files import files_under
from cram.stages.tasks.kind import Start, TokenizeSettings, count

if TYPE_CHECKING:
    from cram.stages import Context, Upstream
    from cram.stages.retrieval.choosing import Judged
    from cram.stages.retrieval.tuning import EmbedderGraph, EmbeddingTuners, RetrievalLoaded
    from cram.stages.shared.precision import Difference, Precision
    from cram.stages.shared.tokenizer import Tokenizer
    from cram.stages.tasks.config import TaskConfig, TaskSettings, Tuning

_REMEDY = "drop this task, or hold documents out"


class Retrieval:
    """Retrieval tasks: a contrastive fine-tune per seed, nDCG@10, Recall@100 and MRR@10 beside BM25's."""

    name = "retrieval"
    kinds = ("retrieval", "heldout-retrieval")
    fields = (
        "pairs",
        "query_max_length",
        "batch_size",
        "pooling",
        "mini_batch_size",
        "hard_negatives",
        "negatives_per_pair",
        "ignore_identical_ids",
    )
    unkeyed = fields  # added after the stage's key was fixed: a config without a retrieval task keys as before
    lengths = ("query_max_length",)
    takes_head = False

    def check_entry(self, task: TaskConfig) -> None:
        if task.kind == "retrieval" and not task.path:
            raise ValueError("path: a retrieval task needs a BEIR folder (corpus.jsonl, queries.jsonl, qrels/test.tsv)")
        if task.kind == "heldout-retrieval" and (task.path or task.pairs):
            raise ValueError("path, pairs: a heldout-retrieval task reads tokenize's held-out documents alone")
        if task.query_max_length is not None and task.query_max_length < 3:
            raise ValueError(f"query_max_length: {task.query_max_length} must be >= 3 ([CLS], a token, [SEP])")
        if task.batch_size is not None and task.batch_size < 2:
            raise ValueError(f"batch_size: {task.batch_size} must be >= 2 (a pair's negatives are the batch's others)")
        if task.mini_batch_size is not None and task.mini_batch_size < 1:
            raise ValueError(f"mini_batch_size: {task.mini_batch_size} must be >= 1 (rows embedded at once)")
        if task.hard_negatives not in (None, "pairs", "mined"):
            raise ValueError(f'hard_negatives: {task.hard_negatives!r}; choose "pairs" or "mined"')
        if not 1 <= task.negatives_per_pair <= MAX_NEGATIVES_PER_PAIR:
            raise ValueError(
                f"negatives_per_pair: {task.negatives_per_pair} must be in 1..{MAX_NEGATIVES_PER_PAIR} "
                "(hard negatives a training pair takes)"
            )
        if task.negatives_per_pair > 1 and task.hard_negatives != "mined":
            raise ValueError(
                f'negatives_per_pair: {task.negatives_per_pair} needs hard_negatives = "mined" (a pairs file\'s '
                '"negative" gives one a pair)'
            )
        if task.pooling is not None and task.pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"pooling: {task.pooling!r}; choose one of {', '.join(EMBEDDING_POOLINGS)}")

    def settings(self, task: TaskConfig, stage: TaskSettings) -> RetrievalSettings:
        """`stage`'s, and retrieval's own, else its defaults (query length, batch, mean pooling)."""
        return RetrievalSettings(
            **dataclasses.asdict(stage),
            query_max_length=task.query_max_length or min(QUERY_MAX_LENGTH, stage.max_length),
            batch_size=task.batch_size or RETRIEVAL_BATCH_SIZE,
            pooling=task.pooling or "mean",
            mini_batch_size=task.mini_batch_size,
            hard_negatives=task.hard_negatives or "pairs",
            negatives_per_pair=task.negatives_per_pair,
            ignore_identical_ids=task.ignore_identical_ids,
        )

    def linked(self, task: TaskConfig, init_pooling: str | None) -> TaskConfig:
        """A task without a `pooling` takes "first" from pretrain.init's folder ("mean" is the default already:
        keys stay as they were)."""
        if task.pooling is None and init_pooling == "first":
            return dataclasses.replace(task, pooling="first")
        return task

    def defaults(self, task: TaskConfig, lengths: tuple[int, ...]) -> dict[str, int | float]:
        """A BEIR folder's (`BEIR_DEFAULTS`); a held-out retrieval task takes the stage's, as a topic task does."""
        if task.kind != "retrieval":
            return {}
        longest = max((n for n in lengths if n <= BEIR_MAX_LENGTH), default=BEIR_MAX_LENGTH)
        return {**BEIR_DEFAULTS, "max_length": longest}

    def files(self, task: TaskConfig) -> list[Path]:
        """The BEIR folder's files, and a pairs file outside it."""
        root, files = Path(task.path).expanduser(), []
        if task.path and root.is_dir():
            files += files_under(root)
        pairs = Path(task.pairs).expanduser()
        if task.pairs and pairs.is_file() and not pairs.resolve().is_relative_to(root.resolve()):
            files.append(pairs)
        return files

    def plan_gap(
        self,
        task: TaskConfig,
        settings: TaskSettings,
        tokenize: TokenizeSettings,
        buckets: tuple[int, ...],
        positions: int | None,
    ) -> str | None:
        """A held-out retrieval task needs documents alone, and lengths within the model's positions."""
        if task.kind != "heldout-retrieval":
            return None
        if tokenize.task_text == "only":
            return 'searches the documents tokenize holds out, and tokenize.task_text = "only" reads no corpus'
        if tokenize.heldout_fraction == 0:
            return "searches the documents tokenize holds out, and tokenize.heldout_fraction = 0 holds out none"
        return _too_long(settings, buckets, positions)

    def gap(
        self, task: TaskConfig, settings: TaskSettings, tokenize: Upstream, buckets: tuple[int, ...], positions: int
    ) -> str | None:
        """No held-out documents, lengths beyond the model's `positions`, or too few documents for one batch of
        pairs."""
        from cram.stages.retrieval.results import load_task

        if tokenize.outputs.get("heldout") is None:
            return "searches the documents tokenize holds out, and it held out none"
        if (reason := _too_long(settings, buckets, positions)) is not None:
            return reason
        try:
            load_task(task, 0, tokenize, settings)
        except StageError as e:
            return f"has no pairs to train on in the held-out documents ({e})"
        return None

    def check(self, task: TaskConfig, index: int, settings: TaskSettings, gap: str | None) -> None:
        """A BEIR folder and its pairs read in full; a held-out task's `gap` refused."""
        from cram.stages.retrieval.results import load_task

        if task.kind == "retrieval":
            load_task(task, index, None, settings)
        elif gap:
            raise StageError(f"evaluate.tasks[{index}]: kind '{task.kind}' {gap}; {_REMEDY}")

    def steps(self, task: TaskConfig, index: int, settings: TaskSettings, batch_size: int) -> str:
        """A BEIR task's contrastive steps per seed: epochs x full batches of its pairs (fewer where texts repeat)."""
        from cram.stages.retrieval.results import load_task

        if task.kind == "heldout-retrieval":
            return "contrastive steps known after tokenize (held-out titles against their texts, beside BM25)"
        found = load_task(task, index, None, settings)
        batches = len(found.pairs) // settings.batch_size
        steps = f"{count(settings.epochs * batches, 'contrastive step')} ({count(settings.epochs, 'epoch')} x "
        steps += f"{count(batches, 'batch', 'batches')} of {settings.batch_size} {found.source} pairs, "
        return steps + f"{len(found.queries)} test queries over {count(len(found.corpus), 'document')}, beside BM25)"

    def load(
        self, task: TaskConfig, index: int, settings: TaskSettings, tokenize: Upstream, tokenizer: Tokenizer
    ) -> RetrievalLoaded:
        from cram.stages.retrieval import results

        found = results.load_task(task, index, tokenize, settings)
        return results.loaded(task, found, tokenizer, tokenize.outputs["special_ids"], settings)

    def cost(self, loaded: RetrievalLoaded) -> float:
        return 2 * len(loaded.data.texts) * loaded.settings.epochs  # a pair reads two texts

    def runner(self, loaded: list[RetrievalLoaded], start: Start) -> Retrievers:
        from cram.stages.retrieval.results import with_mined_negatives
        from cram.stages.retrieval.tuning import EmbeddingTuner, EmbeddingTuners, Making, embedder_graphs
        from cram.stages.shared.precision import FP32

        make = functools.partial(
            EmbeddingTuner.make, start.tuning, start.cfg, start.params, start.special, start.device
        )
        # mined once, by the encoder as it came (eager, fp32), for every seed and precision alike
        mined = {
            t.task.name: with_mined_negatives(t, make(Making(FP32, False, start.attention, t.settings.pooling)))
            for t in loaded
            if t.settings.hard_negatives == "mined"
        }
        ready = [mined.get(t.task.name, t) for t in loaded]
        embedders = EmbeddingTuners(make, ready, start.tuning.compile, start.attention)
        return Retrievers(embedders, embedder_graphs(ready, start.tuning, start.seed), start.scratch, mined)

    def result(self, loaded: RetrievalLoaded, seeds: list[int], runs: list[dict], tuning: Tuning, ctx: Context) -> dict:
        from cram.stages.retrieval.results import retrieval_result

        return retrieval_result(loaded, seeds, runs, ctx)

    def totals(self, tasks: dict[str, dict]) -> dict[str, Any]:
        return {}

    def meta(self, loaded: RetrievalLoaded, tuning: Tuning, tokenizer: dict) -> dict:
        from cram.stages.retrieval.results import embedder_meta

        return embedder_meta(loaded, tuning.buckets, tokenizer)


@dataclass(frozen=True)
class Retrievers:
    """The retrieval tasks' fine-tunes in a stage: their embedders (one per pooling and precision), the graphs
    the canary checks, and the folder a seed's corpus embeddings are written in."""

    embedders: EmbeddingTuners
    shapes: list[EmbedderGraph]
    scratch: Path
    mined: dict[str, RetrievalLoaded]  # the tasks whose pairs take mined hard negatives, with them
    untuned: dict[tuple[str, Precision], Judged] = field(default_factory=dict)  # each task's encoder as it was

    def graphs(self) -> int:
        return len(self.shapes)

    def canary(self, precision: Precision, steps: int, tolerance: float) -> Difference:
        return self.embedders.check(precision, self.shapes, steps, tolerance)

    def run_seed(self, precision: Precision, loaded: RetrievalLoaded, seed: int, ctx: Context, keep: Callable) -> dict:
        from cram.stages.retrieval.results import SeedRun, judged, retrieve_seed

        loaded = self.mined.get(loaded.task.name, loaded)
        embedder = self.embedders.of(precision, loaded.settings.pooling, loaded.settings.mini_batch_size)
        key = (loaded.task.name, precision)
        if key not in self.untuned:  # once a task: every seed must beat the same start on validation
            runs = embedder.runs(embedder.params, loaded, self.scratch)
            self.untuned[key] = judged(runs, loaded)
        return retrieve_seed(embedder, loaded, seed, SeedRun(ctx, self.scratch, self.untuned[key]), keep)


def _too_long(settings: RetrievalSettings, buckets: tuple[int, ...], positions: int | None) -> str | None:
    """Why a retrieval task's documents or queries pad beyond the model's `positions`; None when they fit."""
    longest = bucket(max(settings.max_length, settings.query_max_length), buckets)
    if positions is None or longest <= positions:
        return None
    return f"pads its texts to {longest} tokens, beyond the model's {positions} positions"


RETRIEVAL = Retrieval()
