"""The task kind as a plug-in: what the evaluate side's orchestration (stages/evaluating/) calls of a kind, from
the config's checks to results.json. A kind lives in its own wing (classification: stages/finetuning/kind.py,
retrieval: stages/retrieval/kind.py), which imports this module and no other wing; stages/evaluating/kinds.py
registers it under the `kind` names of `[[evaluate.tasks]]` it serves.

    kind = kinds.of(task.kind)
    kind.check_entry(task)                                   # when evaluate's Config is made
    settings = kind.settings(task, config.task_settings(task))
    loaded = kind.load(task, index, settings, tokenize, tokenizer)
    runner = kind.runner([loaded, ...], start)               # its compiled graphs, the canary, its seeds
    run = runner.run_seed(precision, loaded, seed, ctx, keep)
    result = kind.result(loaded, seeds, runs, tuning, ctx)   # its entry of results.json
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from cram.model.config import ModelConfig
    from cram.stages import Context, Upstream
    from cram.stages.data.source import CorpusConfig
    from cram.stages.shared.precision import Difference, Precision
    from cram.stages.shared.tokenizer import Tokenizer
    from cram.stages.tasks.config import TaskConfig, TaskSettings, Tuning


class TokenizeSettings(Protocol):
    """What a kind reads of tokenize's Config (stages/tokenize.py, which imports the evaluate side: a kind
    cannot import it back) to tell whether its settings leave a held-out task any documents."""

    @property
    def task_text(self) -> str: ...
    @property
    def heldout_fraction(self) -> float: ...
    @property
    def corpus(self) -> CorpusConfig: ...


class Scored(Protocol):
    """What the keeper reads of a loaded task: its name, and where its main score is (the first metric on the
    first test set)."""

    name: str
    metrics: Sequence[str]
    tests: Mapping[str, Any] | Sequence[str]


class Loaded(Protocol):
    """A task ready to fine-tune, as a kind loads it: its config entry, its data and its settings."""

    config: TaskConfig
    task: Scored
    settings: TaskSettings


@dataclass(frozen=True)
class Start:
    """What every fine-tune of a stage starts from and how its steps are made: the fine-tuners' settings, the
    pretrained encoder (its ModelConfig, and its params on `device`), the special ids, the attention, the run's
    first seed (the canary's) and the stage's folder, for scratch files."""

    tuning: Tuning
    cfg: ModelConfig
    params: dict
    special: dict
    device: torch.device
    attention: str
    seed: int
    scratch: Path


@runtime_checkable
class Runner(Protocol):
    """One kind's fine-tunes in a stage: its compiled graphs in each precision tried, checked against eager
    ones (the canary), and its seeds run in the precision chosen."""

    def graphs(self) -> int:
        """How many compiled graphs `canary` checks."""
        ...

    def canary(self, precision: Precision, steps: int, tolerance: float) -> Difference:
        """The largest relative difference of this kind's compiled graphs in `precision` from eager, stopping
        at the first past `tolerance`; the compiled graphs are the ones `run_seed` then runs."""
        ...

    def run_seed(self, precision: Precision, loaded: Loaded, seed: int, ctx: Context, keep: Callable) -> dict:
        """One seed of `loaded` fine-tuned and scored: its run record (`"scores"` by test set and metric);
        `keep` is called with the fine-tuned params and the record (`Keeper.offer`)."""
        ...


@runtime_checkable
class Kind(Protocol):
    """A kind of evaluate task, what the orchestration calls of it, in the order a stage does."""

    name: str  # the family, in log lines: "classification", "retrieval"
    kinds: tuple[str, ...]  # the `kind` values of `[[evaluate.tasks]]` it serves
    fields: tuple[str, ...]  # the task fields it alone takes: refused on another kind's task
    # its fields that a stage key leaves out at their defaults: added after the key was fixed, so that a config
    # that leaves them at their defaults keys as it did before them (`keyed_tasks`)
    unkeyed: tuple[str, ...]
    lengths: tuple[str, ...]  # its settings that are token lengths besides max_length: padded to a bucket too
    takes_head: bool  # whether its fine-tune takes [evaluate]'s classifier head (`head`, `head_width`)

    def check_entry(self, task: TaskConfig) -> None:
        """ValueError naming the field, where the entry is not one this kind runs (before any stage)."""
        ...

    def settings(self, task: TaskConfig, stage: TaskSettings) -> TaskSettings:
        """The task's settings: `stage` (its own epochs, seeds, lr and max_length, else the stage's) and the
        kind's own."""
        ...

    def linked(self, task: TaskConfig, init_pooling: str | None) -> TaskConfig:
        """The entry with what it takes from pretrain.init's folder resolved (`init_pooling`: the pooling its
        sentence-transformers folder names; None: none)."""
        ...

    def defaults(self, task: TaskConfig, lengths: tuple[int, ...]) -> dict[str, int | float]:
        """The kind's own epochs, seeds, lr and max_length for an entry, where they are not the stage's
        (`Config.linked` writes each into an entry that sets none, unless [evaluate] sets its own);
        `lengths`: the buckets the model's positions take, the lengths a task may pad to."""
        ...

    def files(self, task: TaskConfig) -> list[Path]:
        """The files it reads from disk, in order: a stage's key holds their sizes and times."""
        ...

    def plan_gap(
        self,
        task: TaskConfig,
        settings: TaskSettings,
        tokenize: TokenizeSettings,
        buckets: tuple[int, ...],
        positions: int | None,
    ) -> str | None:
        """Why tokenize's settings (its Config) leave the task nothing to run on, or why its lengths pad beyond
        the model's `positions` (None: unknown); None when they do not."""
        ...

    def gap(
        self, task: TaskConfig, settings: TaskSettings, tokenize: Upstream, buckets: tuple[int, ...], positions: int
    ) -> str | None:
        """As `plan_gap`, from tokenize's outputs once it ran."""
        ...

    def check(self, task: TaskConfig, index: int, settings: TaskSettings, gap: str | None) -> None:
        """StageError where task `index` cannot run: its local files (read in full), or `gap` (`plan_gap`'s)."""
        ...

    def steps(self, task: TaskConfig, index: int, settings: TaskSettings, batch_size: int) -> str:
        """For a dry run: its fine-tune steps per seed, where what it reads tells them."""
        ...

    def load(
        self, task: TaskConfig, index: int, settings: TaskSettings, tokenize: Upstream, tokenizer: Tokenizer
    ) -> Loaded:
        """Task `index`, read and tokenized; StageError naming what is wrong with it."""
        ...

    def cost(self, loaded: Loaded) -> float:
        """A seed's cost in examples read, for sharing seeds out across ranks."""
        ...

    def runner(self, loaded: list[Loaded], start: Start) -> Runner:
        """What fine-tunes `loaded` (this kind's tasks of the stage) from `start`."""
        ...

    def result(self, loaded: Loaded, seeds: list[int], runs: list[dict], tuning: Tuning, ctx: Context) -> dict:
        """The task's entry of results.json from its seeds' runs (in seed order)."""
        ...

    def totals(self, tasks: dict[str, dict]) -> dict[str, Any]:
        """results.json's figures over this kind's tasks (`tasks`: every task's entry), beside "tasks"."""
        ...

    def meta(self, loaded: Loaded, tuning: Tuning, tokenizer: dict) -> dict:
        """What the kept models of the task's seeds share (classifier.json's or embedder.json's fields);
        `tokenizer`: how a kept model finds the run's tokenizer (`kept.tokenizer_fields`)."""
        ...


def count(n: int, noun: str, plural: str = "") -> str:
    """`n` and the noun, plural where `n` is not 1: a dry run's "3 steps", "1 epoch"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
