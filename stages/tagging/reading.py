"""A token-classification task's files read into words and IOB2 tags, one reader per format:

    folder/train.conll, dev.conll, test.conll   CoNLL: a token and its tags a line (the tag the LAST column,
                                                 columns split by tabs where the line has one, else by spaces),
                                                 a blank line between sentences, `-DOCSTART-` lines skipped
    folder/train.jsonl, ...                      JSON lines: {"tokens": [...], "tags": [...]} (or "ner_tags")
    folder/dataset_dict.json, train/, ...        `datasets` save_to_disk: columns tokens and ner_tags (or tags),
                                                 tags as strings or ClassLabel ids

A split's file is its name (train; validation, dev or valid; test; any case) with .conll, .txt, .tsv or
.jsonl. Tags are read as IOB1, IOB2 or BIOES (the scheme detected over every split, `detect_scheme`) and
written as IOB2; an I- that continues nothing (IOB2, BIOES) starts an entity, as conlleval reads it, and is
counted (`Tagged.repaired`). A fault is one StageError naming the file and line (or split and row).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cram.stages import StageError
from cram.stages.shared.files import files_under
from cram.stages.shared.taskfiles import checked_text, iter_records

SPLITS = {"train": ("train",), "validation": ("validation", "dev", "valid"), "test": ("test",)}
SUFFIXES = (".conll", ".txt", ".tsv", ".jsonl")
DOCSTART = "-DOCSTART-"
TAG = re.compile(r"(?:([BIES])-(.+)|O)\Z")
SCHEMES = ("IOB1", "IOB2", "BIOES")
VALIDATION_SHARE = 0.1  # of the training sentences, where a folder has no validation file


@dataclass(frozen=True)
class Sentences:
    """A split: each sentence's words and their tags as the file gives them; `where` names each sentence's
    place (file:line, or split and row) for the errors raised after reading."""

    words: list[list[str]]
    tags: list[list[str]]
    where: list[str]


@dataclass(frozen=True)
class Tagged:
    """A task's splits in IOB2, the tag set (O, then B- and I- of each type in name order), the scheme the
    files were written in, how many I- tags of each split continued nothing and were read as B-, and whether
    the validation split was carved from the training file."""

    splits: dict[str, Sentences]  # train, validation and test
    labels: tuple[str, ...]
    scheme: str
    repaired: dict[str, int]
    carved: bool  # the validation split is held out of the training file's (the folder has none)

    @property
    def types(self) -> list[str]:
        return [label[2:] for label in self.labels if label.startswith("B-")]

    def untrained(self) -> list[str]:
        """The entity types a validation or test sentence tags and no training sentence does."""
        trained = {t[2:] for tags in self.splits["train"].tags for t in tags if t != "O"}
        return [t for t in self.types if t not in trained]


def read_task(path: str, where: str) -> Tagged:
    """The task in folder `path` (`where` names the config entry), its tags checked and in IOB2."""
    folder = _task_folder(path, where)
    raw = _read_saved(folder) if (folder / "dataset_dict.json").is_file() else _read_files(folder, where)
    scheme = detect_scheme([tags for split in raw.values() for tags in split.tags])
    splits, repaired = {}, {}
    for name, split in raw.items():
        normal = [to_iob2(tags, scheme) for tags in split.tags]
        splits[name] = Sentences(split.words, [tags for tags, _ in normal], split.where)
        repaired[name] = sum(count for _, count in normal)
    if all(t == "O" for tags in splits["train"].tags for t in tags):
        raise StageError(f"{where}.path: the training split of {folder} tags no entity (every tag is O)")
    # every split's types: one the training split lacks is scored (a miss each time) and named in the results
    types = sorted({t[2:] for split in splits.values() for tags in split.tags for t in tags if t != "O"})
    carved = "validation" not in splits
    if carved:
        splits["train"], splits["validation"] = carve_validation(splits["train"])
    labels = ("O", *(f"{p}-{t}" for t in types for p in "BI"))
    return Tagged(splits, labels, scheme, repaired, carved)


def train_files(path: str, where: str) -> list[Path]:
    """The files holding the training sentences of the task in folder `path`; StageError where there are none."""
    folder = _task_folder(path, where)
    if (folder / "dataset_dict.json").is_file():
        return files_under(folder / "train")
    return [_split_file(folder, "train", where)]


def train_words(path: str, where: str) -> list[list[str]]:
    """The training sentences' words, as the fine-tune reads them (validation carved from them or not)."""
    folder = Path(path).expanduser()
    if (folder / "dataset_dict.json").is_file():
        return _read_saved(folder)["train"].words
    return read_file(train_files(path, where)[0]).words


