"""Fine-tuning tasks for the evaluate stage: loading them as text/label examples, and scoring them.

Three sources, one shape (`Task`): GLUE (the hub's `nyu-mll/glue`, or a local directory in the
original GLUE TSV layout or as `datasets` saved to disk), a custom CSV / JSON-lines task, and the
held-out Wikipedia articles' topics. Scoring them is `metrics.py`.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cram.stages import StageError
from cram.stages.finetuning.metrics import REGRESSION_METRICS, score
from cram.stages.shared.taskfiles import (
    GLUE,
    GlueSpec,
    find_split,
    glue_folder,
    glue_rows,
    read_rows,
    read_tsv,
)

# --------------------------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Examples:
    texts: list[tuple[str, ...]]  # one text, or a pair
    labels: np.ndarray  # int64 class ids, or float32 targets for regression


@dataclass(frozen=True)
class Task:
    name: str
    metrics: tuple[str, ...]  # the first is the task's main score
    label_names: tuple[str, ...]  # () for regression
    train: Examples
    tests: dict[str, Examples]  # evaluation sets by name: "test", or MNLI's "matched"/"mismatched"

    @property
    def regression(self) -> bool:
        return not self.label_names

    @property
    def num_outputs(self) -> int:
        return len(self.label_names) or 1


TOPIC_LEFT_OUT = ("", "Uncategorized")


def load_glue(name: str, path: str, where: str) -> Task:
    """GLUE task `name` from the hub (`path` == "") or from a local directory in either layout.

    `path` may be the task's own folder or a GLUE root holding it (`CoLA/` for TSV, `cola/` for
    `datasets`). `where` names the config entry in error messages.
    """
    if name not in GLUE:
        raise StageError(f"{where}.name: unknown GLUE task {name!r}; choose one of {', '.join(GLUE)}")
    spec = GLUE[name]
    if not path:
        return _glue_from_hub(name, spec, where)
    layout, folder = glue_folder(name, path, where)
    return _glue_from_saved(name, spec, folder) if layout == "saved" else _glue_from_tsv(name, spec, folder)


def _glue_from_hub(name: str, spec: GlueSpec, where: str) -> Task:
    import datasets

    try:
        data = datasets.load_dataset("nyu-mll/glue", name)
    except Exception as e:  # offline, or the hub is unreachable: the message says what to do instead
        raise StageError(
            f"{where}.path: GLUE {name} could not be loaded from the hub (nyu-mll/glue): {type(e).__name__}; "
            "set path to a local GLUE directory (TSV layout or datasets save_to_disk)"
        ) from None
    return _glue_from_dataset_dict(name, spec, data, "nyu-mll/glue")


def _glue_from_saved(name: str, spec: GlueSpec, folder: Path) -> Task:
    import datasets

    return _glue_from_dataset_dict(name, spec, datasets.load_from_disk(str(folder)), str(folder))


def _glue_from_dataset_dict(name: str, spec: GlueSpec, data, source: str) -> Task:
    def split(split_name: str) -> Examples:
        texts, labels = glue_rows(name, data, split_name, source)
        examples = _check_labels(texts, labels, spec.labels, f"{source}/{split_name}")
        return examples if spec.labels else _varied(examples, f"{source}/{split_name}", f"GLUE {name}'s label")

    return Task(name, spec.metrics, spec.labels, split("train"), {t: split(hf) for t, _, hf in spec.tests})


def _glue_from_tsv(name: str, spec: GlueSpec, folder: Path) -> Task:
    def split(file_name: str) -> Examples:
        path = folder / file_name
        if not path.is_file():
            raise StageError(f"{path}: missing; the GLUE TSV layout of {name} has it")
        try:
            texts, labels = read_tsv(path, spec.tsv_text, spec.tsv_label)
        except UnicodeDecodeError as e:
            raise StageError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
        labels = [_tsv_label(v, spec.labels, path) for v in labels]
        examples = _check_labels(texts, labels, spec.labels, str(path))
        return examples if spec.labels else _varied(examples, path, f"GLUE {name}'s label")

    return Task(name, spec.metrics, spec.labels, split("train.tsv"), {t: split(f) for t, f, _ in spec.tests})


def _tsv_label(value: str, names: tuple[str, ...], path: Path) -> int | float | str:
    if not names:
        try:
            return float(value)
        except ValueError:
            raise StageError(f"{path}: score {value!r} is not a number") from None
    if value in names:
        return names.index(value)
    # CoLA, SST-2, MRPC and QQP write ids, the others names; _check_labels rejects anything else.
    return int(value) if value.isdigit() else value


def _check_labels(texts, labels, names: tuple[str, ...], source: str) -> Examples:
    if not names:
        return Examples(list(texts), np.asarray(labels, dtype=np.float32))
    bad = next((v for v in labels if not (isinstance(v, int) and 0 <= v < len(names))), None)
    if bad is not None:
        raise StageError(f"{source}: label {bad!r} is not one of {', '.join(names)} (ids 0..{len(names) - 1})")
    return Examples(list(texts), np.asarray(labels, dtype=np.int64))


def load_custom(
    name: str, path: str, text_fields: Sequence[str], label_field: str, metrics: Sequence[str], where: str
) -> Task:
    """A task from a folder holding `train.csv|jsonl` and `test|dev|validation.csv|jsonl`.

    Class labels are the distinct training values, ordered (numerically when all are numbers); `f1`
    takes the second of them as the positive class. Regression when the metrics are correlations.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise StageError(f"{where}.path: {folder} is not a directory (of train and test .csv or .jsonl files)")
    train_file = find_split(folder, ("train",), where)
    test_file = find_split(folder, ("test", "dev", "validation"), where)
    if os.path.samefile(train_file, test_file):
        raise StageError(
            f"{where}.path: {train_file.name} and {test_file.name} are the same file; a test set must be unseen"
        )
    train = (train_file, *read_rows(train_file, text_fields, label_field))
    test = (test_file, *read_rows(test_file, text_fields, label_field))
    if all(m in REGRESSION_METRICS for m in metrics):
        task = _regression_task(name, tuple(metrics), train, test, label_field)
    else:
        task = _classification_task(name, tuple(metrics), train, test, label_field)
    _check_unseen(train, test, where)  # after the labels: a file's own faults are named first
    return task


