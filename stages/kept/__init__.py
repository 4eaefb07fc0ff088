"""Kept models: what a run keeps of a fine-tune, read back, run on texts and written in the formats other
tools read. Shared by the evaluate stage (which keeps classifiers, stages/evaluating/keeping.py), `cram
predict` and `cram export`; the commands parse, call this room and print.

    folder.py          a kept folder's files, their checksums, and the classifier or embedding model it holds
                       (`read_classifier`, `read_embedder`)
    batches.py         rows padded to the length buckets and run sorted by length, as the fine-tuner,
                       prediction and embedding give them
    predicting.py      a classifier run on files a chunk at a time (`Predictor`, `predict_files`)
    embedding.py       an embedding model run on files a chunk at a time into one .npy (`Embedding`, `embed_files`)
    searching.py       a corpus indexed once (embeddings, BM25) and searched dense, bm25 or hybrid (`cram search`)
    exporting.py       cram's format, transformers' and sentence-transformers' (`write_export`), read back
                       (`load_export`, `open_export`, `open_embedder_export`)
    sentence.py        the sentence-transformers modules of an export, and such a folder read as an embedding model
    fast_tokenizer.py  the tokenizer.json of a transformers export, encoding as cram does
    card.py            the model card of an export

A classifier is the first kind of kept model; an embedding model is the second, beside it: its own
description file, reader and runner, sharing the folder's files, checksums and export writing.
`predicting` and `embedding` are imported as modules (`cram.stages.kept.embedding`).
"""

from cram.stages.kept.card import Card
from cram.stages.kept.exporting import (
    FORMATS,
    Source,
    check_transformers,
    load_export,
    open_embedder_export,
    open_export,
    write_export,
)
from cram.stages.kept.folder import (
    EMBEDDER,
    MARKER,
    META,
    MODEL,
    PARAMS,
    KeptClassifier,
    KeptEmbedder,
    KeptError,
    read_classifier,
    read_embedder,
)

__all__ = [
    "EMBEDDER",
    "FORMATS",
    "MARKER",
    "META",
    "MODEL",
    "PARAMS",
    "Card",
    "KeptClassifier",
    "KeptEmbedder",
    "KeptError",
    "Source",
    "check_transformers",
    "load_export",
    "open_embedder_export",
    "open_export",
    "read_classifier",
    "read_embedder",
    "write_export",
]
