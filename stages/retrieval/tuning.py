"""A retrieval task's contrastive fine-tune and its search, as `finetuning/finetune.py`'s Tuner does a
classifier's: every seed from the pretrained encoder (no head), its batches padded so that the compiled
steps are made once per length bucket, and the fine-tuned encoder scored on the test queries.

Batches (`model/embedder.py` reads them): the queries padded to one length (the bucket of the task's
`query_max_length`), the positives and hard negatives to the bucket of their longest, `batch_size` pairs
each with no text twice (`loss.distinct_batches`): the contrastive step compiles once per document
bucket. The corpus is embedded once per model in length-sorted batches, written to an `.npy` file in a
scratch folder (removed after), and searched exactly for each query's best 100 (`search.top_k`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from cram.stages.finetuning.finetune import FINETUNE_OPTIMIZER, PROGRESS_EVERY_S
from cram.stages.kept.batches import Padding, bucket, join
from cram.stages.retrieval.loss import distinct_batches
from cram.stages.shared.device import to_device
from cram.stages.shared.precision import stepped_difference
from cram.stages.shared.progress import Every, track

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    import torch
    from structlog.stdlib import BoundLogger

    from cram.model.config import ModelConfig
    from cram.stages.finetuning.config import RetrievalSettings, TaskConfig, Tuning
    from cram.stages.retrieval.metrics import Scores
    from cram.stages.retrieval.pairs import RetrievalTask
    from cram.stages.shared.precision import Precision
    from cram.stages.shared.tokenizer import Tokenizer

    Rows: TypeAlias = tuple[list[np.ndarray], np.ndarray]  # (ragged rows of ids, their lengths)

TOP_K = 100  # documents retrieved per query: Recall@100's depth


@dataclass(frozen=True)
class EncodedPairs:
    """A retrieval task's texts as token ids: the training pairs' sides, the corpus and the test queries."""

    texts: list[tuple[str, ...]]  # each pair's texts, for batches without a text twice
    queries: Rows  # the pairs' queries
    positives: Rows
    negatives: Rows | None  # hard negatives, where the pairs carry them
    corpus_ids: list[str]
    corpus: Rows
    query_ids: list[str]  # the test queries
    test_queries: Rows


@dataclass(frozen=True)
class RetrievalLoaded:
    """A retrieval task ready to fine-tune: its config entry, its data, them encoded, its settings."""

    config: TaskConfig
    task: RetrievalTask
    data: EncodedPairs
    settings: RetrievalSettings


def encode_pairs(task: RetrievalTask, tokenizer: Tokenizer, special: dict, settings: RetrievalSettings) -> EncodedPairs:
    """The task's texts as [CLS] text [SEP] rows: queries cut at `query_max_length`, documents at `max_length`."""
    import numpy as np

    def rows(texts: list[str], length: int) -> Rows:
        encoded = [join((ids,), special, length) for ids in tokenizer.encode(texts)]
        return encoded, np.array([len(r) for r in encoded])

    queries, documents = settings.query_max_length, settings.max_length
    pairs = task.pairs
    negatives = [p.negative for p in pairs if p.negative is not None]
    return EncodedPairs(
        texts=[p.texts for p in pairs],
        queries=rows([p.query for p in pairs], queries),
        positives=rows([p.positive for p in pairs], documents),
        negatives=rows(negatives, documents) if negatives else None,
        corpus_ids=list(task.corpus),
        corpus=rows([d.full_text for d in task.corpus.values()], documents),
        query_ids=list(task.queries),
        test_queries=rows(list(task.queries.values()), queries),
    )


def epoch_batches(loaded: RetrievalLoaded, seed: int, epoch: int, where: str) -> list[list[int]]:
    """An epoch's batches of pair indices, no text twice in one, shuffled by the seed and the epoch."""
    return distinct_batches(loaded.data.texts, loaded.settings.batch_size, seed * 1_000_003 + epoch, where)


