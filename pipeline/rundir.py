"""Run directories: layout, the manifest and the lock."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from cram.pipeline.config import tomllib
from cram.pipeline.schema import SCHEMA, SchemaError, StageRecord
from cram.stages.shared.files import temp_path, write_atomic

MANIFEST = "manifest.json"
CONFIG = "config.toml"
LOCK = ".lock"
EVENTS = Path("logs") / "events.jsonl"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class RunDirError(Exception):
    """A bad run name or a run directory that cannot be used now; exit code 2."""


def validate_name(name: str) -> str:
    if not _NAME.fullmatch(name) or ".." in name:
        raise RunDirError(
            f"run name {name!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return name


def now() -> str:
    return datetime.now().astimezone().isoformat(timespec="milliseconds")


@dataclass
class Manifest:
    """`manifest.json`: the run's name and one record per stage, in the order the stages first ran (see
    pipeline/schema.py)."""

    path: Path
    run: str
    records: dict[str, StageRecord]

    @classmethod
    def load(cls, run_dir: Path) -> "Manifest":
        path = run_dir / MANIFEST
        if not path.exists():
            return cls(path, run_dir.name, {})
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise RunDirError(f"{path}: not valid JSON ({e}); move it away to start the run afresh") from None
        except (OSError, UnicodeDecodeError) as e:
            raise RunDirError(f"{path}: cannot be read ({e})") from None
        stages = data.get("stages") if isinstance(data, dict) else None
        if not isinstance(stages, dict) or not all(isinstance(r, dict) for r in stages.values()):
            raise RunDirError(
                f'{path}: not a cram manifest (expected {{"stages": {{name: record}}}}); '
                "move it away to start the run afresh"
            )
        written = data.get("schema", 1)
        if not isinstance(written, int) or isinstance(written, bool) or written > SCHEMA:
            raise RunDirError(f"{path}: manifest schema {written!r}; this cram reads schemas 1 to {SCHEMA}: upgrade it")
        try:
            records = {name: StageRecord.from_json(r, f"stages.{name}") for name, r in stages.items()}
        except SchemaError as e:
            raise RunDirError(f"{path}: not a cram manifest ({e}); move it away to start the run afresh") from None
        return cls(path, str(data.get("run", run_dir.name)), records)

    def stage(self, name: str) -> StageRecord | None:
        return self.records.get(name)

    def put(self, name: str, record: StageRecord) -> None:
        self.records[name] = record
        self.save()

    def update(self, name: str, **changes: Any) -> StageRecord:
        """The stage's record with `changes` (fields of StageRecord), saved."""
        record = dataclasses.replace(self.records.get(name) or StageRecord(), **changes)
        self.put(name, record)
        return record

    def save(self) -> None:
        data = {"schema": SCHEMA, "run": self.run, "stages": {n: r.to_json() for n, r in self.records.items()}}
        write_atomic(self.path, json.dumps(data, indent=2) + "\n")


def records(run_dir: Path) -> dict[str, StageRecord]:
    """The stage records of an existing run directory, for commands that read a run (status, export,
    compare). RunDirError, naming the file, where there is no manifest or it cannot be read."""
    if not (run_dir / MANIFEST).is_file():
        raise RunDirError(f"{run_dir}: no {MANIFEST}; not a run directory")
    return Manifest.load(run_dir).records


def saved_config(run_dir: Path, required: bool = True) -> dict[str, Any]:
    """The resolved config a run saved (`config.toml`) as a dict; where it has none, RunDirError when
    `required`, else an empty dict (a run that has not started its first stage)."""
    path = run_dir / CONFIG
    if not path.is_file():
        if required:
            raise RunDirError(f"{path}: no saved config; is {run_dir} a run directory?")
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise RunDirError(f"{path}: not a readable config ({e})") from None


def pid_alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0 or -1, ...) would address process groups, not one process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(path: Path, log: Any) -> dict[str, Any] | None:
    """Take the lock file `path`: None when taken, else the live holder's pid, host and since.

    The file appears with its content in one step (written aside, then hard-linked into place), so a
    lock without a readable pid can only be left by a process killed while writing an older one: it is
    taken over, as is the lock of a process that is gone.
    """
    tmp = temp_path(path)
    tmp.write_text(holder_record())
    try:
        while True:
            try:
                os.link(tmp, path)
                return None
            except FileExistsError:
                pass
            holder = read_lock(path)
            if holder is None:
                continue  # it vanished between our link and our read: try again
            state = holder_state(holder)
            if state == "live":
                return holder
            if state == "unreadable":
                log.warning(
                    "taking over a lock without a pid (empty or half-written: its writer was killed)", lock=str(path)
                )
            else:
                log.warning("taking over a stale lock", lock=str(path), dead_pid=holder.get("pid"))
            path.unlink(missing_ok=True)
    finally:
        tmp.unlink(missing_ok=True)


def holder_record() -> str:
    """What a lock file says of the process holding it (JSON: pid, host, since), as `read_lock` reads it."""
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": now()})


def holder_state(holder: dict[str, Any]) -> str:
    """Whether a lock's holder is "live", "dead" (its pid is gone from this host) or "unreadable" (no pid)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return "unreadable"
    if holder.get("host") != socket.gethostname() or pid_alive(pid):
        return "live"  # on another host we cannot tell: assume it runs
    return "dead"


def release(path: Path) -> None:
    if (read_lock(path) or {}).get("pid") == os.getpid():
        path.unlink(missing_ok=True)


@contextmanager
def locked(run_dir: Path, log: Any) -> Iterator[None]:
    """Hold `RUN_DIR/.lock` for the block; a lock left by a dead process is taken over with a warning."""
    path = run_dir / LOCK
    holder = acquire(path, log)
    if holder is not None:
        raise RunDirError(
            f"{run_dir} is in use by pid {holder.get('pid')} on {holder.get('host')} "
            f"since {holder.get('since')}; wait for it, or remove {path} if that process is gone"
        )
    try:
        yield
    finally:
        release(path)


def read_lock(path: Path) -> dict[str, Any] | None:
    """The holder a lock file names (see `holder_record`); None without the file, {} when it holds no record."""
    try:
        holder = json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}  # half-written by a process killed while writing it: treated as dead
    return holder if isinstance(holder, dict) else {}
