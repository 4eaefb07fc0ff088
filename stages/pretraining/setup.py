"""What the pretrain stage reads and checks before it trains: the configured model against the
tokenizer (or `init`'s checkpoint: `continued.py`), the packed data and the device's memory (`validate`,
`validate_runtime`), and the `Setup` that `run` derives from pack's outputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cram.model.config import ModelConfig
from cram.stages import Context, Pipeline, StageError, Upstream
from cram.stages.pretraining import continued
from cram.stages.pretraining.config import Config
from cram.stages.pretraining.phases import Plan, Span
from cram.stages.pretraining.phases import plan as plan_phases
from cram.stages.pretraining.resolved import Batch
from cram.stages.shared import device as devices
from cram.stages.shared import precision as precisions
from cram.stages.shared.masking import MaskSpec, mask_spec

if TYPE_CHECKING:
    import numpy as np
    import torch

    from cram.model.step import Compilation
    from cram.stages import tokenize as tokenize_stage
    from cram.stages.shared.blocks import Boundary


def planned_model(config: Config, batch: Batch, pipeline: Pipeline) -> tuple[Plan, ModelConfig]:
    """The phases at `batch` and the model as the stage will make them, from the config of the stages
    before it."""
    from cram import model

    tokenize, pack = pipeline.stages.get("tokenize"), pipeline.stages.get("pack")
    preset = model.PRESETS.get(config.model.preset)
    vocab_size, special = _tokenizer_facts(tokenize, preset)
    seq_len = pack.seq_len if pack is not None else (preset.max_seq_len if preset is not None else 0)
    plan = plan_phases(config, seq_len, special, vocab_size, batch=batch)
    return plan, _model_config(model, config, vocab_size, plan.chunk, special["pad"])


def _tokenizer_facts(tokenize: tokenize_stage.Config | None, preset: ModelConfig | None) -> tuple[int, dict[str, int]]:
    """(vocab size, special ids) that tokenize is set to make: a given tokenizer's, or those it trains."""
    from cram.stages.shared.special import SPECIAL_IDS

    if tokenize is None:
        return (preset.vocab_size if preset is not None else 0), dict(SPECIAL_IDS)
    if not tokenize.tokenizer:
        return tokenize.vocab_size, dict(SPECIAL_IDS)
    from cram.stages.shared.tokenizer import TokenizerError, load

    try:
        found = load(Path(tokenize.tokenizer))
    except TokenizerError as e:
        raise StageError(f"tokenize.tokenizer: {e}") from None
    return found.vocab_size, found.special_ids


@dataclass(frozen=True)
class Setup:
    """What `run` reads and derives before training: the data, the model, its masking and device."""

    blocks: np.ndarray  # [blocks, seq_len] integers, memory-mapped: the training data
    val: np.ndarray  # held out, as blocks of the first phase's length
    model: ModelConfig  # at the data's vocabulary and the longest phase's length
    plan: Plan  # the sequence-length phases
    spec: MaskSpec  # the held-out masking, at the first phase's length
    documents: Boundary | None  # attention within documents: pack's boundary token
    device: torch.device
    precision: precisions.Precision  # the configured one's first candidate, until the canary chooses
    attention: str = "auto"  # `[run] attention`: how attention is computed

    @property
    def autocast(self) -> torch.dtype | None:
        """The forward's autocast dtype; None: fp32."""
        return self.precision.autocast()

    def compilation(self, compile: bool, backend: str = "inductor") -> Compilation:
        """How the steps run in this precision and attention: compiled by `backend`, or eagerly."""
        from cram.model.step import Compilation

        return Compilation(compile, backend, self.autocast, self.attention, self.precision.compile_options())


def prepare(config: Config, batch: Batch, pack: Upstream, ctx: Context) -> Setup:
    """The packed data, the phases at `batch` and the model config, checked; what `StageError`s a bad config
    or input raises."""
    import numpy as np

    from cram import model
    from cram.stages.shared.blocks import blocks_of, boundary

    blocks = np.load(pack.path("train"), mmap_mode="r")
    val = np.load(pack.path("val"), mmap_mode="r")
    seq_len, special = int(pack.outputs["seq_len"]), pack.outputs["special_ids"]
    vocab_size = int(pack.outputs["vocab_size"])  # the tokenizer's: a checkpoint may have more embedding rows
    _check_data(blocks, val, seq_len, pack)
    check_schedule(model, config)
    if batch.batch_size % (ctx.world_size * batch.microbatch):
        raise StageError(
            f"pretrain.batch_size: {batch.batch_size} must be a multiple of microbatch x ranks "
            f"({ctx.world_size * batch.microbatch})"
        )
    plan = plan_phases(config, seq_len, special, vocab_size, ctx.world_size, batch=batch)
    cfg = _model_config(model, config, vocab_size, plan.chunk, special["pad"])
    plan = plan.with_flops(lambda span, encoder_trained: _flops_per_token(model, cfg, span, encoder_trained))
    first = plan.spans[0].seq_len
    spec = mask_spec(config.masking, special, vocab_size, first)  # random replacements are real tokens
    device = devices.resolve(ctx.device)
    precision = precisions.candidates(config.precision, device, config.backend, config.compile)[0]
    documents = boundary(pack.outputs["boundary"], special) if config.document_attention else None
    return Setup(blocks, blocks_of(val, first), cfg, plan, spec, documents, device, precision, ctx.attention)


