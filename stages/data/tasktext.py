"""The evaluate tasks' own training text as pretraining documents (`tokenize.task_text`): task-adaptive
pretraining (Gururangan et al. 2020, "Don't Stop Pretraining") continues an encoder on the text of the
task it will be fine-tuned on, labels dropped.

Only a task's training file is read, never its test or validation file. A row is one document; a pair
task's two texts are joined by a newline into one, so that a pair stays in one document as fine-tuning
sees it; a token-classification task's sentence is its words joined by spaces. A "heldout-topic" task has
no training file of its own: it classifies the documents tokenize holds out of the corpus, so it gives no task
text (nor do the retrieval kinds, as yet). A GLUE task is read from a local folder only. Each kind that gives
text is one entry of `READERS`: its training files and its rows' texts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, NamedTuple

from cram.stages import StageError
from cram.stages.shared import files as shared_files
from cram.stages.shared import taskfiles

if TYPE_CHECKING:
    from cram.stages.evaluating.config import Config as EvaluateConfig
    from cram.stages.tasks.config import TaskConfig


@dataclass(frozen=True)
class TaskFile:
    """An entry of `[[evaluate.tasks]]` as far as its training text goes; `where` names it in messages."""

    where: str = ""
    kind: Literal["custom", "glue", "token-classification"] = "custom"
    name: str = ""
    path: str = ""  # glue: "" is the hub, which task text refuses (`check`)
    text_fields: tuple[str, ...] = ()  # custom


def of_tasks(tasks: Iterable[TaskConfig]) -> tuple[TaskFile, ...]:
    """The evaluate tasks (its TaskConfigs) that have a training file, in the config's order."""
    return tuple(
        TaskFile(f"evaluate.tasks[{i}]", t.kind, t.name, t.path, tuple(t.text_fields))
        for i, t in enumerate(tasks)
        if t.kind in READERS
    )


def check(tasks: tuple[TaskFile, ...], option: str, evaluate: EvaluateConfig | None) -> None:
    """What `tokenize.task_text = option` needs: a task with a training file on disk, each found.
    `evaluate`: the pipeline's evaluate Config (None: the pipeline has no evaluate stage)."""
    if not tasks:
        why = "the pipeline has no evaluate stage" if evaluate is None else "evaluate.tasks is empty"
        if evaluate is not None and evaluate.tasks:
            kinds = ", ".join(sorted({t.kind for t in evaluate.tasks}))
            why = f"its tasks are of kind {kinds}, without a training file of their own"
        raise StageError(
            f'tokenize.task_text: "{option}" pretrains on the training files of [[evaluate.tasks]] of kind '
            f"{', '.join(READERS)} (GLUE's from a local folder), and there is none ({why}); add one or set "
            'task_text = "none"'
        )
    for task in tasks:
        train_files(task)
    if option == "only" and not any(_has_text(task) for task in tasks):
        named = ", ".join(str(path) for task in tasks for path in train_files(task))
        raise StageError(
            f'tokenize.task_text: "only" pretrains on the tasks\' training rows alone, and every text in {named} '
            'is blank: nothing to pretrain on; fill them, or set task_text = "add" or "none"'
        )


def _has_text(task: TaskFile) -> bool:
    """Whether a training row of the task holds a text that is not blank (read up to the first)."""
    return any(part.strip() for row in _train_texts(task) for part in row)


def train_files(task: TaskFile) -> list[Path]:
    """The files that hold the task's training rows; StageError naming the task when they are missing."""
    return READERS[task.kind].files(task)


def fingerprint(tasks: tuple[TaskFile, ...]) -> list[list[Any]]:
    """Path, size and modification time of each task's training files, so that editing one re-runs
    tokenize; a task whose files cannot be found gives its error instead (`check` reports it)."""
    prints: list[list[Any]] = []
    for task in tasks:
        try:
            prints += shared_files.fingerprint(train_files(task))
        except StageError as e:
            prints.append(["unavailable", str(e)])
    return prints


def documents(task: TaskFile, batch_size: int, limit: int, tally: dict[str, int]) -> Iterator[dict[str, list[str]]]:
    """The task's training rows as documents, in batches of string columns text, title and label (""
    for both: a row's label is what fine-tuning learns, and no part of pretraining). A text over `limit`
    characters is cut into pieces, counted in tally["documents_cut"], as the corpus readers cut theirs."""
    from cram.stages.data.readers import cut_text

    texts = []
    for row in _train_texts(task):
        text = "\n".join(part.strip() for part in row if part.strip())
        if len(text) > limit:
            tally["documents_cut"] += 1
        texts += cut_text(text, limit) if text else []
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        yield {"text": batch, "title": [""] * len(batch), "label": [""] * len(batch)}


def _train_texts(task: TaskFile) -> Iterable[tuple[str, ...]]:
    """Each training row's texts, read by the readers evaluate uses (a custom task's as they are read)."""
    return READERS[task.kind].texts(task)


def _custom_files(task: TaskFile) -> list[Path]:
    return [taskfiles.find_split(_folder(task), ("train",), task.where)]


def _custom_texts(task: TaskFile) -> Iterable[tuple[str, ...]]:
    return taskfiles.iter_texts(_custom_files(task)[0], task.text_fields)


def _glue_files(task: TaskFile) -> list[Path]:
    if not task.path:
        raise StageError(
            f"tokenize.task_text: {task.where} (GLUE {task.name}) is fetched from the hub when evaluate runs, and "
            f"task text reads training files on disk; set {task.where}.path to a local GLUE folder"
        )
    layout, folder = taskfiles.glue_folder(task.name, task.path, task.where)
    return [folder / "train.tsv"] if layout == "tsv" else shared_files.files_under(folder / "train")


def _glue_texts(task: TaskFile) -> Iterable[tuple[str, ...]]:
    spec = taskfiles.GLUE[task.name]
    layout, folder = taskfiles.glue_folder(task.name, task.path, task.where)
    if layout == "tsv":
        return taskfiles.read_tsv(folder / "train.tsv", spec.tsv_text, spec.tsv_label)[0]
    import datasets

    return taskfiles.glue_rows(task.name, datasets.load_from_disk(str(folder)), "train", str(folder))[0]


def _token_files(task: TaskFile) -> list[Path]:
    from cram.stages.tagging.reading import train_files as token_train_files

    return token_train_files(task.path, task.where)


def _token_texts(task: TaskFile) -> Iterable[tuple[str, ...]]:
    from cram.stages.tagging.reading import train_words

    return ((" ".join(words),) for words in train_words(task.path, task.where))


def _folder(task: TaskFile) -> Path:
    folder = Path(task.path).expanduser()
    if not folder.is_dir():
        raise StageError(f"{task.where}.path: {folder} is not a directory (of train and test .csv or .jsonl files)")
    return folder


class Reader(NamedTuple):
    """How a kind of evaluate task gives training text: its training files, and its rows' texts."""

    files: Callable[[TaskFile], list[Path]]
    texts: Callable[[TaskFile], Iterable[tuple[str, ...]]]


READERS: dict[str, Reader] = {
    "custom": Reader(_custom_files, _custom_texts),
    "glue": Reader(_glue_files, _glue_texts),
    "token-classification": Reader(_token_files, _token_texts),
}
