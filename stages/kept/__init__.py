"""Kept models: what a run keeps of a fine-tune, read back, run on texts and written in the formats other
tools read. Shared by the evaluate stage (which keeps classifiers, stages/finetuning/kept.py), `cram
predict` and `cram export`; the commands parse, call this room and print.

    folder.py          a kept folder's files, their checksums, and the classifier it holds (`read_classifier`)
    batches.py         rows padded to the length buckets, as the fine-tuner and prediction give them
    predicting.py      a classifier run on files a chunk at a time (`Predictor`, `predict_files`)
    exporting.py       cram's format and transformers' (`write_export`), read back (`load_export`, `open_export`)
    fast_tokenizer.py  the tokenizer.json of a transformers export, encoding as cram does
    card.py            the model card of an export

A classifier is the first kind of kept model; an embedding model is the second, beside it: its own
description file, reader and runner, sharing the folder's files, checksums and
export writing. `predicting` is imported as a module (`cram.stages.kept.predicting`).
"""

from cram.stages.kept.card import Card
from cram.stages.kept.exporting import (
    FORMATS,
    MARKER,
    Source,
    check_transformers,
    load_export,
    open_export,
    write_export,
)
from cram.stages.kept.folder import META, MODEL, PARAMS, Classifier, KeptError, read_classifier

__all__ = [
    "FORMATS",
    "MARKER",
    "META",
    "MODEL",
    "PARAMS",
    "Card",
    "Classifier",
    "KeptError",
    "Source",
    "check_transformers",
    "load_export",
    "open_export",
    "read_classifier",
    "write_export",
]
