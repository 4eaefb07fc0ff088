"""Pack's documents read in place from memory-mapped files of ids: tokenize's token shards, each one int32
array, a document found by its position in the concatenation of those arrays (`flatten` in
stages/pack.py records it from each batch's place in its file, `shards.read_batches_located`); or,
where the shards would not stay in the page cache, pack's compact copy of the ids.

Reading the shards in place spares pack writing that copy: 3.8 GB at 10 GB of text, whose write-back
past the kernel's dirty-page thresholds lands inside pack (bench/README.md, "Pack reads the shards in
place"). The mapped pages are the page cache's: they count in the process's RSS while they are mapped,
not in its anonymous memory, and the kernel can reclaim them.
"""

from __future__ import annotations

import bisect
import mmap
from pathlib import Path
from typing import TYPE_CHECKING

from cram.stages.shared.runs import gather_runs

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import DTypeLike


def positions_in(path: Path, dtype: DTypeLike) -> int:
    """How many ids of `dtype` the file `path` spans in the concatenation (its size, rounded down)."""
    import numpy as np

    return path.stat().st_size // np.dtype(dtype).itemsize


def can_read_in_place(paths: list[Path]) -> bool:
    """Whether pack may read the token shards `paths` in place: whether they take at most half of the
    memory available now, so that the page cache keeps them while pack reads their documents in
    shuffled order (from disk, a document would cost a page or more), and whether this process may
    keep them all open at once (a memory map keeps its file open). If not, pack writes a compact copy
    of the ids instead (half the bytes at uint16) and reads that."""
    available = memory_available()
    if available is not None and sum(path.stat().st_size for path in paths) > available // 2:
        return False
    return _allow_open_files(len(paths))


def memory_available() -> int | None:
    """Bytes of memory the kernel estimates are available for new work (MemAvailable: free memory and
    the page cache it can reclaim), or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            line = next(line for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


class MappedIds:
    """The files `paths` as read-only arrays of `dtype` over memory maps; `offsets` (each document's end
    in the stream of all ids, after a leading 0) and `sources` (where each document's ids start in the
    concatenation of the files) say where each document is."""

    def __init__(self, paths: list[Path], dtype: DTypeLike, offsets: np.ndarray, sources: np.ndarray):
        import numpy as np

        self.paths, self.dtype, self.offsets, self.sources = paths, np.dtype(dtype), offsets, sources

    def __enter__(self) -> MappedIds:
        import numpy as np

        self._maps: list[mmap.mmap] = []
        self.arrays: list[np.ndarray] = []
        for path in self.paths:
            size = positions_in(path, self.dtype)
            if size:
                with open(path, "rb") as file:
                    self._maps.append(mmap.mmap(file.fileno(), size * self.dtype.itemsize, access=mmap.ACCESS_READ))
                self.arrays.append(np.frombuffer(self._maps[-1], self.dtype, size))
            else:
                self.arrays.append(np.zeros(0, self.dtype))
        self.bases = np.cumsum([0] + [len(a) for a in self.arrays])
        self._base_list = self.bases.tolist()  # for one document at a time: bisect costs less than numpy
        self._bytes = [memoryview(a).cast("B") for a in self.arrays]
        return self

    def locate(self, sources: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For positions in the concatenation: which file holds each, and where in that file."""
        import numpy as np

        which = np.searchsorted(self.bases, sources, side="right") - 1
        return which, sources - self.bases[which]

    def document(self, doc: int) -> np.ndarray:
        """The ids of document `doc`."""
        length, source = int(self.offsets[doc + 1] - self.offsets[doc]), int(self.sources[doc])
        which = bisect.bisect_right(self._base_list, source) - 1
        start = source - self._base_list[which]
        return self.arrays[which][start : start + length]

    def gather(
        self,
        sources: np.ndarray,
        lengths: np.ndarray,
        at: np.ndarray,
        out: np.ndarray,
        long_documents: int,
        index: np.ndarray | None = None,
    ) -> None:
        """Copy the documents at `sources` of `lengths` ids into `out` (an array of the dtype) at `at`.
        Documents at least `long_documents` ids long on average are copied a slice each (a memcpy: less
        than building and reading an index for every id); shorter ones gathered through an index, one
        gather for each file they come from. `index`: an intp array to build the indices in."""
        import numpy as np

        which, start = self.locate(sources)
        if int(lengths.sum()) >= long_documents * len(sources):
            # Slices of memoryviews of bytes, which cost ~0.3 us less per document than numpy's slices.
            item = self.dtype.itemsize
            places = zip(which.tolist(), (at * item).tolist(), (start * item).tolist(), (lengths * item).tolist())
            with memoryview(out) as whole, whole.cast("B") as to_:
                for k, to, begin, length in places:
                    to_[to : to + length] = self._bytes[k][begin : begin + length]
            return
        by_file = np.argsort(which, kind="stable")
        files, firsts = np.unique(which[by_file], return_index=True)
        for k, first, last in zip(files.tolist(), firsts.tolist(), [*firsts[1:].tolist(), len(by_file)]):
            these = by_file[first:last]
            values = np.take(self.arrays[k], gather_runs(start[these], lengths[these], index))
            out[gather_runs(at[these], lengths[these], index)] = values

    def __exit__(self, *exc: object) -> None:
        for view in self._bytes:
            view.release()
        del self.arrays, self._bytes
        for map_ in self._maps:
            try:
                map_.close()
            except BufferError:
                pass  # a view into the map is still alive (an exception's traceback): it closes with the view


def _allow_open_files(n: int) -> bool:
    """Whether this process may open `n` more files: its limit (`ulimit -n`) raised to fit them where
    the hard limit allows."""
    try:
        import resource
    except ImportError:  # not a Unix: no such limit
        return True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + 256  # the files already open and those the rest of the stage opens
    if soft == resource.RLIM_INFINITY or soft >= need:
        return True
    if hard != resource.RLIM_INFINITY and hard < need:
        return False
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return True
