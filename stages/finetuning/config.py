"""The evaluate stage's config (`[evaluate]`, `[[evaluate.tasks]]`), in the wing that reads it, and the small
values its helpers receive: the fine-tuner's settings (`Tuning`), a task's own (`TaskSettings`) and the held-out
masked LM's (`MlmSettings`), each made once from the Config. `stages/evaluate.py` re-exports `Config` and
`TaskConfig`, so `evaluate.Config` names the same class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cram.stages.finetuning.metrics import METRICS, REGRESSION_METRICS
from cram.stages.shared.precision import check_canary
from cram.stages.shared.taskfiles import GLUE

if TYPE_CHECKING:
    from cram.stages.shared.pretrained import Pretrained

Pooling = Literal["auto", "first", "mean", "pooler"]
Head = Literal["cramming", "auto", "bert", "roberta", "modernbert"]
RETRIEVAL_KINDS = ("retrieval", "heldout-retrieval")
EMBEDDING_POOLINGS = ("mean", "first")  # model/embedder.py's, named here to keep this module free of torch
# A retrieval task's own settings: added after the stage's key was fixed, left out of it at their
# defaults (`keyed_tasks`), so a config without a retrieval task keys as it did before them.
RETRIEVAL_OPTIONS = ("pairs", "query_max_length", "batch_size", "pooling")
# Settings that only mean something for a classifier: refused on a retrieval task, which has no labels.
CLASSIFICATION_ONLY = ("text_fields", "metrics", "label_field")


@dataclass(frozen=True)
class TaskConfig:
    """One fine-tuning task, an entry of `[[evaluate.tasks]]`."""

    kind: Literal["heldout-topic", "glue", "custom", "retrieval", "heldout-retrieval"] = "heldout-topic"
    name: str = "topic"  # glue: cola, sst2, mrpc, stsb, qqp, mnli, qnli or rte; otherwise the results' label
    # glue: a local GLUE directory ("" = the hub); custom: a folder with train and test files; retrieval: a
    # BEIR folder (corpus.jsonl, queries.jsonl, qrels/test.tsv, optional qrels/train.tsv)
    path: str = ""
    text_fields: tuple[str, ...] = ()  # custom: the text field, or the two fields of a pair
    label_field: str = "label"  # custom
    # custom: accuracy, f1, macro_f1, matthews, pearson, spearman (these two: regression); the first is the main
    metrics: tuple[str, ...] = ()
    # heldout-topic: share of each topic's articles kept for testing; heldout-retrieval: of the documents
    test_fraction: float = 0.2
    # retrieval: a JSON-lines file of training pairs {"query", "positive"[, "negative"]}, read where the
    # folder has no qrels/train.tsv (without either, pairs are made from the corpus: stages/retrieval/pairs.py)
    pairs: str = ""
    query_max_length: int | None = None  # retrieval kinds: tokens per query (None: QUERY_MAX_LENGTH)
    batch_size: int | None = None  # retrieval kinds: pairs per contrastive batch (None: RETRIEVAL_BATCH_SIZE)
    # retrieval kinds: the embedding's pooling (None: the pooling of `pretrain.init`'s sentence-transformers
    # folder where it names one, else mean: `Config.linked`)
    pooling: Literal["mean", "first"] | None = None
    epochs: int | None = None  # None: the stage's; likewise seeds, lr and max_length
    seeds: int | None = None
    lr: float | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
        if self.kind == "glue" and self.name not in GLUE:
            raise ValueError(f"name: {self.name!r} is no GLUE task; choose one of {', '.join(GLUE)}")
        if self.kind == "custom":
            if not self.path:
                raise ValueError("path: a custom task needs the folder holding its train and test files")
            if len(self.text_fields) not in (1, 2):
                raise ValueError(f"text_fields: {list(self.text_fields)} must name one text field or two (a pair)")
            if not self.metrics:
                raise ValueError(f"metrics: a custom task needs at least one of {', '.join(METRICS)}")
            unknown = [m for m in self.metrics if m not in METRICS]
            if unknown:
                raise ValueError(f"metrics: unknown metric {unknown[0]!r}; choose from {', '.join(METRICS)}")
            if len({m in REGRESSION_METRICS for m in self.metrics}) > 1:
                raise ValueError(
                    f"metrics: {list(self.metrics)} mixes regression "
                    f"({', '.join(REGRESSION_METRICS)}) and classification"
                )
        elif self.kind in RETRIEVAL_KINDS:
            self._check_retrieval()
        elif self.text_fields or self.metrics:
            raise ValueError(f"text_fields, metrics: only a custom task takes them; {self.kind} sets its own")
        if self.kind not in RETRIEVAL_KINDS:
            given = [key for key in RETRIEVAL_OPTIONS if getattr(self, key) != getattr(TaskConfig, key)]
            if given:
                raise ValueError(f"{', '.join(given)}: only a retrieval task takes them; {self.kind} has none")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction: {self.test_fraction} must be in (0, 1)")
        for key in ("epochs", "seeds"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{key}: {getattr(self, key)} must be >= 1")
        if self.max_length is not None and self.max_length < 3:
            raise ValueError(f"max_length: {self.max_length} must be >= 3 ([CLS], a token, [SEP])")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr: {self.lr} must be > 0")

    def _check_retrieval(self) -> None:
        given = [key for key in CLASSIFICATION_ONLY if getattr(self, key) != getattr(TaskConfig, key)]
        if given:
            raise ValueError(f"{', '.join(given)}: a {self.kind} task has no labels and no classifier; drop them")
        if self.kind == "retrieval" and not self.path:
            raise ValueError("path: a retrieval task needs a BEIR folder (corpus.jsonl, queries.jsonl, qrels/test.tsv)")
        if self.kind == "heldout-retrieval" and (self.path or self.pairs):
            raise ValueError("path, pairs: a heldout-retrieval task reads tokenize's held-out documents alone")
        if self.query_max_length is not None and self.query_max_length < 3:
            raise ValueError(f"query_max_length: {self.query_max_length} must be >= 3 ([CLS], a token, [SEP])")
        if self.batch_size is not None and self.batch_size < 2:
            raise ValueError(f"batch_size: {self.batch_size} must be >= 2 (a pair's negatives are the batch's others)")
        if self.pooling is not None and self.pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"pooling: {self.pooling!r}; choose one of {', '.join(EMBEDDING_POOLINGS)}")


QUERY_MAX_LENGTH = 32  # a retrieval task's query length where it sets none: a title, a question
RETRIEVAL_BATCH_SIZE = 32  # pairs per contrastive batch where a task sets none: 31 in-batch negatives each
DEFAULT_TASK = TaskConfig(epochs=2, seeds=3, lr=1e-3, max_length=64)
# The held-out documents' titles as queries against their texts (stages/retrieval/pairs.py): your own
# corpus scored for retrieval beside BM25, sized like the topic task for about a minute on 2 cores.
DEFAULT_RETRIEVAL_TASK = TaskConfig(
    kind="heldout-retrieval", name="retrieval", epochs=1, seeds=3, lr=5e-4, max_length=64, query_max_length=32
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
    # of every seed, or of none: outputs `classifiers/` (stages/finetuning/kept.py), which
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
    # (stages/finetuning/versus.py); "none": the continued model alone. "auto": "init" where pretrain
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
        lengths = {"max_length": self.max_length}
        lengths.update({f"tasks[{i}].max_length": t.max_length for i, t in enumerate(self.tasks)})
        lengths.update({f"tasks[{i}].query_max_length": t.query_max_length for i, t in enumerate(self.tasks)})
        for key, length in lengths.items():
            if length is not None and not 3 <= length <= self.buckets[-1]:
                raise ValueError(f"{key}: {length} must be in [3, the largest bucket {self.buckets[-1]}]")
        names = [t.name for t in self.tasks]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tasks: the name {repeated[0]!r} is used twice; results are keyed by name")

    def linked(self, sections: dict[str, Any]) -> Config:
        """`head = "auto"` is the head of the family of `pretrain.init`'s transformers checkpoint where its
        model maps onto one, else "cramming"; `pooling = "auto"` is the pooling that `init`'s
        sentence-transformers folder names ("mean" or "first") where the head reads it, else "first"; a
        retrieval task without a `pooling` takes that folder's pooling too (else mean, at retrieval_settings);
        `baseline = "auto"` is "init" where pretrain continues `init`'s checkpoint on a budget that is not
        zero (a zero budget scores the checkpoint itself), else "none". Resolved here, so the config holds
        what runs."""
        from cram.stages.shared import pretrained

        pretrain = sections.get("pretrain")
        init = getattr(pretrain, "init", "")
        config = self
        if self.baseline == "auto":
            trains = getattr(getattr(pretrain, "budget", None), "tokens", None) != 0
            config = dataclasses.replace(config, baseline="init" if init and trains else "none")
        found = None
        own_pooling = any(t.kind in RETRIEVAL_KINDS and t.pooling is None for t in self.tasks)
        if init and (self.head == "auto" or self.pooling == "auto" or own_pooling):
            try:
                found = pretrained.locate(Path(init))
            except pretrained.PretrainedError:  # pretrain's validate names it
                pass
        if config.head == "auto":
            config = dataclasses.replace(config, head=init_head(found))
        if config.pooling == "auto":
            pooling = None if found is None else found.pooling
            if pooling == "mean" and config.head in ("bert", "roberta"):  # their classifiers read [CLS] alone
                pooling = None
            config = dataclasses.replace(config, pooling=pooling or "first")
        if found is not None and found.pooling == "first":  # "mean" is the default already: keys stay as they were
            tasks = [
                dataclasses.replace(t, pooling="first") if t.kind in RETRIEVAL_KINDS and t.pooling is None else t
                for t in config.tasks
            ]
            config = dataclasses.replace(config, tasks=tasks)
        return config

    def task_settings(self, task: TaskConfig) -> TaskSettings:
        """The task's own epochs, seeds, lr and max_length, the stage's where it sets none."""
        own = {key: getattr(task, key) for key in ("epochs", "seeds", "lr", "max_length")}
        return TaskSettings(**{key: getattr(self, key) if value is None else value for key, value in own.items()})

    def retrieval_settings(self, task: TaskConfig) -> RetrievalSettings:
        """A retrieval task's settings: its own, else the stage's (epochs, seeds, lr, max_length) or
        retrieval's defaults (query length, batch, mean pooling)."""
        own = self.task_settings(task)
        query_max_length = task.query_max_length or min(QUERY_MAX_LENGTH, own.max_length)
        return RetrievalSettings(
            **dataclasses.asdict(own),
            query_max_length=query_max_length,
            batch_size=task.batch_size or RETRIEVAL_BATCH_SIZE,
            pooling=task.pooling or "mean",
        )

    def tuning(self) -> Tuning:
        """What the fine-tuner reads of this config. A config never linked to a pipeline (`linked`) has no
        `pretrain.init`: its `head = "auto"` is the head from scratch, cramming's."""
        config = dataclasses.replace(self, head=init_head(None)) if self.head == "auto" else self
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


