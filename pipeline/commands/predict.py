"""`cram predict`: classify files with a classifier the evaluate stage kept, or one exported with
`cram export RUN --task NAME` (cram's format).

    predict(Path("runs/default"), [Path("texts.csv")], task="topic", out=Path("labels.jsonl"))

Inputs are CSV / TSV (a header names the fields), JSON lines or plain text (one text a line), holding
the task's text fields (classifier.json `text_fields`), read as a custom task's files are. The texts are
cut and batched as evaluate's test sets are (`Tuner.outputs`: sorted by length, padded to the task's
length buckets, one compiled prediction graph per bucket and no recompiles). One row per input text,
in order: `{"label": NAME, "probabilities": {NAME: p, ...}}`, or `{"value": x}` for a regression; JSON
lines or CSV by the `--out` extension, JSON lines on stdout without it. Nothing is written before every
input is read and classified; `--out` is written to a temporary file and renamed.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from cram.pipeline import errors, rundir, store
from cram.pipeline.commands import classifiers
from cram.stages import StageError

INPUTS = (".csv", ".tsv", ".jsonl", ".ndjson", ".txt", ".text")
OUTPUTS = (".jsonl", ".csv")


class PredictError(errors.CramError):
    """An input, output or classifier `cram predict` cannot use; one line, exit code 2."""


def predict(
    source: Path,
    files: list[Path],
    task: str | None = None,
    out: Path | None = None,
    compile: bool = True,
    backend: str = "inductor",
    batch_size: int = 128,
    stream: TextIO | None = None,
) -> int:
    """Classify every text of FILES with SOURCE's classifier (a run directory and `task`, or a cram-format
    classifier export); write the rows to OUT (or `stream`, by default the stdout of the moment, never the
    one at import); return how many were written."""
    check_paths(files, out)
    kept, tokenizer, special = _classifier(source, task)
    texts = _texts(files, kept.meta["text_fields"])
    outputs = _outputs(kept, tokenizer, special, texts, compile, backend, batch_size)
    rows = _rows(kept, outputs)
    text = _format(rows, kept, "csv" if out is not None and out.suffix.lower() == ".csv" else "jsonl")
    if out is None:
        (stream or sys.stdout).write(text)
    else:
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, out)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise PredictError(f"--out {out}: cannot write it: {e}") from None
    return len(rows)


def check_paths(files: list[Path], out: Path | None) -> None:
    """PredictError for an input that is missing or of an unknown kind, or an `--out` of an unknown kind,
    that is one of the inputs, or that lies in a run directory or a stage store."""
    for path in files:
        if path.suffix.lower() not in INPUTS:
            raise PredictError(f"{path}: unknown extension {path.suffix or '(none)'!r}; allowed {', '.join(INPUTS)}")
        if not path.is_file():
            raise PredictError(f"{path}: not a file")
    if out is None:
        return
    if out.suffix.lower() not in OUTPUTS:
        raise PredictError(f"--out {out}: unknown extension {out.suffix or '(none)'!r}; allowed {', '.join(OUTPUTS)}")
    target = out.resolve()
    if any(target == path.resolve() for path in files):
        raise PredictError(f"--out {out}: is one of the inputs; never overwritten: choose another path")
    inside = next((p for p in target.parents if (p / rundir.MANIFEST).is_file() or p.name == store.STORE), None)
    if inside is not None:
        raise PredictError(f"--out {out}: inside the run directory or store {inside}; write it outside")
    if not target.parent.is_dir():
        raise PredictError(f"--out {out}: the folder {out.parent} does not exist")


def _classifier(source: Path, task: str | None) -> tuple[classifiers.Kept, Path, dict[str, int]]:
    """(the classifier, its tokenizer file, the special ids) of a run directory's task or an export."""
    from cram.pipeline.commands import export
    from cram.stages.shared.tokenizer import in_folder

    if (source / rundir.MANIFEST).is_file():
        if task is None:
            raise PredictError(f"{source}: a run directory; name the task to classify with --task")
        kept = classifiers.find(source, task)
        run = export.finished_run(source)
        return kept, run["tokenize_dir"] / run["tokenize"]["tokenizer"], run["tokenize"]["special_ids"]
    if not source.is_dir():
        raise PredictError(f"{source}: neither a run directory nor an exported classifier folder")
    kept = classifiers.from_export(source)
    if task is not None and task != kept.meta["task"]:
        raise PredictError(f"--task {task}: {source} holds the classifier of task {kept.meta['task']!r}")
    tokenizer = in_folder(source)
    try:
        special = json.loads((source / "special_ids.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PredictError(f"{source / 'special_ids.json'}: not readable ({e}); export it again") from None
    if tokenizer is None:
        raise PredictError(f"{source}: no tokenizer.json or tokenizer.model; export it again")
    return kept, tokenizer, special


def _texts(files: list[Path], fields: list[str]) -> list[tuple[str, ...]]:
    from cram.stages.shared.taskfiles import read_texts

    texts = []
    for path in files:
        try:
            texts += read_texts(path, fields)
        except StageError as e:
            raise PredictError(f"{e} (the classifier reads {', '.join(fields)})") from None
    return texts


def _outputs(
    kept: classifiers.Kept, tokenizer: Path, special: dict, texts: list, compile: bool, backend: str, size: int
):
    """The model's outputs [N, num_outputs] (logits, or the regression value), batched as evaluate's are."""
    import numpy as np
    import torch

    from cram.stages import evaluate
    from cram.stages.finetuning.finetune import Tuner, encode
    from cram.stages.finetuning.tasks import Examples, Task
    from cram.stages.shared import device as devices
    from cram.stages.shared import precision as precisions
    from cram.stages.shared import tokenizer as tokenizers

    meta = kept.meta
    config = evaluate.Config(
        tasks=[],
        max_length=meta["max_length"],
        buckets=tuple(meta["buckets"]),
        pooling=meta["pooling"],
        head=meta["head"],
        head_width=meta["head_width"],
        eval_batch_size=size,
        compile=compile,
        backend=backend,
    )
    data = Task(meta["task"], (), (), Examples(texts, np.zeros(len(texts), np.int64)), {})
    rows, lengths, _ = encode(data, tokenizers.load(tokenizer), special, config.max_length).train
    device = devices.resolve("auto")
    params = {k: v.to(device) for k, v in kept.params().items()}
    tuner = Tuner.make(config, kept.cfg, params, special, device, precisions.FP32)

    def report(done: int) -> None:
        print(f"predict: {done:,}/{len(rows):,} texts", file=sys.stderr, flush=True)

    # One graph per bucket; past dynamo's limit it would fall back to eager silently: an error instead.
    limit = max(8, len(config.buckets))  # as evaluate's: the code object may hold graphs of earlier calls
    with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        bar = None if not sys.stderr.isatty() else f"predict {meta['task']}"
        return tuner.outputs(params, rows, lengths, bar, None if bar else report)


def _rows(kept: classifiers.Kept, outputs: Any) -> list[dict[str, Any]]:
    import numpy as np

    if kept.meta["regression"]:
        return [{"value": float(v)} for v in outputs[:, 0]]
    shifted = np.exp(outputs - outputs.max(-1, keepdims=True))
    probabilities = shifted / shifted.sum(-1, keepdims=True)
    labels = kept.labels
    return [
        {"label": labels[int(p.argmax())], "probabilities": {n: round(float(v), 6) for n, v in zip(labels, p)}}
        for p in probabilities
    ]


def _format(rows: list[dict[str, Any]], kept: classifiers.Kept, kind: str) -> str:
    if kind == "jsonl":
        return "".join(json.dumps(row) + "\n" for row in rows)
    text = io.StringIO()
    columns = ["value"] if kept.meta["regression"] else ["label", *kept.labels]
    writer = csv.writer(text)
    writer.writerow(columns)
    for row in rows:
        writer.writerow([row["value"]] if "value" in row else [row["label"], *row["probabilities"].values()])
    return text.getvalue()