def _check_unseen(train: tuple, test: tuple, where: str) -> None:
    """`train` and `test`: (file, texts, labels). No test row's text may be a training row's: the score
    would measure memory, and `tokenize.task_text` would pretrain on the test set's text."""
    seen = set(train[1])
    shared = sum(text in seen for text in test[1])
    if shared:
        raise StageError(
            f"{where}.path: {shared:,} of the {len(test[1]):,} rows of {test[0].name} have the text of a row of "
            f"{train[0].name}; a test set must be unseen: drop them from one of the files"
        )


def _regression_task(name: str, metrics: tuple[str, ...], train: tuple, test: tuple, label_field: str) -> Task:
    """`train` and `test`: (file, texts, labels). The targets of each must vary: a correlation with a
    constant is undefined (and the majority baseline would score 0 for it)."""
    train_set, test_set = (
        _varied(_float_labels(texts, labels, file, label_field), file, f"field {label_field!r} of task {name!r}")
        for file, texts, labels in (train, test)
    )
    return Task(name, metrics, (), train_set, {"test": test_set})


def _varied(examples: Examples, source: Path | str, what: str) -> Examples:
    """A regression set's `examples`, refused (naming `source` and `what` holds its targets) when every
    target is the same: a correlation with a constant is undefined."""
    if len(set(examples.labels.tolist())) < 2:
        raise StageError(
            f"{source}: {what} holds one value only ({examples.labels[0]:g}); "
            "a correlation with a constant target is undefined"
        )
    return examples


def _classification_task(name: str, metrics: tuple[str, ...], train: tuple, test: tuple, label_field: str) -> Task:
    """`train` and `test`: (file, texts, labels). Two classes or more, each label a string or an integer,
    and not one class per example (a column of ids or scores, which no classifier can learn)."""
    (train_file, train_texts, train_labels), (test_file, test_texts, test_labels) = train, test
    for file, labels in ((train_file, train_labels), (test_file, test_labels)):
        _check_class_labels(labels, file, label_field)
    names = _ordered_names({str(v) for v in train_labels})
    if len(names) < 2:
        raise StageError(
            f"{train_file}: field {label_field!r} holds one class only ({names[0]!r}); a classifier "
            "needs two or more (for a regression, choose the metrics pearson or spearman)"
        )
    if len(names) == len(train_labels) > 2:
        raise StageError(
            f"{train_file}: field {label_field!r} holds {len(names)} classes in {len(names)} examples, each "
            "label once: no class to learn (for a regression, choose the metrics pearson or spearman)"
        )
    unseen = sorted({str(v) for v in test_labels} - set(names))
    if unseen:
        raise StageError(f"{test_file}: label {unseen[0]!r} of field {label_field!r} never occurs in {train_file.name}")
    ids = {n: i for i, n in enumerate(names)}

    def examples(texts, labels) -> Examples:
        return Examples(texts, np.asarray([ids[str(v)] for v in labels], dtype=np.int64))

    return Task(name, metrics, names, examples(train_texts, train_labels), {"test": examples(test_texts, test_labels)})


