"""A retrieval set in the BEIR layout, and training pairs, read into small typed values with every bad
input the files themselves can show refused in one line that names the file and the id, record or line.

The BEIR layout is what every retrieval benchmark and NanoBEIR ship: `corpus.jsonl` (`_id`, `title`,
`text`), `queries.jsonl` (`_id`, `text`), `qrels/test.tsv` and optionally `qrels/dev.tsv` and
`qrels/train.tsv` (tab-separated `query-id  corpus-id  score` under a header line). A pairs file is JSON
lines `{"query", "positive"[, "negative"]}`. Records are read by `taskfiles.iter_records`, the one
reader of a task's JSON-lines files, and each text checked by its `checked_text`, as every text read is.
"""

from __future__ import annotations

import csv
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cram.stages import StageError
from cram.stages.shared.taskfiles import checked_text, iter_records

SPLITS = ("test", "dev", "train")  # the qrels a folder may hold; test is required
Qrels = dict[str, dict[str, int]]  # query id -> corpus id -> graded relevance (> 0: relevant)


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str

    @property
    def full_text(self) -> str:
        """What a model reads of the document: title and text joined by a space, as BEIR's own
        sentence-embedding evaluation joins them."""
        return f"{self.title} {self.text}".strip()


@dataclass(frozen=True)
class BeirSet:
    folder: Path
    corpus: dict[str, Document]  # by id, in the file's order
    queries: dict[str, str]  # id -> text, in the file's order
    qrels: dict[str, Qrels]  # split ("test", and "dev"/"train" where the folder has them) -> qrels


@dataclass(frozen=True)
class Pair:
    query: str
    positive: str
    negatives: tuple[str, ...] = ()  # hard negatives: a pairs file's one, or mining's n (mining.py)

    @property
    def texts(self) -> tuple[str, ...]:
        return (self.query, self.positive, *self.negatives)