def carve_validation(train: Sentences) -> tuple[Sentences, Sentences]:
    """A folder without a validation file: VALIDATION_SHARE of the training sentences (at least one, by a hash
    of their words: the same sentences whatever the order) held out to choose the seed on, never the test."""
    ranked = sorted(range(len(train.words)), key=lambda i: hashlib.sha1("\t".join(train.words[i]).encode()).digest())
    if len(ranked) < 2:
        raise StageError(f"{train.where[0]}: one training sentence, and no validation file to choose a seed on")
    held = set(ranked[: max(1, round(VALIDATION_SHARE * len(ranked)))])

    def part(keep: bool) -> Sentences:
        index = [i for i in range(len(train.words)) if (i in held) != keep]
        return Sentences(*([column[i] for i in index] for column in (train.words, train.tags, train.where)))

    return part(True), part(False)


def _task_folder(path: str, where: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise StageError(f"{where}.path: {folder} is not a folder (of train and test CoNLL or JSON-lines files)")
    return folder


def _read_files(folder: Path, where: str) -> dict[str, Sentences]:
    found = {split: _split_file(folder, split, where) for split in SPLITS}
    return {split: read_file(file) for split, file in found.items() if file is not None}


def _split_file(folder: Path, split: str, where: str) -> Path | None:
    """The split's file in `folder`; StageError where the train or test file is missing (validation may be)."""
    by_name = {p.name.lower(): p for p in sorted(folder.iterdir()) if p.is_file()}
    found = next((by_name[s + x] for s in SPLITS[split] for x in SUFFIXES if s + x in by_name), None)
    if found is None and split != "validation":
        raise StageError(f"{where}.path: {folder} has no {'|'.join(SPLITS[split])} file ({', '.join(SUFFIXES)})")
    return found


def read_file(path: Path) -> Sentences:
    """A CoNLL or JSON-lines file's sentences; StageError naming the file and line of a fault."""
    sentences = list(_jsonl(path) if path.suffix.lower() == ".jsonl" else _conll(path))
    if not sentences:
        raise StageError(f"{path}: no sentences")
    words, tags, where = map(list, zip(*sentences))
    return Sentences(words, tags, where)


def _conll(path: Path) -> Iterator[tuple[list[str], list[str], str]]:
    words: list[str] = []
    tags: list[str] = []
    start = 0
    try:
        with path.open(encoding="utf-8-sig", newline="\n") as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                columns = line.split("\t") if "\t" in line else line.split()
                if not line.strip() or columns[0] == DOCSTART:
                    if words:
                        yield words, tags, f"{path}:{start}"
                    words, tags = [], []
                    continue
                at = f"{path}:{n}"
                if len(columns) < 2 or not columns[0].strip():
                    raise StageError(f"{at}: expected a token and its tag (columns split by tabs or spaces)")
                words.append(checked_text(columns[0].strip(), "token", at))
                tags.append(_checked_tag(columns[-1].strip(), at))
                start = start if len(words) > 1 else n
    except UnicodeDecodeError as e:
        raise StageError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    if words:
        yield words, tags, f"{path}:{start}"


def _jsonl(path: Path) -> Iterator[tuple[list[str], list[str], str]]:
    for at, record in iter_records(path):
        field = "tags" if "tags" in record else "ner_tags"
        yield (*_sentence(record.get("tokens"), record.get(field), at, field), at)


def _sentence(tokens: object, tags: object, at: str, field: str = "tags") -> tuple[list[str], list[str]]:
    """A record's tokens and tags, checked: two lists of one length, non-empty tokens, tags of a scheme."""
    if not isinstance(tokens, list) or not isinstance(tags, list):
        raise StageError(f"{at}: expected lists 'tokens' and '{field}'")
    if len(tokens) != len(tags):
        raise StageError(f"{at}: {len(tokens)} tokens but {len(tags)} tags")
    if not tokens:
        raise StageError(f"{at}: an empty sentence (no tokens)")
    words = [checked_text(t, "tokens", at) for t in tokens]
    if not all(w.strip() for w in words):
        raise StageError(f"{at}: an empty or blank token")
    return [w.strip() for w in words], [_checked_tag(t, at) for t in tags]


def _checked_tag(tag: object, at: str) -> str:
    if not isinstance(tag, str) or not TAG.match(tag):
        raise StageError(
            f"{at}: tag {tag!r} is none of IOB1, IOB2 or BIOES's: O, or B-, I-, E-, S- and the entity's type"
        )
    return tag


def _read_saved(folder: Path) -> dict[str, Sentences]:
    """A `datasets` DatasetDict saved to disk: its train, validation (or dev, valid) and test splits."""
    import datasets

    data = datasets.load_from_disk(str(folder))
    found = {}
    for split, stems in SPLITS.items():
        name = next((s for s in stems if s in data), None)
        if name is None:
            if split != "validation":
                raise StageError(f"{folder}: no {'|'.join(stems)} split; found {', '.join(data)}")
            continue
        found[split] = _saved_split(data[name], f"{folder}/{name}")
    return found


def _saved_split(split, source: str) -> Sentences:
    field = next((c for c in ("ner_tags", "tags") if c in split.column_names), None)
    if "tokens" not in split.column_names or field is None:
        found = ", ".join(split.column_names)
        raise StageError(f"{source}: expected columns tokens and ner_tags (or tags); found {found}")
    feature = split.features[field]
    names = getattr(getattr(feature, "feature", None), "names", None)  # a Sequence of ClassLabel ids
    rows = split.select_columns(["tokens", field]).to_dict()
    words, tags, where = [], [], []
    for i, (tokens, ids) in enumerate(zip(rows["tokens"], rows[field])):
        at = f"{source}: row {i}"
        named = [names[t] if names is not None and isinstance(t, int) else t for t in ids]
        w, t = _sentence(tokens, named, at, field)
        words.append(w)
        tags.append(t)
        where.append(at)
    if not words:
        raise StageError(f"{source}: no sentences")
    return Sentences(words, tags, where)


def detect_scheme(sentences: Sequence[Sequence[str]]) -> str:
    """BIOES where an E- or S- tag occurs; IOB1 where some entity starts with I- and no B- starts one (IOB1's
    B- parts two touching entities of a type alone); IOB2 otherwise."""
    prefixes = {t[0] for tags in sentences for t in tags}
    if prefixes & {"E", "S"}:
        return "BIOES"
    starts = {tags[i][0] for tags in sentences for i in range(len(tags)) if _starts(tags, i)}
    return "IOB1" if "I" in starts and "B" not in starts else "IOB2"


def _starts(tags: Sequence[str], i: int) -> bool:
    """Whether tag i begins an entity as written: not O, and not the same type as the tag before it."""
    return tags[i] != "O" and (i == 0 or tags[i - 1] == "O" or tags[i - 1][2:] != tags[i][2:])


def to_iob2(tags: Sequence[str], scheme: str) -> tuple[list[str], int]:
    """`tags` of `scheme` in IOB2, and how many I- tags continued nothing and were made B- (in IOB1 that is
    how an entity starts, and is not counted)."""
    if scheme == "BIOES":
        tags = [{"S": "B", "E": "I"}.get(t[0], t[0]) + t[1:] for t in tags]
    out, repaired = [], 0
    for i, tag in enumerate(tags):
        if tag.startswith("I-") and (i == 0 or out[i - 1] == "O" or out[i - 1][2:] != tag[2:]):
            tag = "B-" + tag[2:]
            repaired += scheme != "IOB1"
        out.append(tag)
    return out, repaired
