"""The masked-LM objective every stage applies alike: its config (`[pretrain.masking]`), what it makes
of a block length and the special ids (`MaskSpec`), and the masking of a batch of ids.

Masks are drawn from a generator seeded per microbatch (`mask_seed`), so they are a function of the
seed and the data position alone: pretrain's training masks and the held-out masks of pretrain and
evaluate (`val_mlm`) never depend on the device, the batch size or the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cram.stages import StageError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Masking:
    """Exactly round(rate * seq_len) positions per sequence; of those, `mask_token` become [MASK],
    `random_token` a random token, the rest keep their token.

    The corruption is BERT's 80/10/10 by default; `mask_token = 1.0, random_token = 0.0` replaces every
    selected token by [MASK] (NeoBERT's choice: the model never sees the token it predicts, and never
    has to tell a kept or random token from a true one).

    `end_rate`: the rate moves linearly from `rate` at the start of the budget to `end_rate` at its
    end (None: `rate` throughout). Shapes stay static: each sequence-length phase masks as many rows
    as its highest rate needs, and the rows above the current rate keep their token and their label
    is ignored.

    `phase_rates`: one rate per entry of `[pretrain] phases` (one phase at pack's length when there are
    none), used in training instead of `rate` (which stays evaluate's default held-out rate), e.g.
    mmBERT's 30% -> 15% -> 5%. Phases of one length make it a piecewise-constant schedule over the
    budget's progress; each phase's row count is its own static shape (one more compiled graph per
    distinct count)."""

    rate: float = 0.25
    mask_token: float = 0.8
    random_token: float = 0.1
    end_rate: float | None = None
    phase_rates: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.rate < 1:
            raise ValueError(f"rate: {self.rate} must be in (0, 1)")
        if self.end_rate is not None and not 0 < self.end_rate < 1:
            raise ValueError(f"end_rate: {self.end_rate} must be in (0, 1)")
        if not (0 <= self.mask_token and 0 <= self.random_token and self.mask_token + self.random_token <= 1):
            raise ValueError(
                f"mask_token, random_token: {self.mask_token}, {self.random_token} must be >= 0 with sum <= 1"
            )
        for i, rate in enumerate(self.phase_rates):
            if not 0 < rate < 1:
                raise ValueError(f"phase_rates[{i}]: {rate} must be in (0, 1)")
        if self.phase_rates and self.end_rate is not None:
            raise ValueError("phase_rates, end_rate: a rate per phase or a linear schedule, not both")
        if self.mask_token == self.random_token == 0:
            raise ValueError(
                "mask_token, random_token: 0 and 0 leave every selected token as it was, so the model sees "
                "each token it must predict; at least one must be above 0"
            )

    def rate_at(self, progress: float) -> float:
        """The masking rate at `progress` through the budget."""
        if self.end_rate is None:
            return self.rate
        return self.rate + (self.end_rate - self.rate) * min(max(progress, 0.0), 1.0)


@dataclass(frozen=True)
class MaskSpec:
    """How the masked positions of a sequence are chosen and corrupted (cramming's MLM objective)."""

    per_sequence: int  # K: exactly this many positions per sequence
    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]  # never chosen while a sequence has enough other tokens
    replace_with_mask: float = 0.8
    replace_with_random: float = 0.1  # the rest of the chosen positions keep their token
    # Of the K positions, this many are masked and labelled (a masking schedule below its peak); the
    # others keep their token and label IGNORED. None: all K.
    labelled: int | None = None


def mask_spec(
    masking: Masking, special: dict[str, int], vocab_size: int, seq_len: int, rate_key: str = "pretrain.masking.rate"
) -> MaskSpec:
    """The masking of pretraining for blocks of `seq_len` at `masking.rate` (`rate_key` names it in an
    error); evaluate masks its held-out blocks alike."""
    return MaskSpec(
        per_sequence=masked_per_sequence(masking.rate, seq_len, rate_key),
        mask_id=special["mask"],
        vocab_size=vocab_size,
        special_ids=tuple(sorted(set(special.values()))),
        replace_with_mask=masking.mask_token,
        replace_with_random=masking.random_token,
    )


def masked_per_sequence(rate: float, seq_len: int, key: str) -> int:
    """How many positions of a `seq_len`-token block a masking `rate` masks; StageError naming `key`
    when that is none (no loss to learn from). Torch-free: the stages' `validate` call it too."""
    per_sequence = round(rate * seq_len)
    if per_sequence < 1:
        raise StageError(
            f"{key}: {rate} masks no token of a {seq_len}-token block; it must be above {0.5 / seq_len:.3g}"
        )
    return per_sequence


IGNORED = -100  # the label of a row the loss skips (F.cross_entropy's ignore_index)


def mask_seed(seed: int, first: int, stream: int = 0) -> int:
    """The masking seed for the microbatch starting at sequence `first` of `stream` (0: training)."""
    import numpy as np

    return int(np.random.SeedSequence([seed, stream, first]).generate_state(1, np.uint64)[0] >> 1)


def mask_tokens(ids: torch.Tensor, masking: MaskSpec, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The MLM batch for `ids` [B, S] (any integer dtype, on the training device).

    Returns `input_ids` [B, S] int64 and the static-shape `mlm_positions` / `mlm_labels` [B * K]
    int64, positions being flat indices into B * S; labels of rows beyond `masking.labelled` are IGNORED.
    """
    import torch

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
    if masking.labelled is not None and masking.labelled < masking.per_sequence:
        keep = _highest(scores.gather(1, chosen), masking.labelled).reshape(-1)
        replaced = torch.where(keep, replaced, labels)
        labels = labels.masked_fill(~keep, IGNORED)
    input_ids = flat.index_put((positions,), replaced).reshape(batch, seq_len)
    return {"input_ids": input_ids, "mlm_positions": positions, "mlm_labels": labels}


def _highest(scores: torch.Tensor, count: int) -> torch.Tensor:
    """[B, K] bool: the `count` highest of each row's `scores`; random scores make them a random subset."""
    rank = scores.argsort(dim=1, descending=True, stable=True).argsort(dim=1)
    return rank < count
