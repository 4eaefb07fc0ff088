"""A validation split carved from a retrieval task's training pairs: what the task's choices are made on
(the seed kept, the fusion with BM25, fine-tuned or as it was), never its test.

Queries are drawn by a hash of their text, so the split is the same wherever the task runs: SHARE of the
training queries, at most MAX_QUERIES, each with all of its pairs. A task whose draw gives fewer than
MIN_QUERIES, or whose other pairs would fill fewer than two batches, has no validation split: then nothing
is chosen (the first seed is kept, fine-tuned, fused at fusion.py's default). A validation query's positives
are found in the corpus by their text where they are in it (a BEIR folder's train qrels); the others join
the corpus for the validation search alone (`documents`), so that each validation query has its answer to
find among the test corpus's documents.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cram.stages.retrieval.beir import Document, Pair, Qrels

SHARE = 0.1
MIN_QUERIES = 8  # fewer: a score too noisy to choose by (a 50-query nDCG@10 has a standard error near 0.04)
MAX_QUERIES = 1000  # more: a longer search after every seed for little more certainty


@dataclass(frozen=True)
class Validation:
    """Validation queries by id, their judgements, and the positives the corpus lacks (searched beside it)."""

    queries: dict[str, str]
    qrels: Qrels
    documents: dict[str, Document]


def carve(
    pairs: tuple[Pair, ...], corpus: dict[str, Document], batch_size: int
) -> tuple[tuple[Pair, ...], Validation | None]:
    """(the training pairs left, the validation split), or (`pairs`, None) where the task has none."""
    by_query: dict[str, list[Pair]] = {}
    for pair in pairs:
        by_query.setdefault(pair.query.strip(), []).append(pair)
    drawn = sorted((q for q in by_query if draw(q) < SHARE), key=draw)[:MAX_QUERIES]
    held = set(drawn)
    train = tuple(p for p in pairs if p.query.strip() not in held)
    if len(drawn) < MIN_QUERIES or len(train) < 2 * batch_size:
        return pairs, None
    return train, _split([by_query[q] for q in drawn], corpus)


def _split(groups: list[list[Pair]], corpus: dict[str, Document]) -> Validation:
    by_text = {doc.full_text.strip(): doc.id for doc in corpus.values()}
    queries: dict[str, str] = {}
    qrels: Qrels = {}
    documents: dict[str, Document] = {}
    for n, group in enumerate(groups):
        query = f"validation-q{n}"
        queries[query] = group[0].query
        for pair in group:
            text = pair.positive.strip()
            if text not in by_text:
                doc = _fresh_id(f"validation-d{len(documents)}", corpus)
                documents[doc] = Document(doc, "", pair.positive)
                by_text[text] = doc
            qrels.setdefault(query, {})[by_text[text]] = 1
    return Validation(queries, qrels, documents)


def draw(query: str) -> float:
    """Where a query falls in [0, 1): a hash of its text, not a random draw, so every run splits alike;
    salted, since the held-out documents are split into test and training by the bare hash of the same
    titles (pairs.load_heldout_task), which would leave every training title above the test's share."""
    return int(hashlib.sha1(b"validation\0" + query.encode("utf-8")).hexdigest()[:12], 16) / 16**12


def _fresh_id(wanted: str, corpus: dict[str, Document]) -> str:
    while wanted in corpus:
        wanted += "_"
    return wanted
