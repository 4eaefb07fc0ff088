"""Pretraining batches: a deterministic stream of packed blocks, prefetched, and masked on the device.

The stream is a function of (seed, position) alone, so a resumed or re-sharded run sees exactly the
sequences and masks an uninterrupted one would have:
- global sequence `g` is block `order(epoch = g // n)[g % n]`, a fresh permutation per epoch;
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

import numpy as np
import torch

from cram.stages.shared.masking import mask_seed

_STOP_POLL_S = 0.1


@dataclass(frozen=True)
class Microbatch:
    ids: torch.Tensor  # [microbatch, seq_len] int32 on the CPU (pinned when feeding a GPU)
    first: int  # global index of its first sequence
    mask_seed: int


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def read_sequences(blocks: np.ndarray, seed: int, first: int, count: int, orders: dict[int, np.ndarray]) -> np.ndarray:
    """Rows for global sequences `first .. first + count - 1`, as int32. `orders` caches permutations."""
    n = len(blocks)
    g = np.arange(first, first + count)
    rows = np.empty(count, dtype=np.int64)
    for epoch in np.unique(g // n):
        if epoch not in orders:
            orders.clear()  # one epoch at a time: the stream only moves forward
            orders[epoch] = epoch_order(seed, int(epoch), n)
        here = g // n == epoch
        rows[here] = orders[epoch][g[here] % n]
    # Sorted reads are kinder to a memory map; the original order is restored after.
    sort = np.argsort(rows, kind="stable")
    out = np.empty((count, blocks.shape[1]), dtype=np.int32)
    out[sort] = blocks[rows[sort]]
    return out


class Prefetcher:
    """This rank's microbatches from global sequence `start` on, read ahead by a background thread.

    `next()` blocks only when the thread has fallen behind; `wait_s` adds up that blocked time, on top of
    `waited_s` (what a resumed run carries over from its checkpoint).
    """

    def __init__(
        self,
        blocks: np.ndarray,
        *,
        seed: int,
        start: int,
        microbatch: int,
        rank: int = 0,
        world_size: int = 1,
        depth: int = 4,
        pin: bool = False,
        waited_s: float = 0.0,
    ):
        self.wait_s = waited_s
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill,
            args=(blocks, seed, start, microbatch, rank, world_size, pin),
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

    def _fill(self, blocks, seed, start, microbatch, rank, world_size, pin) -> None:
        orders: dict[int, np.ndarray] = {}
        global_first = start
        try:
            while not self._stop.is_set():
                first = global_first + rank * microbatch
                ids = torch.from_numpy(read_sequences(blocks, seed, first, microbatch, orders))
                item = Microbatch(ids.pin_memory() if pin else ids, first, mask_seed(seed, first))
                self._put(item)
                global_first += world_size * microbatch
        except BaseException as e:  # handed to the consumer, which raises it in the training loop
            self._put(e)

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_STOP_POLL_S)
                return
            except queue.Full:
                continue
