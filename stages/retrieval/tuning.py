"""A retrieval task's contrastive fine-tune and its search, as `finetuning/finetune.py`'s Tuner does a
classifier's: every seed from the pretrained encoder (no head), its batches padded so that the compiled
steps are made once per length bucket, and the fine-tuned encoder scored on the test queries.

Batches (`model/embedder.py` reads them): the queries padded to one length (the bucket of the task's
`query_max_length`), the positives and hard negatives to the bucket of their longest, `batch_size` pairs
each with no text twice (`loss.distinct_batches`): the contrastive step compiles once per document
bucket. Eager steps have no graphs to bound: each batch is padded to its longest row, and the loop's
AdamW writes into its own copy of the params (`donate`), as the classifier's eager fine-tune does.

The corpus is embedded once per model in length-sorted batches, written to an `.npy` file in a scratch
folder (removed after), and searched exactly for each query's best 100 (`search.top_k`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from cram.stages.kept.batches import Padding, bucket, join
from cram.stages.retrieval.loss import distinct_batches
from cram.stages.shared.device import to_device
from cram.stages.shared.precision import stepped_difference
from cram.stages.shared.progress import Every, bar, track
from cram.stages.tasks.config import FINETUNE_OPTIMIZER, PROGRESS_EVERY_S

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    import torch
    from structlog.stdlib import BoundLogger

    from cram.model.config import ModelConfig
    from cram.stages.retrieval.metrics import Run, Scores
    from cram.stages.retrieval.pairs import RetrievalTask
    from cram.stages.retrieval.settings import RetrievalSettings
    from cram.stages.shared.precision import Difference, Precision
    from cram.stages.shared.tokenizer import Tokenizer
    from cram.stages.tasks.config import TaskConfig, Tuning

    Rows: TypeAlias = tuple[list[np.ndarray], np.ndarray]  # (ragged rows of ids, their lengths)

TOP_K = 101  # documents retrieved per query: Recall@100's depth and one the query itself may take (score_run)


@dataclass(frozen=True)
class EncodedPairs:
    """A retrieval task's texts as token ids: the training pairs' sides, the corpus (then the validation
    positives it lacks: searched for the validation queries alone), the test and the validation queries."""

    texts: list[tuple[str, ...]]  # each pair's texts, for batches without a text twice
    queries: Rows  # the pairs' queries
    positives: Rows
    negatives: Rows | None  # hard negatives, where the pairs carry them: pair i's n at rows i*n .. i*n+n-1
    corpus_ids: list[str]
    corpus: Rows
    documents: int  # the test corpus: the first `documents` of `corpus`
    query_ids: list[str]  # the test queries
    test_queries: Rows
    validation_ids: list[str]
    validation_queries: Rows | None

    @property
    def negatives_per_pair(self) -> int:
        """Hard negatives a pair carries (every pair the same: a batch has one shape); 0 without."""
        return 0 if self.negatives is None else len(self.negatives[0]) // len(self.queries[0])


@dataclass(frozen=True)
class RetrievalLoaded:
    """A retrieval task ready to fine-tune: its config entry, its data, them encoded, its settings, BM25's runs."""

    config: TaskConfig
    task: RetrievalTask
    data: EncodedPairs
    settings: RetrievalSettings
    lexical: dict[str, Run]  # BM25's runs by split (results.bm25_runs)
    mining: dict[str, int] | None = None  # what mining its hard negatives did (results.with_mined_negatives)


