"""Pack's per-document arrays on disk: files in the stage's scratch folder, memory-mapped, each built and
read a block of documents at a time, so that the process's anonymous memory does not grow with the
number of documents (at 10M documents the arrays are ~300 MB; in RAM they would be that much more).

The pages of a mapped file are the page cache's: they count in RSS while mapped but not in RssAnon, and
the kernel can drop them under pressure (written back first where they were written).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import DTypeLike

    from cram.stages.data.token_map import MappedIds

DOCUMENTS = 1 << 18  # documents handled at a time by every pass over a per-document array
BUCKET_DOCUMENTS = 1 << 18  # de-duplication's buckets hold about this many documents each
MAX_BUCKETS = 256  # open files at once; past 67M documents the buckets grow instead
_RECORD = [("key", "<u8"), ("doc", "<i8")]


def blocks(n: int, size: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive blocks of `size` (default DOCUMENTS) covering range(n)."""
    size = size or DOCUMENTS
    for start in range(0, n, size):
        yield start, min(n, start + size)


class Appender:
    """A flat file of `dtype` values written block by block with plain writes; `mapped()` reads it
    back as an array over a memory map."""

    def __init__(self, path: Path, dtype: DTypeLike):
        import numpy as np

        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self._file = open(path, "wb")

    def append(self, array: np.ndarray) -> None:
        import numpy as np

        array = np.ascontiguousarray(array, dtype=self.dtype)
        write(array, self._file)
        self.count += len(array)

    def mapped(self) -> np.ndarray:
        self._file.close()
        return mapped(self.path, self.dtype, self.count)


def write(array: np.ndarray, out: BinaryIO) -> None:
    """Append a contiguous `array`'s bytes to the open file `out` (no copy); a disk that fills is one
    line naming the file (the runner then removes the whole partial entry)."""
    try:
        out.write(memoryview(array).cast("B"))
    except OSError as e:
        raise OSError(e.errno, f"{out.name}: {e.strerror} while pack wrote it") from None


def mapped(path: Path, dtype: DTypeLike, count: int, writable: bool = False) -> np.ndarray:
    """`count` values of `dtype` in the file `path` as a plain ndarray over a shared memory map (a
    writable one is allocated on disk first: a write into a page the disk has no room for would
    kill the process with SIGBUS instead of raising)."""
    import numpy as np

    if count == 0:
        return np.zeros(0, dtype)
    if writable:
        with open(path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, count * np.dtype(dtype).itemsize)
            except OSError as e:
                raise OSError(e.errno, f"{path}: {e.strerror} while pack wrote it") from None
    # A plain ndarray view: numpy treats a memmap subclass more slowly (e.g. Generator.shuffle loops).
    return np.memmap(path, dtype=dtype, mode="r+" if writable else "r", shape=(count,)).view(np.ndarray)


def nonempty_documents(offsets: np.ndarray, folder: Path) -> np.ndarray:
    """Indices of the documents with at least one token, ascending, as a mapped array."""
    import numpy as np

    out = Appender(folder / "nonempty", np.int64)
    for start, stop in blocks(len(offsets) - 1):
        bounds = offsets[start : stop + 1]
        out.append(np.flatnonzero(bounds[1:] > bounds[:-1]) + start)
    return out.mapped()