def _flops_per_token(model, cfg: ModelConfig, span: Span, encoder_trained: bool) -> float:
    """Model FLOPs per token of a phase: attention's share grows with its length."""
    return model.flops_per_token(
        dataclasses.replace(cfg, max_seq_len=span.seq_len), span.spec.per_sequence / span.seq_len, encoder_trained
    )


MAX_PASSES = 4  # more passes over the training blocks than this: a warning that the data is too small


def warn_of_data_limits(config: Config, setup: Setup, ctx: Context) -> None:
    """Say when the data holds less than the config asks for: fewer held-out blocks than `val_blocks`,
    or so few training blocks that a step or token budget passes over them many times."""
    if config.val_blocks > len(setup.val):
        ctx.log.warning(
            f"pretrain.val_blocks = {config.val_blocks}, but pack's val holds {len(setup.val)} blocks: "
            f"the held-out loss uses those {len(setup.val)}"
        )
    passes = planned_passes(config, setup, ctx.world_size)
    if passes is not None:
        warn_of_repeats(passes, len(setup.blocks), ctx, "makes about")


def planned_passes(config: Config, setup: Setup, world_size: int) -> float | None:
    """The passes over the training blocks that the step or token budget makes, the batch ramp (and the
    phases) averaged over (at most) 10,000 points; None for a time budget alone, whose steps depend on
    the speed."""
    from cram.stages.pretraining.loop import micro_steps

    budget = config.budget
    tokens = [] if budget.tokens is None else [budget.tokens]
    if budget.steps is not None:
        points, total = min(budget.steps, 10_000), 0
        for i in range(points):
            span = setup.plan.span_at(i / points)
            rank_tokens = span.microbatch * span.seq_len
            total += (
                micro_steps(i / points, config.ramp, span.batch_size // (world_size * span.microbatch)) * rank_tokens
            )
        tokens.append(budget.steps * total / points * world_size)
    return min(tokens) / setup.blocks.size if tokens else None


def warn_of_repeats(passes: float, blocks: int, ctx: Context, verb: str) -> None:
    if passes > MAX_PASSES:
        ctx.log.warning(
            f"the budget {verb} {passes:.1f} passes over the {blocks} training blocks (more than "
            f"{MAX_PASSES}): each block is seen that often; a larger corpus or a smaller budget repeats less"
        )


def _model_config(model, config: Config, vocab_size: int, seq_len: int, pad_id: int) -> ModelConfig:
    if config.init:
        return continued.architecture(config, vocab_size, seq_len, pad_id)
    arch = config.model
    if arch.preset not in model.PRESETS:
        raise StageError(f"pretrain.model.preset: {arch.preset!r} is not one of {', '.join(model.PRESETS)}")
    overrides = {k: v for k, v in dataclasses.asdict(arch).items() if k != "preset" and v is not None}
    try:
        return dataclasses.replace(
            model.PRESETS[arch.preset], vocab_size=vocab_size, max_seq_len=seq_len, pad_id=pad_id, **overrides
        )
    except (TypeError, ValueError) as e:
        raise StageError(f"pretrain.model: {e}") from None


# Refused only past this share of the device's memory: the estimate is rough, and a config that
# may just fit is left to try rather than refused.
MEMORY_SHARE = 0.9


def check_memory(precision: str, cfg: ModelConfig, span: Span, device_name: str) -> None:
    """StageError when one training step's estimated peak (`model.training_memory`) in the phase `span`, in
    `precision` (`pretrain.precision`), clearly exceeds the device's memory, naming the estimate, the memory
    and the settings that lower it."""
    from cram import model

    device = devices.resolve(device_name)
    autocast = devices.autocast_dtype(precision, device) is not None
    at_length = dataclasses.replace(cfg, max_seq_len=span.seq_len)
    need = model.training_memory(at_length, span.microbatch, span.microbatch * span.spec.per_sequence, autocast)
    have = devices.memory_bytes(device)
    if need.total > MEMORY_SHARE * have:
        gib = 2**30
        raise StageError(
            f"pretrain: a training step needs about {need.total / gib:,.1f} GiB ({need.state / gib:,.1f} GiB "
            f"parameters, AdamW state and gradients of {model.parameter_count(cfg):,} parameters, "
            f"{need.activations / gib:,.1f} GiB activations of microbatch {span.microbatch}), more than "
            f"{MEMORY_SHARE:.0%} of the {have / gib:,.1f} GiB of {device}; lower pretrain.microbatch, "
            "or pretrain.model.hidden, layers or intermediate"
        )


def check_schedule(model, config: Config) -> None:
    if config.schedule not in model.SCHEDULES:
        raise StageError(f"pretrain.schedule: {config.schedule!r} is not one of {', '.join(model.SCHEDULES)}")
    try:
        model.lr_schedule(config.schedule, 0.5, **config.schedule_args)
    except (TypeError, ValueError) as e:
        raise StageError(f"pretrain.schedule_args: {e}") from None


def _check_data(train, val, seq_len: int, pack: Upstream) -> None:
    for name, blocks in (("train", train), ("val", val)):
        if blocks.ndim != 2 or blocks.shape[1] != seq_len or blocks.dtype.kind not in "iu":
            raise StageError(
                f"{pack.path(name)}: shape {blocks.shape} {blocks.dtype}; expected [blocks, {seq_len}] integers"
            )
    if len(train) == 0:
        raise StageError(f"{pack.path('train')}: no blocks to train on")