@dataclass(frozen=True)
class Embedder:
    """What every retrieval fine-tune of a pooling shares: the pretrained encoder, the compiled steps."""

    config: Tuning
    cfg: ModelConfig
    params: dict  # the pretrained encoder, on the device: no masked-LM head
    special: dict
    device: torch.device
    step: Callable  # (params, opt_state, batch, lr) -> (params, opt_state, metrics)
    embed: Callable  # (params, {"input_ids", "attention_mask"}) -> [B, H] unit vectors

    @classmethod
    def make(
        cls, config: Tuning, cfg: ModelConfig, params: dict, special: dict, device: torch.device, how: Making
    ) -> Embedder:
        import dataclasses

        from cram import model
        from cram.model.embedder import make_contrastive_step, make_embed_step

        fixed = {k: v for k, v in FINETUNE_OPTIMIZER.items() if k != "schedule"}
        opt_cfg = model.OptimizerConfig(lr=config.lr, weight_decay=config.weight_decay, **fixed)
        options = how.precision.compile_options() if how.compile else None
        compilation = model.Compilation(how.compile, config.backend, how.precision.autocast(), how.attention, options)
        cfg = dataclasses.replace(cfg, dropout=0.0)  # the step's rate comes with each batch
        step = make_contrastive_step(cfg, opt_cfg, compilation, pooling=how.pooling)
        embed = make_embed_step(cfg, compilation, pooling=how.pooling)
        encoder = {k: v for k, v in params.items() if not k.startswith("head.")}
        return cls(config, cfg, encoder, special, device, step, embed)

    def train(
        self, loaded: RetrievalLoaded, seed: int, where: str, label: str, log: BoundLogger | None = None
    ) -> tuple[dict, float]:
        """The encoder fine-tuned from the pretrained one on the task's pairs, and the last epoch's mean loss."""
        import torch

        from cram import model

        settings = loaded.settings
        torch.manual_seed(seed)  # dropout's masks: a seed's fine-tune is the same wherever it runs
        params = dict(self.params)
        opt_state = model.adamw_init(params)
        epochs = [epoch_batches(loaded, seed, epoch, where) for epoch in range(settings.epochs)]
        total, done, every = sum(map(len, epochs)), 0, Every(PROGRESS_EVERY_S)
        if log is not None:
            log.info("fine-tuning", step=f"0/{total}", epochs=settings.epochs, pairs=len(loaded.data.texts))
        for batches in epochs:
            losses = []
            for index in track(batches, label, total, done=done):
                factor = model.lr_schedule(FINETUNE_OPTIMIZER["schedule"], done / total, warmup=self.config.warmup)
                lr = to_device(torch.tensor(settings.lr * factor, dtype=torch.float32), self.device)
                batch = self.batch(loaded, index, self.config.dropout)
                params, opt_state, metrics = self.step(params, opt_state, batch, lr)
                losses.append(metrics["loss"])
                done += 1
                if log is not None and every.due():  # the loss read here is the one host sync in 30 s
                    log.info("fine-tuning", step=f"{done}/{total}", loss=round(float(metrics["loss"]), 4))
        return params, float(torch.stack(losses).mean())

    def canary(self, eager: Embedder, loaded: RetrievalLoaded, steps: int, seed: int) -> float:
        """The largest relative difference between this embedder's (compiled) steps and `eager`'s: `steps`
        contrastive steps on the first batch, dropout off (loss and gradient norm), then both models'
        embeddings of its documents (relative to 1: they are unit vectors); inf when one is not finite."""
        import numpy as np
        import torch

        index = epoch_batches(loaded, seed, 0, "canary")[0]
        batch = self.batch(loaded, index, dropout=0.0)
        lr = to_device(torch.tensor(self.config.lr, dtype=torch.float32), self.device)
        embedders = (self, eager)
        diffs, ended = stepped_difference((self.step, eager.step), self.params, batch, lr, steps)
        rows, lengths = loaded.data.positives
        shown = [e.embedded(ended[k], rows, lengths, np.asarray(index)) for k, e in enumerate(embedders)]
        embedded = torch.tensor([float(np.abs(shown[0] - shown[1]).max())], dtype=torch.float64)
        worst = torch.cat([diffs.double().cpu(), embedded]).max()
        return float(worst) if torch.isfinite(worst) else float("inf")

    def search(self, params: dict, loaded: RetrievalLoaded, scratch: Path) -> Scores:
        """The test queries' scores: the corpus embedded to a file in a folder made under `scratch` (removed
        after), each query's TOP_K documents by exact search, scored against the qrels."""
        import numpy as np

        from cram.stages.retrieval.metrics import score_run
        from cram.stages.retrieval.search import Embeddings, top_k, write_embeddings

        data = loaded.data
        rows, lengths = data.corpus
        order = np.argsort(lengths, kind="stable")
        folder = Path(tempfile.mkdtemp(prefix=".embeddings-", dir=scratch))
        try:
            path = folder / "corpus.npy"
            batches = self._batches(params, rows, lengths, order, self.config.buckets)
            write_embeddings(path, batches, len(rows), "float32")
            queries = self.embedded(params, *data.test_queries, buckets=self._query_buckets(loaded))
            scores, index = top_k(queries, Embeddings.open(path), TOP_K)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        ids = [data.corpus_ids[i] for i in order]  # the file's rows are in length order
        run = {query: {ids[j]: float(s) for s, j in zip(scores[n], index[n])} for n, query in enumerate(data.query_ids)}
        return score_run(run, loaded.task.qrels)

    def embedded(
        self, params: dict, rows: list, lengths, index=None, buckets: tuple[int, ...] | None = None
    ) -> np.ndarray:
        """[N, H] fp32 embeddings of `rows[index]` (every row by default), in that order."""
        import numpy as np

        index = np.arange(len(rows)) if index is None else np.asarray(index)
        by_length = np.argsort(lengths[index], kind="stable")
        batches = self._batches(params, rows, lengths, index[by_length], buckets or self.config.buckets)
        out = np.concatenate(list(batches))
        embeddings = np.empty_like(out)
        embeddings[by_length] = out
        return embeddings

    def _batches(self, params: dict, rows: list, lengths, order, buckets: tuple[int, ...]) -> Iterator[np.ndarray]:
        """Embeddings of `rows[order]`, `eval_batch_size` rows a batch (fillers past the end), padded to buckets."""
        import torch

        size, padding = self.config.eval_batch_size, Padding(self.special, buckets, False)
        for start in range(0, len(order), size):
            index = order[start : start + size]
            arrays = padding.inputs(rows, lengths, index, size)
            batch = {k: to_device(torch.from_numpy(v), self.device) for k, v in arrays.items()}
            yield self.embed(params, batch)[: len(index)].float().cpu().numpy()

    def batch(self, loaded: RetrievalLoaded, index: list[int], dropout: float) -> dict:
        """The contrastive step's batch of pairs `index` (model/embedder.py): queries padded to one length,
        positives then hard negatives to the bucket of the longest; `dropout`: the step's rate."""
        import numpy as np
        import torch

        data, index = loaded.data, np.asarray(index)
        queries = Padding(self.special, self._query_buckets(loaded), False).inputs(*data.queries, index, len(index))
        doc_rows = [data.positives[0][i] for i in index]
        if data.negatives is not None:
            doc_rows += [data.negatives[0][i] for i in index]
        lengths = np.array([len(r) for r in doc_rows])
        everyone = np.arange(len(doc_rows))
        docs = Padding(self.special, self.config.buckets, False).inputs(doc_rows, lengths, everyone, len(doc_rows))
        arrays = {
            "query_ids": queries["input_ids"],
            "query_mask": queries["attention_mask"],
            "doc_ids": docs["input_ids"],
            "doc_mask": docs["attention_mask"],
            "dropout": np.array(dropout, dtype=np.float32),
        }
        return {k: to_device(torch.from_numpy(v), self.device) for k, v in arrays.items()}

    def _query_buckets(self, loaded: RetrievalLoaded) -> tuple[int, ...]:
        """One length for every query of the task: the bucket of its `query_max_length`."""
        return (bucket(loaded.settings.query_max_length, self.config.buckets),)


