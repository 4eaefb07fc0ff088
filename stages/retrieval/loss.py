"""The contrastive fine-tune's batches (its loss, InfoNCE with in-batch negatives, is `model/embedder.py`'s).

Each query's positive is the right answer among every positive of the batch (and every hard negative,
where pairs carry one): the other pairs' texts are free negatives. That only holds when no text comes
twice in a batch: a query's own positive appearing as another pair's text is scored as a negative (a
false negative), so the batches are drawn as sentence-transformers' NO_DUPLICATES sampler draws them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from cram.stages import StageError


def distinct_batches(pairs: Sequence[Sequence[str]], batch_size: int, seed: int, where: str) -> list[list[int]]:
    """Batches of `batch_size` pair indices, no text twice in a batch, in an order shuffled by `seed`.
    Each batch takes the first pairs in the shuffled order whose texts (query, positive, negative) are
    all new to it; a pair skipped waits for a later batch; pairs too few to fill a last batch are dropped.
    `where` names the pairs in the error raised when not one batch can be filled."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    remaining = dict.fromkeys(order)  # insertion-ordered, with O(1) removal
    batches = []
    while True:
        batch: list[int] = []
        seen: set[str] = set()
        for i in remaining:
            texts = set(pairs[i])
            if not texts & seen:
                batch.append(i)
                seen |= texts
                if len(batch) == batch_size:
                    break
        if len(batch) < batch_size:
            break
        for i in batch:
            del remaining[i]
        batches.append(batch)
    if not batches:
        raise StageError(
            f"{where}: {len(pairs)} pairs do not fill one batch of {batch_size} without a text twice "
            f"(a repeated text is a false negative); give more distinct pairs or a smaller batch"
        )
    return batches
