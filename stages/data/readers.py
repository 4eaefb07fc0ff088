"""The corpus readers, one a format: each turns one `corpus.Unit` into batches of string columns
`text`, `title` and `label` ("" where the source has none), checking records and columns as it goes.

- text, JSON lines and CSV/TSV: a byte range of a file, decoded and split into documents (paragraphs,
  lines or the whole file) or records (CSV: named by the file's header row); an error names the file
  and line. A document over MAX_DOCUMENT_CHARS is cut into pieces (text) or skipped (a JSON line, a
  CSV record), and counted in the caller's tally; a UTF-8 byte-order mark opening a file is dropped.
- json: a whole file holding a list of records or an object of key -> record.
- parquet: row groups of a file (`parquet_row_groups` says how they are grouped into units).
- arrow: one shard of a `datasets` folder (`load_disk` opens the folder).
- hub: one shard of a dataset streamed from (or cached from) the Hugging Face hub.

What a local file's first bytes say before any stage runs is `sniff.py`.

pyarrow and datasets are imported inside the functions that need them: the CLI stays fast.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable, Iterator

from cram.stages import StageError
from cram.stages.data import hub
from cram.stages.data.source import format_of
from cram.stages.shared import records

if TYPE_CHECKING:
    from datasets import Features

    from cram.stages.data.source import CorpusConfig, Unit
    from cram.stages.protocols import JSON

WHERE = "tokenize.corpus"  # the config section that errors name
# A longer document (a text paragraph or line, a JSON line, a CSV record) is cut (text) or skipped
# (records): what one process holds stays bounded, and no tokenizer or model needs one this long.
MAX_DOCUMENT_CHARS = 16 << 20
TALLY = ("documents_cut", "records_skipped")  # what the readers count of documents over the limit
PARAGRAPH_BREAK = re.compile(rb"\n[ \t\r\f\v]*\n")
_PARAGRAPH_BREAK_TEXT = re.compile(PARAGRAPH_BREAK.pattern.decode())


def file_format(path: Path, config: CorpusConfig) -> str:
    """The format of one local corpus file: the configured one, else its extension's, else "json"
    (every corpus's default before formats were told from extensions; `check_start` names the
    format to set when the file's first bytes say otherwise)."""
    return (config.format if config.format != "auto" else format_of(str(path))) or "json"


def open_file(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise _vanished(path) from None


def byte_range_documents(
    unit: Unit, config: CorpusConfig, batch_size: int, tally: dict[str, int]
) -> Iterator[dict[str, list[str]]]:
    """The documents (text) or records (JSON lines, CSV) in bytes [start, stop) of a file."""
    content, head_cut, tail_cut = _read_range(unit, config)
    if unit.format == "text":
        tally["documents_cut"] += tail_cut
        for texts in _batched(_text_pieces(content, config.text_unit, tally), batch_size):
            yield {"text": texts, "title": [""] * len(texts), "label": [""] * len(texts)}
    elif unit.format in ("csv", "tsv"):
        yield from _batched(_csv_records(content, unit, config, tally), batch_size)
    else:
        yield from _batched(_jsonl_records(content, unit, config, (head_cut, tail_cut), tally), batch_size)


def _read_range(unit: Unit, config: CorpusConfig) -> tuple[str, bool, bool]:
    """Bytes [start, stop) of the unit's file decoded (less a UTF-8 BOM at the file's start), and
    whether the range starts and ends inside a document (a cut that `corpus.units` forced in a
    document over MAX_DOCUMENT_CHARS: every other cut follows a line break)."""
    path = Path(unit.source)
    with open_file(path) as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(unit.start - 1, 0))
        head_cut = unit.start > 0 and f.read(1) != b"\n"
        raw = f.read(unit.stop - unit.start)
    if len(raw) < unit.stop - unit.start:
        raise StageError(f"{path}: the file changed while it was read (it is shorter than {unit.stop:,} bytes)")
    tail_cut = unit.stop < size and not raw.endswith(b"\n")
    try:
        content = raw.decode("utf-8", errors=config.encoding_errors)
    except UnicodeDecodeError as e:
        at = unit.start + e.start
        raise StageError(
            f"{path}:{_line_number(path, at)}: byte {at:,} is not valid UTF-8; fix the file or set "
            f'{WHERE}.encoding_errors = "replace"'
        ) from None
    return (content.removeprefix(records.BOM) if unit.start == 0 else content), head_cut, tail_cut


def _text_pieces(content: str, text_unit: str, tally: dict[str, int]) -> Iterator[str]:
    for document in _text_documents(content, text_unit):
        for i, piece in enumerate(cut_text(document, MAX_DOCUMENT_CHARS)):
            tally["documents_cut"] += i > 0
            yield piece


def _jsonl_records(
    content: str, unit: Unit, config: CorpusConfig, cut: tuple[bool, bool], tally: dict[str, int]
) -> Iterator[tuple[str, str, str]]:
    """The records of a unit of JSON lines; a line over MAX_DOCUMENT_CHARS (or the pieces of one that
    forced cuts split between units: counted where it starts) is skipped unparsed."""
    path = Path(unit.source)
    lines = content.split("\n")
    head_cut, tail_cut = cut
    if head_cut:
        lines[0] = ""
    if tail_cut and (len(lines) > 1 or not head_cut):
        lines[-1] = ""
        tally["records_skipped"] += 1
    for i, line in enumerate(lines):
        if len(line) > MAX_DOCUMENT_CHARS:
            tally["records_skipped"] += 1
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problem = _record_problem(record, config)
        except json.JSONDecodeError as e:
            problem = f"not valid JSON ({e.msg}: column {e.colno}); a truncated or broken line?"
        if not problem and records.may_escape_surrogates(line):
            fields, problem = encodable(_fields(record, config, ""), config)
        elif not problem:
            fields = _fields(record, config, "")
        if problem:  # line numbers are counted only when an error needs one
            raise StageError(f"{path}:{_line_number(path, unit.start) + i}: {problem}")
        yield fields


def csv_reader(lines: Iterable[str], fmt: str) -> Iterator[list[str]]:
    """A strict csv reader of comma- (csv) or tab- (tsv) separated lines, quoted fields allowed to
    hold line breaks, its field limit raised (a record over MAX_DOCUMENT_CHARS is skipped)."""
    import csv

    records.raise_csv_field_limit()
    return csv.reader(lines, delimiter="," if fmt == "csv" else "\t", strict=True)


def csv_header(path: Path, fmt: str) -> list[str]:
    """The column names of a CSV/TSV file: its first record."""
    import csv

    with open_file(path) as f:
        lines = (line.decode("utf-8", errors="replace").removeprefix(records.BOM) for line in f)
        try:
            return next(csv_reader(lines, fmt), [])
        except csv.Error as e:
            raise StageError(f"{path}:1: not a readable {fmt} header ({e})") from None


def _csv_records(content: str, unit: Unit, config: CorpusConfig, tally: dict[str, int]) -> Iterator[tuple]:
    """The records of a unit of a CSV/TSV file, fields found by the header's names; a record whose
    text is over MAX_DOCUMENT_CHARS is skipped."""
    import csv
    import io

    path = Path(unit.source)
    header = csv_header(path, unit.format or "csv")
    check_text_column(header, config, str(path))
    where = {name: header.index(name) for name in (config.title_field, config.label_field) if name in header}
    text_at = header.index(config.text_field)
    reader = csv_reader(io.StringIO(content, newline=""), unit.format or "csv")
    try:
        for row in reader:
            if reader.line_num == 1 and unit.start == 0 or not row:
                continue
            if len(row) != len(header):
                problem = f"{len(row)} fields where the header has {len(header)}; an unquoted separator?"
                raise StageError(f"{path}:{_line_number(path, unit.start) + reader.line_num - 1}: {problem}")
            if len(row[text_at]) > MAX_DOCUMENT_CHARS:
                tally["records_skipped"] += 1
                continue
            title, label = (row[where[n]] if n in where else "" for n in (config.title_field, config.label_field))
            yield row[text_at], title, _label(label, config.unlabeled)
    except csv.Error as e:
        raise StageError(f"{path}:{_line_number(path, unit.start) + reader.line_num - 1}: {e}") from None


def cut_text(text: str, limit: int) -> Iterator[str]:
    """`text` in pieces of at most `limit` characters, each cut at a space in its second half when
    there is one, the blanks after a cut dropped. Time linear in the text's length."""
    start, end = 0, len(text)
    while end - start > limit:
        at = text.rfind(" ", start + limit // 2, start + limit + 1)
        at = at if at > start else start + limit
        yield text[start:at]
        start = at
        while start < end and text[start].isspace():
            start += 1
    if start < end:
        yield text[start:]


def json_documents(path: Path, config: CorpusConfig, batch_size: int) -> Iterator[dict[str, list[str]]]:
    """The records of a JSON file: a list of records, or an object of key -> record."""
    return _batched(_json_records(path, config), batch_size)


def parquet_row_groups(path: Path, config: CorpusConfig) -> list[tuple[int, int]]:
    """A parquet file's row groups as [start, stop) ranges, each a unit of reading."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
    except FileNotFoundError:
        raise _vanished(path) from None
    except Exception as e:  # pyarrow raises its own error types for a file that is not parquet
        raise StageError(f"{path}: not a readable parquet file ({e})") from None
    check_text_column(meta.schema.names, config, str(path))
    # Row groups are parquet's unit of reading: a few together make a unit of a few million rows at most.
    ranges, first, rows = [], 0, 0
    for group in range(meta.num_row_groups):
        rows += meta.row_group(group).num_rows
        if rows >= 100_000 or group == meta.num_row_groups - 1:
            ranges.append((first, group + 1))
            first, rows = group + 1, 0
    return ranges


def parquet_documents(unit: Unit, config: CorpusConfig, batch_size: int) -> Iterator[dict[str, list[str]]]:
    import pyarrow.parquet as pq

    path = Path(unit.source)
    try:
        file = pq.ParquetFile(path)
        names = file.schema_arrow.names
        fields = (config.text_field, config.title_field, config.label_field)
        wanted = list(dict.fromkeys(c for c in fields if c in names))
        row = sum(file.metadata.row_group(g).num_rows for g in range(unit.start))
        for batch in file.iter_batches(batch_size, row_groups=range(unit.start, unit.stop), columns=wanted):
            yield _standardise(batch.to_pydict(), config, None, str(path), row)
            row += batch.num_rows
    except FileNotFoundError:
        raise _vanished(path) from None
    except OSError as e:  # a truncated or corrupt file
        raise StageError(f"{path}: row groups {unit.start}-{unit.stop - 1} are not readable ({e})") from None


def load_disk(config: CorpusConfig) -> Any:
    """The `datasets` folder of a `kind = "disk"` corpus (its configured split, for a DatasetDict)."""
    import datasets

    path = Path(os.path.expanduser(config.paths[0]))
    if not path.exists():
        raise StageError(f"{WHERE}.paths: '{path}' does not exist (from {Path.cwd()})")
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise StageError(f"{WHERE}.paths: '{path}' is not a datasets folder (save_to_disk): {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if config.split not in ds:
            raise StageError(f"{WHERE}.split: '{config.split}' is not in {path}; splits are: {', '.join(ds)}")
        ds = ds[config.split]
    return ds


def arrow_documents(unit: Unit, config: CorpusConfig) -> Iterator[dict[str, list[str]]]:
    from cram.stages.data.shards import read_batches

    path = Path(unit.source)
    try:
        for batch in read_batches(path):
            yield _standardise(batch.to_pydict(), config, unit.label_names, str(path))
    except FileNotFoundError:
        raise _vanished(path) from None


def hub_documents(unit: Unit, config: CorpusConfig, batch_size: int) -> Iterator[dict[str, list[str]]]:
    where = hub_where(config)
    ds = hub.load(config.name, config.subset, config.split, unit.offline, where)
    ds = ds.shard(num_shards=unit.stop, index=unit.start, contiguous=True)
    try:
        for batch in ds.iter(batch_size=batch_size):
            yield _standardise(batch, config, unit.label_names, where)
    except (ConnectionError, FileNotFoundError, OSError) as e:
        raise StageError(f"{where}: reading shard {unit.start} of {unit.stop} failed: {e}") from None


def hub_where(config: CorpusConfig) -> str:
    return f"{WHERE}.name: hub dataset '{config.name}'"


def check_text_column(names: list[str] | None, config: CorpusConfig, source: str) -> None:
    if names is not None and config.text_field not in names:
        raise StageError(
            f"{source}: no text column '{config.text_field}' ({WHERE}.text_field); columns are: {', '.join(names)}"
        )


def label_names(features: Features | None, config: CorpusConfig) -> tuple[str, ...] | None:
    """A class-label column holds ints: its names are what a label means downstream."""
    names = getattr((features or {}).get(config.label_field or ""), "names", None)
    return tuple(names) if names is not None else None


def _vanished(path: Path) -> StageError:
    return StageError(f"{path}: the file vanished while the corpus was read (moved or deleted?)")


def _line_number(path: Path, offset: int) -> int:
    """The 1-based number of the line holding byte `offset` (read again: only errors need it)."""
    lines = 1
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 20))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            offset -= len(chunk)
    return lines


def _text_documents(content: str, unit: str) -> Iterator[str]:
    if unit == "file":
        parts: Any = [content]
    elif unit == "line":
        parts = content.splitlines()
    else:
        parts = _PARAGRAPH_BREAK_TEXT.split(content)
    return (p.strip() for p in parts if p.strip())


def _json_records(path: Path, config: CorpusConfig) -> Iterator[tuple[str, str, str]]:
    with open_file(path) as f:
        raw = f.read()
    try:
        content = raw.decode("utf-8", errors=config.encoding_errors)
    except UnicodeDecodeError as e:
        raise StageError(
            f"{path}:{_line_number(path, e.start)}: byte {e.start:,} is not valid UTF-8; fix the file or set "
            f'{WHERE}.encoding_errors = "replace"'
        ) from None
    data = _parse_json(content.removeprefix(records.BOM), str(path))
    escapes = records.may_escape_surrogates(content)
    del raw, content
    if isinstance(data, dict):
        items = ((f"{path}: key {key!r}", str(key), record) for key, record in data.items())
    elif isinstance(data, list):
        items = ((f"{path}: item {i}", "", record) for i, record in enumerate(data))
    else:
        raise StageError(f"{path}: a json corpus must be a list of records or an object of records")
    for where, key, record in items:
        text, title, label = _fields(record, config, where)
        fields, problem = (text, title or key, label), None
        if escapes:
            fields, problem = encodable(fields, config)
        if problem:
            raise StageError(f"{where}: {problem}")
        yield fields


def _batched(rows: Iterator[Any], batch_size: int) -> Iterator[Any]:
    """Rows in lists of batch_size; (text, title, label) rows become column batches."""
    batch: list[Any] = []
    for row in rows:
        batch.append(row)
        if len(batch) == batch_size:
            yield _columns(batch) if isinstance(row, tuple) else batch
            batch = []
    if batch:
        yield _columns(batch) if isinstance(batch[0], tuple) else batch


def _columns(rows: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    texts, titles, labels = zip(*rows)
    return {"text": list(texts), "title": list(titles), "label": list(labels)}


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise StageError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def _fields(record: JSON, config: CorpusConfig, where: str) -> tuple[str, str, str]:
    problem = _record_problem(record, config)
    if problem:
        raise StageError(f"{where}: {problem}")
    text = record[config.text_field]
    title = record.get(config.title_field) if config.title_field else None
    label = record.get(config.label_field) if config.label_field else None
    return _as_text(text), _as_text(title), _label(label, config.unlabeled)


def encodable(fields: tuple[str, str, str], config: CorpusConfig) -> tuple[tuple[str, str, str], str | None]:
    """A record's (text, title, label) as UTF-8 can encode them: a character it cannot (a lone surrogate,
    which a JSON escape can make) is replaced by U+FFFD under `encoding_errors = "replace"`, else
    (fields, why they cannot be encoded)."""
    for value, name in zip(fields, (config.text_field, config.title_field, config.label_field)):
        problem = records.unencodable_problem(value, name or "")
        if problem is None:
            continue
        if config.encoding_errors == "replace":
            text, title, label = (records.replace_unencodable(v) for v in fields)
            return (text, title, label), None
        return fields, f'{problem}; fix the file or set {WHERE}.encoding_errors = "replace"'
    return fields, None


def _record_problem(record: JSON, config: CorpusConfig) -> str | None:
    if not isinstance(record, dict):
        return f"expected a record (JSON object), got {type(record).__name__}"
    if config.text_field not in record:
        return (
            f"no text field '{config.text_field}' ({WHERE}.text_field); "
            f"fields are: {', '.join(map(str, record)) or 'none'}"
        )
    return _not_text(record[config.text_field], config.text_field)


def _not_text(value: object, field: str) -> str | None:
    """Why `value` of the text field is no text, or None: a corpus is trained on what it says."""
    problem = records.not_text(value, field)
    return None if problem is None else f"{problem} ({WHERE}.text_field)"


def _as_text(value: object) -> str:
    return "" if value is None else str(value)


def _label(value: object, unlabeled: tuple[str, ...]) -> str:
    text = _as_text(value)
    return "" if text in unlabeled else text


def _standardise(
    batch: dict[str, list],
    config: CorpusConfig,
    label_names: tuple[str, ...] | None,
    source: str,
    first_row: int | None = None,
) -> dict[str, list[str]]:
    """A batch of source columns reduced to string columns text, title, label. `first_row`: the source's
    row number of the batch's first row, where the source has one (an error then names the row)."""
    check_text_column(list(batch), config, source)
    rows = len(batch[config.text_field])
    for i, value in enumerate(batch[config.text_field]):
        if problem := _not_text(value, config.text_field):
            where = source if first_row is None else f"{source}: row {first_row + i + 1}"
            raise StageError(f"{where}: {problem}")
    titles = batch.get(config.title_field or "", [None] * rows)
    labels = batch.get(config.label_field or "", [None] * rows)
    if label_names is not None:
        labels = [None if v is None or v < 0 else label_names[v] for v in labels]
    return {
        "text": [_as_text(t) for t in batch[config.text_field]],
        "title": [_as_text(t) for t in titles],
        "label": [_label(v, config.unlabeled) for v in labels],
    }
