"""The evaluate stage's config (`[evaluate]`, `[[evaluate.tasks]]`) and the held-out masked LM's settings
(`MlmSettings`), made once from it. A task entry (`TaskConfig`) and the fine-tuners' settings (`Tuning`,
`TaskSettings`) are every kind's, below them (stages/tasks/config.py); each entry is checked by its kind
(`kinds.of(task.kind).check_entry`). `stages/evaluate.py` re-exports `Config` and `TaskConfig`, so
`evaluate.Config` names the same class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cram.stages.evaluating import kinds
from cram.stages.evaluating.positions import task_positions
from cram.stages.pretraining.config import Config as PretrainConfig
from cram.stages.protocols import StageConfig, section
from cram.stages.shared.precision import check_canary
from cram.stages.tasks.config import Head, Pooling, TaskConfig, TaskSettings, Tuning

if TYPE_CHECKING:
    from cram.stages.shared.pretrained import Pretrained

DEFAULT_TASK = TaskConfig(epochs=2, seeds=3, lr=1e-3, max_length=64)
# The held-out documents' titles as queries against their texts (stages/retrieval/pairs.py): your own
# corpus scored for retrieval beside BM25, sized like the topic task for about a minute on 2 cores.
DEFAULT_RETRIEVAL_TASK = TaskConfig(
    kind="heldout-retrieval", name="retrieval", epochs=1, seeds=3, lr=3e-3, max_length=64, query_max_length=32
)


@dataclass(frozen=True)
class Config:
    # Fine-tuning follows cramming's GLUE rules: one set of hyper-parameters for every task.
    # The defaults: the held-out topics and the held-out retrieval, each sized for the default CPU pipeline
    # (about a minute on 2 cores). Minutes of pretraining leave a tiny model that learns nothing at GLUE's
    # 4e-5 in 2 epochs. Each is left out where the held-out documents give it nothing (`fitting_tasks`):
    # the topics without labels, the retrieval without documents enough: a default must fit any corpus.
    tasks: list[TaskConfig] = field(default_factory=lambda: [DEFAULT_TASK, DEFAULT_RETRIEVAL_TASK])
    epochs: int = 5
    batch_size: int = 16
    lr: float = 4e-5
    warmup: float = 0.1  # cosine decay after a linear warm-up over this fraction of the steps
    weight_decay: float = 0.0  # cramming fine-tunes without weight decay
    max_length: int = 128  # tokens per example, [CLS] and [SEP]s included; longer texts are cut
    buckets: tuple[int, ...] = (32, 64, 128)  # padded batch lengths: one compiled graph each, at most
    # first: the [CLS] token; mean: the mean over real tokens; pooler: the first token through a head whose
    # dense layer starts as the checkpoint's pooler (BERT's; head_width = 0). auto: the pooling of
    # pretrain.init's sentence-transformers folder where it names one that the head's family reads (BERT's
    # and RoBERTa's classifiers read the first token alone), else first (resolved at load, `linked`).
    pooling: Pooling = "auto"
    head_width: int = 1024  # the classifier head's dense layer (cramming's); 0: the model's hidden size
    dropout: float = 0.1  # fine-tuning only: embeddings, attention, hidden and the head (cramming's)
    seeds: int = 5
    eval_batch_size: int = 128
    mlm: bool = True  # the held-out masked-LM loss and accuracy
    mlm_seed: int = 0  # masks the held-out blocks: fixed, so re-runs agree; 0 is pretrain's val-loss masking
    # 0: mask the held-out blocks at pretraining's rate; else at this one, so that runs trained at
    # different masking rates (a sweep) compare on one held-out loss.
    mlm_mask_rate: float = 0.0
    # "pretrain": corrupt the held-out masked tokens as pretraining did (pretrain.masking.mask_token and
    # random_token); "bert": BERT's 80/10/10 whatever pretraining used, so that runs trained with other
    # corruptions (all [MASK]) compare on one held-out loss.
    mlm_corruption: Literal["pretrain", "bert"] = "pretrain"
    mlm_batch_size: int = 128
    # The held-out masked-LM at each of these block lengths (`mlm_loss@L` when more than one); empty:
    # the lengths pretrain trained at. `mlm_loss` stays the first length's.
    mlm_lengths: tuple[int, ...] = ()
    compile: bool = True
    backend: str = "inductor"
    # auto: bf16 autocast on CUDA and on CPUs with native bf16, where the compiled fine-tune step agrees
    # with eager (the canary), else fp32 (stages/shared/precision.py)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Before the first fine-tune: this many steps of the first task compiled and eagerly from the same
    # params (dropout off), and their predictions; a relative difference above the tolerance tries the
    # next precision, or stops the stage. 0: off (and off when compile is false).
    canary_steps: int = 2
    canary_tolerance: float = 0.02
    # Per task, the fine-tuned classifier (encoder and head) of its best seed by the reported score,
    # of every seed, or of none: outputs `classifiers/` (stages/evaluating/keeping.py), which
    # `cram export RUN --task NAME` and `cram predict RUN --task NAME` read.
    keep: Literal["best", "all", "none"] = "best"
    # The classifier head (model/classifier.py): cramming's (`head_width` wide), or the one of transformers'
    # BERT, RoBERTa or ModernBERT ...ForSequenceClassification (the hidden size wide), which export exactly.
    # auto: the head of the family of pretrain.init's transformers or sentence-transformers checkpoint
    # (model/hf.py), so that the run's classifiers export to it; else cramming's, which scored better from
    # scratch (bench/NOTEBOOK.md, "The default head"). Resolved at load (`linked`).
    head: Head = "auto"
    # "init": pretrain.init's checkpoint is fine-tuned too, with the same tasks, seeds and settings (the
    # baseline stage, stages/baseline.py), and each task's results set the continued score beside it
    # (stages/evaluating/versus.py); "none": the continued model alone. "auto": "init" where pretrain
    # continues a checkpoint on a budget that is not zero, else "none" (resolved at load, `linked`).
    baseline: Literal["auto", "init", "none"] = "auto"

    def __post_init__(self) -> None:
        positive = ("epochs", "batch_size", "max_length", "seeds", "eval_batch_size", "mlm_batch_size")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: {getattr(self, key)} must be >= 1")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(f"lr, weight_decay: {self.lr}, {self.weight_decay} must be > 0 and >= 0")
        if self.head_width < 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"head_width, dropout: {self.head_width}, {self.dropout} must be >= 0 and in [0, 1)")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup: {self.warmup} must be in [0, 1)")
        check_canary(self.canary_steps, self.canary_tolerance)
        if any(length < 1 for length in self.mlm_lengths):
            raise ValueError(f"mlm_lengths: {list(self.mlm_lengths)} must be lengths of at least 1")
        if not 0 <= self.mlm_mask_rate < 1:
            raise ValueError(f"mlm_mask_rate: {self.mlm_mask_rate} must be in [0, 1); 0 keeps pretraining's rate")
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 3:
            raise ValueError(f"buckets: {list(self.buckets)} must be increasing lengths of at least 3")
        for i, task in enumerate(self.tasks):
            _check_task(task, f"tasks[{i}]")
        lengths = {"max_length": self.max_length}
        for i, task in enumerate(self.tasks):
            keys = ("max_length", *kinds.of(task.kind).lengths)
            lengths.update({f"tasks[{i}].{key}": getattr(task, key) for key in keys})
        for key, length in lengths.items():
            if length is not None and not 3 <= length <= self.buckets[-1]:
                fix = f"; or add {length} to buckets (now {list(self.buckets)})" if length > self.buckets[-1] else ""
                raise ValueError(f"{key}: {length} must be in [3, the largest bucket {self.buckets[-1]}]{fix}")
        names = [t.name for t in self.tasks]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tasks: the name {repeated[0]!r} is used twice; results are keyed by name")

    def linked(self, sections: Mapping[str, StageConfig]) -> Config:
        """`head = "auto"` is the head of the family of `pretrain.init`'s transformers checkpoint where its
        model maps onto one, else "cramming"; `pooling = "auto"` is the pooling that `init`'s
        sentence-transformers folder names ("mean" or "first") where the head reads it, else "first"; a
        task takes what its kind takes of that folder (`Kind.linked`: a retrieval task's pooling);
        `baseline = "auto"` is "init" where pretrain continues `init`'s checkpoint on a budget that is not
        zero (a zero budget scores the checkpoint itself), else "none". Resolved here, so the config holds
        what runs; so does each task's kind's own epochs, seeds, lr and max_length (`_with_kind_defaults`)."""
        from cram.stages.shared import pretrained

        pretrain = section(sections, "pretrain", PretrainConfig)
        init = pretrain.init if pretrain is not None else ""
        config = self
        if self.baseline == "auto":
            trains = pretrain is None or pretrain.budget.tokens != 0
            config = dataclasses.replace(config, baseline="init" if init and trains else "none")
        found = None
        if init:
            try:
                found = pretrained.locate(Path(init))
            except pretrained.PretrainedError:  # pretrain's validate names it
                pass
        if config.head == "auto":
            config = dataclasses.replace(config, head=auto_head(found))
        if config.pooling == "auto":
            pooling = None if found is None else found.pooling
            if pooling == "mean" and config.head in ("bert", "roberta"):  # their classifiers read [CLS] alone
                pooling = None
            config = dataclasses.replace(config, pooling=pooling or "first")
        init_pooling = None if found is None else found.pooling
        tasks = [kinds.of(t.kind).linked(t, init_pooling) for t in config.tasks]
        positions = task_positions(pretrain, sections.get("pack"))
        lengths = tuple(n for n in config.buckets if positions is None or n <= positions.length)
        tasks = [config._with_kind_defaults(t, lengths) for t in tasks]
        return dataclasses.replace(config, tasks=tasks) if tasks != config.tasks else config

    def _with_kind_defaults(self, task: TaskConfig, lengths: tuple[int, ...]) -> TaskConfig:
        """`task` with its kind's own epochs, seeds, lr and max_length (`Kind.defaults`) where neither it nor
        [evaluate] sets one: a stage value left at its default is no choice of the user's."""
        own = kinds.of(task.kind).defaults(task, lengths)
        stage_defaults = {f.name: f.default for f in dataclasses.fields(Config)}
        unset = {k: v for k, v in own.items() if getattr(task, k) is None and getattr(self, k) == stage_defaults[k]}
        return dataclasses.replace(task, **unset) if unset else task

    def task_settings(self, task: TaskConfig) -> TaskSettings:
        """The task's own epochs, seeds, lr and max_length, the stage's where it sets none."""
        own = {key: getattr(task, key) for key in ("epochs", "seeds", "lr", "max_length")}
        return TaskSettings(**{key: getattr(self, key) if value is None else value for key, value in own.items()})

    def settings(self, task: TaskConfig) -> TaskSettings:
        """The task's settings as its kind makes them (`Kind.settings`): its own, else the stage's."""
        return kinds.of(task.kind).settings(task, self.task_settings(task))

    def tuning(self) -> Tuning:
        """What the fine-tuner reads of this config. A config never linked to a pipeline (`linked`) has no
        `pretrain.init`: its `head = "auto"` is the head from scratch, cramming's."""
        config = dataclasses.replace(self, head=auto_head(None)) if self.head == "auto" else self
        return Tuning(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Tuning)})

    def mlm_settings(self) -> MlmSettings:
        """What the held-out masked LM reads of this config."""
        return MlmSettings(
            seed=self.mlm_seed,
            batch_size=self.mlm_batch_size,
            mask_rate=self.mlm_mask_rate,
            corruption=self.mlm_corruption,
            lengths=self.mlm_lengths,
            compile=self.compile,
            backend=self.backend,
        )


