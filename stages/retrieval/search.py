"""Exact top-k search over a corpus's embeddings kept on disk, in memory bounded by a chunk of the
corpus, not by the corpus: a million documents search in the memory of a few thousand.

Embeddings are written once per model as a `.npy` file (fp16 halves the disk and the reads; fp32 where
the scores must be exact to the last bit), normalised, so a dot product is the cosine similarity. The
search maps one chunk of rows at a time, copies it to fp32, unmaps it (so its pages leave the
process's resident set: a mapping kept whole would grow with the corpus), multiplies it with the
queries and keeps the running best k. The result is exactly the unchunked one: the best k by score,
equal scores by lower corpus index, whatever the chunk size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from cram.stages.shared.files import atomic

CHUNK_ROWS = 32768  # corpus rows a step: fp32 copy 48 MiB at 384 wide; scores 16 MiB a 128-query batch
QUERY_ROWS = 128


def normalised(rows: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length in fp32 (a zero row stays zero)."""
    rows = np.asarray(rows, np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, np.finfo(np.float32).tiny)


def write_embeddings(path: Path, batches: Iterable[np.ndarray], rows: int, dtype: str = "float16") -> None:
    """Write `rows` embeddings, arriving in batches (each normalised here), to `path` as one `.npy`
    file, atomically: a reader never sees half a corpus. The header for `rows` rows goes first, then each
    batch is appended as it comes: the file grows with what is written (a full disk is an OSError at the
    batch that meets it, the temporary file removed) and the process holds one batch, whatever the output's
    size. ValueError, nothing written, where the batches hold another number of rows than `rows`."""
    normalised_batches = map(normalised, batches)  # one batch in memory at a time
    first = next(normalised_batches, None)
    if first is None:
        raise ValueError(f"{path}: no embeddings to write")
    kind = np.dtype(dtype)
    # The count is known before the first row (the callers count their inputs first), so the header is
    # final when written: no seek back to fix it, and a short or long delivery is refused below.
    header = {"descr": np.lib.format.dtype_to_descr(kind), "fortran_order": False, "shape": (rows, first.shape[1])}
    with atomic(path) as tmp, open(tmp, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        at = 0
        for batch in chain([first], normalised_batches):
            if at + len(batch) > rows:
                raise ValueError(f"{path}: more than the {rows} rows announced")
            f.write(np.ascontiguousarray(batch, kind).data)
            f.flush()  # to the kernel now: a write that cannot be made fails at this batch, not at the end
            at += len(batch)
        if at != rows:
            raise ValueError(f"{path}: {at} rows written of the {rows} announced")


@dataclass(frozen=True)
class Embeddings:
    """An embeddings file's layout, read from its `.npy` header: where its rows start and what they are."""

    path: Path
    rows: int
    dim: int
    dtype: np.dtype
    offset: int  # bytes before the first row

    @classmethod
    def open(cls, path: Path) -> Embeddings:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            if fortran or len(shape) != 2:
                raise ValueError(f"{path}: not a C-ordered 2-D array")
            return cls(path, shape[0], shape[1], dtype, f.tell())

    def chunk(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as a fresh fp32 array; the mapping that read them is gone on return."""
        mapped = np.memmap(
            self.path, self.dtype, "r", self.offset + start * self.dim * self.dtype.itemsize, (stop - start, self.dim)
        )
        rows = np.array(mapped, np.float32)
        del mapped
        return rows


def top_k(
    queries: np.ndarray, corpus: Embeddings, k: int, chunk_rows: int = CHUNK_ROWS
) -> tuple[np.ndarray, np.ndarray]:
    """The `k` corpus rows nearest each (normalised) query by dot product: (scores, indices), each
    (queries, min(k, rows)), best first, equal scores by lower index. (trec_eval orders equal scores
    by id; only a tie across the k-th place could differ, and only Recall@k would see it.)"""
    queries = np.asarray(queries, np.float32)
    k = min(k, corpus.rows)
    scores = np.full((len(queries), k), -np.inf, np.float32)
    index = np.full((len(queries), k), np.iinfo(np.int64).max, np.int64)  # unfilled places sort last
    for start in range(0, corpus.rows, chunk_rows):
        rows = corpus.chunk(start, min(start + chunk_rows, corpus.rows))
        for q in range(0, len(queries), QUERY_ROWS):
            chunk_scores = queries[q : q + QUERY_ROWS] @ rows.T
            chosen = _best_columns(chunk_scores, k)
            merged_scores = np.concatenate([scores[q : q + QUERY_ROWS], np.take_along_axis(chunk_scores, chosen, 1)], 1)
            merged_index = np.concatenate([index[q : q + QUERY_ROWS], chosen + start], 1)
            order = np.lexsort((merged_index, -merged_scores), axis=1)[:, :k]
            scores[q : q + QUERY_ROWS] = np.take_along_axis(merged_scores, order, 1)
            index[q : q + QUERY_ROWS] = np.take_along_axis(merged_index, order, 1)
    return scores, index


def _best_columns(scores: np.ndarray, k: int) -> np.ndarray:
    """The columns of each row's `k` highest scores, equal scores by lower column, in no order.
    argpartition picks among scores equal to the k-th at random, so a row where they straddle the
    k-th place is sorted whole (stable: lower column first); with real-valued embeddings that is rare."""
    if k >= scores.shape[1]:
        return np.broadcast_to(np.arange(scores.shape[1]), scores.shape).copy()
    chosen = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    kth = np.take_along_axis(scores, chosen, 1).min(axis=1, keepdims=True)
    straddle = np.flatnonzero((scores > kth).sum(1) + (scores == kth).sum(1) > k)
    for row in straddle:
        chosen[row] = np.argsort(-scores[row], kind="stable")[:k]
    return chosen
