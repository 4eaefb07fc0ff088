"""What a local corpus file's first bytes say, checked by tokenize's `validate` before any stage runs:
the format they look like against the one set (a mismatch names the format to set), a text JSON lines
cannot encode there, and, for a held-out-topic task, records plainly without the label field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cram.stages import StageError
from cram.stages.data import readers
from cram.stages.shared import records

if TYPE_CHECKING:
    from cram.stages.data.source import CorpusConfig

_HEAD_BYTES = 4096  # what `check_start` reads of a file
_FORMAT_NAMES = {"json": "JSON", "jsonl": "JSON lines", "parquet": "parquet", "csv": "CSV", "tsv": "TSV"}


def check_start(path: Path, fmt: str, config: CorpusConfig) -> None:
    """The first bytes of a local corpus file against its format: on a mismatch, the error names
    the format to set (checked before any stage runs, so a wrong format costs no tokenize run)."""
    with readers.open_file(path) as f:
        head = f.read(_HEAD_BYTES)
    text = head.decode("utf-8", errors="replace").removeprefix(records.BOM).lstrip()
    guess = _guess_format(head, text, config)
    if fmt in ("csv", "tsv") and guess in ("text", fmt):  # a header without the text column is told as such
        readers.check_text_column(readers.csv_header(path, fmt), config, str(path))
        return
    if fmt == guess == "jsonl":
        _check_head_encodable(path, head, config)
    if not text or fmt == "text" or guess == fmt or (fmt == "json" and guess == "jsonl"):
        return
    preview = "".join(c if c.isprintable() else "?" for c in text.split("\n", 1)[0][:12])
    where = f"{readers.WHERE}.format"
    raise StageError(f'{path}: not {_FORMAT_NAMES[fmt]} (starts with "{preview}"); set {where} = "{guess}"')


def _check_head_encodable(path: Path, head: bytes, config: CorpusConfig) -> None:
    """The whole JSON lines in a file's first bytes, each record's fields as UTF-8 can encode them
    (under `encoding_errors = "strict"`): a lone surrogate there fails the dry run, not tokenize."""
    lines = head.decode("utf-8", errors="replace").removeprefix(records.BOM).split("\n")
    for n, line in enumerate(lines[:-1] if len(head) == _HEAD_BYTES else lines, 1):
        record = _json_or_none(line) if records.may_escape_surrogates(line) else None
        if not isinstance(record, dict):
            continue
        fields = [record.get(name) for name in (config.text_field, config.title_field, config.label_field)]
        text, title, label = (value if isinstance(value, str) else "" for value in fields)
        _, problem = readers.encodable((text, title, label), config)
        if problem:
            raise StageError(f"{path}:{n}: {problem}")


def _guess_format(head: bytes, text: str, config: CorpusConfig) -> str:
    """The format a file's first bytes look like."""
    if head.startswith(b"PAR1"):
        return "parquet"
    if text.startswith("["):
        return "json"
    if text.startswith("{"):
        return "jsonl" if re.search(r"}[ \t\r]*\n[ \t\r]*{", text) else "json"
    first_line = text.split("\n", 1)[0]
    for fmt, separator in (("csv", ","), ("tsv", "\t")):
        if config.text_field in (name.strip().strip('"') for name in first_line.split(separator)):
            return fmt
    return "text"


def label_problem(path: Path, fmt: str, config: CorpusConfig) -> str | None:
    """Why a local file's records have no label field, when they plainly have none: a CSV header or a
    parquet schema without it, or JSON lines none of whose first records (in its first MiB) has it."""
    label = config.label_field
    if fmt in ("csv", "tsv"):
        missing = label not in readers.csv_header(path, fmt)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        missing = label not in pq.read_schema(path).names
    elif fmt == "jsonl":
        with readers.open_file(path) as f:
            lines = f.read(1 << 20).decode("utf-8", errors="replace").removeprefix(records.BOM).split("\n")[:1000]
        found = [r for r in map(_json_or_none, lines) if isinstance(r, dict)]
        missing = bool(found) and not any(label in r for r in found)
    else:
        return None
    return (
        f"{path}: records without the label field '{label}' ({readers.WHERE}.label_field), which the "
        "held-out-topic task classifies by; set it to the field that holds the topic, or drop the task"
        if missing
        else None
    )


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
