"""Run directories: layout, the manifest and the lock."""

from __future__ import annotations

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
    """`manifest.json`: one record per stage (see docs/architecture.md)."""

    path: Path
    data: dict[str, Any]

    @classmethod
    def load(cls, run_dir: Path) -> "Manifest":
        path = run_dir / MANIFEST
        if not path.exists():
            return cls(path, {"run": run_dir.name, "stages": {}})
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
        wrong = next((w for name, r in stages.items() if (w := _wrong_field(r, f"stages.{name}"))), None)
        if wrong is not None:
            raise RunDirError(f"{path}: not a cram manifest ({wrong}); move it away to start the run afresh")
        return cls(path, data)

    @property
    def records(self) -> dict[str, dict[str, Any]]:
        """The stage records by stage name, in the order the stages first ran (`load` checked their shape)."""
        return self.data["stages"]

    def stage(self, name: str) -> dict[str, Any] | None:
        return self.records.get(name)

    def put(self, name: str, record: dict[str, Any]) -> None:
        self.records[name] = record
        self.save()

    def update(self, name: str, **fields: Any) -> dict[str, Any]:
        record = self.records.setdefault(name, {})
        record.update(fields)
        self.save()
        return record

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.data, indent=2, sort_keys=False) + "\n")


_NULL = type(None)
_TEXT = ((str, _NULL), "a string or null")
_TABLE = ((dict, _NULL), "an object or null")
# The type of each record field that commands read: checked once, where every manifest is read, so that
# no command meets a hand-edited or damaged value it cannot use. A field left out is allowed.
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "status": ((str,), "a string"),
    **dict.fromkeys(("key", "config_hash", "inputs_hash", "version", "started", "ended"), _TEXT),
    **dict.fromkeys(("error", "host", "git_commit", "reused"), _TEXT),
    "duration_s": ((int, float, _NULL), "a number or null"),
    "pid": ((int, _NULL), "an integer or null"),
    **dict.fromkeys(("outputs", "upstream_keys", "versions", "attempt"), _TABLE),
    "attempts": ((list,), "a list"),
}


def _wrong_field(record: dict[str, Any], where: str) -> str | None:
    """What is wrong with the field types of a stage record (or of an attempt kept in it), naming the
    field and its value; None when nothing is."""
    for name, (allowed, expected) in _FIELDS.items():
        value = record.get(name)
        if name in record and (not isinstance(value, allowed) or isinstance(value, bool)):
            return f"{where}.{name}: expected {expected}, got {_shown(value)}"
    upstream = record.get("upstream_keys") or {}
    if not all(isinstance(k, str) for k in upstream.values()):
        return f"{where}.upstream_keys: expected keys (strings) by stage, got {_shown(upstream)}"
    kept = {"attempt": record.get("attempt")} | {f"attempts[{i}]": a for i, a in enumerate(record.get("attempts", []))}
    for name, attempt in kept.items():
        if attempt is not None and not isinstance(attempt, dict):
            return f"{where}.{name}: expected an object, got {_shown(attempt)}"
        if attempt and (wrong := _wrong_field(attempt, f"{where}.{name}")):
            return wrong
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def records(run_dir: Path) -> dict[str, dict[str, Any]]:
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
