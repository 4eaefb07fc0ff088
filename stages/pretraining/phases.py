"""Sequence-length phases: train on short blocks for most of the budget, then on longer ones.

Pack cuts one contiguous stream of shuffled documents into blocks, so blocks of any length are a
reshape of the same tokens (`batches.blocks_of`): nothing is packed again. The stream's unit is the
chunk, a block of the longest phase's length, which every phase's length divides. Epochs permute
chunks; a phase of length L reads each chunk as `chunk / L` consecutive sequences. A phase starts at
the chunk boundary after the last token its predecessor read, so phases never re-read within a pass,
and the data position is exact: (`phase`, `phase_start` in tokens, `sequences` read in the phase).
With no phases (or one at pack's length) the chunk is pack's block: today's stream, bit for bit.

Each phase has its own static shapes (its microbatch, its length and its masked rows), hence its own
compiled graph, declared up front: `Plan.shapes` graphs, compiled before the budget clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cram.stages import StageError
from cram.stages.pretraining.config import Config, Phase
from cram.stages.shared.masking import Masking, MaskSpec, mask_spec, masked_per_sequence

if TYPE_CHECKING:
    from cram.stages.pretraining.resolved import Batch
    from cram.stages.pretraining.state import TrainState


@dataclass(frozen=True)
class Span:
    """A phase as the loop runs it: from `start` to `until` (1.0: the end) of the budget's progress."""

    seq_len: int
    start: float
    until: float
    microbatch: int  # sequences per rank per forward/backward
    batch_size: int  # the global batch the ramp reaches, in sequences
    spec: MaskSpec  # K: the masked rows at the phase's highest masking rate
    flops_per_token: float = 0.0  # filled in by `Plan.with_flops` (the model's count needs torch)
    head_flops_per_token: float = 0.0  # the same, while the head trains alone (a head warm-up)


@dataclass(frozen=True)
class Plan:
    """The phases of a run, in order, and how each reads the stream and masks its blocks."""

    spans: tuple[Span, ...]
    chunk: int  # the stream's unit in tokens: the longest phase's length
    masking: Masking

    @property
    def lengths(self) -> list[int]:
        """The lengths trained at, each once, in training order."""
        return list(dict.fromkeys(s.seq_len for s in self.spans))

    @property
    def shapes(self) -> int:
        """The compiled graphs a step needs: one per distinct (microbatch, length, masked rows)."""
        return len({(s.microbatch, s.seq_len, s.spec.per_sequence) for s in self.spans})

    def span_at(self, progress: float) -> Span:
        return next((s for s in self.spans if progress < s.until), self.spans[-1])

    def spec_at(self, span: Span, progress: float) -> MaskSpec:
        """The span's masking at `progress`: with a masking schedule, the rows below the current rate are labelled."""
        if self.masking.end_rate is None:
            return span.spec
        labelled = round(self.masking.rate_at(progress) * span.seq_len)
        return dataclasses.replace(span.spec, labelled=min(span.spec.per_sequence, max(1, labelled)))

    def position(self, state: TrainState) -> int:
        """The data position of `state`, in tokens of the stream."""
        return state.phase_start + state.sequences * self.spans[state.phase].seq_len

    def first_sequence(self, state: TrainState) -> int:
        """The index of the next sequence in the stream of the current phase's length."""
        return self.position(state) // self.spans[state.phase].seq_len

    def with_flops(self, per_token: Callable[[Span, bool], float]) -> Plan:
        """`per_token(span, encoder_trained)`: the model's FLOPs per token of a span, whole or head alone."""
        spans = tuple(
            dataclasses.replace(s, flops_per_token=per_token(s, True), head_flops_per_token=per_token(s, False))
            for s in self.spans
        )
        return dataclasses.replace(self, spans=spans)


