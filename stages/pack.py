"""Pack: turn tokenized documents into fixed-length blocks for pretraining, the cramming way.

Documents are de-duplicated (optional), shuffled with the run seed and split into validation and
training documents; each split is concatenated with boundary tokens and cut into blocks of
`seq_len` tokens, its last partial block dropped, so no batch ever holds padding. Each split is
one `.npy` array [blocks, seq_len]: pretraining reads a batch as one slice of a memory map.

Out of core, in two streaming passes: the first reads the token shards a batch at a time and writes
each document's end offset, hash and place in its shard; the second gathers the shuffled documents a
chunk of ~4M tokens at a time from the shards themselves, memory-mapped (`stages/data/token_map.py`),
and appends each chunk to the `.npy` file. Where the shards would outgrow the page cache, the first
pass also writes a compact copy of the ids, which the second reads instead. The rows once written are
dropped from the page cache, which keeps it for the ids. Every per-document array (offsets, hashes,
the de-duplicated and the shuffled order) is a memory-mapped file built a block at a time
(`stages/data/scratch.py`), so anonymous memory grows neither with the number of tokens nor with the
number of documents.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from cram.stages import Context, StageError, Upstream
from cram.stages.data import scratch, shards
from cram.stages.data.token_map import MappedIds, can_read_in_place, positions_in

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    from numpy.typing import DTypeLike

NAME = "pack"
VERSION = "1"
UPSTREAM = ("tokenize",)
RESUMABLE = False

_UINT16_LIMIT = 1 << 16
CHUNK_TOKENS = 1 << 22  # tokens gathered and written at a time
# Documents (with their boundary tokens) at least this long on average are copied a slice each,
# shorter ones gathered through an index: the cost per token of the two crosses near here.
LONG_DOCUMENTS = 128
WRITTEN_BYTES = 256 << 20  # rows written before they are dropped from the page cache


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
        offsets, keys, ids, in_place = _first_pass(upstream.path("tokens"), folder, vocab_size, dtype)
        n_documents, n_tokens = len(offsets) - 1, int(offsets[-1])
        with ids:
            # Empty documents would add only boundary tokens.
            nonempty = scratch.nonempty_documents(offsets, folder)
            keep = scratch.unique_documents(ids, offsets, keys, nonempty, folder) if config.dedup else nonempty
            n_nonempty, n_keep = len(nonempty), len(keep)
            order = scratch.shuffled(keep, ctx.seed, folder)
            del nonempty, keep, keys  # their maps closed, their pages no longer counted
            prefix = [special_ids["cls"]] if config.boundary == "cls-sep" else []
            rows = Rows(config.seq_len, dtype, prefix, [special_ids["sep"]])
            n_val, val_len, total = _validation_split(order, offsets, config, rows.wrap)
            splits = (("val", order[:n_val], val_len), ("train", order[n_val:], total - val_len))
            shapes = {
                split: write_blocks(out_dir / f"{split}.npy", ids, docs, size, rows) for split, docs, size in splits
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
        "read_in_place": in_place,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(n_tokens / seconds),
    }
    shapes = {"train": list(shapes["train"]), "val": list(shapes["val"])}
    (out_dir / "pack.json").write_text(json.dumps({**outputs, "shapes": shapes}, indent=1))
    ctx.log.info("packed", **{k: v for k, v in outputs.items() if isinstance(v, (int, float))})
    return outputs


def _first_pass(
    tokens: Path, folder: Path, vocab_size: int, dtype: DTypeLike
) -> tuple[np.ndarray, np.ndarray, MappedIds, bool]:
    """`flatten`'s arrays, where pass two reads the ids from (the shards in place, or else the compact
    copy that pass one writes) and whether that is in place."""
    import numpy as np

    paths = shards.shard_files(tokens)
    in_place = can_read_in_place(paths)
    copy = None if in_place else folder / "ids.scratch"
    offsets, keys, sources = flatten(paths, folder, vocab_size, copy, dtype)
    files, ids_dtype = (paths, np.int32) if copy is None else ([copy], dtype)
    return offsets, keys, MappedIds(files, ids_dtype, offsets, sources), in_place


def flatten(
    paths: list[Path], folder: Path, vocab_size: int, copy: Path | None, dtype: DTypeLike
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pass one: every document of the token shards `paths`, in order; returns, as mapped arrays, each
    document's end offset in the stream of all ids (after a leading 0), a hash of its ids
    (`unique_documents`' keys) and where its ids start (`MappedIds`' sources): in the concatenation of
    the shards, or with `copy`, in that file, where pass one writes every id as `dtype`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    # uint64 values, so that the per-document sums need no cast of every token.
    table = np.random.default_rng(0).integers(0, 2**32, size=vocab_size, dtype=np.uint32).astype(np.uint64)
    offsets, keys = scratch.Appender(folder / "offsets", np.int64), scratch.Appender(folder / "keys", np.uint64)
    sources = scratch.Appender(folder / "sources", np.int64)
    offsets.append(np.zeros(1, np.int64))
    end, base, buffers = 0, 0, _Buffers(dtype)
    with open(copy, "wb") if copy else contextlib.nullcontext() as out:
        for path in paths:
            for batch, file_delta in shards.read_batches_located(path):
                column = batch.column("input_ids")
                if column.type.value_type != pa.int32():
                    raise StageError(f"{path}: token ids of type {column.type.value_type}, not int32; re-run tokenize")
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
                ends = np.cumsum(n) + end
                if out is None:
                    sources.append(base + _first_id_at(column, file_delta, path) + column.offsets.to_numpy()[:-1])
                else:
                    sources.append(ends - n)
                    _write_as(ids, dtype, out, buffers)
                # Built in the buffer kept from batch to batch: fresh arrays fault their pages in anew.
                values = buffers.values(len(ids))
                np.take(table, ids, out=values, mode="clip")  # "clip": unbuffered (and checked above)
                offsets.append(ends)
                end = int(ends[-1]) if len(ends) else end
                keys.append(_document_hashes(values, n))
            base += positions_in(path, np.int32)
            if out is not None:
                with open(path, "rb") as shard:
                    _drop_cached(shard)  # read once
    return offsets.mapped(), keys.mapped(), sources.mapped()


def _write_as(ids: np.ndarray, dtype: DTypeLike, out: BinaryIO, buffers: _Buffers) -> None:
    """Append the int32 `ids` (viewed as uint32) to the open file `out` as `dtype`."""
    import numpy as np

    if np.dtype(dtype).itemsize == ids.itemsize:
        scratch.write(ids, out)  # int32 ids: the same bytes
    else:
        cast = buffers.take(len(ids))[1]
        np.copyto(cast, ids, casting="unsafe")
        scratch.write(cast, out)


def _first_id_at(column: pa.ListArray, file_delta: int, path: Path) -> int:
    """Where the list column's values start in the shard file `path`, in ids (`file_delta`: the shard's
    offset of a buffer's address, `shards.read_batches_located`)."""
    values = column.values
    if len(values) == 0:
        return 0
    at = values.buffers()[1].address + file_delta + 4 * values.offset
    if at % 4:
        raise StageError(f"{path}: token ids not 4-byte aligned in the file; re-run tokenize")
    return at // 4


