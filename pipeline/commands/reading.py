"""What the commands that show runs read from run directories: a run's stage records and their status
as `cram status` shows it, the newest stage of each run under a root, a run's saved config.

    for stage in status(Path("runs/default")): print(stage.name, stage.state, stage.note)
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cram.pipeline import rundir, store
from cram.pipeline.errors import CramError
from cram.pipeline.schema import StageRecord


@dataclass(frozen=True)
class Stage:
    """A stage's manifest record, with its status checked against the files and processes (see
    checked_status) and a note on a kept attempt or a replaced upstream."""

    name: str
    record: StageRecord
    state: str
    note: str


@dataclass(frozen=True)
class Newest:
    """A run under a root and its newest started stage (`stage` None: none has started), or, where its
    manifest cannot be read, why (`unreadable`)."""

    run: str
    stage: str | None = None
    state: str = ""
    started: str = ""
    unreadable: str | None = None


@dataclass(frozen=True)
class Versus:
    """A task's main score from the continued model beside the one from the checkpoint it started from
    (`[evaluate] baseline = "init"`), medians over the same seeds, and each one's spread over them."""

    task: str  # the task, and its test set where it has more than one
    metric: str
    continued: float
    start: float
    gain: float  # continued less start
    spread: float  # max - min of the continued model's per-seed scores
    start_spread: float


def versus(run_dir: Path, record: StageRecord) -> list[Versus]:
    """Each task's continued and starting scores, from a done evaluate's results (stages/evaluating/versus.py);
    none for a run without a baseline, or whose results cannot be read (its status says why)."""
    name = record.outputs.get("results")
    if record.status != "done" or not isinstance(name, str):
        return []
    try:
        tasks = json.loads((run_dir / "evaluate" / name).read_text(encoding="utf-8")).get("tasks", {})
        return [_versus(task, r, test) for task, r in tasks.items() if "start" in r for test in r["median"]]
    except (OSError, ValueError, AttributeError, KeyError, TypeError, IndexError):
        return []


def _versus(task: str, r: dict[str, Any], test: str) -> Versus:
    metric = r["metrics"][0]
    label = task if len(r["median"]) == 1 else f"{task}/{test}"
    start = r["start"]
    return Versus(
        label,
        metric,
        r["median"][test][metric],
        start["median"][test][metric],
        r["gain"][test][metric],
        r["spread"][test][metric],
        start["spread"][test][metric],
    )


def folder(path: Path) -> Path:
    """`path`, which must be an existing folder (a runs root)."""
    if not path.is_dir():
        raise CramError(f"{path}: no such directory")
    return path


def status(run_dir: Path) -> list[Stage]:
    stages = rundir.records(run_dir)
    return [Stage(name, r, *checked_status(run_dir, name, r, stages)) for name, r in stages.items()]


def newest(root: Path) -> list[Newest]:
    """Every run under `root`, by name; a manifest that cannot be read is an entry, never the end of the list."""
    found = []
    for path in sorted(p for p in folder(root).iterdir() if (p / rundir.MANIFEST).is_file()):
        try:
            stages = rundir.Manifest.load(path).records
        except rundir.RunDirError as e:  # one bad run must not hide the others
            found.append(Newest(path.name, unreadable=str(e)))
            continue
        started = {k: (r, r.started) for k, r in stages.items() if r.started}
        if not started:
            found.append(Newest(path.name))
            continue
        stage = max(started, key=lambda k: started[k][1])
        r, when = started[stage]
        found.append(Newest(path.name, stage, checked_status(path, stage, r)[0], when))
    return found


def checked_status(
    run_dir: Path, name: str, record: StageRecord, records: dict[str, StageRecord] | None = None
) -> tuple[str, str]:
    """A stage's status as `cram status` shows it, checked against the files and the processes, and a
    note on an unfinished attempt kept beside a done result, or on a result made from an upstream
    result that the run has since replaced (given all the run's `records`)."""
    status = record.status
    if status == "done" and (trouble := store.problem(run_dir / name, record.key or "")):
        return ("damaged" if trouble.damaged else "missing"), f"not done: {trouble}"
    replaced = [
        u
        for u, k in record.upstream_keys.items()
        if status == "done" and records and (up := records.get(u)) is not None and up.key not in (None, k)
    ]
    if status == "running" and _gone(record):
        return "killed", f"pid {record.pid} ended without a word (killed); cram resume {run_dir} continues it"
    notes = [f"(made from an earlier {', '.join(replaced)}: re-run to bring it up to date)"] if replaced else []
    attempt = record.attempt
    if attempt is not None:
        state = "killed" if attempt.status == "running" and _gone(attempt) else attempt.status
        error = f": {attempt.error}" if attempt.error else ""
        notes.append(f"(a newer attempt, key {str(attempt.key)[:12]}, {state}{error}; this result is kept)")
    return status, " ".join(notes)


def _gone(record: StageRecord) -> bool:
    """A record says running, but its process on this host has ended (killed: it could not say)."""
    here = socket.gethostname()
    return record.pid is not None and (record.host or here) == here and not rundir.pid_alive(record.pid)