def enter(plan: Plan, state: TrainState, progress: float) -> None:
    """Move `state` into the phase that `progress` falls in (a phase that ended before any step is
    skipped); the new phase reads from the next chunk boundary on."""
    while progress >= plan.spans[state.phase].until:
        end = plan.position(state)
        state.phase_start = -(-end // plan.chunk) * plan.chunk
        state.sequences = 0
        state.phase += 1


def plan(
    config: Config,
    pack_seq_len: int,
    special: dict[str, int],
    vocab_size: int,
    world_size: int = 1,
    *,
    batch: Batch | None = None,
) -> Plan:
    """The phases of `config` over pack's blocks of `pack_seq_len` at `batch` (None: `[pretrain]`'s), checked:
    one line naming the key when they cannot run (the order of `until`, a length, a microbatch, a masking rate)."""
    phases = config.phases or (Phase(pack_seq_len),)
    _check_order(phases)
    rates = config.masking.phase_rates
    if rates and len(rates) != len(phases):
        raise StageError(
            f"pretrain.masking.phase_rates: {len(rates)} rates for {len(phases)} phase(s) (pretrain.phases; "
            "none: one at pack's length); give one rate per phase"
        )
    chunk = max(p.seq_len for p in phases)
    sequences = (batch.microbatch, batch.batch_size) if batch else (config.microbatch, config.batch_size)
    spans, start = [], 0.0
    for i, phase in enumerate(phases):
        key = f"pretrain.phases[{i}]"
        if chunk % phase.seq_len:
            raise StageError(f"{key}.seq_len: {phase.seq_len} must divide the longest phase's {chunk}")
        until = 1.0 if phase.until is None else phase.until
        microbatch = phase.microbatch or _scaled(sequences[0], pack_seq_len, phase.seq_len, f"{key}.microbatch")
        batch_size = _scaled(sequences[1], pack_seq_len, phase.seq_len, "pretrain.batch_size")
        if batch_size % (world_size * microbatch):
            raise StageError(
                f"{key}.microbatch: {microbatch} x {world_size} rank(s) must divide the phase's batch of "
                f"{batch_size} sequences (pretrain.batch_size scaled to seq_len {phase.seq_len})"
            )
        spec = _spec(config.masking, special, vocab_size, phase.seq_len, start, until, i)
        spans.append(Span(phase.seq_len, start, until, microbatch, batch_size, spec))
        start = until
    return Plan(tuple(spans), chunk, config.masking)


def _check_order(phases: tuple[Phase, ...]) -> None:
    for i, phase in enumerate(phases):
        last = i == len(phases) - 1
        if last != (phase.until is None):
            need = "has no until (it runs to the end)" if last else "needs until, the progress where it ends"
            raise StageError(f"pretrain.phases[{i}].until: {phase.until}; the {'last' if last else 'phase'} {need}")
        if i and not last and phase.until <= phases[i - 1].until:
            raise StageError(
                f"pretrain.phases[{i}].until: {phase.until} must be above the previous phase's {phases[i - 1].until}"
            )


def _scaled(sequences: int, pack_seq_len: int, seq_len: int, key: str) -> int:
    """`sequences` of pack's length as sequences of `seq_len` holding the same tokens."""
    tokens = sequences * pack_seq_len
    if tokens % seq_len or tokens < seq_len:
        raise StageError(
            f"{key}: {sequences} x {pack_seq_len} tokens (pack.seq_len) is not a whole number of "
            f"{seq_len}-token sequences; set the phase's microbatch or change pretrain.microbatch/batch_size"
        )
    return tokens // seq_len


def _spec(
    masking: Masking, special: dict[str, int], vocab_size: int, seq_len: int, start: float, until: float, index: int
) -> MaskSpec:
    """The phase's masking: K rows at its highest rate (its own rate with `phase_rates`); its lowest rate
    must still mask a token."""
    if masking.phase_rates:
        own = dataclasses.replace(masking, rate=masking.phase_rates[index])
        return mask_spec(own, special, vocab_size, seq_len, f"pretrain.masking.phase_rates[{index}]")
    spec = mask_spec(masking, special, vocab_size, seq_len)
    if masking.end_rate is None:
        return spec
    low, high = sorted(round(masking.rate_at(p), 9) for p in (start, until))  # without float noise in a message
    masked_per_sequence(low, seq_len, "pretrain.masking.end_rate")
    return dataclasses.replace(spec, per_sequence=masked_per_sequence(high, seq_len, "pretrain.masking.rate"))