@dataclass(frozen=True)
class Making:
    """How an Embedder's steps are made: the precision, compiled or eager, the attention and the pooling."""

    precision: Precision
    compile: bool
    attention: str
    pooling: str


@dataclass
class Embedders:
    """The retrieval tasks' embedders, one per pooling and precision, made once each; the precision's
    canary on the first task (the compiled steps against eager ones, as `Tuner.canary`)."""

    make: Callable[[Making], Embedder]  # Embedder.make with the run's config, model, params and device
    tasks: list[RetrievalLoaded]
    compile: bool
    attention: str
    made: dict[tuple[Precision, str], Embedder] = field(default_factory=dict)  # (precision, pooling) -> Embedder

    def of(self, precision: Precision, pooling: str) -> Embedder:
        key = (precision, pooling)  # bf16 at two vector widths is two precisions: compiled apart
        if key not in self.made:
            self.made[key] = self.make(Making(precision, self.compile, self.attention, pooling))
        return self.made[key]

    def check(self, precision: Precision, steps: int, seed: int) -> float:
        """The first task's canary in `precision` (0.0 without a retrieval task)."""
        if not self.tasks:
            return 0.0
        first = self.tasks[0]
        eager = self.make(Making(precision, False, self.attention, first.settings.pooling))
        return self.of(precision, first.settings.pooling).canary(eager, first, steps, seed)
