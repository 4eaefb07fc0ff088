"""Where a fine-tuning task's files lie and how their records are read: GLUE's layouts (`GLUE`,
`glue_folder`, `read_tsv`, `glue_rows`), a custom task's CSV / JSON-lines files (`find_split`,
`read_rows`) and the files `cram predict` classifies (`iter_texts`: TSV and plain text too), one
reader for all: records streamed, CSV's quoting strict (a malformed record is refused, never merged
into its neighbours), a line of plain text or JSON lines ended only by \\n or \\r\\n, and each text checked
(`checked_text`, which the BEIR and pairs readers use too). Shared by the evaluate stage,
which fine-tunes on the tasks, the tokenize stage, which can pretrain on their training text
(`tokenize.task_text`), and `cram predict`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from cram.stages import StageError
from cram.stages.shared import records

# The longest text a task or input file's field may hold, as long as a corpus document may be
# (data/readers.py's MAX_DOCUMENT_CHARS): no classifier reads more than its max_length of it.
MAX_FIELD_CHARS = 16 << 20

if TYPE_CHECKING:
    from datasets import DatasetDict

    from cram.stages.protocols import JSON


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


def read_tsv(
    path: Path, text_cols: Sequence[str | int], label_col: str | int
) -> tuple[list[tuple[str, ...]], list[str]]:
    """A GLUE TSV's texts and labels, each text checked as every text read is (`checked_text`)."""
    # GLUE's TSVs carry bare quote characters inside sentences: quoting must be off. MRPC's header
    # starts with a byte-order mark, which utf-8-sig drops.
    records.raise_csv_field_limit()
    with _opened(path, table=True) as f:
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
        names = [c if isinstance(c, str) else f"column {c}" for c in text_cols]
        # QQP's train.tsv has a few broken lines (too few fields): skipped, as the hub's loader does.
        texts, labels = [], []
        for row in rows:
            if len(row) < width:
                continue
            where = f"{path}:{rows.line_num}"
            texts.append(tuple(checked_text(row[i], name, where) for i, name in zip(text_idx, names)))
            labels.append(row[label_idx])
    return texts, labels


def file_format(path: Path) -> Literal["csv", "tsv", "text", "jsonl"]:
    """A task or input file's format from its extension, in any case: CSV, TSV, plain text (`.txt`,
    `.text`), else JSON lines."""
    return {".csv": "csv", ".tsv": "tsv", ".txt": "text", ".text": "text"}.get(path.suffix.lower(), "jsonl")


def find_split(folder: Path, stems: Sequence[str], where: str) -> Path:
    """The file of a custom task's split: the first stem's `.csv` or `.jsonl`, its extension in any case."""
    try:
        by_name = {p.name.lower(): p for p in sorted(folder.iterdir(), reverse=True) if p.is_file()}
    except OSError:
        by_name = {}
    for stem in stems:
        for suffix in (".csv", ".jsonl"):
            name = f"{stem}{suffix}"
            if (folder / name).is_file():
                return folder / name
            if name in by_name:
                return by_name[name]
    raise StageError(f"{where}.path: {folder} has no {'|'.join(stems)}.csv or .jsonl")