def encode_pairs(task: RetrievalTask, tokenizer: Tokenizer, special: dict, settings: RetrievalSettings) -> EncodedPairs:
    """The task's texts as [CLS] text [SEP] rows: queries cut at `query_max_length`, documents at `max_length`."""
    import numpy as np

    def rows(texts: list[str], length: int) -> Rows:
        # as given, not stripped: sentence-transformers 6 embeds a text as given (2 to 5 stripped it first),
        # and a byte-level tokenizer reads " text" and "text" apart; the export embeds what the fine-tune saw
        encoded = [join((ids,), special, length) for ids in tokenizer.encode(texts)]
        return encoded, np.array([len(r) for r in encoded])

    queries, documents = settings.query_max_length, settings.max_length
    pairs = task.pairs
    negatives = [text for p in pairs for text in p.negatives]
    validation = task.validation
    searched = {**task.corpus, **(validation.documents if validation is not None else {})}
    return EncodedPairs(
        texts=[p.texts for p in pairs],
        queries=rows([p.query for p in pairs], queries),
        positives=rows([p.positive for p in pairs], documents),
        negatives=rows(negatives, documents) if negatives else None,
        corpus_ids=list(searched),
        corpus=rows([d.full_text for d in searched.values()], documents),
        documents=len(task.corpus),
        query_ids=list(task.queries),
        test_queries=rows(list(task.queries.values()), queries),
        validation_ids=list(validation.queries) if validation is not None else [],
        validation_queries=rows(list(validation.queries.values()), queries) if validation is not None else None,
    )


def epoch_batches(loaded: RetrievalLoaded, seed: int, epoch: int, where: str) -> list[list[int]]:
    """An epoch's batches of pair indices, no text twice in one, shuffled by the seed and the epoch."""
    return distinct_batches(loaded.data.texts, loaded.settings.batch_size, seed * 1_000_003 + epoch, where)


