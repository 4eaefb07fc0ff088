"""Pack: turn tokenized documents into fixed-length blocks for pretraining, the cramming way.

Documents are de-duplicated (optional), shuffled with the run seed and split into validation and
training documents; each split is concatenated with boundary tokens and cut into blocks of
`seq_len` tokens, its last partial block dropped, so no batch ever holds padding. Each split is
one `.npy` array [blocks, seq_len]: pretraining reads a batch as one slice of a memory map.

Out of core, in two streaming passes: the first reads the token shards a batch at a time into one
flat scratch file of ids, and each document's end offset and hash into two more; the second gathers
the shuffled documents a chunk of ~4M tokens at a time from that file, memory-mapped (its pages
dropped from RSS every ~256 MB read), and appends each chunk to the `.npy` file. The shards once read
and the rows once written are dropped from the page cache, so that at 10 GB the ids file has it to
itself. Every per-document array (offsets, hashes, the de-duplicated and the shuffled order) is a
memory-mapped file built a block at a time (`stages/data/scratch.py`), so anonymous memory grows
neither with the number of tokens nor with the number of documents.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cram.stages import Context, StageError, Upstream
from cram.stages.data import scratch, shards
from cram.stages.shared.runs import gather_runs

NAME = "pack"
VERSION = "1"
UPSTREAM = ("tokenize",)
RESUMABLE = False

_UINT16_LIMIT = 1 << 16
CHUNK_TOKENS = 1 << 22  # tokens gathered and written at a time
# Documents (with their boundary tokens) at least this long on average are copied a slice each,
# shorter ones gathered through an index: the cost per token of the two crosses near here.
LONG_DOCUMENTS = 128
RESIDENT_BYTES = 256 << 20  # pages of the memory-mapped ids read before they are dropped from RSS
_FAULT_AROUND = 64 << 10  # what one page fault in a mapped file may map (Linux's fault_around_bytes)


@dataclass(frozen=True)
class Config:
    seq_len: int = 128
    val_fraction: float = 0.02  # share of documents for validation (at least one block's worth)
    # What goes around each document: "sep" appends [SEP]; "cls-sep" also puts [CLS] in front,
    # the form a fine-tuned classifier reads, so pretraining learns that token too.
    boundary: Literal["sep", "cls-sep"] = "cls-sep"
    dedup: bool = True  # drop exact duplicate documents (same token ids), keeping the first
    dtype: Literal["auto", "uint16", "int32"] = "auto"  # auto: uint16 when the vocab fits

    def __post_init__(self) -> None:
        if self.seq_len < 8:
            raise ValueError(f"seq_len: {self.seq_len} is too short; it must be at least 8")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction: {self.val_fraction} must be in (0, 0.5)")


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    import numpy as np
    import pyarrow.compute  # noqa: F401  (imported before the clock starts: figures time the packing)

    started = time.perf_counter()
    upstream = inputs["tokenize"]
    vocab_size, special_ids = upstream.outputs["vocab_size"], upstream.outputs["special_ids"]
    dtype = _dtype(config.dtype, vocab_size)
    folder = out_dir / "scratch"
    folder.mkdir()
    try:
        offsets, keys = flatten(upstream.path("tokens"), folder, dtype, vocab_size)
        n_documents, n_tokens = len(offsets) - 1, int(offsets[-1])
        with MappedIds(folder / "ids.scratch", dtype, n_tokens) as ids:
            # Empty documents would add only boundary tokens.
            nonempty = scratch.nonempty_documents(offsets, folder)
            keep = scratch.unique_documents(ids, offsets, keys, nonempty, folder) if config.dedup else nonempty
            n_nonempty, n_keep = len(nonempty), len(keep)
            order = scratch.shuffled(keep, ctx.seed, folder)
            del nonempty, keep, keys  # their maps closed, their pages no longer counted
            prefix = [special_ids["cls"]] if config.boundary == "cls-sep" else []
            suffix = [special_ids["sep"]]
            n_val, val_len, total = _validation_split(order, offsets, config, len(prefix) + len(suffix))
            if (total - val_len) // config.seq_len == 0:
                raise StageError(
                    f"tokenize.corpus: {n_tokens} tokens in {n_keep} documents are too few for one training "
                    f"block of pack.seq_len = {config.seq_len} after validation takes its share; use a bigger corpus"
                )
            splits = (("val", order[:n_val], val_len), ("train", order[n_val:], total - val_len))
            shapes = {
                split: write_blocks(out_dir / f"{split}.npy", ids, offsets, docs, size, prefix, suffix, config.seq_len)
                for split, docs, size in splits
            }
            del order, offsets, splits
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    seconds = time.perf_counter() - started
    outputs = {
        "train": "train.npy",
        "val": "val.npy",
        "meta": "pack.json",
        "seq_len": config.seq_len,
        "vocab_size": vocab_size,
        "special_ids": dict(special_ids),
        "dtype": np.dtype(dtype).name,
        "boundary": config.boundary,
        "train_blocks": shapes["train"][0],
        "val_blocks": shapes["val"][0],
        "train_documents": n_keep - n_val,
        "val_documents": n_val,
        "documents": n_documents,
        "duplicates_removed": n_nonempty - n_keep,
        "tokens": n_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(n_tokens / seconds),
    }
    shapes = {"train": list(shapes["train"]), "val": list(shapes["val"])}
    (out_dir / "pack.json").write_text(json.dumps({**outputs, "shapes": shapes}, indent=1))
    ctx.log.info("packed", **{k: v for k, v in outputs.items() if isinstance(v, (int, float))})
    return outputs


def flatten(tokens: Path, folder: Path, dtype: Any, vocab_size: int) -> tuple[Any, Any]:
    """Pass one: every document's ids, in order, appended to the flat file `folder/ids.scratch` as `dtype`;
    returns, as mapped arrays, each document's end offset in that file (after a leading 0) and a hash
    of its ids (`unique_documents`' keys)."""
    import numpy as np
    import pyarrow.compute as pc

    # uint64 values, so that the per-document sums need no cast of every token.
    table = np.random.default_rng(0).integers(0, 2**32, size=vocab_size, dtype=np.uint32).astype(np.uint64)
    offsets, keys = scratch.Appender(folder / "offsets", np.int64), scratch.Appender(folder / "keys", np.uint64)
    offsets.append(np.zeros(1, np.int64))
    end, buffers = 0, _Buffers(dtype)
    with open(folder / "ids.scratch", "wb") as out:
        for path in shards.shard_files(tokens):
            for batch in shards.read_batches(path, ("input_ids",)):
                column = batch.column(0)
                if column.null_count:  # a null list's offsets may span values that flatten() leaves out
                    n = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
                else:
                    n = np.diff(column.offsets.to_numpy())
                n = n.astype(np.int64)
                ids = column.flatten().to_numpy(zero_copy_only=False).view(np.uint32)
                # As unsigned, a negative id is past the table's end too: one maximum checks both ends.
                if len(ids) and int(ids.max()) >= vocab_size:
                    raise StageError(
                        f"{path}: token ids outside [0, vocab_size = {vocab_size}): "
                        f"the tokenize output is not from this tokenizer; re-run tokenize"
                    )
                # Built in the buffers kept from batch to batch: fresh arrays fault their pages in anew.
                values = buffers.values(len(ids))
                np.take(table, ids, out=values, mode="clip")  # "clip": unbuffered (and checked above)
                if np.dtype(dtype).itemsize == ids.itemsize:
                    scratch.write(ids, out)  # int32 ids: the same bytes
                else:
                    cast = buffers.take(len(ids))[1]
                    np.copyto(cast, ids, casting="unsafe")
                    scratch.write(cast, out)
                ends = np.cumsum(n) + end
                offsets.append(ends)
                end = int(ends[-1]) if len(ends) else end
                keys.append(_document_hashes(values, n))
            with open(path, "rb") as shard:
                _drop_cached(shard)  # read once
    return offsets.mapped(), keys.mapped()


def _drop_cached(file: Any) -> None:
    """Drop the page cache's copy of an open file pack is done with: a token shard pass one has read,
    or the rows pass two has written. At 10 GB of text the shards, the ids file and the output outgrow
    the page cache of a small machine, and the kernel would otherwise reclaim pages while pack writes,
    in pack's system time. Pages not yet written back are only scheduled for writing, not dropped."""
    if hasattr(os, "posix_fadvise"):
        file.flush()
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _document_hashes(values: Any, lengths: Any) -> Any:
    """A hash of each document's multiset of ids: the sum of a random value per id, and the length.
    Vectorised; collisions (e.g. the same ids in another order) are told apart by comparing ids."""
    import numpy as np

    sums = np.zeros(len(lengths), dtype=np.uint64)
    nonempty = lengths > 0
    starts = (np.cumsum(lengths) - lengths)[nonempty]
    with np.errstate(over="ignore"):  # the hash wraps around 2**64 on purpose
        if len(starts):
            # Segments run from one non-empty document's start to the next's: empty ones add nothing.
            sums[nonempty] = np.add.reduceat(values, starts)
        return sums + lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


class MappedIds:
    """The flat scratch file of ids as a read-only array over a memory map. A memory map's pages
    count in the process's RSS until they are dropped, and a pass over a 10 GB file would "use"
    10 GB: `touched(n)` drops the pages read so far (the page cache keeps them) once about
    RESIDENT_BYTES have been read since the last drop. Dropping after every chunk would cost a page
    fault per document read, a third of pack's time on a small corpus."""

    def __init__(self, path: Path, dtype: Any, count: int):
        self.path, self.dtype, self.count = path, dtype, count
        self._read = 0

    def __enter__(self) -> MappedIds:
        import numpy as np

        self._file = open(self.path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.count else None
        self.array = np.frombuffer(self._map, self.dtype, self.count) if self._map else np.zeros(0, self.dtype)
        return self

    def __getitem__(self, index: Any) -> Any:
        return self.array[index]

    def touched(self, tokens: int, documents: int = 1) -> None:
        # Scattered documents touch whole pages, and a page fault maps the cached pages around it too
        # (the kernel's fault-around, 64 KB): count the larger of twice the bytes and that per document.
        self._read += max(2 * tokens * self.array.itemsize, documents * _FAULT_AROUND)
        if self._read >= RESIDENT_BYTES and self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)
            self._read = 0

    def __exit__(self, *exc: Any) -> None:
        del self.array
        try:
            if self._map is not None:
                self._map.close()
        except BufferError:
            pass  # a view into the map is still alive (an exception's traceback): it closes with the view
        self._file.close()


def write_blocks(
    path: Path, ids: MappedIds, offsets: Any, docs: Any, size: int, prefix: list[int], suffix: list[int], seq_len: int
) -> tuple[int, int]:
    """Pass two, for one split: the documents `docs`, in that order, each wrapped in prefix and
    suffix tokens (`size` tokens in all), cut into rows of seq_len (the remainder that does not fill a
    row is dropped) and written to the `.npy` file `path` a chunk at a time. Returns the array's shape.

    The file is written with plain writes after its header, not through `open_memmap`: the pages
    of a writable memory map stay in the process's RSS until it is closed."""
    import numpy as np

    shape = (size // seq_len, seq_len)
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(ids.dtype)), "fortran_order": False, "shape": shape}
    remaining, wrap, unadvised = shape[0] * seq_len, len(prefix) + len(suffix), 0
    with open(path, "wb") as out:
        np.lib.format.write_array_header_1_0(out, header)
        buffers = _Buffers(ids.dtype)
        for block_start, block_stop in scratch.blocks(len(docs)):
            part = docs[block_start:block_stop]
            starts = offsets[part]
            lengths = offsets[part + 1] - starts
            ends = np.cumsum(lengths + wrap)
            first = 0
            while first < len(part) and remaining > 0:
                # The documents that end within CHUNK_TOKENS of this chunk's start (at least one).
                start = int(ends[first - 1]) if first else 0
                last = max(first + 1, int(np.searchsorted(ends, start + CHUNK_TOKENS, side="right")))
                chunk = wrapped(ids, starts[first:last], lengths[first:last], prefix, suffix, buffers)[:remaining]
                scratch.write(chunk, out)
                remaining -= len(chunk)
                first = last
                ids.touched(len(chunk))
                unadvised += chunk.nbytes
                if unadvised >= RESIDENT_BYTES:  # a small output stays cached for pretrain to read
                    _drop_cached(out)
                    unadvised = 0
    return shape


