"""Run directories: layout, the manifest, the lock, and atomic writes."""

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

MANIFEST = "manifest.json"
CONFIG = "config.toml"
LOCK = ".lock"
EVENTS = Path("logs") / "events.jsonl"
PARTIAL = ".partial"

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


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
            raise RunDirError(f'{path}: not a cram manifest (expected {{"stages": {{name: record}}}}); '
                              "move it away to start the run afresh")
        return cls(path, data)

    def stage(self, name: str) -> dict[str, Any] | None:
        return self.data["stages"].get(name)

    def update(self, name: str, **fields: Any) -> dict[str, Any]:
        record = self.data["stages"].setdefault(name, {})
        record.update(fields)
        self.save()
        return record

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.data, indent=2, sort_keys=False) + "\n")


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


@contextmanager
def locked(run_dir: Path, log: Any) -> Iterator[None]:
    """Hold `RUN_DIR/.lock` for the block; a lock left by a dead process is taken over with a warning."""
    path = run_dir / LOCK
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": now()})
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None:
                continue  # it vanished between our open and our read: try again
            same_host = holder.get("host") == socket.gethostname()
            if not same_host or pid_alive(int(holder.get("pid", -1))):
                raise RunDirError(
                    f"{run_dir} is in use by pid {holder.get('pid')} on {holder.get('host')} "
                    f"since {holder.get('since')}; wait for it, or remove {path} if that process is gone"
                ) from None
            log.warning("taking over a stale lock", lock=str(path), dead_pid=holder.get("pid"))
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(mine)
        break
    try:
        yield
    finally:
        if (_read_lock(path) or {}).get("pid") == os.getpid():
            path.unlink(missing_ok=True)


def _read_lock(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return {}  # half-written by a process killed while writing it: treated as dead
