"""The evaluate stage's held-out masked LM: pack's val blocks at each length, masked as pretrain masked
its own (`stages/shared/val_mlm.py`), in a compiled eval step per length, each checked against the eager
step on its first batch inside the stage's precision choice (`mlm_canary`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from cram.stages import Context, StageError, Upstream
from cram.stages.evaluating.checks import check_position
from cram.stages.evaluating.config import MlmSettings

if TYPE_CHECKING:
    import numpy as np
    import torch

    from cram.model.config import ModelConfig
    from cram.stages.shared.blocks import Boundary
    from cram.stages.shared.masking import MaskSpec
    from cram.stages.shared.precision import Difference, Precision


@dataclass(frozen=True)
class HeldOut:
    """How the held-out masked LM is measured: pack's val blocks at `lengths`, masked as pretrain masked,
    with evaluate's `settings` (the masks' seed, the batch size, compiling)."""

    path: Path  # pack's val.npy
    lengths: list[int]
    masking: dict  # a `Masking` as a dict; its rate: evaluate.mlm_mask_rate, or pretraining's
    special: dict[str, int]
    vocab_size: int  # the tokenizer's: random replacements are real tokens, not rows a model has past them
    documents: Boundary | None  # when pretrain attended within documents
    settings: MlmSettings

    @classmethod
    def of(cls, settings: MlmSettings, inputs: dict[str, Upstream]) -> HeldOut:
        from cram.stages.shared.blocks import boundary

        pretrain, pack, tokenize = inputs["pretrain"], inputs["pack"], inputs["tokenize"].outputs
        special = tokenize["special_ids"]
        trained = pretrain.outputs
        masking = trained["masking"]
        if settings.mask_rate:
            masking = {**masking, "rate": settings.mask_rate}
        if settings.corruption == "bert":
            masking = {**masking, "mask_token": 0.8, "random_token": 0.1}
        lengths = list(settings.lengths) or trained.get("seq_lens") or [int(pack.outputs["seq_len"])]
        documents = boundary(pack.outputs["boundary"], special) if trained.get("document_attention") else None
        return cls(pack.path("val"), lengths, masking, special, int(tokenize["vocab_size"]), documents, settings)


@dataclass(frozen=True)
class MlmSteps:
    """The held-out masked LM's eval steps: `compiled`, one per length (each its own graph, checked against
    eager by `mlm_canary`), and `eager`, for a length's last, shorter batch and for the canary."""

    compiled: dict[int, Callable]
    eager: Callable

    @classmethod
    def make(cls, held_out: HeldOut, cfg: ModelConfig, precision: Precision, attention: str) -> MlmSteps:
        from cram import model

        config = held_out.settings
        how = model.Compilation(
            config.compile, config.backend, precision.autocast(), attention, precision.compile_options()
        )
        # Its own compiled function per length: one graph each, never a recompile of another length's.
        return cls(
            {length: model.make_eval_step(cfg, how) for length in held_out.lengths},
            model.make_eval_step(cfg, how.eager()),
        )


def mlm_canary(held_out: HeldOut, steps: MlmSteps, cfg: ModelConfig, params: dict, device: torch.device) -> Difference:
    """The largest relative difference of the masked-LM loss between each length's compiled step and the
    eager one, on that length's first batch (a length whose blocks fill no batch runs no compiled step);
    inf when one is not finite; an error raised naming the graph."""
    import torch

    from cram.stages.shared.device import to_device
    from cram.stages.shared.precision import Difference, graph_named
    from cram.stages.shared.val_mlm import mask_blocks

    blocks, size, worst = _blocks(held_out), held_out.settings.batch_size, Difference(0.0)
    for length, step in steps.compiled.items():
        rows = _at_length(blocks, length, cfg)[:size]
        if len(rows) < size:
            continue
        batch = mask_blocks(rows, 0, _spec(held_out, length), held_out.settings.seed, held_out.documents)
        batch = {k: to_device(v, device) for k, v in batch.items()}
        name = f"held-out masked LM, length {length}"
        with graph_named(name), torch.no_grad():
            losses = [s(params, batch)["loss"].float() for s in (step, steps.eager)]
        diff = ((losses[0] - losses[1]).abs() / losses[1].abs().clamp(min=1e-6)).double()
        worst = worst.worse(Difference(float(diff) if torch.isfinite(diff) else float("inf"), name))
    return worst


def evaluate_mlm(
    held_out: HeldOut, cfg: ModelConfig, params: dict, device: torch.device, steps: MlmSteps, ctx: Context
) -> dict:
    """Mean loss and accuracy over every masked token of the held-out blocks, masked as pretrain masks
    its held-out blocks (`stages/shared/val_mlm.py`), at each length of `held_out`, with `steps`: the
    first's figures, and every length's under `by_length`."""
    blocks = _blocks(held_out)
    by_length = {
        length: _mlm_at(held_out, steps, params, device, _at_length(blocks, length, cfg), length)
        for length in held_out.lengths
    }
    result = {**by_length[held_out.lengths[0]], "mask_rate": held_out.masking["rate"]}
    if len(by_length) > 1:
        result["by_length"] = {str(length): r for length, r in by_length.items()}
    ctx.log.info("mlm", **{k: v for k, v in result.items() if k != "by_length"})
    return result


def _blocks(held_out: HeldOut) -> np.ndarray:
    import numpy as np

    blocks = np.load(held_out.path, mmap_mode="r")
    if blocks.ndim != 2 or len(blocks) == 0:
        raise StageError(f"{held_out.path}: expected blocks [n, seq_len] with n > 0, got {list(blocks.shape)}")
    return blocks


def _at_length(blocks: np.ndarray, length: int, cfg: ModelConfig) -> np.ndarray:
    """The held-out blocks of `length`; StageError when the model or the data has no such block."""
    from cram.stages.shared.blocks import blocks_of

    check_position(length, cfg.position, cfg.max_seq_len)
    at_length = blocks_of(blocks, length)
    if len(at_length) == 0:
        raise StageError(f"evaluate.mlm_lengths: {length}: pack's val ({blocks.size} tokens) holds no block that long")
    return at_length


def _spec(held_out: HeldOut, length: int) -> MaskSpec:
    from cram.stages.shared.masking import Masking, mask_spec

    return mask_spec(Masking(**held_out.masking), held_out.special, held_out.vocab_size, length)


def _mlm_at(
    held_out: HeldOut, steps: MlmSteps, params: dict, device: torch.device, at_length: np.ndarray, length: int
) -> dict:
    """The held-out masked LM on `at_length`, its blocks of `length`."""
    from cram.stages.shared.val_mlm import val_mlm

    began = time.perf_counter()
    result = val_mlm(
        steps.compiled[length],
        params,
        at_length,
        _spec(held_out, length),
        seed=held_out.settings.seed,
        batch_size=held_out.settings.batch_size,
        device=device,
        tail=steps.eager,  # the last, shorter batch runs eagerly rather than compiling a second graph for one call
        documents=held_out.documents,
    )
    return {**result, "blocks": len(at_length), "time_s": round(time.perf_counter() - began, 3)}