def wrapped(ids: MappedIds, starts: Any, lengths: Any, prefix: list[int], suffix: list[int], reuse: Any = None) -> Any:
    """The documents at `starts` of `lengths` tokens, in that order, each wrapped in prefix and suffix
    tokens, as one flat array: one gather of each document with as many ids around it as it has
    boundary tokens (clipped to the file at its ends), then the boundary tokens written over those; no
    Python work per token, and no mask or second copy of the chunk. `reuse`: a `_Buffers` to build it in."""
    import numpy as np

    wrap = len(prefix) + len(suffix)
    size = int(lengths.sum()) + wrap * len(starts)
    index, out = (None, np.empty(size, ids.dtype)) if reuse is None else reuse.take(size)
    if size == 0:
        return out
    at = np.cumsum(lengths + wrap) - (lengths + wrap)  # where each wrapped document starts
    if size >= LONG_DOCUMENTS * len(starts):
        # Long documents: a slice copy each (a memcpy) costs less than building and reading an index
        # for every token (bench/README.md, "Pack"); the boundary slots are written below. Slices of
        # memoryviews of bytes, which cost ~0.3 us less per document than numpy's slices.
        item = out.itemsize
        places = zip(((at + len(prefix)) * item).tolist(), (starts * item).tolist(), (lengths * item).tolist())
        with memoryview(ids.array) as whole, whole.cast("B") as source, memoryview(out) as part, part.cast("B") as to_:
            for to, start, length in places:
                to_[to : to + length] = source[start : start + length]
    else:
        np.take(ids.array, gather_runs(starts - len(prefix), lengths + wrap, index), mode="clip", out=out)
    for k, token in enumerate(prefix):
        out[at + k] = token
    for k, token in enumerate(suffix):
        out[at + len(prefix) + lengths + k] = token
    return out