def read_beir(folder: Path) -> BeirSet:
    """The set in `folder`, its qrels checked against its corpus and queries."""
    missing = [name for name in ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv") if not (folder / name).is_file()]
    if missing:
        raise StageError(f"{folder}: not a BEIR folder: no {', '.join(missing)}")
    corpus, queries = _read_corpus(folder / "corpus.jsonl"), _read_queries(folder / "queries.jsonl")
    qrels = {}
    for split in SPLITS:
        path = folder / "qrels" / f"{split}.tsv"
        if path.is_file():
            qrels[split] = read_qrels(path)
            _check_known(path, qrels[split], corpus, queries)
            if split != "dev":  # dev is not read
                _check_relevant(path, qrels[split], split)
    return BeirSet(folder, corpus, queries, qrels)


def read_qrels(path: Path) -> Qrels:
    """The qrels of one split: integer scores, each (query, document) judged once, under a header line."""
    qrels: Qrels = {}
    with path.open(encoding="utf-8-sig", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None)
        if header is None or (len(header) == 3 and _integer(header[2]) is not None):
            raise StageError(f"{path}: no header line; expected 'query-id<TAB>corpus-id<TAB>score' first")
        for line, row in enumerate(rows, 2):
            if not row:
                continue
            if len(row) != 3:
                raise StageError(f"{path}:{line}: {len(row)} fields; expected query-id, corpus-id, score")
            query, doc, score = row
            relevance = _integer(score)
            if relevance is None:
                raise StageError(f"{path}:{line}: score {score!r} is not an integer")
            judged = qrels.setdefault(query, {})
            if doc in judged:
                raise StageError(f"{path}:{line}: query {query!r} judges document {doc!r} a second time")
            judged[doc] = relevance
    if not qrels:
        raise StageError(f"{path}: no judgements")
    return qrels


def read_pairs(path: Path) -> tuple[Pair, ...]:
    """Training pairs from a JSON-lines file: `query` and `positive` in each record, `negative` optional
    (in every record or in none: a batch's hard-negative column is all or nothing)."""
    pairs = []
    for n, (where, record) in enumerate(iter_records(path), 1):
        texts = {}
        for key in ("query", "positive", "negative"):
            value = record.get(key)
            if value is None and key == "negative":
                continue
            if value is None:
                raise StageError(f"{path}: record {n} has no {key!r}; each record needs query and positive texts")
            value = checked_text(value, key, f"{path}: record {n}")
            if not value.strip():
                raise StageError(f"{path}: record {n} has an empty {key!r}")
            texts[key] = value
        _check_distinct(texts, where)
        pairs.append(Pair(texts["query"], texts["positive"], (texts["negative"],) if "negative" in texts else ()))
    if not pairs:
        raise StageError(f"{path}: no pairs")
    with_negative = sum(bool(p.negatives) for p in pairs)
    if 0 < with_negative < len(pairs):
        first = next(n for n, p in enumerate(pairs, 1) if not p.negatives)
        raise StageError(
            f"{path}: {with_negative} of {len(pairs)} records have a 'negative' (record {first} has none); "
            "give one to every record or to none"
        )
    return tuple(pairs)


def _check_distinct(texts: dict[str, str], where: str) -> None:
    """Refuse a record two of whose texts are one text (compared as the leak check compares them, without
    the whitespace at either end): a positive that is its query teaches nothing, a negative that is its
    positive (or its query) is trained both toward and away from it."""
    for first, second in itertools.combinations(texts, 2):
        if texts[first].strip() == texts[second].strip():
            raise StageError(f"{where}: its {second!r} is the same text as its {first!r}; a pair's texts must differ")


def qrels_pairs(beir: BeirSet, split: str = "train") -> tuple[Pair, ...]:
    """A pair for each relevant (score > 0) judgement of `split`: the query's text and the document's."""
    return tuple(
        Pair(beir.queries[query], beir.corpus[doc].full_text)
        for query, judged in beir.qrels[split].items()
        for doc, relevance in judged.items()
        if relevance > 0
    )


def without_leaks(beir: BeirSet, pairs: Sequence[Pair]) -> tuple[tuple[Pair, ...], int]:
    """The training pairs less those whose query is a test query's text, and how many were dropped: a
    model trained on a test query scores what it memorised, not what it retrieves. Published sets hold
    such pairs (in one small BEIR set two training queries are test queries word for word), so they are
    dropped and counted, not refused."""
    tests = {beir.queries[q].strip() for q in beir.qrels["test"]}
    kept = tuple(p for p in pairs if p.query.strip() not in tests)
    return kept, len(pairs) - len(kept)


def _read_corpus(path: Path) -> dict[str, Document]:
    corpus = {
        id_: Document(id_, _text(record, "title", path, id_, optional=True), _text(record, "text", path, id_))
        for id_, record in _records(path)
    }
    empty = next((doc.id for doc in corpus.values() if not doc.full_text), None)
    if empty is not None:
        raise StageError(f"{path}: document {empty!r} has an empty title and text")
    return corpus


def _read_queries(path: Path) -> dict[str, str]:
    queries = {id_: _text(record, "text", path, id_) for id_, record in _records(path)}
    empty = next((id_ for id_, text in queries.items() if not text.strip()), None)
    if empty is not None:
        raise StageError(f"{path}: query {empty!r} has an empty text")
    return queries


def _parse(path: Path) -> list[dict]:
    return [record for _, record in iter_records(path)]


def _records(path: Path) -> list[tuple[str, dict]]:
    """(id, record) of each record, ids present and unique."""
    records = _parse(path)
    out = []
    for n, record in enumerate(records, 1):
        id_ = record.get("_id")
        if isinstance(id_, bool) or not isinstance(id_, (str, int)) or str(id_) == "":
            raise StageError(f"{path}: record {n} has no '_id' (a string or an integer)")
        out.append((str(id_), record))
    counts = Counter(id_ for id_, _ in out)
    repeated = [id_ for id_, count in counts.items() if count > 1]
    if repeated:
        raise StageError(
            f"{path}: {len(repeated)} id{'s' if len(repeated) > 1 else ''} given more than once, "
            f"the first {repeated[0]!r} ({counts[repeated[0]]} times)"
        )
    if not out:
        raise StageError(f"{path}: no records")
    return out


def _text(record: dict, key: str, path: Path, id_: str, optional: bool = False) -> str:
    value = record.get(key)
    if value is None and optional:
        return ""
    if value is None:
        raise StageError(f"{path}: record {id_!r} has no {key!r}")
    return checked_text(value, key, f"{path}: record {id_!r}")


def _check_known(path: Path, qrels: Qrels, corpus: dict[str, Document], queries: dict[str, str]) -> None:
    for what, ids, known, file in (
        ("query", list(qrels), queries, "queries.jsonl"),
        ("document", [d for judged in qrels.values() for d in judged], corpus, "corpus.jsonl"),
    ):
        unknown = list(dict.fromkeys(i for i in ids if i not in known))
        if unknown:
            raise StageError(
                f"{path}: {len(unknown)} {what} id{'s' if len(unknown) > 1 else ''} not in {file}, "
                f"the first {unknown[0]!r}"
            )


def _check_relevant(path: Path, qrels: Qrels, split: str) -> None:
    """A split whose every judgement scores 0 or less holds no relevant document: its test queries could
    not be scored (each metric divides by the query's relevant documents), its training queries pair with
    nothing."""
    if any(relevance > 0 for judged in qrels.values() for relevance in judged.values()):
        return
    what = "no test query can be scored" if split == "test" else "it gives no training pairs"
    raise StageError(
        f"{path}: every judgement scores 0 or less, so no query has a relevant document and {what}; "
        "a relevant document scores 1 or more"
    )


def _integer(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None