@dataclass(frozen=True)
class EmbeddingTuner:
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
    ) -> EmbeddingTuner:
        import dataclasses

        from cram import model
        from cram.model.embedder import make_contrastive_step, make_embed_step
        from cram.model.grad_cache import make_cached_contrastive_step

        fixed = {k: v for k, v in FINETUNE_OPTIMIZER.items() if k != "schedule"}
        opt_cfg = model.AdamW(lr=config.lr, weight_decay=config.weight_decay, **fixed)
        options = how.precision.compile_options() if how.compile else None
        compilation = model.Compilation(how.compile, config.backend, how.precision.autocast(), how.attention, options)
        cfg = dataclasses.replace(cfg, dropout=0.0)  # the step's rate comes with each batch
        config = dataclasses.replace(config, compile=how.compile)
        if how.mini_batch is None:
            step = make_contrastive_step(cfg, opt_cfg, compilation, pooling=how.pooling)
        else:
            step = make_cached_contrastive_step(cfg, opt_cfg, compilation, pooling=how.pooling, chunk=how.mini_batch)
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
        # the loop's own copy, which its steps may overwrite (`donate`): every seed starts from self.params
        params = {k: v.clone() for k, v in self.params.items()}
        opt_state = model.optimizer_init(model.AdamW(), params)  # the fine-tune's optimizer: AdamW
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
                params, opt_state, metrics = self.step(params, opt_state, batch, lr, donate=True)
                losses.append(metrics["loss"])
                done += 1
                if log is not None and every.due():  # the loss read here is the one host sync in 30 s
                    log.info("fine-tuning", step=f"{done}/{total}", loss=round(float(metrics["loss"]), 4))
        return params, float(torch.stack(losses).mean())

    def canary(self, eager: EmbeddingTuner, graphs: list[EmbedderGraph], steps: int, tolerance: float) -> Difference:
        """The largest relative difference between this embedder's compiled graphs and `eager`'s, over
        `graphs` in turn (`graph_difference`, `precision.worst_graph`): the graphs fine-tuning and search
        then use."""
        from cram.stages.shared.precision import worst_graph

        return worst_graph(graphs, lambda graph: self.graph_difference(eager, graph, steps), tolerance)

    def graph_difference(self, eager: EmbeddingTuner, graph: EmbedderGraph, steps: int) -> float:
        """One graph's largest relative difference from eager, from the pretrained encoder, dropout off:
        `steps` contrastive steps on its batch of pairs (loss and gradient norm), or its rows' embeddings
        (relative to 1: they are unit vectors); inf when one is not finite."""
        import numpy as np
        import torch

        if graph.rows is None:
            batch = self.batch(graph.task, list(graph.index), dropout=0.0)
            lr = to_device(torch.tensor(self.config.lr, dtype=torch.float32), self.device)
            worst = stepped_difference((self.step, eager.step), self.params, batch, lr, steps).double().max()
            return float(worst) if torch.isfinite(worst) else float("inf")
        rows, lengths = graph.rows
        padding = Padding(self.special, (graph.bucket,), False)
        arrays = padding.inputs(rows, lengths, graph.index, self.config.eval_batch_size)
        batch = {k: to_device(torch.from_numpy(v), self.device) for k, v in arrays.items()}
        shown = [e.embed(self.params, batch).float().cpu().numpy() for e in (self, eager)]
        worst = float(np.abs(shown[0] - shown[1]).max())
        return worst if np.isfinite(worst) else float("inf")

    def search(self, params: dict, loaded: RetrievalLoaded, scratch: Path) -> Scores:
        """The test queries' scores (`runs`' test run against the qrels)."""
        from cram.stages.retrieval.metrics import score_run

        return score_run(
            self.runs(params, loaded, scratch)["test"], loaded.task.qrels, loaded.settings.ignore_identical_ids
        )

    def runs(self, params: dict, loaded: RetrievalLoaded, scratch: Path) -> dict[str, Run]:
        """Each query's TOP_K documents by exact search, by split ("test"; "validation" where the task has
        one): the corpus embedded to a file in a folder made under `scratch` (removed after). A test query
        searches the test corpus alone: the validation positives it lacks are searched past and dropped."""
        import numpy as np

        from cram.stages.retrieval.search import Embeddings, top_k, write_embeddings

        data = loaded.data
        rows, lengths = data.corpus
        order = np.argsort(lengths, kind="stable")
        ids = [data.corpus_ids[i] for i in order]  # the file's rows are in length order
        splits = [("test", data.query_ids, data.test_queries)]
        if data.validation_queries is not None:
            splits.append(("validation", data.validation_ids, data.validation_queries))
        folder = Path(tempfile.mkdtemp(prefix=".embeddings-", dir=scratch))
        try:
            path = folder / "corpus.npy"
            # a large corpus embeds for many minutes: a log line every PROGRESS_EVERY_S says it is not hung
            label = f"{loaded.config.name}: embedding the corpus"
            with bar(label, len(rows), lines_every=PROGRESS_EVERY_S) as advance:
                batches = self._batches(params, rows, lengths, order, self.config.buckets, advance)
                write_embeddings(path, batches, len(rows), "float32")
            runs = {}
            for split, query_ids, query_rows in splits:
                queries = self.embedded(params, *query_rows, buckets=self._query_buckets(loaded))
                past = len(rows) - data.documents if split == "test" else 0
                scores, index = top_k(queries, Embeddings.open(path), TOP_K + past)
                keep = (order[index] < data.documents) if past else np.ones(index.shape, bool)
                runs[split] = {
                    query: dict([(ids[j], float(s)) for s, j, k in zip(scores[n], index[n], keep[n]) if k][:TOP_K])
                    for n, query in enumerate(query_ids)
                }
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return runs

    def embedded(
        self, params: dict, rows: list, lengths, index=None, buckets: tuple[int, ...] | None = None
    ) -> np.ndarray:
        """[N, H] fp32 embeddings of `rows[index]` (every row by default), in that order."""
        import numpy as np

        index = np.arange(len(rows)) if index is None else np.asarray(index)
        by_length = np.argsort(lengths[index], kind="stable")
        batches = self._batches(
            params, rows, lengths, index[by_length], self.config.buckets if buckets is None else buckets
        )
        out = np.concatenate(list(batches))
        embeddings = np.empty_like(out)
        embeddings[by_length] = out
        return embeddings

    def _batches(
        self,
        params: dict,
        rows: list,
        lengths,
        order,
        buckets: tuple[int, ...],
        done: Callable[[int], None] | None = None,
    ) -> Iterator[np.ndarray]:
        """Embeddings of `rows[order]`, `eval_batch_size` rows a batch (fillers past the end), padded to buckets
        (eager: to each batch's longest); `done(n)` after each batch of n rows (a progress bar)."""
        import torch

        size, padding = self.config.eval_batch_size, Padding(self.special, self._compiled(buckets), False)
        for start in range(0, len(order), size):
            index = order[start : start + size]
            arrays = padding.inputs(rows, lengths, index, size)
            batch = {k: to_device(torch.from_numpy(v), self.device) for k, v in arrays.items()}
            yield self.embed(params, batch)[: len(index)].float().cpu().numpy()
            if done is not None:
                done(len(index))

    def batch(self, loaded: RetrievalLoaded, index: list[int], dropout: float) -> dict:
        """The contrastive step's batch of pairs `index` (model/embedder.py): queries padded to one length,
        the positives, then the pairs' first hard negatives, their second, ... (sentence-transformers' negative
        columns), to the bucket of the longest; `dropout`: the step's rate."""
        import numpy as np
        import torch

        data, index = loaded.data, np.asarray(index)
        queries = Padding(self.special, self._compiled(self._query_buckets(loaded)), False)
        queries = queries.inputs(*data.queries, index, len(index))
        doc_rows = [data.positives[0][i] for i in index]
        n = data.negatives_per_pair
        for k in range(n):
            doc_rows += [data.negatives[0][i * n + k] for i in index]
        lengths = np.array([len(r) for r in doc_rows])
        everyone = np.arange(len(doc_rows))
        padding = Padding(self.special, self._compiled(self.config.buckets), False)
        docs = padding.inputs(doc_rows, lengths, everyone, len(doc_rows))
        arrays = {
            "query_ids": queries["input_ids"],
            "query_mask": queries["attention_mask"],
            "doc_ids": docs["input_ids"],
            "doc_mask": docs["attention_mask"],
            "dropout": np.array(dropout, dtype=np.float32),
        }
        return {k: to_device(torch.from_numpy(v), self.device) for k, v in arrays.items()}

    def _compiled(self, buckets: tuple[int, ...]) -> tuple[int, ...]:
        """`buckets` for compiled steps, which they bound the graphs of; none for eager ones, whose batches
        are each padded to their longest row."""
        return buckets if self.config.compile else ()

    def _query_buckets(self, loaded: RetrievalLoaded) -> tuple[int, ...]:
        """One length for every query of the task: the bucket of its `query_max_length`."""
        return (bucket(loaded.settings.query_max_length, self.config.buckets),)


