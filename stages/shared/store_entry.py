"""A stage-store entry's own files, their one writer and one reader: the marker (`.cram-entry.json`) a
finished entry records itself in, and the damage note (`.cram-damaged`) a check leaves in an entry it
found damaged. The store (`pipeline/store.py`) makes, checks and links entries; a stage that reads
another run's files (`stages/shared/pretrained.py`) checks them against the same marker. Stages never
import the pipeline, so the format lives here, below both."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cram.stages.shared.files import CONTENT_HASH, content_hash, write_atomic

MARKER = ".cram-entry.json"
DAMAGED = ".cram-damaged"  # in an entry a check found damaged: its one line says which file


@dataclass(frozen=True)
class Marker:
    """A finished entry's record of itself: its stage and key, the manifest record of the run that made it
    (as JSON), and each file's size, modification time and CONTENT_HASH, by name relative to the entry. A
    marker written before hashes has sizes only (`times` and `hashes` None): such an entry is trusted on
    sizes."""

    stage: str
    key: object  # a 64-hex key as written; whatever a marker edited by hand holds, for the check to refuse
    record: dict[str, Any]
    sizes: dict[str, int]
    times: dict[str, int] | None = None
    hashes: dict[str, str] | None = None

    @classmethod
    def of_files(cls, folder: Path, stage: str, key: str, record: dict[str, Any]) -> Marker:
        """The marker of `folder` as it is now: every file below it (but the marker and a damage note) with
        its size, modification time and hash."""
        found = sorted(Path(dirpath) / name for dirpath, _, names in os.walk(folder) for name in names)
        paths = {str(p.relative_to(folder)): p for p in found if p.name not in (MARKER, DAMAGED)}
        stats = {name: p.stat() for name, p in paths.items()}
        return cls(
            stage,
            key,
            record,
            sizes={name: stat.st_size for name, stat in stats.items()},
            times={name: stat.st_mtime_ns for name, stat in stats.items()},
            hashes={name: content_hash(p) for name, p in paths.items()},
        )

    def write(self, folder: Path) -> None:
        """Into `folder`, atomically (an entry is renamed into place only once its marker is whole)."""
        marker: dict[str, Any] = {"stage": self.stage, "key": self.key, "record": self.record, "files": self.sizes}
        if self.times is not None:
            marker["mtime_ns"] = self.times
        if self.hashes is not None:
            marker[CONTENT_HASH] = self.hashes
        write_atomic(folder / MARKER, json.dumps(marker, indent=1) + "\n")


def read_marker(folder: Path) -> Marker | None:
    """The marker of the store entry at `folder`, or None when it has none or it is unreadable. A field of
    the wrong type reads as absent: the checks then refuse the entry (a key), check no sizes (files) or
    trust it on sizes (times, hashes)."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(marker, dict):
        return None

    def table(name: str) -> dict | None:
        value = marker.get(name)
        return value if isinstance(value, dict) else None

    stage = marker.get("stage")
    return Marker(
        stage=stage if isinstance(stage, str) else "",
        key=marker.get("key"),
        record=table("record") or {},
        sizes=table("files") or {},
        times=table("mtime_ns"),
        hashes=table(CONTENT_HASH),
    )


def damage_note(folder: Path) -> str | None:
    """The line a check left in the entry at `folder` when it found a file damaged, or None."""
    if not (folder / DAMAGED).is_file():
        return None
    return (folder / DAMAGED).read_text(encoding="utf-8", errors="replace").strip()


def note_damage(folder: Path, line: str) -> None:
    """Leave `line` in the entry at `folder`, so every later check sees the damage without hashing again.
    A read-only copy keeps no note: its damage is found again by hashing."""
    try:
        write_atomic(folder / DAMAGED, f"{line}\n")
    except OSError:
        pass


def stored_damage(path: Path) -> str | None:
    """Why `path`, a file directly inside a store entry (a run's `<stage>` folder), is not what the entry
    recorded: a damage note on the entry, or a hash that differs; None when it is, or when no hash of it
    was recorded (not an entry's file, or an entry made before hashes)."""
    folder = path.parent
    if (note := damage_note(folder)) is not None:
        return note
    marker = read_marker(folder)
    recorded = (marker.hashes or {}).get(path.name) if marker is not None else None
    if isinstance(recorded, str) and content_hash(path) != recorded:
        return f"{path}: damaged, its {CONTENT_HASH} is not the one its store entry recorded"
    return None