def _check_class_labels(labels: list, path: Path, label_field: str) -> None:
    """A class label is a string or an integer: a JSON float, bool, list or object is no class name."""
    bad = next((v for v in labels if isinstance(v, bool) or not isinstance(v, (str, int))), None)
    if bad is not None:
        raise StageError(
            f"{path}: label {bad!r} of field {label_field!r} is not a class; class labels are strings or "
            "integers (for a regression, choose the metrics pearson or spearman)"
        )


def _float_labels(texts, labels, path: Path, label_field: str) -> Examples:
    """Regression targets: finite numbers, in float32 too (a nan or inf target makes every correlation nan)."""
    with np.errstate(over="ignore"):
        values = np.asarray([_as_float(v) for v in labels], dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise StageError(
            f"{path}: label {labels[bad[0]]!r} of field {label_field!r} is not a finite number; "
            "the metrics ask for regression"
        )
    return Examples(texts, values)


def _as_float(value: object) -> float:
    """`value` as a number, nan when it is none (a bool, a word, a list)."""
    if isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def _ordered_names(values: set[str]) -> tuple[str, ...]:
    try:
        return tuple(sorted(values, key=float))
    except ValueError:
        return tuple(sorted(values))


def load_topics(name: str, path: Path, test_fraction: float) -> Task:
    """The held-out Wikipedia articles' topics, split per topic into train and test by title hash.

    Hashing the title makes the split independent of row order and of the run seed; doing it per topic
    keeps every topic in both halves.
    """
    import datasets

    data = datasets.load_from_disk(str(path))
    missing = [c for c in ("text", "label") if c not in data.column_names]
    if missing:
        found = ", ".join(data.column_names)
        raise StageError(f"{path}: the held-out articles have no {missing[0]!r} column, only {found}")
    rows = data.to_dict()
    keys = rows.get("title") or rows["text"]
    by_topic: dict[str, list[int]] = {}
    for i, label in enumerate(rows["label"]):
        if label not in TOPIC_LEFT_OUT:
            by_topic.setdefault(label, []).append(i)
    if not by_topic:
        raise StageError(
            f"{path}: records without the label field: none of the {len(rows['label']):,} held-out articles has a "
            "topic; set tokenize.corpus.label_field to the corpus field that holds it"
        )
    # A topic needs two articles, one for each half.
    names = tuple(sorted(t for t, idx in by_topic.items() if len(idx) >= 2))
    if len(names) < 2:
        raise StageError(f"{path}: fewer than two topics with two or more articles; nothing to classify")
    train, test = [], []
    for label, topic in enumerate(names):
        ranked = sorted(by_topic[topic], key=lambda i: hashlib.sha1(keys[i].encode()).hexdigest())
        n_test = min(len(ranked) - 1, max(1, round(test_fraction * len(ranked))))
        test += [(i, label) for i in ranked[:n_test]]
        train += [(i, label) for i in ranked[n_test:]]

    def examples(pairs) -> Examples:
        return Examples([(rows["text"][i],) for i, _ in pairs], np.asarray([y for _, y in pairs], dtype=np.int64))

    return Task(name, ("accuracy", "macro_f1"), names, examples(train), {"test": examples(test)})


def has_topics(path: Path) -> bool:
    """Whether the held-out articles at `path` carry any topic label (an unlabelled corpus gives them none)."""
    import datasets

    data = datasets.load_from_disk(str(path))
    return "label" in data.column_names and any(label not in TOPIC_LEFT_OUT for label in data.unique("label"))


def majority_baseline(task: Task, test: Examples) -> dict[str, float]:
    """Scores of always answering the training set's most common class (its mean, for regression)."""
    if task.regression:
        guess = np.full(len(test.labels), task.train.labels.mean(), dtype=np.float32)
    else:
        guess = np.full(len(test.labels), np.bincount(task.train.labels).argmax())
    return score(task.metrics, guess, test.labels)


def glue_average(scores: dict[str, dict[str, float]]) -> float:
    """Cramming's GLUE average: the mean of each evaluation set's main score.

    `scores` maps a GLUE evaluation set ("cola/test", "mnli/matched", "mnli/mismatched", ...) to its
    scores; MNLI's two sets count apart, as in the paper's table. Main scores follow BERT's report:
    Matthews for CoLA, F1 for MRPC and QQP, Spearman for STS-B, accuracy for the rest.
    """
    return float(np.mean([values[GLUE[key.split("/")[0]].metrics[0]] for key, values in scores.items()]))
