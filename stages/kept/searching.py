"""A corpus searched with a kept embedding model, BM25, or both fused: `cram search`'s engine.

    index = open_index(embedding, Corpus((Path("docs.jsonl"),), id_field="_id"), cache=Path(".cram-search"))
    hits = search(index, embedding, [Path("queries.txt")], Query(mode="hybrid", top_k=10))

The corpus is indexed once for each (corpus files, text and id fields, embedding model, precision): its
embeddings (unit vectors, fp16 `.npy`), its BM25 index (stages/retrieval/bm25.py) and its ids, in a cache
entry named by their key, built in a temporary folder and renamed into place; a later search with the same
key reuses it. Searching maps the embeddings a chunk at a time (stages/retrieval/search.py) and the BM25
arrays from disk, so memory stays flat in the corpus's size beyond the vocabulary. Each query takes the
dense run's and BM25's best CANDIDATES documents; `hybrid` fuses them (stages/retrieval/fusion.py), and the
best `top_k` come out, equal scores by corpus order.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from cram.stages.kept.embedding import Embedding, Request, identified, prompt_text
from cram.stages.kept.folder import KeptError
from cram.stages.kept.predicting import PROGRESS_EVERY_S
from cram.stages.retrieval import bm25
from cram.stages.retrieval.fusion import Fusion, Hits, fuse
from cram.stages.retrieval.search import Embeddings, top_k, write_embeddings
from cram.stages.shared.files import files_under, fingerprint, write_atomic
from cram.stages.shared.progress import bar

MODES = ("hybrid", "dense", "bm25")
CANDIDATES = 100  # each run's depth before fusion: BEIR's retrieval depth
ENTRY_VERSION = 1
_ENTRY, _EMBEDDINGS, _IDS, _BM25 = "entry.json", "embeddings.npy", "ids.npy", "bm25"


@dataclass(frozen=True)
class Corpus:
    """What to index: the records of `files` (text, CSV, TSV or JSON lines), their text `field`, and the
    field of each one's id (None: the row number from 0)."""

    files: tuple[Path, ...]
    field: str = "text"
    id_field: str | None = None


@dataclass(frozen=True)
class Query:
    """How to answer: `mode` (MODES), the `top_k` hits a query, the `fusion` of `hybrid` (None: the one the
    embedding model's evaluate chose on its validation queries, `embedder.json`'s, else fusion.py's default),
    and the queries' text field and id field (None: the row number from 0)."""

    mode: Literal["hybrid", "dense", "bm25"] = "hybrid"
    top_k: int = 10
    fusion: Fusion | None = None
    field: str = "text"
    id_field: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.top_k < 1:
            raise ValueError(f"top_k: {self.top_k} must be at least 1")


@dataclass(frozen=True)
class CorpusIndex:
    """A cache entry opened: its folder, the documents' ids, their embeddings on disk, their BM25 index,
    and whether it was there before this search."""

    folder: Path
    ids: np.ndarray
    embeddings: Embeddings
    lexical: bm25.Index
    reused: bool


def corpus_key(embedding: Embedding, corpus: Corpus) -> str:
    """The cache entry's name: it changes when a corpus file, a field, the model's files or the precision
    the model computes in does (files by size and modification time, as stage keys take them)."""
    payload = {
        "version": ENTRY_VERSION,
        "corpus": fingerprint(path.resolve() for path in corpus.files),
        "field": corpus.field,
        "id_field": corpus.id_field,
        "model": fingerprint(files_under(embedding.embedder.folder.resolve())),
        "precision": embedding.precision,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def open_index(embedding: Embedding, corpus: Corpus, cache: Path) -> CorpusIndex:
    """The corpus's cache entry under `cache`, built first where it is not there."""
    entry = cache / corpus_key(embedding, corpus)
    reused = (entry / _ENTRY).is_file()
    if not reused:
        try:
            _build(embedding, corpus, entry)
        except OSError as e:
            raise KeptError(f"--cache {cache}: cannot write the corpus index there: {e.strerror or e}") from None
    ids = np.load(entry / _IDS, mmap_mode="r")
    return CorpusIndex(entry, ids, Embeddings.open(entry / _EMBEDDINGS), bm25.load(entry / _BM25), reused)


def _build(embedding: Embedding, corpus: Corpus, entry: Path) -> None:
    """Every file of the entry written to a temporary sibling folder, renamed into place once whole; a
    build that fails or is interrupted leaves no entry and no temporary folder."""
    files, request = list(corpus.files), Request(field=corpus.field, id_field=corpus.id_field)
    size = embedding.settings.chunk
    count = sum(len(texts) for texts, _ in identified(files, request, size))  # every record checked first
    if not count:
        raise KeptError("no documents to index: name at least one corpus file")
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True)
    try:
        ids: list[str] = []
        prompt = prompt_text(embedding.embedder, None)
        with bar("index", count, lines_every=PROGRESS_EVERY_S) as advance:

            def vectors() -> Iterator[np.ndarray]:
                for texts, chunk_ids in identified(files, request, size):
                    ids.extend(str(i) for i in chunk_ids)
                    yield embedding.vectors(texts, False, advance, prompt)

            write_embeddings(tmp / _EMBEDDINGS, vectors(), count, "float16")
        np.save(tmp / _IDS, np.array(ids, dtype=str))
        bm25.save(bm25.index(text for texts, _ in identified(files, request, size) for text in texts), tmp / _BM25)
        write_atomic(tmp / _ENTRY, json.dumps({"version": ENTRY_VERSION, "documents": count}))
        try:
            tmp.rename(entry)
        except OSError:
            if not (entry / _ENTRY).is_file():  # not another process's finished entry: a real failure
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def search(index: CorpusIndex, embedding: Embedding, files: list[Path], query: Query) -> Iterator[dict]:
    """One record a query of FILES, in order: `{"query": id, "hits": [{"id": ..., "score": ...}, ...]}`."""
    request = Request(field=query.field, id_field=query.id_field, query=True)
    prompt = prompt_text(embedding.embedder, None)
    for texts, ids in identified(files, request, embedding.settings.chunk):
        dense = _dense_runs(index, embedding, texts, prompt) if query.mode != "bm25" else [{} for _ in texts]
        for text, query_id, dense_run in zip(texts, ids, dense):
            lexical = _lexical_run(index, text) if query.mode != "dense" else {}
            if query.mode == "hybrid":
                run = fuse(dense_run, lexical, query.fusion or model_fusion(embedding))
            else:
                run = dense_run if query.mode == "dense" else lexical
            best = sorted(run, key=lambda doc: (-run[doc], doc))[: query.top_k]
            hits = [{"id": str(index.ids[doc]), "score": round(float(run[doc]), 6)} for doc in best]
            yield {"query": query_id if isinstance(query_id, str) else int(query_id), "hits": hits}


def model_fusion(embedding: Embedding) -> Fusion:
    """The fusion the embedding model was kept with (`embedder.json`'s `fusion`), else the default."""
    recorded = embedding.embedder.meta.get("fusion")
    return Fusion(**recorded) if isinstance(recorded, dict) else Fusion()


def _dense_runs(index: CorpusIndex, embedding: Embedding, texts: list[str], prompt: str) -> list[Hits]:
    scores, found = top_k(embedding.vectors(texts, True, prompt=prompt), index.embeddings, CANDIDATES)
    return [{int(d): float(s) for d, s in zip(docs, row)} for docs, row in zip(found, scores)]


def _lexical_run(index: CorpusIndex, text: str) -> Hits:
    docs, scores = bm25.search(index.lexical, text, CANDIDATES)
    return {int(d): float(s) for d, s in zip(docs, scores)}