def _drop_cached(file: BinaryIO) -> None:
    """Drop the page cache's copy of an open file pack is done with: a token shard pass one has read,
    or the rows pass two has written. At 10 GB of text the shards, the ids file and the output outgrow
    the page cache of a small machine, and the kernel would otherwise reclaim pages while pack writes,
    in pack's system time. Pages not yet written back are only scheduled for writing, not dropped."""
    if hasattr(os, "posix_fadvise"):
        file.flush()
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _document_hashes(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
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


@dataclass(frozen=True)
class Rows:
    """How pack lays out a split: each document wrapped in `prefix` and `suffix` tokens, the stream cut
    into rows of `seq_len`, stored as `dtype`."""

    seq_len: int
    dtype: DTypeLike
    prefix: list[int]
    suffix: list[int]

    @property
    def wrap(self) -> int:
        """The tokens a document gains."""
        return len(self.prefix) + len(self.suffix)


def write_blocks(path: Path, ids: MappedIds, docs: np.ndarray, size: int, rows: Rows) -> tuple[int, int]:
    """Pass two, for one split: the documents `docs`, in that order, laid out as `rows` says (`size`
    tokens in all, wrapped; the remainder that does not fill a row is dropped) and written to the `.npy`
    file `path` a chunk at a time. Returns the array's shape.

    The file is written with plain writes after its header, not through `open_memmap`: the pages
    of a writable memory map stay in the process's RSS until it is closed."""
    import numpy as np

    shape = (size // rows.seq_len, rows.seq_len)
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(rows.dtype)), "fortran_order": False, "shape": shape}
    remaining, wrap, unadvised = shape[0] * rows.seq_len, rows.wrap, 0
    with open(path, "wb") as out:
        np.lib.format.write_array_header_1_0(out, header)
        buffers = _Buffers(rows.dtype, ids.dtype)
        for block_start, block_stop in scratch.blocks(len(docs)):
            part = docs[block_start:block_stop]
            sources = ids.sources[part]
            lengths = ids.offsets[part + 1] - ids.offsets[part]
            ends = np.cumsum(lengths + wrap)
            first = 0
            while first < len(part) and remaining > 0:
                # The documents that end within CHUNK_TOKENS of this chunk's start (at least one).
                start = int(ends[first - 1]) if first else 0
                last = max(first + 1, int(np.searchsorted(ends, start + CHUNK_TOKENS, side="right")))
                chunk = wrapped(ids, sources[first:last], lengths[first:last], rows.prefix, rows.suffix, buffers)
                chunk = chunk[:remaining]
                scratch.write(chunk, out)
                remaining -= len(chunk)
                first = last
                unadvised += chunk.nbytes
                if unadvised >= WRITTEN_BYTES:  # a small output stays cached for pretrain to read
                    _drop_cached(out)
                    unadvised = 0
    return shape


