"""A task entry of `[[evaluate.tasks]]` (`TaskConfig`) and what every kind's fine-tune reads of evaluate's
config: the stage's fine-tuner settings (`Tuning`) and a task's own (`TaskSettings`). The entry is flat, as the
TOML writes it: its kind-specific fields are each kind's (`Kind.fields`), checked by it (`Kind.check_entry`)
when evaluate's Config is made (stages/evaluating/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pooling = Literal["auto", "first", "mean", "pooler"]
Head = Literal["cramming", "auto", "bert", "roberta", "modernbert"]
# cramming's fine-tuning AdamW: betas (0.9, 0.98), eps 1e-6, no gradient clipping; cosine after the warm-up.
FINETUNE_OPTIMIZER = {"betas": (0.9, 0.98), "eps": 1e-6, "clip_norm": 0.0, "schedule": "cosine"}
PROGRESS_EVERY_S = 30.0  # a fine-tune's progress line in the log this often (and when it starts)


@dataclass(frozen=True)
class TaskConfig:
    """One fine-tuning task, an entry of `[[evaluate.tasks]]`."""

    # heldout-topic, glue, custom (stages/finetuning/), retrieval, heldout-retrieval (stages/retrieval/):
    # the kinds stages/evaluating/kinds.py registers
    kind: str = "heldout-topic"
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
    # retrieval kinds: the rows the encoder embeds at once while the loss takes the whole batch (GradCache: a
    # large batch in a small batch's memory; None: the whole batch at once)
    mini_batch_size: int | None = None
    # retrieval kinds: where a pair's hard negative comes from: "pairs" (the pairs file's `negative`, where it
    # has one), "mined" (BM25's candidates less the likely relevant: stages/retrieval/mining.py); None: "pairs"
    hard_negatives: Literal["pairs", "mined"] | None = None
    # retrieval kinds: mined hard negatives per training pair (1 to 16: stages/retrieval/settings.py), each
    # query's first survivors of the false-negative filter, every one a further column of the loss
    negatives_per_pair: int = 1
    # retrieval kinds: a retrieved document whose id is the query's dropped before scoring, as BEIR's evaluator
    # drops it (in ArguAna and Quora a query is also a corpus document, which would find itself first)
    ignore_identical_ids: bool = True
    epochs: int | None = None  # None: the stage's; likewise seeds, lr and max_length
    seeds: int | None = None
    lr: float | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction: {self.test_fraction} must be in (0, 1)")
        for key in ("epochs", "seeds"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{key}: {getattr(self, key)} must be >= 1")
        if self.max_length is not None and self.max_length < 3:
            raise ValueError(f"max_length: {self.max_length} must be >= 3 ([CLS], a token, [SEP])")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr: {self.lr} must be > 0")


@dataclass(frozen=True)
class TaskSettings:
    """A task's epochs, seeds, lr and max_length: its own, or the stage's (`Config.task_settings`)."""

    epochs: int
    seeds: int
    lr: float
    max_length: int


def task_seeds(first: int, settings: TaskSettings) -> list[int]:
    """The seeds a task fine-tunes with: `settings.seeds` of them from the run's seed `first`."""
    return [first + k for k in range(settings.seeds)]


@dataclass(frozen=True)
class Tuning:
    """What the fine-tuners (`finetune.Tuner`, `tuning.EmbeddingTuner`) read of evaluate's Config: the optimizer and its
    schedule, batching and padding, the head, and compiling (`Config.tuning`)."""

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
