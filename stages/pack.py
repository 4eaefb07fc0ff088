"""Pack: turn tokenized documents into fixed-length blocks for pretraining, the cramming way.

Documents are de-duplicated (optional), shuffled with the run seed and split into validation and
training documents; each split is concatenated with boundary tokens and cut into blocks of
`seq_len` tokens, its last partial block dropped, so no batch ever holds padding. Each split is
one `.npy` array [blocks, seq_len]: pretraining reads a batch as one slice of a memory map.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stages import Context, StageError, Upstream

NAME = "pack"
VERSION = "1"
UPSTREAM = ("tokenize",)
RESUMABLE = False

_UINT16_LIMIT = 1 << 16


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
    import datasets  # noqa: F401  (imported before the clock starts: figures time the packing)
    import numpy as np

    started = time.perf_counter()
    upstream = inputs["tokenize"]
    vocab_size, special_ids = upstream.outputs["vocab_size"], upstream.outputs["special_ids"]
    dtype = _dtype(config.dtype, vocab_size)
    ids, offsets = read_documents(upstream.path("tokens"))
    n_documents, n_tokens = len(offsets) - 1, len(ids)

    # Empty documents would add only boundary tokens.
    nonempty = nonempty_documents(offsets)
    keep = unique_documents(ids, offsets) if config.dedup else nonempty
    order = keep[np.random.default_rng(ctx.seed).permutation(len(keep))]
    prefix = [special_ids["cls"]] if config.boundary == "cls-sep" else []
    suffix = [special_ids["sep"]]
    n_val, val_len = _validation_split(order, offsets, config, len(prefix) + len(suffix))
    # The validation documents come first in `order`: one concatenation, cut in two.
    flat = concatenate(ids, offsets, order, prefix, suffix, dtype)
    blocks = {"train": to_blocks(flat[val_len:], config.seq_len), "val": to_blocks(flat[:val_len], config.seq_len)}
    if len(blocks["train"]) == 0:
        raise StageError(
            f"tokenize.corpus: {n_tokens} tokens in {len(keep)} documents are too few for one training "
            f"block of pack.seq_len = {config.seq_len} after validation takes its share; use a bigger corpus"
        )
    for name, array in blocks.items():
        np.save(out_dir / f"{name}.npy", array)
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
        "train_blocks": len(blocks["train"]),
        "val_blocks": len(blocks["val"]),
        "train_documents": len(order) - n_val,
        "val_documents": n_val,
        "documents": n_documents,
        "duplicates_removed": len(nonempty) - len(keep),
        "tokens": n_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(n_tokens / seconds),
    }
    shapes = {name: list(array.shape) for name, array in blocks.items()}
    (out_dir / "pack.json").write_text(json.dumps({**outputs, "shapes": shapes}, indent=1))
    ctx.log.info("packed", **{k: v for k, v in outputs.items() if isinstance(v, (int, float))})
    return outputs


def read_documents(path: Path) -> tuple[Any, Any]:
    """Every document's token ids as one flat int array and document offsets into it
    (document i is ids[offsets[i]:offsets[i + 1]]), straight from the arrow data."""
    import datasets
    import numpy as np
    import pyarrow.compute as pc

    column = datasets.load_from_disk(str(path)).data.column("input_ids")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pc.list_flatten(column).to_numpy(zero_copy_only=False), offsets


def unique_documents(ids: Any, offsets: Any) -> Any:
    """Indices of the non-empty documents, without exact duplicates (same ids): each is kept at
    its first occurrence.

    A hash of each document's multiset of ids (vectorised) finds candidates; candidates are then
    compared id for id, so a hash collision never removes a distinct document."""
    import numpy as np

    docs = nonempty_documents(offsets)
    starts, lengths = offsets[docs], offsets[docs + 1] - offsets[docs]
    table = np.random.default_rng(0).integers(0, 2**32, size=int(ids.max(initial=0)) + 1, dtype=np.uint32)
    with np.errstate(over="ignore"):  # the hash wraps around 2**64 on purpose
        # Segments run from one non-empty document's start to the next's: empty ones add nothing.
        sums = np.add.reduceat(table[ids], starts, dtype=np.uint64) if len(docs) else np.zeros(0, np.uint64)
        keys = sums + lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    _, first, inverse, counts = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
    keep = np.zeros(len(docs), dtype=bool)
    keep[first] = True
    for group in np.flatnonzero(counts > 1):
        kept: list[Any] = []
        for i in np.flatnonzero(inverse == group):
            doc = ids[starts[i] : starts[i] + lengths[i]]
            keep[i] = not any(np.array_equal(doc, other) for other in kept)
            if keep[i]:
                kept.append(doc)
    return docs[keep]


def nonempty_documents(offsets: Any) -> Any:
    import numpy as np

    return np.flatnonzero(offsets[1:] > offsets[:-1])


def concatenate(ids: Any, offsets: Any, docs: Any, prefix: list[int], suffix: list[int], dtype: Any) -> Any:
    """The documents `docs`, in that order, each wrapped in prefix and suffix tokens, as one flat
    array: a single gather, no Python work per token or per document."""
    import numpy as np

    # The boundary tokens are appended to the ids, so that every piece of the output (prefix,
    # document, suffix) is a run of consecutive entries in one source array.
    specials = np.asarray(prefix + suffix, dtype=ids.dtype)
    source = np.concatenate([ids, specials])
    special_at = len(ids) + np.arange(len(specials))
    runs = len(specials) + 1
    run_starts = np.empty((len(docs), runs), dtype=np.int64)
    run_lengths = np.ones((len(docs), runs), dtype=np.int64)
    run_starts[:, : len(prefix)] = special_at[: len(prefix)]
    run_starts[:, len(prefix)] = offsets[docs]
    run_lengths[:, len(prefix)] = offsets[docs + 1] - offsets[docs]
    run_starts[:, len(prefix) + 1 :] = special_at[len(prefix) :]
    return source[gather_runs(run_starts.ravel(), run_lengths.ravel())].astype(dtype, copy=False)


def gather_runs(starts: Any, lengths: Any) -> Any:
    """Indices starts[0], starts[0] + 1, ..., starts[0] + lengths[0] - 1, starts[1], ...: one
    cumulative sum of steps that are 1 inside a run and jump at each run's first element."""
    import numpy as np

    nonempty = lengths > 0
    starts, lengths = starts[nonempty], lengths[nonempty]
    if len(starts) == 0:
        return np.zeros(0, dtype=np.int32)
    # int32 indices when they fit: half the memory traffic of int64.
    index = np.int32 if int(starts.max()) + int(lengths.max()) < 2**31 else np.int64
    steps = np.ones(int(lengths.sum()), dtype=index)
    first = np.cumsum(lengths) - lengths
    steps[0] = starts[0]
    steps[first[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(steps, out=steps)  # in place: a second array this size costs more than the sum


def to_blocks(flat: Any, seq_len: int) -> Any:
    """Rows of seq_len tokens; the remainder that does not fill a row is dropped."""
    usable = len(flat) // seq_len * seq_len
    return flat[:usable].reshape(-1, seq_len)


def _validation_split(order: Any, offsets: Any, config: Config, wrap: int) -> tuple[int, int]:
    """How many of the shuffled documents go to validation, and their length with boundaries:
    val_fraction of the documents, or more when that is less than one block."""
    import numpy as np

    n_val = max(1, round(config.val_fraction * len(order)))
    sizes = np.cumsum(offsets[order + 1] - offsets[order] + wrap)
    if len(order) and sizes[min(n_val, len(order)) - 1] < config.seq_len:
        n_val = int(np.searchsorted(sizes, config.seq_len)) + 1
    if n_val >= len(order):
        total = int(sizes[-1]) if len(order) else 0
        if len(order) == 1 and total >= 2 * config.seq_len:  # enough tokens: it is the documents that are few
            raise StageError(
                f"tokenize.corpus: one document of {total} tokens; pack keeps whole documents apart for "
                "validation, so it needs two or more (split the text, e.g. tokenize.corpus.text_unit = \"paragraph\")"
            )
        raise StageError(
            f"tokenize.corpus: {len(order)} documents ({total} tokens with boundaries) are too few for one "
            f"validation block and one training block of pack.seq_len = {config.seq_len}"
        )
    return n_val, int(sizes[n_val - 1])


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
