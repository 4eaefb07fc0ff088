"""Where a fine-tuning task's files lie and how their records are read: GLUE's layouts (`GLUE`,
`glue_folder`, `read_tsv`, `glue_rows`) and a custom task's CSV / JSON-lines files (`find_split`,
`parse_records`, `read_texts`). Shared by the evaluate stage, which fine-tunes on the tasks, and the
tokenize stage, which can pretrain on their training text (`tokenize.task_text`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cram.stages import StageError

if TYPE_CHECKING:
    from datasets import DatasetDict


@dataclass(frozen=True)
class GlueSpec:
    tsv_dir: str  # folder name in the GLUE download
    tsv_text: tuple[str | int, ...]  # TSV columns by header name, or by index where there is no header
    tsv_label: str | int
    hf_text: tuple[str, ...]  # the hub's column names
    labels: tuple[str, ...]  # the hub's label names in id order; () = regression
    metrics: tuple[str, ...]
    tests: tuple[tuple[str, str, str], ...] = (("test", "dev.tsv", "validation"),)  # (name, tsv, hub split)


# The labelled dev sets are GLUE's test sets here: the official test labels are hidden.
GLUE: dict[str, GlueSpec] = {
    "cola": GlueSpec("CoLA", (3,), 1, ("sentence",), ("unacceptable", "acceptable"), ("matthews",)),
    "sst2": GlueSpec("SST-2", ("sentence",), "label", ("sentence",), ("negative", "positive"), ("accuracy",)),
    "mrpc": GlueSpec(
        "MRPC",
        ("#1 String", "#2 String"),
        "Quality",
        ("sentence1", "sentence2"),
        ("not_equivalent", "equivalent"),
        ("f1", "accuracy"),
    ),
    "stsb": GlueSpec(
        "STS-B", ("sentence1", "sentence2"), "score", ("sentence1", "sentence2"), (), ("spearman", "pearson")
    ),
    "qqp": GlueSpec(
        "QQP",
        ("question1", "question2"),
        "is_duplicate",
        ("question1", "question2"),
        ("not_duplicate", "duplicate"),
        ("f1", "accuracy"),
    ),
    "mnli": GlueSpec(
        "MNLI",
        ("sentence1", "sentence2"),
        "gold_label",
        ("premise", "hypothesis"),
        ("entailment", "neutral", "contradiction"),
        ("accuracy",),
        tests=(
            ("matched", "dev_matched.tsv", "validation_matched"),
            ("mismatched", "dev_mismatched.tsv", "validation_mismatched"),
        ),
    ),
    "qnli": GlueSpec(
        "QNLI",
        ("question", "sentence"),
        "label",
        ("question", "sentence"),
        ("entailment", "not_entailment"),
        ("accuracy",),
    ),
    "rte": GlueSpec(
        "RTE",
        ("sentence1", "sentence2"),
        "label",
        ("sentence1", "sentence2"),
        ("entailment", "not_entailment"),
        ("accuracy",),
    ),
}


def glue_folder(name: str, path: str, where: str) -> tuple[Literal["saved", "tsv"], Path]:
    """The local folder of GLUE task `name` and its layout: "saved" (`datasets` save_to_disk) or "tsv"
    (the GLUE download). `path` may be the task's own folder or a GLUE root holding it (`CoLA/` for
    TSV, `cola/` for `datasets`). `where` names the config entry in error messages."""
    spec = GLUE[name]
    root = Path(path).expanduser()
    for folder in (root, root / spec.tsv_dir, root / name):
        if (folder / "dataset_dict.json").is_file():
            return "saved", folder
        if (folder / "train.tsv").is_file():
            return "tsv", folder
    raise StageError(
        f"{where}.path: {root} holds no GLUE {name} data; expected train.tsv (GLUE TSV layout) or "
        f"dataset_dict.json (datasets save_to_disk) in it or in {spec.tsv_dir}/ or {name}/ below it"
    )


def glue_rows(name: str, data: DatasetDict, split_name: str, source: str) -> tuple[list[tuple[str, ...]], list[Any]]:
    """The texts and labels of split `split_name` of GLUE task `name` in the DatasetDict `data` (the
    hub's or one saved to disk at `source`), its columns checked."""
    spec = GLUE[name]
    if split_name not in data:
        raise StageError(f"{source}: no split {split_name!r} for GLUE {name}; found {', '.join(data)}")
    columns = data[split_name].column_names
    for column in (*spec.hf_text, "label"):
        if column not in columns:
            raise StageError(f"{source}/{split_name}: no column {column!r}; found {', '.join(columns)}")
    rows = data[split_name].select_columns([*spec.hf_text, "label"]).to_dict()
    return list(zip(*(rows[c] for c in spec.hf_text))), rows["label"]


def read_tsv(path: Path, text_cols: Sequence[str | int], label_col: str | int):
    # GLUE's TSVs carry bare quote characters inside sentences: quoting must be off. MRPC's header
    # starts with a byte-order mark, which utf-8-sig drops.
    with path.open(encoding="utf-8-sig", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        if isinstance(label_col, str):
            header = next(rows, [])
            missing = [c for c in (*text_cols, label_col) if c not in header]
            if missing:
                raise StageError(f"{path}: no column {missing[0]!r} in the header; found {', '.join(header)}")
            text_idx = [header.index(c) for c in text_cols]
            label_idx = header.index(label_col)
        else:
            text_idx, label_idx = list(text_cols), label_col
        width = max(*text_idx, label_idx) + 1
        # QQP's train.tsv has a few broken lines (too few fields): skipped, as the hub's loader does.
        good = [row for row in rows if len(row) >= width]
    return [tuple(row[i] for i in text_idx) for row in good], [row[label_idx] for row in good]


def find_split(folder: Path, stems: Sequence[str], where: str) -> Path:
    for stem in stems:
        for suffix in (".csv", ".jsonl"):
            if (folder / f"{stem}{suffix}").is_file():
                return folder / f"{stem}{suffix}"
    raise StageError(f"{where}.path: {folder} has no {'|'.join(stems)}.csv or .jsonl")


def read_texts(path: Path, text_fields: Sequence[str]) -> list[tuple[str, ...]]:
    """The texts of a file to classify, read as a custom task's files are: CSV or TSV with a header, JSON
    lines, or (`.txt`, `.text`, one text field only) plain text, one text a line (blank lines skipped)."""
    try:
        if path.suffix in (".txt", ".text"):
            if len(text_fields) != 1:
                raise StageError(
                    f"{path}: plain text holds one text a line, and the task reads a pair "
                    f"({', '.join(text_fields)}); give a CSV, TSV or JSON-lines file with those fields"
                )
            with path.open(encoding="utf-8-sig") as f:
                texts = [(line.rstrip("\r\n"),) for line in f if line.strip()]
            if not texts:
                raise StageError(f"{path}: no text")
            return texts
        records = parse_records(path)
    except UnicodeDecodeError as e:
        raise StageError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    check_fields(records, path, tuple(text_fields))
    return [tuple(str(r[k]) for k in text_fields) for r in records]


def check_fields(records: list[dict], path: Path, fields: tuple[str, ...]) -> None:
    for n, record in enumerate(records, 1):
        missing = next((k for k in fields if k not in record or record[k] is None), None)
        if missing is not None:
            raise StageError(f"{path}: record {n} has no field {missing!r}; it has {', '.join(map(str, record))}")
    if not records:
        raise StageError(f"{path}: no records")


def parse_records(path: Path) -> list[dict]:
    if path.suffix in (".csv", ".tsv"):
        with path.open(encoding="utf-8-sig", newline="") as f:
            return list(csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ","))
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise StageError(f"{path}:{n}: not JSON: {e.msg}") from None
                if not isinstance(record, dict):
                    raise StageError(f"{path}:{n}: not a JSON object (one record per line)")
                records.append(record)
    return records
