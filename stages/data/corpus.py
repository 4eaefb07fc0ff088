"""Corpus sources for the tokenize stage: local files, a file shipped in a package, a `datasets`
folder on disk, or a dataset on the Hugging Face hub, read as a stream.

Every source is cut into `Unit`s that separate processes can read side by side (byte ranges of
text, JSON-lines and CSV files cut between documents, parquet row groups, `datasets` shards, hub
shards); `documents` gives a unit's non-empty documents in batches of string columns `text`,
`title` and `label` ("" where the source has none). Nothing holds more than one unit's documents
(~16 MB of text) at a time, except a `format = "json"` file, which is one JSON document and is
read whole: use JSON lines for big corpora. A document over `readers.MAX_DOCUMENT_CHARS` (a line or
paragraph of text, a JSON line, a CSV record) is cut (text) or skipped (records), and counted, so a
unit stays bounded whatever a line's length. How each format is read is `readers.py`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from cram.stages import StageError
from cram.stages.data import hub, readers
from cram.stages.data.source import CorpusConfig, Unit
from cram.stages.shared import files as shared_files


def units(config: CorpusConfig, parallel: int = 1) -> list[Unit]:
    """The configured corpus as units, in document order. Reads only file metadata and the few
    bytes around each cut. `parallel`: how many processes will read a hub dataset's shards."""
    if config.kind in ("files", "package"):
        files = _expand(config.paths) if config.kind == "files" else [package_file(config.package, config.file)]
        return [unit for path in files for unit in _file_units(path, config)]
    if config.kind == "disk":
        ds = readers.load_disk(config)
        readers.check_text_column(ds.column_names, config, config.paths[0])
        names = readers.label_names(ds.features, config)
        return [Unit("arrow", f["filename"], label_names=names) for f in ds.cache_files]
    offline = hub.offline()
    ds = hub.load(config.name, config.subset, config.split, offline, readers.hub_where(config))
    names = readers.label_names(ds.features, config)
    shards = max(1, min(ds.num_shards, 4 * parallel))
    return [Unit("hub", config.name, i, shards, names, offline) for i in range(shards)]


def documents(
    unit: Unit, config: CorpusConfig, batch_size: int = 1000, tally: dict[str, int] | None = None
) -> Iterator[dict[str, list[str]]]:
    """The non-empty documents of one unit, in batches of string columns text, title and label.
    `tally` counts the documents over MAX_DOCUMENT_CHARS: "documents_cut" (text) and "records_skipped"."""
    tally = {} if tally is None else tally
    for key in readers.TALLY:
        tally.setdefault(key, 0)
    if unit.kind == "bytes":
        batches = readers.byte_range_documents(unit, config, batch_size, tally)
    elif unit.kind == "json":
        batches = readers.json_documents(Path(unit.source), config, batch_size)
    elif unit.kind == "parquet":
        batches = readers.parquet_documents(unit, config, batch_size)
    elif unit.kind == "arrow":
        batches = readers.arrow_documents(unit, config)
    else:
        batches = readers.hub_documents(unit, config, batch_size)
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
            files = shared_files.files_under(Path(os.path.expanduser(config.paths[0])))
        else:
            return []  # a hub dataset is named by its config; its revision is the hub's business
    except StageError as e:
        return [["unavailable", str(e)]]
    return shared_files.fingerprint(files)


def package_file(package: str, file: str) -> Path:
    """A data file shipped in an installed distribution, found from its metadata: the package is
    never imported (importing some packages runs a lot of code, e.g. loads all their data)."""
    import importlib.metadata

    try:
        files = importlib.metadata.distribution(package).files or []
    except importlib.metadata.PackageNotFoundError:
        raise StageError(
            f"{readers.WHERE}.package: '{package}' is not installed; install it (pip install '{package}'"
            f", or the project's extra: pip install -e '.[wiki]')"
        ) from None
    wanted = file.strip("/")
    for entry in files:
        if entry.as_posix() == wanted or entry.as_posix().endswith("/" + wanted):
            path = Path(entry.locate())
            if path.is_file():
                return path
    raise StageError(f"{readers.WHERE}.file: '{file}' is not a file of the installed package '{package}'")


