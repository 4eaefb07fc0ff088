"""The pretrain stage's training steps: made compiled or eager, compiled for every phase's shape before
the budget clock, and checked against eager steps by the canary in each candidate precision until one
agrees (`stages/shared/precision.py`); and the eager held-out loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cram.stages import Context
from cram.stages.pretraining.config import Config
from cram.stages.pretraining.resolved import Resolved
from cram.stages.pretraining.setup import Setup
from cram.stages.shared import precision as precisions

if TYPE_CHECKING:
    from cram.model.step import Compilation
    from cram.stages.pretraining import loop
    from cram.stages.pretraining.batches import PhaseStream
    from cram.stages.pretraining.loop import Steps
    from cram.stages.pretraining.state import Params, TrainState


@dataclass(frozen=True)
class Compiled:
    """The training steps in the precision they train in: the `setup` of that precision, the `steps`, how
    the precision was chosen, and the seconds spent compiling before the budget clock."""

    setup: Setup
    steps: Steps
    choice: precisions.Choice
    compile_s: float = 0.0


def make_steps(resolved: Resolved, setup: Setup, how: Compilation, world_size: int) -> Steps:
    """The training steps of `resolved.optimizer`, run as `how` says (compiled or eager), and with a head
    warm-up (`resolved.warmup`) the head's own as `head`. One microbatch per step (no ramp to grow): the whole
    step is one graph. Otherwise two graphs, accumulate (per microbatch) and apply (per step), since a graph
    cannot loop over a varying count."""
    import torch

    from cram import model
    from cram.stages.pretraining.loop import Steps

    reduce_grads = model.make_grad_all_reduce(world_size) if world_size > 1 else None
    single = all(span.batch_size == world_size * span.microbatch for span in setup.plan.spans)
    optimizer = resolved.optimizer
    generator = torch.Generator(device=setup.device)

    def training(trained: tuple[str, ...] | None) -> Steps:
        whole = accumulate = apply = None
        if single:
            whole = model.make_train_step(setup.model, optimizer, how, reduce_grads=reduce_grads, trained=trained)
        else:
            accumulate = model.make_accumulate_step(setup.model, how, trained=trained)
            apply = model.make_apply_step(optimizer, how, reduce_grads=reduce_grads)
        steps = Steps(whole, accumulate, apply, generator, setup.device, setup.autocast, setup.documents, trained)
        if trained is None:  # a head trained alone has no hidden matrix for Muon
            steps.optimizer_flops = model.optimizer_flops(setup.model, optimizer)
        return steps

    steps = training(None)
    if resolved.warmup is not None:
        steps.head = training(resolved.warmup.names)
    return steps


def val_loss(setup: Setup, params: Params, blocks: int) -> float:
    """The held-out MLM loss on the first `blocks` held-out blocks, masked as evaluate masks them. Two forward
    passes over a few hundred blocks are not worth a compile."""
    from cram import model
    from cram.stages.shared.val_mlm import MASK_SEED, val_mlm

    evaluate = model.make_eval_step(setup.model, setup.compilation(compile=False))
    return val_mlm(
        evaluate,
        params,
        setup.val[:blocks],
        setup.spec,
        seed=MASK_SEED,
        batch_size=setup.plan.spans[0].microbatch,
        device=setup.device,
        documents=setup.documents,
    )["loss"]


def compiled_steps(
    config: Config, resolved: Resolved, setup: Setup, ctx: Context, state: TrainState, data: PhaseStream
) -> Compiled:
    """The training steps (of `resolved`'s optimizer and warm-up) in the precision they will train in, and the
    seconds spent compiling them.

    Before the budget clock, unless the steps are eager or the budget is spent: each candidate precision
    (`precision.candidates`) is compiled for every phase's shape and, with the canary on, checked against
    eager steps at the first phase's; the first that agrees is kept (`precision.choose`)."""
    from cram.stages.pretraining.budget import progress
    from cram.stages.pretraining.loop import Canary

    if not config.compile or not progress(config.budget, state, state.elapsed_s) < 1:
        why = "eager steps" if not config.compile else "the budget is spent"
        choice = precisions.unchecked(config.precision, setup.device, f"{why}: no compile canary")
        setup = dataclasses.replace(setup, precision=choice.precision)
        how = setup.compilation(config.compile, config.backend)
        return Compiled(setup, make_steps(resolved, setup, how, ctx.world_size), choice)
    built: dict[precisions.Precision, tuple[Setup, Steps]] = {}
    compile_s = 0.0

    def build(candidate: precisions.Precision) -> tuple[Setup, Steps]:
        nonlocal compile_s
        trial = dataclasses.replace(setup, precision=candidate)
        built[candidate] = trial, make_steps(resolved, trial, trial.compilation(True, config.backend), ctx.world_size)
        compile_s += _warm_up(setup, built[candidate][1], state)
        return built[candidate]

    def check(candidate: precisions.Precision) -> float:
        trial, steps = build(candidate)
        eager = make_steps(resolved, trial, trial.compilation(False), ctx.world_size)
        diff = _canary(Canary(config.canary_steps, resolved.peak_lr), ctx, (steps, eager), state, data)
        ctx.log.info("canary", precision=candidate.label, steps=config.canary_steps, max_relative_diff=diff)
        return diff

    if config.canary_steps:
        canary = precisions.Canary(check, config.canary_tolerance, "pretrain", ctx.world_size)
        choice = precisions.choose(config.precision, setup.device, config.backend, canary, ctx.log, "pretrain")
    else:
        choice = precisions.unchecked(config.precision, setup.device, "canary_steps = 0: not checked against eager")
        build(choice.precision)
    return Compiled(*built[choice.precision], choice, compile_s)


def _warm_up(setup: Setup, steps: Steps, state: TrainState) -> float:
    """Compile `steps` (and the head's) for every phase's shape; return seconds."""
    from cram.stages.shared.blocks import blocks_of

    shapes = {(s.microbatch, s.seq_len, s.spec.per_sequence): s for s in setup.plan.spans}
    return sum(
        each.warm_up(state.params, state.opt_state, blocks_of(setup.blocks, s.seq_len), s.microbatch, s.spec)
        for each in _modes(steps)
        for s in shapes.values()
    )


def _canary(run: loop.Canary, ctx: Context, steps: tuple[Steps, Steps], state: TrainState, data: PhaseStream) -> float:
    """The compiled steps' largest relative difference from the eager steps in the same precision (`steps`:
    compiled, eager; the head's and the whole model's, with a warm-up), over `run.steps` steps at its lr."""
    from cram.stages.pretraining.loop import canary

    compiled, eager = steps
    return max(canary(run, ctx, c, e, state, data) for c, e in zip(_modes(compiled), _modes(eager)))


def _modes(steps: Steps) -> list[Steps]:
    return [steps] if steps.head is None else [steps.head, steps]
