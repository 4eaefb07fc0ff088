"""The stage store: every finished stage's outputs once per runs root, by cache key.

    ROOT/.store/<stage>-<key>/             a finished entry: the stage's files and `.cram-entry.json`
    ROOT/.store/<stage>-<key>.partial/     the entry while it is computed (a resumable stage re-enters it)
    ROOT/.store/<stage>-<key>.lock         flock'd by the process computing or linking that key
    ROOT/<run>/<stage> -> ../.store/<stage>-<key>   a run's view of the entry it uses (relative symlink)

An entry appears by renaming its finished partial folder, after `.cram-entry.json` (its stage, key,
outputs and every file with its size, modification time and sha256) is written into it; an entry whose
marker is missing or whose files no longer match it is not trusted. Nothing in the store is deleted
except by `collect` (`cram gc`).

Checking stays cheap where it runs often and whole where a file is read:
- `problem` (every plan, `cram status`): the marker, each file's size, the damage note, and the hash of
  each file whose modification time is not the one recorded (written to since: a same-size edit).
- `verify` (linking an entry from the store, a stage's upstream before it runs, `cram export`,
  `cram verify`): every file's hash, each file once per process while it is unchanged.
A hash that differs writes `.cram-damaged` into the entry, so every later check (the next plan too)
treats it like a missing file: `files damaged`, recomputed. A marker written before hashes were
recorded has sizes only and is trusted on sizes, as it was.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from cram.pipeline import rundir
from cram.pipeline.schema import SchemaError, StageRecord
from cram.stages.shared.files import CONTENT_HASH, content_hash, write_atomic
from cram.stages.shared.store_entry import MARKER, Marker, damage_note, note_damage, read_marker

if TYPE_CHECKING:
    from cram.stages.protocols import Log

STORE = ".store"
_ITEM = re.compile(r"(?P<stage>[A-Za-z0-9_]+)-(?P<key>[0-9a-f]{64})(?P<kind>|\.partial|\.lock|\.retired-\d+)")
_DELETING = ".deleting-"
HASHES = "hashes"  # ROOT/.store/hashes/: sha256 of files outside the store (a checkpoint), by their metadata


class StoreError(Exception):
    """The store cannot be collected safely (a run directory that cannot be read), or a path to check is
    neither a run nor a runs root; exit code 2."""


@dataclass(frozen=True)
class Problem:
    """Why a stage output cannot be trusted, as one line; `damaged` when a file's bytes are not the ones
    written (the plan then says `files damaged`, not `files missing`)."""

    text: str
    damaged: bool = False

    def __str__(self) -> str:
        return self.text


# Files this process has hashed and found as written (or written itself), by what would change if they
# were written to since: each is read once per process however many steps read it.
_hashed: set[tuple[str, int, int, int, int]] = set()


@dataclass(frozen=True)
class Store:
    root: Path  # ROOT/.store

    @classmethod
    def of(cls, run_dir: Path) -> "Store":
        return cls(Path(os.path.abspath(run_dir)).parent / STORE)  # `cram resume .` too

    def entry(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key}"

    def partial(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key}.partial"

    def lock(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key}.lock"

    @contextmanager
    def locked(self, stage: str, key: str, log: Log) -> Iterator[None]:
        """Hold the key's lock for the block, waiting while another process holds it."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.lock(stage, key)
        fd = take_lock(path, log, wait=True)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # while holding it: see take_lock
            os.close(fd)

    def finish(self, partial: Path, stage: str, key: str, record: StageRecord) -> Path:
        """Mark `partial` complete and rename it into place as the key's entry (under the key's lock).

        An entry already there (a forced re-run, or one found broken) is renamed aside first and left
        for `cram gc`: runs may still read from it.
        """
        write_marker(partial, stage, key, record)
        entry = self.entry(stage, key)
        if entry.exists():
            os.replace(entry, entry.with_name(f"{entry.name}.retired-{time.time_ns()}"))
        os.replace(partial, entry)
        _hashed.update(_identity(p) for p in _files(entry) if p.name != MARKER)  # just hashed
        return entry