def unique_documents(
    ids: MappedIds, offsets: np.ndarray, keys: np.ndarray, docs: np.ndarray, folder: Path
) -> np.ndarray:
    """The documents `docs` (ascending) without exact duplicates (same ids), each kept at its first
    occurrence, as a mapped array. Documents are partitioned by the top bits of their hash (`keys`)
    into bucket files, then each bucket is sorted and searched for equal hashes on its own; documents
    with equal hashes are compared id for id (`ids.document(d)`), so a hash collision
    never removes a distinct document."""
    import numpy as np

    n_buckets = 1
    while n_buckets < MAX_BUCKETS and n_buckets * BUCKET_DOCUMENTS < len(docs):
        n_buckets *= 2
    buckets = [Appender(folder / f"bucket-{b}", _RECORD) for b in range(n_buckets)]
    for start, stop in blocks(len(docs)):
        records = np.empty(stop - start, _RECORD)
        records["doc"] = docs[start:stop]
        records["key"] = keys[records["doc"]]
        which = bucket_of(records["key"], n_buckets)
        records = records[np.argsort(which, kind="stable")]  # stable: each bucket stays in document order
        counts = np.bincount(which, minlength=n_buckets)
        ends = np.cumsum(counts)
        for b, (first, last) in enumerate(zip((ends - counts).tolist(), ends.tolist())):
            buckets[b].append(records[first:last])
    dropped = mapped(folder / "dropped", np.bool_, len(offsets) - 1, writable=True)
    for bucket in buckets:
        _drop_duplicates(ids, bucket.mapped(), dropped)
        bucket.path.unlink()
    out = Appender(folder / "unique", np.int64)
    for start, stop in blocks(len(docs)):
        part = docs[start:stop]
        out.append(part[~dropped[part]])
    return out.mapped()


def bucket_of(keys: np.ndarray, n_buckets: int) -> np.ndarray:
    """Which of `n_buckets` (a power of two) buckets each hash goes to: the top bits of the hash times
    an odd constant. The top bits of the hash alone would be those of its length term (the sum of
    a document's values is ~40 bits), putting every document of one length into one bucket."""
    import numpy as np

    if n_buckets == 1:
        return np.zeros(len(keys), np.intp)
    with np.errstate(over="ignore"):  # the product wraps around 2**64 on purpose
        mixed = keys * np.uint64(0xD6E8FEB86659FD93)
    return (mixed >> np.uint64(65 - n_buckets.bit_length())).astype(np.intp)


def _drop_duplicates(ids: MappedIds, records: np.ndarray, dropped: np.ndarray) -> None:
    """Marks in `dropped` every document of one bucket that repeats an earlier one id for id."""
    import numpy as np

    if len(records) < 2:
        return
    records = records[np.argsort(records["key"], kind="stable")]  # equal hashes in document order
    keys, docs = records["key"], records["doc"]
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    sizes = np.diff(np.append(starts, len(keys)))
    for group in np.flatnonzero(sizes > 1):
        kept: list[np.ndarray] = []
        for doc in docs[starts[group] : starts[group] + sizes[group]].tolist():
            tokens = ids.document(doc)
            dropped[doc] = any(np.array_equal(tokens, other) for other in kept)
            if not dropped[doc]:
                kept.append(tokens)


def shuffled(docs: np.ndarray, seed: int, folder: Path) -> np.ndarray:
    """`docs` in the order of `np.random.default_rng(seed).permutation(len(docs))`, as a mapped array:
    that permutation is numpy's in-place shuffle of 0..n-1, here run over a memory map (the same
    random draws, so the same order), then each block of it replaced by the documents it picks."""
    import numpy as np

    order = mapped(folder / "order", np.int64, len(docs), writable=True)
    for start, stop in blocks(len(docs)):
        order[start:stop] = np.arange(start, stop)
    np.random.default_rng(seed).shuffle(order)
    for start, stop in blocks(len(docs)):
        order[start:stop] = docs[order[start:stop]]
    return order


def wrapped_lengths(order: np.ndarray, offsets: np.ndarray, wrap: int) -> np.ndarray:
    """The length of each of the documents `order` with its `wrap` boundary tokens."""
    return offsets[order + 1] - offsets[order] + wrap


def wrapped_total(order: np.ndarray, offsets: np.ndarray, wrap: int) -> int:
    """The summed length of the documents `order` with their boundary tokens, a block at a time."""
    return sum(int(wrapped_lengths(order[a:b], offsets, wrap).sum()) for a, b in blocks(len(order)))
