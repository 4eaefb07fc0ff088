"""Files written whole and files read from outside a run: the one atomic write, the fingerprint by
which a stage's key changes when a file it reads changes, and the content hash by which a reader knows
a file is still what was written (the stage store's entries record it: `store_entry.py`), through the
planner's cache where it set one."""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator


def temp_path(path: Path) -> Path:
    """A hidden sibling of `path` to write before putting it in place: in the same folder, so the rename
    stays on one file system, and named by this process, so two writers never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextmanager
def atomic(path: Path) -> Iterator[Path]:
    """A temporary path for the block to write `path`'s new content to. Once the block ends, the file is
    synced to disk and renamed over `path`: a reader, or a machine that loses power, sees the old file or
    the new one, never half of one. A block that raises leaves `path` as it was and no temporary file."""
    tmp = temp_path(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically (see `atomic`)."""
    with atomic(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def files_under(root: Path) -> list[Path]:
    """Every file below `root`, in a fixed order (sorted paths), so a fingerprint of them is stable."""
    return sorted(p for p in root.rglob("*") if p.is_file())


def fingerprint(files: Iterable[Path]) -> list[list[Any]]:
    """[path, size, modification time in ns] of each file: cheap to compute (no file is read), and it
    changes when a file is edited, replaced or renamed, so a stage key holding it does too."""
    fingerprints = []
    for f in files:
        stat = f.stat()
        fingerprints.append([str(f), stat.st_size, stat.st_mtime_ns])
    return fingerprints


# sha256 runs on the CPU's SHA instructions (about 1.4 GB/s on the 2-core machine, twice BLAKE2b's
# 0.75 GB/s; bench/README.md, "store"), so it is the faster of hashlib's strong hashes here.
CONTENT_HASH = "sha256"


def content_hash(path: Path) -> str:
    """The hex digest of `path`'s bytes (CONTENT_HASH): unlike the fingerprint, it reads the whole file,
    and changes when any byte changes, even where the size and the modification time do not."""
    digest = hashlib.new(CONTENT_HASH)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# Set by whoever plans (the pipeline, with its store's cache of hashes): stages never import the pipeline.
_known_hashes: ContextVar[Callable[[Path], str] | None] = ContextVar("known_hashes", default=None)


@contextmanager
def hashes_from(lookup: Callable[[Path], str]) -> Iterator[None]:
    """Within the block, `known_hash(path)` is `lookup(path)`: a cache that hashes a file only when its
    metadata changed since it was last hashed."""
    token = _known_hashes.set(lookup)
    try:
        yield
    finally:
        _known_hashes.reset(token)


def known_hash(path: Path) -> str:
    """`content_hash(path)`, through the cache `hashes_from` set when there is one: what a stage's
    fingerprint of a large file (a checkpoint) costs when nothing changed is one `stat`."""
    lookup = _known_hashes.get()
    return content_hash(path) if lookup is None else lookup(path)
