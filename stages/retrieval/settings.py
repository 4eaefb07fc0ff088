"""A retrieval task's settings (`RetrievalSettings`, made by the kind: stages/retrieval/kind.py) and the
defaults of the ones it may leave unset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cram.stages.tasks.config import TaskSettings

QUERY_MAX_LENGTH = 32  # a retrieval task's query length where it sets none: a title, a question
RETRIEVAL_BATCH_SIZE = 32  # pairs per contrastive batch where a task sets none: 31 in-batch negatives each
EMBEDDING_POOLINGS = ("mean", "first")  # model/embedder.py's, named here to keep this module free of torch
# mined hard negatives a pair at most: a contrastive batch embeds batch_size x (1 + n) documents, and mining
# reads 30 BM25 candidates a query (mining.DEPTH), some of them dropped as likely relevant
MAX_NEGATIVES_PER_PAIR = 16
# A `kind = "retrieval"` task's epochs, seeds and lr where neither it nor [evaluate] sets them, not the stage's
# GLUE rules (5 epochs x 5 seeds at 4e-5): sentence-transformers' epoch, and the lr chosen on SciFact's and
# NFCorpus's validation queries from all-MiniLM-L6-v2 (bench/README.md, "retrieval defaults").
BEIR_DEFAULTS = {"epochs": 1, "seeds": 3, "lr": 4e-5}
# its documents' length likewise: an abstract's, sentence-transformers' for MiniLM; the longest bucket within
# it where the buckets or the model's positions end sooner
BEIR_MAX_LENGTH = 256


@dataclass(frozen=True)
class RetrievalSettings(TaskSettings):
    """A retrieval task's settings: a classification task's, the query length, the contrastive batch, the
    embedding's pooling, the rows the encoder embeds at once (None: the whole batch), where hard negatives come
    from and how many a pair takes when mined, and whether a document with the query's own id is scored."""

    query_max_length: int
    batch_size: int
    pooling: Literal["mean", "first"]
    mini_batch_size: int | None = None
    hard_negatives: Literal["pairs", "mined"] = "pairs"
    negatives_per_pair: int = 1
    ignore_identical_ids: bool = True
