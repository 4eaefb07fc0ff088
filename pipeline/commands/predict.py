"""`cram predict`: classify files with a classifier the evaluate stage kept, or one exported with
`cram export RUN --task NAME` (cram's format). The prediction itself: stages/kept/predicting.py.

    predict(Path("runs/default"), [Path("texts.csv")], task="topic", out=Path("labels.jsonl"))

Inputs are CSV / TSV (a header names the fields), JSON lines or plain text (one text a line), holding
the task's text fields (classifier.json `text_fields`), read as a custom task's files are. One row per
input text, in order: `{"label": NAME, "probabilities": {NAME: p, ...}}`, or `{"value": x}` for a
regression, or a tagger's `{"entities": [{"type", "start", "end", "text", "score"}, ...]}`
(stages/tagging/predicting.py); JSON lines or CSV by the `--out` extension (any case; a tagger's JSON lines
alone), JSON lines on stdout without it. The texts are read, classified and written a chunk at a time;
`--out` is written to a temporary file and renamed once every row is in it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from cram.pipeline import errors, rundir, store
from cram.pipeline.commands import classifiers
from cram.stages import StageError
from cram.stages.kept import KeptClassifier, KeptError, open_export
from cram.stages.kept.predicting import OUTPUTS, Predictor, Settings, output_kind, predict_files
from cram.stages.tagging.predicting import TagPredictor

INPUTS = (".csv", ".tsv", ".jsonl", ".ndjson", ".txt", ".text")


class PredictError(errors.CramError):
    """An input, output or classifier `cram predict` cannot use; one line, exit code 2."""


def predict(
    source: Path,
    files: list[Path],
    task: str | None = None,
    out: Path | None = None,
    settings: Settings = Settings(),
    stream: TextIO | None = None,
) -> int:
    """Classify every text of FILES with SOURCE's classifier (a run directory and `task`, or a cram-format
    classifier export); write the rows to OUT (or `stream`, by default the stdout of the moment, never the
    one at import); return how many were written."""
    check_paths(files, out)
    classifier, tokenizer, special = _classifier(source, task)
    # a tagger (a token-classification task's) writes each text's entities: JSON lines alone
    tagger = bool(classifier.meta.get("per_token"))
    if tagger and out is not None and output_kind(out) == "csv":
        raise PredictError(f"--out {out}: a tagger writes each text's entities as JSON lines; name a .jsonl file")
    try:
        make = TagPredictor.make if tagger else Predictor.make
        predictor = make(classifier, tokenizer, special, settings)
        return predict_files(predictor, files, out, stream or sys.stdout)
    except KeptError as e:
        raise PredictError(str(e)) from None
    except StageError as e:  # an input file the reader refuses
        raise PredictError(f"{e} (the classifier reads {', '.join(classifier.meta['text_fields'])})") from None


def check_paths(files: list[Path], out: Path | None, outputs: tuple[str, ...] = OUTPUTS) -> None:
    """PredictError for an input that is missing or of an unknown kind, or an `--out` of a kind not in
    `outputs`, that is one of the inputs, that lies in a run directory or a stage store, that is a directory,
    or whose folder is missing or cannot be written."""
    for path in files:
        if path.suffix.lower() not in INPUTS:
            raise PredictError(f"{path}: unknown extension {path.suffix or '(none)'!r}; allowed {', '.join(INPUTS)}")
        if not path.is_file():
            raise PredictError(f"{path}: not a file")
    if out is None:
        return
    if out.suffix.lower() not in outputs:
        raise PredictError(f"--out {out}: unknown extension {out.suffix or '(none)'!r}; allowed {', '.join(outputs)}")
    target = out.resolve()
    if any(target == path.resolve() for path in files):
        raise PredictError(f"--out {out}: is one of the inputs; never overwritten: choose another path")
    inside = next((p for p in target.parents if (p / rundir.MANIFEST).is_file() or p.name == store.STORE), None)
    if inside is not None:
        raise PredictError(f"--out {out}: inside the run directory or store {inside}; write it outside")
    if target.is_dir():
        raise PredictError(f"--out {out}: a directory; name the file to write in it")
    if not target.parent.is_dir():
        raise PredictError(f"--out {out}: the folder {out.parent} does not exist")
    _check_writable(out, target.parent)


def _check_writable(out: Path, folder: Path) -> None:
    """PredictError where no file can be made in `folder` (read-only, not ours, a read-only file system):
    found by making one and removing it, before any model is loaded or text computed, since permission bits
    do not tell (root ignores them; a read-only mount or an ACL does not show in them)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".probe", dir=folder)
    except OSError as e:
        raise PredictError(f"--out {out}: cannot write in {out.parent}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def _classifier(source: Path, task: str | None) -> tuple[KeptClassifier, Path, dict[str, int]]:
    """(the classifier, its tokenizer file, the special ids) of a run directory's task or an export."""
    if (source / rundir.MANIFEST).is_file():
        if task is None:
            raise PredictError(f"{source}: a run directory; name the task to classify with --task")
        classifier = classifiers.find(source, task)
        try:
            run = classifiers.finished_run(source, doing="predicted")
        except classifiers.RunError as e:
            raise PredictError(str(e)) from None
        return classifier, run.tokenizer, run.special_ids
    if not source.is_dir():
        raise PredictError(f"{source}: neither a run directory nor an exported classifier folder")
    try:
        classifier, tokenizer, special = open_export(source)
    except KeptError as e:
        raise PredictError(str(e)) from None
    if task is not None and task != classifier.task:
        raise PredictError(f"--task {task}: {source} holds the classifier of task {classifier.task!r}")
    return classifier, tokenizer, special