class _Buffers:
    """The index and output arrays of `wrapped` (and `flatten`'s cast ids and hash values), kept from
    chunk to chunk (grown when one needs more): fresh arrays of this size come from the system each
    time, their pages faulted in anew."""

    def __init__(self, dtype: Any):
        import numpy as np

        self.dtype = dtype
        self.index, self.out, self.hashed = np.empty(0, np.intp), np.empty(0, dtype), np.empty(0, np.uint64)

    def values(self, size: int) -> Any:
        """A uint64 array of `size`, for `flatten`'s hash values."""
        import numpy as np

        if size > len(self.hashed):
            self.hashed = np.empty(size, np.uint64)
        return self.hashed[:size]

    def take(self, size: int) -> tuple[Any, Any]:
        import numpy as np

        if size > len(self.out):
            self.index, self.out = np.empty(size, np.intp), np.empty(size, self.dtype)
        return self.index, self.out[:size]


def _validation_split(order: Any, offsets: Any, config: Config, wrap: int) -> tuple[int, int, int]:
    """How many of the shuffled documents go to validation, their length with boundaries, and the
    length of all: val_fraction of the documents, or more when that is less than one block."""
    import numpy as np

    n_val = max(1, round(config.val_fraction * len(order)))
    val_len = scratch.wrapped_total(order[:n_val], offsets, wrap)
    total = val_len + scratch.wrapped_total(order[n_val:], offsets, wrap)
    if len(order) and val_len < config.seq_len:
        # Each document is 2+ tokens with its boundaries: the first seq_len of them make a block if any do.
        sizes = np.cumsum(scratch.wrapped_lengths(order[: config.seq_len], offsets, wrap))
        n_val = int(np.searchsorted(sizes, config.seq_len)) + 1
        val_len = int(sizes[n_val - 1]) if n_val <= len(sizes) else total
    if n_val >= len(order):
        if len(order) == 1 and total >= 2 * config.seq_len:  # enough tokens: it is the documents that are few
            raise StageError(
                f"tokenize.corpus: one document of {total} tokens; pack keeps whole documents apart for "
                'validation, so it needs two or more (split the text, e.g. tokenize.corpus.text_unit = "paragraph")'
            )
        raise StageError(
            f"tokenize.corpus: {len(order)} documents ({total} tokens with boundaries) are too few for one "
            f"validation block and one training block of pack.seq_len = {config.seq_len}"
        )
    return n_val, val_len, total


def _dtype(choice: str, vocab_size: int) -> Any:
    import numpy as np

    if choice == "uint16" and vocab_size > _UINT16_LIMIT:
        raise StageError(
            f'pack.dtype: "uint16" holds ids below {_UINT16_LIMIT}, but vocab_size is {vocab_size}; '
            f'use "int32" or "auto"'
        )
    if choice == "int32" or (choice == "auto" and vocab_size > _UINT16_LIMIT):
        return np.int32
    return np.uint16
