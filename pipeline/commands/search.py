"""`cram search`: a corpus searched with a kept or exported embedding model, BM25, or both fused (the
default). The engine: stages/kept/searching.py.

    search(Path("runs/default"), [Path("queries.txt")], Path("hits.jsonl"), Corpus((Path("docs.jsonl"),)))

The corpus's embeddings and BM25 index are built on the first search and kept under `cache` (by default
`.cram-search/` in the working folder), keyed by the corpus files, the fields and the model: a later search
of the same corpus reuses them. One JSON line per query, in order, `{"query": id, "hits": [{"id", "score"}]}`,
written to a temporary file renamed once every line is in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from cram.pipeline import errors
from cram.pipeline.commands import embed, predict
from cram.stages import StageError
from cram.stages.kept import KeptError
from cram.stages.kept.embedding import Embedding
from cram.stages.kept.predicting import Settings
from cram.stages.kept.searching import Corpus, Query, open_index
from cram.stages.kept.searching import search as searched
from cram.stages.retrieval.fusion import Fusion
from cram.stages.shared.files import atomic

CACHE = Path(".cram-search")
OUTPUTS = (".jsonl",)


class SearchError(errors.CramError):
    """An input, output, setting or embedding model `cram search` cannot use; one line, exit code 2."""


class Searched(NamedTuple):
    """What `search` did: queries answered, corpus documents, and whether the corpus index was reused."""

    queries: int
    documents: int
    reused: bool


def query_settings(
    mode: str, top_k: int, fusion: str | None, weight: float | None, field: str = "text", id_field: str | None = None
) -> Query:
    """The options' Query (`fusion` and `weight` None: the model's own); SearchError naming the option where
    one is out of its range."""
    given = {} if fusion is None else {"method": fusion}
    given |= {} if weight is None else {"weight": weight}
    try:
        return Query(mode, top_k, Fusion(**given) if given else None, field, id_field)  # type: ignore[arg-type]
    except ValueError as e:
        option = str(e).split(":")[0].replace("_", "-").replace("method", "fusion")
        raise SearchError(f"--{option}{str(e)[len(option) :]}") from None


def search(
    source: Path,
    queries: list[Path],
    out: Path,
    corpus: Corpus,
    query: Query = Query(),
    task: str | None = None,
    cache: Path = CACHE,
    precision: str = "auto",
) -> Searched:
    """Answer every query of QUERIES over CORPUS with SOURCE's embedding model into OUT."""
    try:
        predict.check_paths([*queries, *corpus.files], out, OUTPUTS)
        embedding = Embedding.make(*embed.open_source(source, task), Settings(compile=False), precision)
        index = open_index(embedding, corpus, cache)
        count = 0
        with atomic(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
            for record in searched(index, embedding, queries, query):
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                count += 1
    except predict.PredictError as e:
        raise SearchError(str(e)) from None
    except KeptError as e:
        raise SearchError(str(e)) from None
    except StageError as e:  # an input file the reader refuses
        raise SearchError(f"{e} (--field and --query-field name the fields that hold the text)") from None
    return Searched(count, index.embeddings.rows, index.reused)
