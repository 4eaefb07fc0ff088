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

_STOP_POLL_S = 0.1


@dataclass(frozen=True)
class Microbatch:
    ids: torch.Tensor  # [microbatch, seq_len] int32 on the CPU (pinned when feeding a GPU)
    first: int  # global index of its first sequence
    mask_seed: int


def mask_seed(seed: int, first: int, stream: int = 0) -> int:
    """The masking seed for the microbatch starting at sequence `first` of `stream` (0: training)."""
    return int(np.random.SeedSequence([seed, stream, first]).generate_state(1, np.uint64)[0] >> 1)


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

    `next()` blocks only when the thread has fallen behind; `wait_s` adds up that blocked time.
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
    ):
        self.wait_s = 0.0
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


@dataclass(frozen=True)
class MaskSpec:
    """How the masked positions of a sequence are chosen and corrupted (cramming's MLM objective)."""

    per_sequence: int  # K: exactly this many positions per sequence
    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]  # never chosen while a sequence has enough other tokens
    replace_with_mask: float = 0.8
    replace_with_random: float = 0.1  # the rest of the chosen positions keep their token


def mask_tokens(ids: torch.Tensor, masking: MaskSpec, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The MLM batch for `ids` [B, S] (any integer dtype, on the training device).

    Returns `input_ids` [B, S] int64 and the static-shape `mlm_positions` / `mlm_labels` [B * K]
    int64, positions being flat indices into B * S.
    """
    ids = ids.long()
    batch, seq_len = ids.shape
    device = ids.device
    scores = torch.rand(batch, seq_len, generator=generator, device=device)
    special = torch.zeros_like(ids, dtype=torch.bool)
    for token in masking.special_ids:  # python scalars: no host-to-device copy, no sync
        special |= ids == token
    # Special tokens score below every real token: chosen only when a sequence runs out of others.
    scores = scores.masked_fill(special, -1.0)
    chosen = scores.topk(masking.per_sequence, dim=1, sorted=False).indices.sort(dim=1).values
    positions = (chosen + torch.arange(batch, device=device)[:, None] * seq_len).reshape(-1)
    flat = ids.reshape(-1)
    labels = flat[positions]
    action = torch.rand(positions.shape, generator=generator, device=device)
    random_tokens = torch.randint(masking.vocab_size, positions.shape, generator=generator, device=device)
    replaced = torch.where(action < masking.replace_with_mask, masking.mask_id, labels)
    use_random = (action >= masking.replace_with_mask) & (
        action < masking.replace_with_mask + masking.replace_with_random
    )
    replaced = torch.where(use_random, random_tokens, replaced)
    input_ids = flat.index_put((positions,), replaced).reshape(batch, seq_len)
    return {"input_ids": input_ids, "mlm_positions": positions, "mlm_labels": labels}