@dataclass(frozen=True)
class Making:
    """How an EmbeddingTuner's steps are made: the precision, compiled or eager, the attention, the pooling, and the
    rows the encoder embeds at once in a contrastive step (None: the whole batch; else GradCache)."""

    precision: Precision
    compile: bool
    attention: str
    pooling: str
    mini_batch: int | None = None


@dataclass(frozen=True)
class EmbedderGraph:
    """A compiled graph that a retrieval fine-tune or its search runs, and one batch of its shape for the
    canary: the contrastive step on a batch of pairs (`index`, its documents padded to `bucket`), or the
    embedding of `eval_batch_size` rows (`rows[index]`, each padded to `bucket`)."""

    task: RetrievalLoaded
    bucket: int
    index: np.ndarray
    rows: Rows | None = None  # the embedding's rows (the corpus or the test queries); None: the step's

    @property
    def name(self) -> str:
        pooling = self.task.settings.pooling
        if self.rows is not None:
            return f"embedding, {pooling} pooling, length {self.bucket}"
        queries = self.task.settings.query_max_length
        return (
            f"contrastive step, {pooling} pooling, {len(self.index)} pairs, queries {queries}, documents {self.bucket}"
        )


def embedder_graphs(tasks: list[RetrievalLoaded], tuning: Tuning, first_seed: int) -> list[EmbedderGraph]:
    """Every graph the retrieval tasks' fine-tunes and searches run, once each: the contrastive step at each
    document bucket a batch of any seed's epochs falls in, and the embedding at each bucket the corpus
    and the test queries fall in, with the first batch or rows of each."""
    import numpy as np

    found: dict[tuple, EmbedderGraph] = {}
    for t in tasks:
        data, settings = t.data, t.settings
        queries = bucket(settings.query_max_length, tuning.buckets)
        longest = data.positives[1]  # a pair's longest document
        if data.negatives is not None:
            longest = np.maximum(longest, data.negatives[1].reshape(len(longest), -1).max(axis=1))
        for seed in range(first_seed, first_seed + settings.seeds):
            for epoch in range(settings.epochs):
                for index in epoch_batches(t, seed, epoch, "canary"):
                    length = bucket(int(longest[index].max()), tuning.buckets)
                    key = ("step", *_step_kind(t), queries, length, len(index), data.negatives_per_pair)
                    found.setdefault(key, EmbedderGraph(t, length, np.asarray(index)))
        in_bucket = np.array([bucket(int(n), tuning.buckets) for n in data.corpus[1]])
        shapes = [(data.corpus, length, np.flatnonzero(in_bucket == length)) for length in np.unique(in_bucket)]
        shapes.append((data.test_queries, queries, np.arange(len(data.test_queries[0]))))  # padded to one length
        for rows, length, index in shapes:
            graph = EmbedderGraph(t, int(length), index[: tuning.eval_batch_size], rows)
            found.setdefault(("embedding", *_step_kind(t), int(length)), graph)
    return list(found.values())