def hash_cache(root: Path) -> Callable[[Path], str]:
    """`content_hash` of files outside the store (an `init` checkpoint), remembered in `root/hashes/` (one
    small file per path) with the file's size, modification time and inode: the same trust the store
    gives its own entries' times. A file whose metadata is what was recorded is not read; any change
    hashes it again. Nothing is written where the store does not exist yet (a first `--dry-run`)."""
    folder = root / HASHES

    def lookup(path: Path) -> str:
        real = os.path.realpath(path)
        stat = os.stat(real)  # before hashing: a file written to meanwhile does not match next time
        seen = {"path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
        record = folder / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"
        try:
            known = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            known = None
        if isinstance(known, dict) and all(known.get(k) == v for k, v in seen.items()):
            if isinstance(known.get(CONTENT_HASH), str):
                return known[CONTENT_HASH]
        digest = content_hash(Path(real))
        if root.is_dir():
            try:
                folder.mkdir(exist_ok=True)
                write_atomic(record, json.dumps({**seen, CONTENT_HASH: digest}) + "\n")
            except OSError:  # a read-only root: hashed again next time, still correct
                pass
        return digest

    return lookup


def take_lock(path: Path, log: Log, wait: bool) -> int | None:
    """An OS lock (flock) on `path`, as an open descriptor; closing it releases the lock. None when
    another process holds it and `wait` is false. The kernel drops the lock of a process that dies, so
    a store lock is never stale and two processes never both hold one; the file says who holds it."""
    told = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    os.close(fd)
                    return None
                if not told:
                    log.info(
                        "waiting for another process computing the same key",
                        lock=str(path),
                        holder=rundir.read_lock(path),
                    )
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            # The holder removes the file before it lets go: a lock taken on a removed file guards nothing.
            if path.exists() and os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.ftruncate(fd, 0)
                os.write(fd, rundir.holder_record().encode())
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def write_marker(folder: Path, stage: str, key: str, record: StageRecord) -> None:
    """`record` is the manifest record of the run that made the entry: a run that reuses the entry copies
    it (outputs, versions, git commit), so its manifest says how the files were made."""
    Marker.of_files(folder, stage, key, record.to_json()).write(folder)


def entry_record(entry: Path) -> StageRecord:
    """The record of the run that made the store entry at `entry`, as its marker holds it (a record that
    cannot be read: an empty one; the entry's files were checked, the record only describes them)."""
    try:
        marker = read_marker(entry)
        return StageRecord.from_json(marker.record if marker is not None else {}, str(entry / MARKER))
    except SchemaError:
        return StageRecord()


def problem(folder: Path, key: str) -> Problem | None:
    """Why the stage output at `folder` (a run's `<stage>` link or a store entry) cannot be trusted for
    `key`, or None when it can: the cheap check of every plan (see the module's docstring). A real folder
    without a marker was made before the store existed (or by hand, as tests and benchmarks make runs): it
    is trusted as it was then."""
    if folder.is_symlink() and not folder.exists():
        return Problem(f"{folder} points to {os.readlink(folder)}, which does not exist")
    if not folder.is_dir():
        return Problem(f"{folder} does not exist")
    if not (folder / MARKER).exists() and not folder.is_symlink():
        return None
    marker = read_marker(folder)
    if marker is None:
        return Problem(f"{folder / MARKER} is missing or unreadable")
    if marker.key != key:
        return Problem(f"{folder} holds key {str(marker.key)[:12]}, not {key[:12]}")
    if (note := damage_note(folder)) is not None:
        return Problem(note, damaged=True)
    for name, size in marker.sizes.items():
        path = folder / name
        if not path.is_file():
            return Problem(f"{path} was deleted")
        if path.stat().st_size != size:
            return Problem(f"{path} has {path.stat().st_size} bytes, {size} when it was written")
    return _touched_files(folder, marker)


def verify(folder: Path, key: str, names: Iterable[str] | None = None) -> Problem | None:
    """`problem`, then the hash of every file of the entry at `folder` (or of `names` alone): what reads an
    entry calls this first. None for an intact entry, or one whose marker predates hashes (sizes only)."""
    if (trouble := problem(folder, key)) is not None:
        return trouble
    marker = read_marker(folder)
    hashes = marker.hashes if marker is not None else None
    if hashes is None:
        return None
    return _damage(folder, hashes, hashes if names is None else [n for n in names if n in hashes])


def hashed(folder: Path) -> bool:
    """Whether the marker at `folder` records hashes (one written before them records sizes only)."""
    marker = read_marker(folder)
    return marker is not None and marker.hashes is not None


def _touched_files(folder: Path, marker: Marker) -> Problem | None:
    """The hash of each file whose modification time is not the one recorded: one written to since (the
    same size or not), or copied without its times. A copy's intact files get their new times recorded,
    so they are not hashed again."""
    hashes, times = marker.hashes, marker.times
    if hashes is None or times is None:
        return None
    now = {name: (folder / name).stat().st_mtime_ns for name in hashes}
    touched = [name for name, mtime in now.items() if times.get(name) != mtime]
    if not touched:
        return None
    if (damage := _damage(folder, hashes, touched)) is not None:
        return damage
    try:
        replace(marker, times=now).write(folder)
    except OSError:  # a read-only copy: hashed again next time, still correct
        pass
    return None


def _damage(folder: Path, hashes: dict[str, str], names: Iterable[str]) -> Problem | None:
    """The first of `names` whose hash is not the recorded one, noted in the entry (`note_damage`) so that
    every later check sees it without hashing again."""
    for name in names:
        path = folder / name
        seen = _identity(path)
        if seen in _hashed:
            continue
        if content_hash(path) != hashes[name]:
            damage = Problem(f"{path}: damaged, its {CONTENT_HASH} is not the one written", damaged=True)
            note_damage(folder, str(damage))
            return damage
        _hashed.add(seen)
    return None


def _identity(path: Path) -> tuple[str, int, int, int, int]:
    """What changes when a file is written to, replaced or even has its time set back (ctime)."""
    stat = path.stat()
    return (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def link(run_dir: Path, stage: str, entry: Path) -> None:
    """Point `RUN_DIR/<stage>` at `entry`, replacing the previous link in one step.

    A real folder there (a run made before the store, or copied with `cp -rL`) is moved into the
    store under the key it was made with, so changing a config never deletes an earlier result.
    """
    view = run_dir / stage
    if view.is_dir() and not view.is_symlink():
        _adopt(run_dir, stage, view)
    tmp = run_dir / f".{stage}.{os.getpid()}.link"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(entry, run_dir))
    os.replace(tmp, view)


def _adopt(run_dir: Path, stage: str, folder: Path) -> None:
    record = rundir.Manifest.load(run_dir).stage(stage) or StageRecord()
    marker = read_marker(folder)
    key = (marker.key if marker is not None else None) or record.key
    store = Store.of(run_dir)
    store.root.mkdir(parents=True, exist_ok=True)
    if not isinstance(key, str) or not re.fullmatch(r"[0-9a-f]{64}", key):
        raise rundir.RunDirError(
            f"{folder}: a folder that neither the manifest nor a marker gives a key; cram did not make it: move it away"
        )
    if marker is None and record.status == "done" and record.key == key:
        write_marker(folder, stage, key, replace(record, attempt=None))
    entry = store.entry(stage, key)
    os.replace(folder, entry if not entry.exists() else entry.with_name(f"{entry.name}.retired-{time.time_ns()}"))


@dataclass(frozen=True)
class Checked:
    """A stage output `cram verify` hashed: `problem` None when intact; `hashed` False when its marker
    predates hashes (checked on sizes only)."""

    path: Path
    problem: Problem | None
    hashed: bool


def check_all(path: Path) -> list[Checked]:
    """`verify` every finished entry in a runs root's store, or every done stage of one run directory. For
    a root, also each done stage of its runs that no entry stands for: a link to an entry that was
    deleted (missing: damage too), or a real folder (a run made before the store, or copied)."""
    if (path / rundir.MANIFEST).is_file():
        found = _done_views(path)
    elif path.is_dir() and ((path / STORE).is_dir() or any((p / rundir.MANIFEST).is_file() for p in path.iterdir())):
        items = ((p, _ITEM.fullmatch(p.name)) for p in sorted(Store(path / STORE).root.glob("*")))
        found = [(p, m["key"]) for p, m in items if m and not m["kind"] and p.is_dir()]
        entries = {os.path.realpath(p) for p, _ in found}
        for run_dir in sorted(p for p in path.iterdir() if (p / rundir.MANIFEST).is_file()):
            try:
                views = _done_views(run_dir)
            except rundir.RunDirError:  # an unreadable manifest: `cram status` and `cram ls` name it
                continue
            found += [(view, key) for view, key in views if os.path.realpath(view) not in entries]
    else:
        raise StoreError(f"{path}: neither a run directory (no {rundir.MANIFEST}) nor a runs root (no {STORE})")
    return [Checked(folder, verify(folder, key), hashed(folder)) for folder, key in found]


def _done_views(run_dir: Path) -> list[tuple[Path, str]]:
    """(RUN_DIR/<stage>, key) of each stage the run's manifest records as done."""
    records = rundir.Manifest.load(run_dir).records
    return [(run_dir / s, r.key or "") for s, r in records.items() if r.status == "done"]


@dataclass(frozen=True)
class Garbage:
    path: Path
    size: int


def collect(root: Path, log: Log, dry_run: bool = False) -> tuple[list[Garbage], list[Path]]:
    """Remove what under `ROOT/.store` no run directory of ROOT refers to: (removed, skipped in use).

    A run refers to the key of each stage record (and of a record's unfinished attempt) and to what
    its `<stage>` links point at. An entry whose key lock is held is being written or linked: skipped.
    Each removal happens under the key's lock, after the references are read again. A store that cannot
    be changed (a read-only root) is a StoreError saying what was removed before that.
    """
    removed: list[Garbage] = []
    try:
        busy = _collect(Store(root / STORE), root, log, dry_run, removed)
    except OSError as e:
        done = f"{len(removed)} item(s) removed before that" if removed and not dry_run else "nothing removed"
        raise StoreError(f"{root}: its store cannot be changed ({e.strerror}: {e.filename}); {done}") from None
    return removed, busy


def _collect(store: Store, root: Path, log: Log, dry_run: bool, removed: list[Garbage]) -> list[Path]:
    """`collect`'s work: each item removed is added to `removed` as it goes; returns the items in use."""
    if not store.root.is_dir():
        return []
    busy: list[Path] = []
    groups: dict[tuple[str, str], list[Path]] = {}
    for path in sorted(store.root.iterdir()):
        if path.name.startswith(_DELETING):  # a removal that was cut short
            removed.append(_remove(path, dry_run))
        elif m := _ITEM.fullmatch(path.name):
            groups.setdefault((m["stage"], m["key"]), []).append(path)
    referenced = references(root)
    for (stage, key), paths in groups.items():
        if (stage, key) in referenced:
            removed.extend(_remove(p, dry_run) for p in paths if ".retired-" in p.name)
            continue
        lock = store.lock(stage, key)
        fd = take_lock(lock, log, wait=False) if lock.exists() or not dry_run else None
        if fd is None and lock.exists():
            busy += [p for p in paths if p != lock]
            continue
        try:
            if not dry_run and (stage, key) in references(root):  # linked since the first look
                continue
            removed.extend(_remove(p, dry_run) for p in paths if p != lock)  # each added once it is gone
            if not dry_run:
                lock.unlink()  # while holding it, as `Store.locked` does
        finally:
            if fd is not None:
                os.close(fd)
    return busy


def references(root: Path) -> set[tuple[str, str]]:
    """(stage, key) of everything the run directories under `root` use, may resume, or were made from."""
    found: set[tuple[str, str]] = set()
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not (run_dir / rundir.MANIFEST).is_file():
            continue
        try:
            records = rundir.Manifest.load(run_dir).records
        except rundir.RunDirError as e:
            raise StoreError(f"{e}; nothing was removed, as what that run uses is unknown") from None
        for stage, record in records.items():
            for r in (record, record.attempt):
                if r is not None and r.key is not None:
                    found.add((stage, r.key))
                    # What a result was made from stays as long as the result (evaluate's params).
                    found.update(r.upstream_keys.items())
        for view in run_dir.iterdir():
            if view.is_symlink() and (m := _ITEM.fullmatch(Path(os.readlink(view)).name)):
                found.add((m["stage"], m["key"]))
    return found


def size_of(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in _files(path))


def _remove(path: Path, dry_run: bool) -> Garbage:
    garbage = Garbage(path, size_of(path))
    if dry_run:
        return garbage
    if path.is_dir() and not path.is_symlink():
        # Renamed first, so that a removal cut short leaves no folder that looks like an entry.
        doomed = path if path.name.startswith(_DELETING) else path.with_name(f"{_DELETING}{path.name}")
        os.replace(path, doomed)
        shutil.rmtree(doomed)
    else:
        path.unlink(missing_ok=True)
    return garbage


def _files(folder: Path) -> Iterator[Path]:
    for dirpath, _, names in os.walk(folder):
        for name in names:
            yield Path(dirpath) / name
