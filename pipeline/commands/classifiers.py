"""The fine-tuned classifiers a run's evaluate stage kept (`[evaluate] keep`, stages/finetuning/kept.py),
found for `cram export RUN --task NAME` and `cram predict`, or read back from a cram-format export.

    kept = find(run_dir, "topic")            # checked against the store's sha256 first
    kept = from_export(Path("out/topic"))    # a `cram export RUN --task topic` folder
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cram.model.config import ModelConfig, ModelConfigError
from cram.pipeline import errors, rundir, store
from cram.stages.finetuning.kept import META, MODEL, PARAMS


class ClassifierError(errors.CramError):
    """No kept classifier where one was asked for, or one that cannot be used; one line, exit code 2."""


@dataclass(frozen=True)
class Kept:
    """A kept classifier: its folder (params, model.json, classifier.json) and what they say."""

    folder: Path
    meta: dict[str, Any]  # classifier.json
    cfg: ModelConfig

    @property
    def labels(self) -> list[str]:
        return list(self.meta["labels"])

    def params(self) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(self.folder / PARAMS)


def find(run_dir: Path, task: str) -> Kept:
    """The classifier RUN_DIR's evaluate stage kept for `task` (its best seed's), once its files are the
    ones the store recorded. ClassifierError naming `evaluate.keep`, the tasks kept or the damage otherwise."""
    record = rundir.records(run_dir).get("evaluate") or {}
    if record.get("status") != "done":
        raise ClassifierError(
            f"{run_dir}: stage evaluate is not done (status {record.get('status', 'missing')}); "
            f"it keeps the fine-tuned classifiers: cram resume {run_dir}"
        )
    kept = (record.get("outputs") or {}).get("classifiers") or {}
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
        raise ClassifierError(f"--task {task}: {run_dir} kept no classifier of that task; it kept: {', '.join(kept)}")
    folder = run_dir / "evaluate" / kept[task]
    names = [f"{kept[task]}/{name}" for name in (PARAMS, MODEL, META)]
    damage = store.verify(run_dir / "evaluate", record.get("key", ""), names)
    if damage is not None:
        raise ClassifierError(
            f"{damage}; nothing read: cram run {run_dir / rundir.CONFIG} --force evaluate computes it again"
        )
    return _read(folder)


def from_export(folder: Path) -> Kept:
    """The classifier of a cram-format `cram export RUN --task NAME` folder."""
    if not (folder / META).is_file():
        hint = " (a transformers export: export with --format cram)" if (folder / "config.json").is_file() else ""
        raise ClassifierError(f"{folder}: no {META}; not a classifier exported by cram export --task{hint}")
    return _read(folder)


def _read(folder: Path) -> Kept:
    path = folder / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        cfg = ModelConfig.from_json(folder / MODEL)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ModelConfigError) as e:
        raise ClassifierError(f"{path}: not a readable classifier ({e})") from None
    check_labels(meta, path)
    if not (folder / PARAMS).is_file():
        raise ClassifierError(f"{folder / PARAMS}: missing")
    return Kept(folder, meta, cfg)


def check_labels(meta: Any, where: Path) -> None:
    """Label names that map to ids and back (distinct non-empty strings, one per output; none for a
    regression); and the text fields a prediction reads. ClassifierError naming `where` otherwise."""
    labels = meta.get("labels") if isinstance(meta, dict) else None
    outputs = meta.get("num_outputs") if isinstance(meta, dict) else None
    ok = isinstance(labels, list) and all(isinstance(n, str) and n for n in labels)
    if not ok or len(set(labels)) != len(labels) or (len(labels) or 1) != outputs:
        raise ClassifierError(
            f"{where}: labels {json.dumps(labels)} do not round-trip to {outputs} output ids; "
            "expected distinct non-empty names, one per output (none for a regression)"
        )
    fields = meta.get("text_fields")
    if not isinstance(fields, list) or len(fields) not in (1, 2) or not all(isinstance(f, str) for f in fields):
        raise ClassifierError(f"{where}: text_fields {json.dumps(fields)}: expected one or two field names")
