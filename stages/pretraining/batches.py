"""Pretraining batches: a deterministic stream of packed blocks, prefetched, and masked on the device.

The stream is a function of (seed, position) alone, so a resumed or re-sharded run sees exactly the
sequences and masks an uninterrupted one would have:
- global sequence `g` is block `order(epoch = g // n)[g % n]`, a fresh permutation per epoch (with
  sequence-length phases, `phases.py`, a block is a chunk of the longest length, and a shorter
  phase's sequence `g` is piece `g % pieces` of chunk `g // pieces`);
- the stream is cut into global microbatches of `world_size * microbatch` sequences, and rank `r`
  reads rows `[r * microbatch, (r + 1) * microbatch)` of each;
- the masking generator is re-seeded per microbatch from (seed, index of its first sequence), so
  masks depend on which sequences are masked, never on which rank or step masks them.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cram.stages.shared.blocks import blocks_of
from cram.stages.shared.masking import mask_seed

if TYPE_CHECKING:
    from cram.stages.pretraining.phases import Plan
    from cram.stages.pretraining.state import TrainState

_STOP_POLL_S = 0.1


@dataclass(frozen=True)
class Microbatch:
    ids: torch.Tensor  # [microbatch, seq_len] int32 on the CPU (pinned when feeding a GPU)
    first: int  # global index of its first sequence
    mask_seed: int


@dataclass(frozen=True)
class Feed:
    """How this rank reads the stream: the run's `seed` (the epochs' order and the masks), its `rank` of
    `world_size`, the microbatches read ahead (`depth`), pinned for a copy to a GPU (`pin`)."""

    seed: int
    rank: int = 0
    world_size: int = 1
    depth: int = 4
    pin: bool = False


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def read_sequences(
    blocks: np.ndarray, seed: int, first: int, count: int, orders: dict[int, np.ndarray], pieces: int = 1
) -> np.ndarray:
    """Rows for global sequences `first .. first + count - 1`, as int32, each a `1 / pieces` part of a
    block. `orders` caches permutations."""
    n, length = len(blocks), blocks.shape[1] // pieces
    g = np.arange(first, first + count) // pieces  # each sequence's block in the stream
    rows = np.empty(count, dtype=np.int64)
    for epoch in np.unique(g // n):
        if epoch not in orders:
            orders.clear()  # one epoch at a time: the stream only moves forward
            orders[epoch] = epoch_order(seed, int(epoch), n)
        here = g // n == epoch
        rows[here] = orders[epoch][g[here] % n]
    # Sorted reads are kinder to a memory map; the original order is restored after.
    sort = np.argsort(rows, kind="stable")
    piece = np.arange(first, first + count) % pieces
    out = np.empty((count, length), dtype=np.int32)
    out[sort] = blocks[rows[sort]].reshape(count, pieces, length)[np.arange(count), piece[sort]]
    return out


class Prefetcher:
    """This rank's microbatches from global sequence `start` on, read ahead by a background thread.

    `next()` blocks only when the thread has fallen behind; `wait_s` adds up that blocked time, on top of
    `waited_s` (what a resumed run carries over from its checkpoint).
    """

    def __init__(
        self, blocks: np.ndarray, feed: Feed, *, start: int, microbatch: int, waited_s: float = 0.0, pieces: int = 1
    ):
        self.wait_s = waited_s
        self._queue: queue.Queue = queue.Queue(maxsize=feed.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill,
            args=(blocks, feed, start, microbatch, pieces),
            name="cram-prefetch",
            daemon=True,
        )
        self._thread.start()

    def next(self) -> Microbatch:
        began = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - began
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fill(self, blocks: np.ndarray, feed: Feed, start: int, microbatch: int, pieces: int) -> None:
        orders: dict[int, np.ndarray] = {}
        global_first = start
        try:
            while not self._stop.is_set():
                first = global_first + feed.rank * microbatch
                ids = torch.from_numpy(read_sequences(blocks, feed.seed, first, microbatch, orders, pieces))
                item = Microbatch(ids.pin_memory() if feed.pin else ids, first, mask_seed(feed.seed, first))
                self._put(item)
                global_first += feed.world_size * microbatch
        except BaseException as e:  # handed to the consumer, which raises it in the training loop
            self._put(e)

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_STOP_POLL_S)
                return
            except queue.Full:
                continue


class PhaseStream:
    """This rank's microbatches across sequence-length phases (`phases.py`): the current phase's
    prefetcher, opened anew at the phase's data position when the phase changes."""

    def __init__(self, train: np.ndarray, plan: Plan, feed: Feed, waited_s: float = 0.0):
        self.chunks, self.plan, self.feed, self.waited_s = blocks_of(train, plan.chunk), plan, feed, waited_s
        self.phase: int | None = None
        self.prefetcher: Prefetcher | None = None

    @property
    def wait_s(self) -> float:
        return self.waited_s if self.prefetcher is None else self.prefetcher.wait_s

    def follow(self, state: TrainState) -> None:
        """Read from `state`'s phase and data position on, unless already reading that phase."""
        if state.phase == self.phase:
            return
        self.close()
        span = self.plan.spans[state.phase]
        self.prefetcher = Prefetcher(
            self.chunks,
            self.feed,
            start=self.plan.first_sequence(state),
            microbatch=span.microbatch,
            waited_s=self.waited_s,
            pieces=self.plan.chunk // span.seq_len,
        )
        self.phase = state.phase

    def next(self) -> Microbatch:
        return self.prefetcher.next()

    def close(self) -> None:
        if self.prefetcher is not None:
            self.waited_s = self.prefetcher.wait_s
            self.prefetcher.close()
            self.prefetcher = None

    def __enter__(self) -> PhaseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
