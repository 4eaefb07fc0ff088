"""The held-out masked-LM loss and accuracy: one function and one masking for pretrain and evaluate.

A block's mask is a function of (seed, the block's index) alone, drawn on the CPU: the same blocks
get the same masks whatever the batch size, the device or the stage, so pretrain's held-out loss
over its first `val_blocks` blocks and evaluate's over all of them measure the same thing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from cram.stages.shared.blocks import Boundary
    from cram.stages.shared.masking import MaskSpec

MASK_SEED = 0  # pretrain's held-out masks; evaluate's `mlm_seed` defaults to the same


def val_mlm(
    evaluate: Callable,
    params: dict,
    blocks: np.ndarray,
    spec: MaskSpec,
    *,
    seed: int,
    batch_size: int,
    device: torch.device,
    tail: Callable | None = None,
    documents: Boundary | None = None,
) -> dict[str, float]:
    """Mean loss and accuracy over every masked token of `blocks` [n, seq_len].

    `evaluate(params, batch) -> {"loss", "accuracy"}` takes full batches of `batch_size`; `tail` (default:
    `evaluate`) the shorter last one, so that a compiled `evaluate` never sees a second shape. Sums stay
    on the device: one host sync at the end. `documents`: the batches carry
    `document_ids`, for attention within documents.
    """
    import torch

    from cram.stages.shared.device import to_device

    sums = []
    for first in range(0, len(blocks), batch_size):
        batch = mask_blocks(blocks[first : first + batch_size], first, spec, seed, documents)
        batch = {k: to_device(v, device) for k, v in batch.items()}
        step = evaluate if len(batch["input_ids"]) == batch_size or tail is None else tail
        with torch.no_grad():
            metrics = step(params, batch)
        k = batch["mlm_labels"].numel()
        sums.append(torch.stack([metrics["loss"].float(), metrics["accuracy"].float()]) * k)
    count = len(blocks) * spec.per_sequence
    loss_sum, correct = torch.stack(sums).sum(0).tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count, "masked_tokens": count}


def mask_blocks(
    rows: np.ndarray, first: int, spec: MaskSpec, seed: int, documents: Boundary | None = None
) -> dict[str, torch.Tensor]:
    """The MLM batch (on the CPU) for `rows` [B, S], row i being held-out block `first + i`."""
    import numpy as np
    import torch

    from cram.stages.shared.blocks import document_ids
    from cram.stages.shared.masking import mask_seed, mask_tokens

    ids = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    generator = torch.Generator()
    seq_len = ids.shape[1]
    parts = []
    for i in range(len(ids)):
        generator.manual_seed(mask_seed(seed, first + i, stream=1))
        parts.append(mask_tokens(ids[i : i + 1], spec, generator))
    batch = {
        "input_ids": torch.cat([p["input_ids"] for p in parts]),
        "mlm_positions": torch.cat([p["mlm_positions"] + i * seq_len for i, p in enumerate(parts)]),
        "mlm_labels": torch.cat([p["mlm_labels"] for p in parts]),
    }
    if documents is not None:
        batch["document_ids"] = document_ids(ids, documents)
    return batch