def auto_head(found: Pretrained | None) -> Head:
    """`head = "auto"` for a run that starts from `found` (None: from scratch): the classifier head of the
    transformers family its model maps onto, for a transformers or sentence-transformers checkpoint;
    "cramming" for any other start."""
    from cram.stages.shared import pretrained

    if found is None or found.kind != "transformers":
        return "cramming"
    try:
        cfg = pretrained.architecture(found)
    except pretrained.PretrainedError:  # pretrain's validate names it
        return "cramming"
    from cram.model.hf import family_head

    return family_head(cfg) or "cramming"


def keyed_tasks(plain: dict[str, Any]) -> dict[str, Any]:
    """evaluate's config as plain values (`pipeline.config.as_plain`) with each task's fields that its kinds
    leave out of the key (`Kind.unkeyed`) left out where they hold their defaults: what a stage key sees of
    them (`evaluate.key_config`). Every kind's, from every task: a task holds another kind's at their defaults."""
    unkeyed = [key for kind in kinds.KINDS for key in kind.unkeyed]
    for task in plain.get("tasks", ()):
        for key in unkeyed:
            if key in task and task[key] == getattr(TaskConfig, key):
                del task[key]
    return plain


def _check_task(task: TaskConfig, where: str) -> None:
    """Task entry `where` as its kind takes it: a kind some wing serves, no field of another kind's, and its
    kind's own checks (`Kind.check_entry`)."""
    kind = kinds.BY_NAME.get(task.kind)
    if kind is None:
        raise ValueError(f"{where}.kind: {task.kind!r} is no kind of task; choose one of {', '.join(kinds.BY_NAME)}")
    for other in kinds.KINDS:
        given = [key for key in other.fields if other is not kind and getattr(task, key) != getattr(TaskConfig, key)]
        if given:
            raise ValueError(f"{where}: {', '.join(given)}: only a {other.name} task takes them; {task.kind} has none")
    try:
        kind.check_entry(task)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


@dataclass(frozen=True)
class MlmSettings:
    """What the held-out masked LM reads of evaluate's Config (`Config.mlm_settings`), its `mlm_` prefix
    dropped."""

    seed: int
    batch_size: int
    mask_rate: float  # 0: pretraining's
    corruption: Literal["pretrain", "bert"]
    lengths: tuple[int, ...]  # empty: the lengths pretrain trained at
    compile: bool
    backend: str