@dataclass
class EmbeddingTuners:
    """The retrieval tasks' embedders, one per pooling and precision, made once each; the precision's
    canary over every graph they run (the compiled graphs against eager ones, as `Tuner.canary`)."""

    make: Callable[[Making], EmbeddingTuner]  # EmbeddingTuner.make with the run's config, model, params and device
    tasks: list[RetrievalLoaded]
    compile: bool
    attention: str
    # (precision, pooling, mini-batch) -> EmbeddingTuner
    made: dict[tuple[Precision, str, int | None], EmbeddingTuner] = field(default_factory=dict)

    def of(self, precision: Precision, pooling: str, mini_batch: int | None = None) -> EmbeddingTuner:
        key = (precision, pooling, mini_batch)  # bf16 at two vector widths is two precisions: compiled apart
        if key not in self.made:
            self.made[key] = self.make(Making(precision, self.compile, self.attention, pooling, mini_batch))
        return self.made[key]

    def check(self, precision: Precision, graphs: list[EmbedderGraph], steps: int, tolerance: float) -> Difference:
        """The canary of `graphs` (`embedder_graphs`) in `precision`, a pooling's graphs against an eager
        embedder of that pooling; stopping at the first graph past `tolerance`."""
        from cram.stages.shared.precision import Difference

        worst = Difference(0.0)
        for pooling, mini_batch in dict.fromkeys(_step_kind(g.task) for g in graphs):
            eager = self.make(Making(precision, False, self.attention, pooling, mini_batch))
            mine = [g for g in graphs if _step_kind(g.task) == (pooling, mini_batch)]
            worst = worst.worse(self.of(precision, pooling, mini_batch).canary(eager, mine, steps, tolerance))
            if not worst.value <= tolerance:
                break
        return worst


def _step_kind(task: RetrievalLoaded) -> tuple[str, int | None]:
    """What tells one EmbeddingTuner's steps from another's: the pooling and the mini-batch."""
    return task.settings.pooling, task.settings.mini_batch_size