def _expand(patterns: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not matches:
            raise StageError(f"{readers.WHERE}.paths: '{pattern}' matches no file (from {Path.cwd()})")
        files.extend(Path(p) for p in matches if Path(p) not in files)
    return files


# Text, JSON-lines and CSV files are cut into units of about this many bytes, each at a document boundary.
UNIT_BYTES = 16 << 20
_LINE_BREAK = re.compile(rb"\n")
_WINDOW = 1 << 20  # bytes read at a time while looking for a boundary


def local_files(config: CorpusConfig) -> list[tuple[Path, str]]:
    """Each local corpus file (files and package kinds) with its format."""
    if config.kind not in ("files", "package"):
        return []
    paths = _expand(config.paths) if config.kind == "files" else [package_file(config.package, config.file)]
    return [(path, readers.file_format(path, config)) for path in paths]


def _file_units(path: Path, config: CorpusConfig) -> list[Unit]:
    fmt = readers.file_format(path, config)
    if fmt == "parquet":
        return [Unit("parquet", str(path), a, b) for a, b in readers.parquet_row_groups(path, config)]
    if fmt == "json":
        return [Unit("json", str(path), 0, path.stat().st_size)]
    if fmt in ("csv", "tsv"):
        cuts = _csv_cuts(path, fmt)
    elif fmt == "text" and config.text_unit == "file":
        cuts = [0, path.stat().st_size]
    else:
        paragraphs = fmt == "text" and config.text_unit == "paragraph"
        cuts = _byte_cuts(path, readers.PARAGRAPH_BREAK if paragraphs else _LINE_BREAK)
    return [Unit("bytes", str(path), a, b, format=fmt) for a, b in zip(cuts, cuts[1:])]


def _byte_cuts(path: Path, boundary: re.Pattern) -> list[int]:
    """Offsets about UNIT_BYTES apart, each just after a document boundary: read once, start to end."""
    size, cuts = path.stat().st_size, [0]
    with readers.open_file(path) as f:
        while cuts[-1] + UNIT_BYTES < size:
            cut = _next_boundary(f, cuts[-1] + UNIT_BYTES, boundary, 4 * readers.MAX_DOCUMENT_CHARS)
            if cut >= size:
                break
            cuts.append(cut)
    return [*cuts, size]


def _next_boundary(f: BinaryIO, at: int, boundary: re.Pattern, limit: int) -> int:
    """The offset just after the first document boundary at or after `at` (the file's size if none).
    Where none comes within `limit` bytes, the document is over MAX_DOCUMENT_CHARS anyway: a character
    start about `limit` bytes on, which bounds a unit's size whatever a line's length."""
    f.seek(at)
    start, carry = at, b""
    while start < at + limit:
        chunk = f.read(_WINDOW)
        found = boundary.search(carry + chunk)
        if found:
            return start + found.end() - len(carry)
        if len(chunk) < _WINDOW:
            return start + len(chunk)
        # A paragraph break may straddle two windows: a last newline followed by blanks only is carried over.
        last = chunk.rfind(b"\n")
        carry = b"\n" if last >= 0 and not chunk[last + 1 :].strip() else b""
        start += len(chunk)
    return _piece_start(f, start)


def _piece_start(f: BinaryIO, offset: int) -> int:
    """Where a forced cut goes: just after the first blank in the 4 KiB from `offset` (between words),
    else the first UTF-8 character start there (a cut never splits a character)."""
    f.seek(offset)
    head = f.read(4096)
    blank = re.search(rb"[ \t\r\f\v]", head)
    if blank:
        return offset + blank.end()
    skip = 0
    while skip < len(head) and 0x80 <= head[skip] < 0xC0:  # continuation bytes
        skip += 1
    return offset + skip


def _csv_cuts(path: Path, fmt: str) -> list[int]:
    """Record ends about UNIT_BYTES apart, found by one csv pass over the file: only parsing from the
    start tells a line break that ends a record from one inside a quoted field. Reads the file once
    in the main process (at the csv module's pace); a file the pass cannot parse stays one unit from
    there on, and reading it names the line."""
    import csv

    size, cuts, offset = path.stat().st_size, [0], 0
    with readers.open_file(path) as f:

        def lines() -> Iterator[str]:
            nonlocal offset
            for line in f:
                offset += len(line)
                yield line.decode("utf-8", errors="replace")

        with contextlib.suppress(csv.Error):
            for _ in readers.csv_reader(lines(), fmt):
                if offset - cuts[-1] >= UNIT_BYTES and offset < size:
                    cuts.append(offset)
    return [*cuts, size]
