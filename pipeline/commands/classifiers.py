"""What `cram export`, `cram predict` and `cram embed` read of a run directory: its tokenizer and
pretrained encoder, or a classifier or embedding model its evaluate stage kept (`[evaluate] keep`), each
file checked against the store's sha256 first; the files themselves are read by the kept-model room
(stages/kept/).

    run = finished_run(run_dir)              # tokenize's and pretrain's outputs, checked
    classifier = find(run_dir, "topic")      # the kept topic classifier, checked
    embedder = find_embedder(run_dir)        # the kept embedding model (name the task where there are several)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cram.pipeline import errors, rundir, store
from cram.pipeline.schema import StageRecord
from cram.stages.kept import (
    EMBEDDER,
    META,
    MODEL,
    PARAMS,
    KeptClassifier,
    KeptEmbedder,
    KeptError,
    read_classifier,
    read_embedder,
)


class ClassifierError(errors.CramError):
    """No kept classifier (or embedding model) where one was asked for, or one that cannot be used; one
    line, exit code 2."""


class RunError(errors.CramError):
    """A run directory whose tokenize or pretrain stage cannot be read for an export; one line, exit code 2."""


@dataclass(frozen=True)
class Run:
    """What an export or a prediction reads of a finished run: its tokenizer and pretrained encoder."""

    tokenizer: Path
    special_ids: dict[str, int]
    params: Path
    model: Path


_NEEDED = {"tokenize": ("tokenizer", "special_ids"), "pretrain": ("params", "model_config")}  # what is read


def finished_run(run_dir: Path, doing: str = "exported") -> Run:
    """RUN_DIR's tokenizer and pretrained encoder, once tokenize and pretrain are done and the files read
    are the ones the store recorded; `doing` says in an error what did not happen."""
    try:
        stages = rundir.records(run_dir)
    except rundir.RunDirError as e:
        raise RunError(str(e)) from None
    outputs = {}
    for stage in ("tokenize", "pretrain"):
        record = stages.get(stage)
        if record is None or record.status != "done" or not (run_dir / stage).is_dir():
            raise RunError(
                f"{run_dir}: stage {stage} is not done (status {record.status if record else 'missing'}); "
                f"run it first: cram resume {run_dir}"
            )
        outputs[stage] = record.outputs
        if missing := [k for k in _NEEDED[stage] if k not in outputs[stage]]:
            raise RunError(
                f"{run_dir / rundir.MANIFEST}: stage {stage} is done, but its outputs lack {', '.join(missing)}; "
                f"re-run it: cram run {run_dir / rundir.CONFIG} --force {stage}"
            )
    for stage, key in (("tokenize", "tokenizer"), ("pretrain", "params"), ("pretrain", "model_config")):
        path = run_dir / stage / str(outputs[stage].get(key))
        if not path.is_file():
            raise RunError(
                f"{path}: missing, though stage {stage} is done; re-run it: "
                f"cram run {run_dir / rundir.CONFIG} --force {stage}"
            )
        # What is read must be what the stage wrote: a damaged file is refused (and noted in its entry).
        damage = store.verify(run_dir / stage, stages[stage].key or "", [str(outputs[stage].get(key))])
        if damage is not None:
            raise RunError(f"{damage}; nothing {doing}: cram resume {run_dir} computes {stage} again")
    tokenize, pretrain = outputs["tokenize"], outputs["pretrain"]
    return Run(
        run_dir / "tokenize" / tokenize["tokenizer"],
        tokenize["special_ids"],
        run_dir / "pretrain" / pretrain["params"],
        run_dir / "pretrain" / pretrain["model_config"],
    )


def find(run_dir: Path, task: str) -> KeptClassifier:
    """The classifier RUN_DIR's evaluate stage kept for `task` (its best seed's), once its files are the
    ones the store recorded. ClassifierError naming `evaluate.keep`, the tasks kept or the damage otherwise."""
    record = _evaluate(run_dir)
    kept = record.outputs.get("classifiers") or {}
    if not kept and (embedders := kept_embedders(run_dir)):
        raise ClassifierError(
            f"--task {task}: {run_dir} kept no classifier; it kept embedding models of: {', '.join(embedders)}"
        )
    if not kept:
        evaluate = rundir.saved_config(run_dir, required=False).get("evaluate") or {}
        if evaluate.get("tasks", True) == []:
            raise ClassifierError(
                f"{run_dir}: evaluate kept no classifier, since it fine-tuned none (evaluate.tasks = []); add the "
                f"task to [[evaluate.tasks]] and run it: cram run {run_dir / rundir.CONFIG}"
            )
        why = 'evaluate.keep = "none"' if evaluate.get("keep") == "none" else "its result predates evaluate.keep"
        raise ClassifierError(
            f'{run_dir}: evaluate kept no classifier ({why}); set evaluate.keep = "best" and re-run it: '
            f"cram run {run_dir / rundir.CONFIG} --force evaluate"
        )
    if task not in kept:
        also = " (an embedding model: cram embed reads it)" if task in kept_embedders(run_dir) else ""
        raise ClassifierError(
            f"--task {task}: {run_dir} kept no classifier of that task{also}; it kept: {', '.join(kept)}"
        )
    try:
        return read_classifier(_verified(run_dir, record, kept[task], META))
    except KeptError as e:
        raise ClassifierError(str(e)) from None


def kept_embedders(run_dir: Path) -> dict[str, str]:
    """Task -> folder (under evaluate/) of each embedding model RUN_DIR's evaluate stage kept; none
    where evaluate is not done."""
    record = rundir.records(run_dir).get("evaluate")
    return dict(record.outputs.get("embedders") or {}) if record is not None and record.status == "done" else {}


def find_embedder(run_dir: Path, task: str | None = None) -> KeptEmbedder:
    """The embedding model RUN_DIR's evaluate stage kept for `task` (None: the one it kept), once its files
    are the ones the store recorded. ClassifierError naming the tasks kept or the damage otherwise."""
    record = _evaluate(run_dir)
    kept = kept_embedders(run_dir)
    if not kept:
        raise ClassifierError(
            f'{run_dir}: evaluate kept no embedding model; a retrieval task ([[evaluate.tasks]] kind = "retrieval") '
            f'with evaluate.keep = "best" keeps one: cram run {run_dir / rundir.CONFIG}'
        )
    if task is None and len(kept) > 1:
        raise ClassifierError(f"{run_dir}: kept embedding models of {', '.join(kept)}; name one with --task")
    task = next(iter(kept)) if task is None else task
    if task not in kept:
        raise ClassifierError(
            f"--task {task}: {run_dir} kept no embedding model of that task; it kept: {', '.join(kept)}"
        )
    try:
        return read_embedder(_verified(run_dir, record, kept[task], EMBEDDER))
    except KeptError as e:
        raise ClassifierError(str(e)) from None


def _evaluate(run_dir: Path) -> StageRecord:
    record = rundir.records(run_dir).get("evaluate")
    if record is None or record.status != "done":
        raise ClassifierError(
            f"{run_dir}: stage evaluate is not done (status {record.status if record else 'missing'}); "
            f"it keeps the fine-tuned classifiers and embedding models: cram resume {run_dir}"
        )
    return record


def _verified(run_dir: Path, record: StageRecord, folder: str, description: str) -> Path:
    """evaluate/FOLDER, once its params, model.json and `description` are the bytes the store recorded."""
    names = [f"{folder}/{name}" for name in (PARAMS, MODEL, description)]
    damage = store.verify(run_dir / "evaluate", record.key or "", names)
    if damage is not None:
        raise ClassifierError(
            f"{damage}; nothing read: cram run {run_dir / rundir.CONFIG} --force evaluate computes it again"
        )
    return run_dir / "evaluate" / folder
