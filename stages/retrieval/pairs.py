"""A retrieval task as evaluate scores it (`RetrievalTask`): the test corpus, queries and qrels, and the
training pairs, from a BEIR folder (`kind = "retrieval"`) or from tokenize's held-out documents
(`kind = "heldout-retrieval"`).

Training pairs, in this order of preference: the folder's `qrels/train.tsv` ("qrels"); the task's pairs
file ("pairs"); else pairs made from the corpus itself, from documents no test query finds relevant: a
document's title against its text where documents have titles ("titles"), else a span of a document
against the rest of it ("inverse-cloze", Lee et al. 2019's pretext task). A training pair whose query
is a test query's text is dropped and counted (`beir.without_leaks`).

The held-out documents are split by a hash of their title (of their text when untitled) into train and
test, as the topic task splits them: the test documents' texts form the corpus and their titles the
queries (each title finds its own document), the training documents give title -> text pairs. Without
titles, a span of each test document is its query and the rest of it the document.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cram.stages import StageError
from cram.stages.retrieval import beir
from cram.stages.retrieval.beir import Document, Pair, Qrels
from cram.stages.retrieval.metrics import METRICS
from cram.stages.retrieval.validation import Validation

PairSource = Literal["qrels", "pairs", "titles", "inverse-cloze"]
CLOZE_MIN_WORDS = 8  # a shorter document gives no inverse-cloze pair: its span or its rest would be a word or two
CLOZE_SPAN = 16  # words in an inverse-cloze query at most: an eighth of the document, at least 4


@dataclass(frozen=True)
class RetrievalTask:
    """What one retrieval task scores and trains on. `metrics` and `tests` read as a classification
    task's do (`kept.main_score`): nDCG@10 of what a seed offers, on the validation split, is the main score."""

    name: str
    corpus: dict[str, Document]  # by id: what the queries search
    queries: dict[str, str]  # the test queries, by id
    qrels: Qrels  # the test judgements
    pairs: tuple[Pair, ...]  # training pairs
    source: PairSource  # where the pairs came from
    pairs_dropped: int = 0  # training pairs whose query was a test query's text
    validation: Validation | None = None  # carved from the training pairs (validation.py), where there are enough

    metrics = METRICS
    # The keeper's main score is the first: what a seed offers scores on validation (results.py), never the test.
    tests = ("selection", "test")


def load_beir_task(name: str, path: str, pairs_file: str, where: str) -> RetrievalTask:
    """The task of a BEIR folder, its training pairs by the module's order of preference."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise StageError(f"{where}.path: {folder} is not a directory (a BEIR folder: corpus, queries, qrels/)")
    found = beir.read_beir(folder)
    test = found.qrels["test"]
    if "train" in found.qrels:
        pairs, source = beir.qrels_pairs(found, "train"), "qrels"
    elif pairs_file:
        pairs_path = Path(pairs_file).expanduser()
        if not pairs_path.is_file():
            raise StageError(f"{where}.pairs: {pairs_path} is not a file (JSON lines of query and positive)")
        pairs, source = beir.read_pairs(pairs_path), "pairs"
    else:
        relevant = {doc for judged in test.values() for doc, score in judged.items() if score > 0}
        pairs, source = corpus_pairs(d for d in found.corpus.values() if d.id not in relevant)
        if not pairs:
            raise StageError(
                f"{where}: no training pairs: {folder} has no qrels/train.tsv, no pairs file is given, and its "
                f"documents not judged relevant to a test query have neither titles nor {CLOZE_MIN_WORDS} words"
            )
    pairs, dropped = beir.without_leaks(found, pairs)
    if not pairs:
        raise StageError(
            f"{where}: every one of the {dropped} training pairs ({source}) has a test query of "
            f"{folder / 'qrels/test.tsv'} as its query: no pairs are left to train on"
        )
    queries = {q: found.queries[q] for q in test}
    return RetrievalTask(name, found.corpus, queries, test, pairs, source, dropped)


def load_heldout_task(name: str, path: Path, test_fraction: float) -> RetrievalTask:
    """The retrieval task of tokenize's held-out documents (a `datasets` folder with `text` and `title`)."""
    import datasets

    rows = datasets.load_from_disk(str(path)).to_dict()
    titles = rows.get("title") or [""] * len(rows["text"])
    docs = _distinct(titles, rows["text"])
    if len(docs) < 2:
        raise StageError(f"{path}: {len(docs)} held-out document(s) with text; a retrieval task needs two or more")
    ranked = sorted(docs, key=lambda d: hashlib.sha1((d.title or d.text).encode()).hexdigest())
    n_test = min(len(ranked) - 1, max(1, round(test_fraction * len(ranked))))
    test, train = ranked[:n_test], ranked[n_test:]
    pairs, source = corpus_pairs(train)
    corpus, queries, qrels = {}, {}, {}
    for k, doc in enumerate(test):
        pair = inverse_cloze(doc) if source == "inverse-cloze" else Pair(doc.title, doc.text) if doc.title else None
        if pair is None:
            continue
        corpus[doc.id] = Document(doc.id, "", pair.positive)  # the title is the query: not in the document
        queries[f"q{k}"] = pair.query
        qrels[f"q{k}"] = {doc.id: 1}
    if not pairs or not qrels:
        raise StageError(
            f"{path}: the held-out documents give no retrieval pairs (titles, or {CLOZE_MIN_WORDS} words or more)"
        )
    return RetrievalTask(name, corpus, queries, qrels, pairs, source)


def corpus_pairs(docs: Iterable[Document]) -> tuple[tuple[Pair, ...], PairSource]:
    """Training pairs made from `docs`: title -> text where any document has both, else inverse cloze."""
    docs = list(docs)
    titled = tuple(Pair(d.title, d.text) for d in docs if d.title.strip() and d.text.strip())
    if titled:
        return titled, "titles"
    return tuple(p for p in map(inverse_cloze, docs) if p is not None), "inverse-cloze"


def inverse_cloze(doc: Document) -> Pair | None:
    """A span of the document's words (an eighth of them, 4 to CLOZE_SPAN, at a place fixed by a hash of
    its id) against the words before and after it; None for a document under CLOZE_MIN_WORDS words."""
    words = doc.full_text.split()
    if len(words) < CLOZE_MIN_WORDS:
        return None
    size = min(CLOZE_SPAN, max(4, len(words) // 8))
    start = int(hashlib.sha1(doc.id.encode()).hexdigest(), 16) % (len(words) - size + 1)
    return Pair(" ".join(words[start : start + size]), " ".join(words[:start] + words[start + size :]))


def _distinct(titles: list[str], texts: list[str]) -> list[Document]:
    """The documents with a text, the first of each title (a title twice would be a query with two
    answers), ids by position."""
    seen, docs = set(), []
    for i, (title, text) in enumerate(zip(titles, texts)):
        title, text = (title or "").strip(), (text or "").strip()
        if not text or (title and title in seen):
            continue
        seen.add(title)
        docs.append(Document(f"d{i}", title, text))
    return docs
