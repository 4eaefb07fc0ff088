"""A fine-tune step's sentences packed into few rows: each row holds several sentences' windows one after
another, each reading only its own tokens (`document_ids`) at its own positions from 0, so that the step computes
what it would with each sentence in a row of its own (tests/test_packed_rows.py) on a fraction of the padding.

Named entity sets are short sentences of varied length (WNUT-17: 31 sub-tokens on average, the longest 75): a
batch of 32 padded to its longest, or to the bucket above it, is about half padding; packed into rows of 128
(their count rounded up as below) about a fifth. A step still takes `batch_size` sentences, drawn as before, so
its loss and its gradient's noise are the unpacked step's. The rows a step needs are rounded up to a multiple of
`batch_size / 8`, and to no fewer than a batch of average sentences takes (a short last batch costs no graph of
its own): at most 8 shapes, one compiled graph each, within dynamo's recompile limit; `step_shapes` lists those
a run will take.

    packing = Packing.of(rows.lengths, batch_size, buckets)
    for index in shuffled_batches(len(rows.ids), batch_size, epochs, seed)[epoch]:
        arrays = packing.inputs(rows, index, special, token_types)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cram.stages.kept.batches import bucket
from cram.stages.tagging.windows import IGNORE, Rows

MAX_SHAPES = 8  # dynamo's default recompile limit: the step's graphs stay within it


def shuffled_batches(count: int, size: int, epochs: int, seed: int) -> list[list[np.ndarray]]:
    """Each epoch's batches of `size` row indices (the last may be short): the rows shuffled anew each epoch by
    one generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(count) for _ in range(epochs)]
    return [[order[i : i + size] for i in range(0, count, size)] for order in orders]


@dataclass(frozen=True)
class Packing:
    """Rows of `width` tokens, their number a multiple of `rows_step` and at least `least_rows`."""

    width: int
    rows_step: int
    least_rows: int

    @classmethod
    def of(cls, lengths: np.ndarray, size: int, buckets: tuple[int, ...]) -> Packing:
        """For a task's training rows (`lengths`) batched `size` at a time: rows as wide as the bucket of its
        longest (no buckets, eager: as its longest), so that any one fits."""
        longest = int(lengths.max())
        width, rows_step = bucket(longest, buckets) if buckets else longest, math.ceil(size / MAX_SHAPES)
        typical = math.ceil(size * float(lengths.mean()) / width)
        return cls(width, rows_step, rows_step * math.ceil(typical / rows_step))

    def place(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Where each of `lengths` goes, first-fit decreasing: its packed row and its offset in that row, and
        the packed rows the batch takes (a multiple of `rows_step`, at least `least_rows`)."""
        row, offset, used = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64), []
        for i in np.argsort(-lengths, kind="stable"):
            found = next((r for r, full in enumerate(used) if full + lengths[i] <= self.width), len(used))
            if found == len(used):
                used.append(0)
            row[i], offset[i] = found, used[found]
            used[found] += int(lengths[i])
        return row, offset, max(self.least_rows, self.rows_step * math.ceil(len(used) / self.rows_step))

    def inputs(
        self, rows: Rows, index: np.ndarray, special: dict[str, int], token_types: bool
    ) -> dict[str, np.ndarray]:
        """numpy `input_ids`, `attention_mask`, `document_ids`, `positions`, `labels` (and `token_type_ids`, all 0)
        of the windows `rows[index]` packed; packed rows past the last used are fillers, [CLS] [SEP] tagged
        IGNORE, as `Padding`'s are."""
        lengths = np.array([len(rows.ids[i]) for i in index])
        placed_row, placed_at, count = self.place(lengths)
        shape = (count, self.width)
        ids = np.full(shape, special["pad"], dtype=np.int64)
        ids[:, :2] = special["cls"], special["sep"]
        mask = np.zeros(shape, dtype=bool)
        mask[:, :2] = True
        documents = np.full(shape, -1, dtype=np.int64)
        documents[:, :2] = len(index)  # a filler row's own document; a used row's first window overwrites it
        positions = np.zeros(shape, dtype=np.int64)
        positions[:, 1] = 1
        labels = np.full(shape, IGNORE, dtype=np.int64)
        for n, (i, r, at, length) in enumerate(zip(index, placed_row, placed_at, lengths)):
            span = slice(at, at + length)
            ids[r, span], mask[r, span], documents[r, span] = rows.ids[i], True, n
            positions[r, span], labels[r, at : at + len(rows.labels[i])] = np.arange(length), rows.labels[i]
        arrays = {"input_ids": ids, "attention_mask": mask, "document_ids": documents, "positions": positions}
        if token_types:
            arrays["token_type_ids"] = np.zeros(shape, dtype=np.int64)
        return {**arrays, "labels": labels}


def step_shapes(
    lengths: np.ndarray, packing: Packing, size: int, epochs: int, seeds: list[int]
) -> dict[int, np.ndarray]:
    """The packed rows a fine-tune's steps take at each seed, with the first batch of each: every graph the
    fine-tunes will run, and nothing more, for the canary to check."""
    found: dict[int, np.ndarray] = {}
    for seed in seeds:
        for batches in shuffled_batches(len(lengths), size, epochs, seed):
            for index in batches:
                found.setdefault(packing.place(lengths[index])[2], index)
    return found