def iter_texts(path: Path, text_fields: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """The texts of a file to classify, one tuple a record, read as a custom task's files are and as
    they are read (nothing held): CSV or TSV with a header, JSON lines, or (`.txt`, `.text`, one text
    field only) plain text, one text a line (blank lines skipped)."""
    if file_format(path) != "text":
        for where, record in iter_records(path):
            yield record_texts(record, tuple(text_fields), where)
        return
    if len(text_fields) != 1:
        raise StageError(
            f"{path}: plain text holds one text a line, and the task reads a pair "
            f"({', '.join(text_fields)}); give a CSV, TSV or JSON-lines file with those fields"
        )
    with _opened(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield (checked_text(line.removesuffix("\n").removesuffix("\r"), text_fields[0], f"{path}:{n}"),)


def read_rows(path: Path, text_fields: Sequence[str], label_field: str) -> tuple[list[tuple[str, ...]], list[Any]]:
    """A custom task file's texts and labels (as the file holds them: a JSON label may be a number)."""
    texts, labels = [], []
    for where, record in iter_records(path):
        texts.append(record_texts(record, tuple(text_fields), where, also=label_field))
        labels.append(record[label_field])
    if not texts:
        raise StageError(f"{path}: no records")
    return texts, labels


def record_texts(record: dict, text_fields: tuple[str, ...], where: str, also: str | None = None) -> tuple[str, ...]:
    """The values of `text_fields` in `record`, each checked to be text: a missing field (or a missing
    `also`, the label's), a value that is no text (a number, a list, an object), one longer than
    MAX_FIELD_CHARS or one UTF-8 cannot encode is refused, naming `where` (the file and record)."""
    missing = next((k for k in (*text_fields, *filter(None, [also])) if record.get(k) is None), None)
    if missing is not None:
        raise StageError(f"{where} has no field {missing!r}; it has {', '.join(map(str, record))}")
    return tuple(checked_text(record[k], k, where) for k in text_fields)


def checked_text(value: JSON, field: str, where: str) -> str:
    """`value` of text field `field`, checked as every text read is, wherever it comes from (a task or
    input file, a pairs file, a BEIR corpus or queries): no text (a number, a list, an object), one longer
    than MAX_FIELD_CHARS or one UTF-8 cannot encode (a lone surrogate) is a StageError naming `where`."""
    problem = records.not_text(value, field)
    if problem is None and len(value) > MAX_FIELD_CHARS:
        problem = f"field '{field}' holds {len(value):,} characters, over the {MAX_FIELD_CHARS:,} a field may hold"
    if problem is None:
        problem = records.unencodable_problem(value, field)
    if problem is not None:
        raise StageError(f"{where}: {problem}")
    return value


def iter_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a CSV, TSV or JSON-lines file, `where` naming the file and the
    record (its number; JSON lines: its line too, as `path:line`). A UTF-8 byte-order mark is dropped;
    TSV has no quoting (a quote character is text, as in GLUE's files), CSV has csv's."""
    fmt = file_format(path)
    with _opened(path, table=fmt in ("csv", "tsv")) as f:
        if fmt in ("csv", "tsv"):
            yield from _table_records(f, path, fmt)
            return
        lines = (item for item in enumerate(f, 1) if item[1].strip())
        for count, (n, line) in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise StageError(f"{path}:{n}: not JSON: {e.msg}") from None
            if not isinstance(record, dict):
                raise StageError(f"{path}:{n}: not a JSON object (one record per line)")
            yield f"{path}:{n}: record {count}", record


def _table_records(f: TextIO, path: Path, fmt: str) -> Iterator[tuple[str, dict]]:
    records.raise_csv_field_limit()
    quoting = csv.QUOTE_NONE if fmt == "tsv" else csv.QUOTE_MINIMAL
    # strict: a quote that does not close a field, or one still open at the end of the file, is an error;
    # without it csv reads on to the next quote and merges the records between into one field.
    reader = csv.DictReader(f, delimiter="\t" if fmt == "tsv" else ",", quoting=quoting, strict=True)
    n, starts = 0, 1  # the record's number, the line it starts on
    try:
        if reader.fieldnames is not None:  # the header, read first: the first record starts after it
            starts = reader.line_num + 1
        for n, record in enumerate(reader, 1):
            yield f"{path}: record {n}", record
            starts = reader.line_num + 1
    except csv.Error as e:
        what = f"record {n + 1}" if starts > 1 else "the header"
        raise StageError(
            f"{path}:{starts}: {what}: {e}; a quoted field is quoted whole, a quote inside it doubled"
        ) from None


@contextmanager
def _opened(path: Path, table: bool = False) -> Iterator[TextIO]:
    """`path` open as UTF-8 text, a byte-order mark dropped, line ends kept; a byte that is not UTF-8 is one
    StageError naming the file. A `table` (CSV, TSV) is read as csv wants it (csv finds its records' ends
    itself); plain text and JSON lines end a line only at \\n (or \\r\\n): a lone \\r is a character of its line."""
    try:
        with path.open(encoding="utf-8-sig", newline="" if table else "\n") as f:
            yield f
    except UnicodeDecodeError as e:
        raise StageError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