def wrapped(
    ids: MappedIds, sources: np.ndarray, lengths: np.ndarray, prefix: list[int], suffix: list[int], buffers: _Buffers
) -> np.ndarray:
    """The documents at `sources` of `lengths` tokens, in that order, each wrapped in prefix and suffix
    tokens, as one flat array of the dtype of `buffers` (which it is built in): the documents gathered
    in the ids' dtype (in place when it is the output's), cast once, and the boundary tokens written in
    the slots left between them."""
    import numpy as np

    wrap = len(prefix) + len(suffix)
    size = int(lengths.sum()) + wrap * len(sources)
    index, out, gathered = buffers.take(size)
    if size == 0:
        return out
    at = np.cumsum(lengths + wrap) - (lengths + wrap) + len(prefix)  # where each document's ids go
    ids.gather(sources, lengths, at, gathered, LONG_DOCUMENTS, index)
    if gathered is not out:
        np.copyto(out, gathered, casting="unsafe")  # ids below the vocab size, which fits the dtype
    for k, token in enumerate(prefix):
        out[at - len(prefix) + k] = token
    for k, token in enumerate(suffix):
        out[at + lengths + k] = token
    return out


class _Buffers:
    """The arrays of `wrapped` (an index, the output and the ids gathered before their cast) and of
    `flatten` (hash values, cast ids), kept from chunk to chunk (grown when one needs more): fresh
    arrays of this size come from the system each time, their pages faulted in anew."""

    def __init__(self, dtype: DTypeLike, source: DTypeLike = None):
        import numpy as np

        self.dtype, self.source = np.dtype(dtype), np.dtype(source or dtype)
        self.index, self.out, self.gathered = np.empty(0, np.intp), np.empty(0, dtype), np.empty(0, self.source)
        self.hashed = np.empty(0, np.uint64)

    def values(self, size: int) -> np.ndarray:
        """A uint64 array of `size`, for `flatten`'s hash values."""
        import numpy as np

        if size > len(self.hashed):
            self.hashed = np.empty(size, np.uint64)
        return self.hashed[:size]

    def take(self, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An index, an output array of the dtype and one of the source dtype to gather into (the output
        itself when the two are one), each of `size`."""
        import numpy as np

        if size > len(self.out):
            # With room to spare: chunks grow a little at a time, and the old arrays live on until the
            # caller drops the last chunk.
            self.index = self.out = self.gathered = None
            room = size + size // 8
            self.index, self.out = np.empty(room, np.intp), np.empty(room, self.dtype)
            self.gathered = self.out if self.source == self.dtype else np.empty(room, self.source)
        return self.index, self.out[:size], self.gathered[:size]


def _validation_split(order: np.ndarray, offsets: np.ndarray, config: Config, wrap: int) -> tuple[int, int, int]:
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
    if n_val < len(order) and (total - val_len) // config.seq_len == 0:
        raise StageError(
            f"tokenize.corpus: {int(offsets[-1])} tokens in {len(order)} documents are too few for one training "
            f"block of pack.seq_len = {config.seq_len} after validation takes its share; use a bigger corpus"
        )
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


def _dtype(choice: str, vocab_size: int) -> type[np.integer]:
    import numpy as np

    if choice == "uint16" and vocab_size > _UINT16_LIMIT:
        raise StageError(
            f'pack.dtype: "uint16" holds ids below {_UINT16_LIMIT}, but vocab_size is {vocab_size}; '
            f'use "int32" or "auto"'
        )
    if choice == "int32" or (choice == "auto" and vocab_size > _UINT16_LIMIT):
        return np.int32
    return np.uint16