def init_head(found: Pretrained | None) -> Head:
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


@dataclass(frozen=True)
class TaskSettings:
    """A task's epochs, seeds, lr and max_length: its own, or the stage's (`Config.task_settings`)."""

    epochs: int
    seeds: int
    lr: float
    max_length: int


@dataclass(frozen=True)
class RetrievalSettings(TaskSettings):
    """A retrieval task's settings (`Config.retrieval_settings`): a classification task's, the query
    length, the contrastive batch and the embedding's pooling."""

    query_max_length: int
    batch_size: int
    pooling: Literal["mean", "first"]


def keyed_tasks(plain: dict[str, Any]) -> dict[str, Any]:
    """evaluate's config as plain values (`pipeline.config.as_plain`) with each task's `RETRIEVAL_OPTIONS`
    left out where they hold their defaults: what a stage key sees of them (`evaluate.key_config`)."""
    for task in plain.get("tasks", ()):
        for key in RETRIEVAL_OPTIONS:
            if key in task and task[key] == getattr(TaskConfig, key):
                del task[key]
    return plain


@dataclass(frozen=True)
class Tuning:
    """What the fine-tuner (`finetune.Tuner`) reads of evaluate's Config: the optimizer and its schedule,
    batching and padding, the head, and compiling (`Config.tuning`)."""

    lr: float  # the stage's: the optimizer config's and the canary steps'; each fine-tune steps at its task's
    weight_decay: float
    warmup: float
    dropout: float
    batch_size: int
    eval_batch_size: int
    buckets: tuple[int, ...]
    pooling: Pooling
    head: Head
    head_width: int
    compile: bool
    backend: str


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
