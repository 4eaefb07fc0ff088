"""The pretrain stage: packed blocks in, a masked language model out, trained on a budget.

The budget (hours, steps or tokens, whichever runs out first) defines progress in [0, 1]; the lr
schedule and the batch-size ramp both follow that progress, as in cramming. This module holds the
stage's checks and `run`; under `stages/pretraining/`: its config (`config.py`, what the TOML says), the
values a run resolves from it once (`resolved.py`: batch, optimizer, peak lr), what it reads and checks
before training (`setup.py`), continuing a checkpoint (`continued.py`), its steps, compiled and checked in
the precision chosen for them (`steps.py`), the loop (`loop.py`) and its hooks (`hooks.py`: logging,
checkpoints, the divergence check), the training state (`state.py`), checkpoints (`checkpoint.py`), the
batch stream (`batches.py`), the budget clock and what the ranks agree on (`budget.py`), metrics,
progress bar and MFU (`telemetry.py`).

Checkpoints in `checkpoints/step-N/` make the stage resumable: a re-run in the same folder continues
from the newest one, and since batches and masks are functions of (seed, data position) alone, a
resumed CPU run ends bit-identical to an uninterrupted one (for step and token budgets).

Under torchrun every rank runs this stage on its own shard of each global batch; gradients are
averaged inside the compiled step; rank 0 alone writes files.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cram.stages import Context, Pipeline, StageError, Upstream
from cram.stages.pretraining import continued, start

# The stage's config, re-exported: `pretrain.Config` is what the pipeline file's `[pretrain]` becomes.
from cram.stages.pretraining.config import DEFAULT_HOURS, Architecture, Budget, Config, InFp32, Phase  # noqa: F401
from cram.stages.pretraining.resolved import Batch, Resolved
from cram.stages.pretraining.setup import (
    Setup,
    check_memory,
    check_schedule,
    planned_model,
    planned_passes,
    prepare,
    warn_of_data_limits,
    warn_of_repeats,
)
from cram.stages.pretraining.steps import Compiled, compiled_steps, val_loss
from cram.stages.shared import device as devices

if TYPE_CHECKING:
    from cram.stages.pretraining.loop import Hook, Steps
    from cram.stages.pretraining.state import TrainState
    from cram.stages.pretraining.telemetry import ProgressBar

NAME = "pretrain"
VERSION = "4"
UPSTREAM = ("pack",)
RESUMABLE = True
DISTRIBUTED = True  # the runner calls `run` on every rank
# How often it logs and checkpoints changes what it reports, not what it computes: not in the cache key,
# so changing them keeps a finished result and resumes an interrupted one. Nor is where `init`'s checkpoint
# lies: its contents are (`fingerprint`), so the same checkpoint moved or copied keeps the key.
NOT_IN_KEY = (
    "log_every_steps",
    "checkpoint_every_minutes",
    "checkpoint_every_steps",
    "keep_checkpoints",
    "init",
)
# Options added after the stage's key was fixed: at their default they are left out of it (planning.keyed_config).
NEW_OPTIONS = (
    "model.local_attention",
    "model.global_every",
    "model.local_rope_theta",
    "model.linear_bias",
    "model.post_norm",
    "model.position_offset",
    "model.token_types",
    "model.decoder_bias",
    "phases",
    "masking.end_rate",
    "document_attention",
    "optimizer.kind",
    "decay_shape",
    "decay_to",
    "masking.phase_rates",
    "head_warmup",
    "head_lr",
    "init_lr",
    "init_optimizer",
    "model.qk_norm",
    "model.zero_init_out",
    "init_switch_params",
    "fp32",
)


def fingerprint(config: Config) -> list[list[str]] | None:
    """The contents of `init`'s checkpoint, which the stage's output depends on (`continued.fingerprint`)."""
    return continued.fingerprint(config.init)


def key_config(config: Config) -> Config:
    """The config as the key sees it, under the TOML's names: `optimizer` the kind and peak lr the run trains
    at (`continued.optimizer_kind`, `continued.peak_lr`), with `init_lr` and `init_optimizer` "auto" (left out
    of the key), so that the same training asked for either way is one key; `head_warmup` as it runs, "auto"
    (left out) where none runs, so that a run without a warm-up keeps the key it had before the option
    existed. A checkpoint that cannot be read leaves it as given: `validate` names the problem. Both as
    `init`'s files give them: a head that measures untrained at the start changes them as a function of what
    the key holds (continued.py's docstring). A run reads them from `resolved.Resolved`, never from here."""
    try:
        runs = continued.warmup_setting(config)
        peak = continued.peak_lr(config, config.optimizer.lr)
        kind = continued.optimizer_kind(config)
    except StageError:
        return config
    return dataclasses.replace(
        config,
        optimizer=config.optimizer.as_kind(kind, lr=peak),
        init_lr="auto",
        init_optimizer="auto",
        head_warmup=runs or "auto",
    )


def validate(config: Config, pipeline: Pipeline) -> None:
    """What `run` would reject before training, checked by the runner before the first stage runs, with
    no torch: the model preset and overrides, or `init`'s checkpoint and what it must agree with (at the
    vocab size that tokenize is set to make and the longest phase's length), the phases, the schedule and
    its arguments, a masking rate or schedule that masks no token of a phase's blocks."""
    from cram import model

    if config.init:
        continued.check_not_its_own(config.init, Path(pipeline.run.root) / pipeline.run.name)
        continued.check_has_tokenizer(config.init, pipeline.stages.get("tokenize"))
    _, cfg = planned_model(config, Batch.given(config), pipeline)
    check_schedule(model, config)
    continued.check_head_warmup(config, cfg, pipeline.stages.get("pack"))


def validate_runtime(config: Config, pipeline: Pipeline) -> None:
    """What `validate` leaves to a stage that runs in this invocation, since it loads torch: the device,
    the compile backend, and a model and microbatch (this device's: `Batch.on`) that cannot fit in the
    device's memory (in any phase)."""
    devices.check(pipeline.run.device)
    devices.check_backend(config.backend, "pretrain.backend")
    plan, cfg = planned_model(config, Batch.on(config, pipeline.run.device), pipeline)
    for span in plan.spans:
        check_memory(config.precision, cfg, span, pipeline.run.device)


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    import torch

    from cram.stages.pretraining.batches import Feed, PhaseStream
    from cram.stages.pretraining.loop import Course, train
    from cram.stages.pretraining.telemetry import ProgressBar, peak_flops

    batch = Batch.on(config, ctx.device)
    setup = prepare(config, batch, inputs["pack"], ctx)
    if ctx.is_main:
        if batch.by_fp32:
            ctx.log.info("fp32 step", by="pretrain.fp32", batch_size=batch.batch_size, lr=batch.lr)
        warn_of_data_limits(config, setup, ctx)
    resolved, state = start.start(config, batch, setup, out_dir, ctx)
    if config.init and ctx.is_main:
        kind, peak = resolved.optimizer.kind, resolved.peak_lr
        ctx.log.info("continuing", init=config.init, peak_lr=peak, optimizer_lr=batch.lr, optimizer=kind)
    # A head made for a zero budget never trains: no held-out loss of it means anything.
    measured = config.val_blocks > 0 and not (resolved.made_head and config.budget.tokens == 0)
    feed = Feed(ctx.seed, ctx.rank, ctx.world_size, config.prefetch, pin=setup.device.type == "cuda")
    data = PhaseStream(setup.blocks, setup.plan, feed, waited_s=state.data_wait_s)
    # One graph per phase shape, each compiled before the budget clock: a further one is a bug, not a
    # silent fall back to eager.
    recompiles = torch._dynamo.config.patch(recompile_limit=setup.plan.shapes, fail_on_recompile_limit_hit=True)
    with recompiles, data:
        compiled = compiled_steps(config, resolved, setup, ctx, state, data)
        setup, steps = compiled.setup, compiled.steps
        if ctx.is_main and measured and state.val_loss_start is None:
            state.val_loss_start = val_loss(setup, state.params, config.val_blocks)
        if ctx.is_main:  # measured on a CPU, which takes seconds: before the budget clock starts
            peak_flops(setup.device, setup.autocast)
        with ProgressBar(ctx.is_main) as bar:
            hooks = _hooks(config, ctx, steps, out_dir, bar, last_saved=state.step)
            train(Course.of(config, resolved.peak_lr, resolved.warmup), ctx, steps, state, data, hooks)

    outputs = _outputs(config, resolved, setup, state)
    if not ctx.is_main:
        return outputs
    if resolved.warmup and state.full_start is None:
        ctx.log.warning("the budget ended within pretrain.head_warmup: only the masked-LM head trained")
    if planned_passes(config, setup, ctx.world_size) is None:  # a time budget: the passes are known now
        warn_of_repeats(setup.plan.position(state) / setup.blocks.size, len(setup.blocks), ctx, "made")
    _write_model(out_dir / outputs["params"], out_dir / outputs["model_config"], setup, state)
    figures = _figures(compiled, ctx, state, config.val_blocks if measured else 0)
    ctx.log.info("trained", **figures)
    ctx.metrics.log(state.step, figures, prefix="final/")
    return {**outputs, **figures}


def _outputs(config: Config, resolved: Resolved, setup: Setup, state: TrainState) -> dict[str, Any]:
    """What every rank returns: the files written, and what later stages read of how the model was trained."""
    made = list(resolved.made_head)
    return {
        "params": "params.safetensors",
        "model_config": "model.json",
        "metrics": "metrics.jsonl",
        "checkpoints": "checkpoints",
        "masking": dataclasses.asdict(config.masking),
        "seq_lens": setup.plan.lengths,
        "document_attention": config.document_attention,
        "peak_lr": resolved.peak_lr,
        "batch_size": resolved.batch.batch_size,  # the target global batch, `[pretrain.fp32]`'s where it applied
        **({"head_initialised": made} if made else {}),
        # The budget's progress at which the whole model began training after the head's warm-up.
        **({"head_warmup_until": state.full_start} if resolved.warmup else {}),
    }


def _hooks(config: Config, ctx: Context, steps: Steps, out_dir: Path, bar: ProgressBar, last_saved: int) -> list[Hook]:
    """The loop's side jobs, in the order they run: the divergence check, the report, checkpoints (rank 0)."""
    from cram.stages.pretraining.hooks import Checkpointer, Checkpointing, DivergenceCheck, Report
    from cram.stages.pretraining.telemetry import MetricsLog

    hooks: list[Hook] = [
        DivergenceCheck(config.log_every_steps, out_dir / "checkpoints"),
        Report(config.log_every_steps, ctx, steps, MetricsLog(out_dir / "metrics.jsonl"), bar),
    ]
    if ctx.is_main:
        every = Checkpointing.of(config)
        hooks.append(Checkpointer(every, config.budget, out_dir / "checkpoints", last_saved, ctx.log))
    return hooks


def _write_model(params_path: Path, config_path: Path, setup: Setup, state: TrainState) -> None:
    from cram.stages.pretraining import checkpoint

    checkpoint.write_tensors(params_path, state.saved_params())
    config_path.write_text(json.dumps(dataclasses.asdict(setup.model), indent=1) + "\n")


def _figures(compiled: Compiled, ctx: Context, state: TrainState, val_blocks: int) -> dict[str, Any]:
    """The stage's results: losses, throughput, what training cost; the held-out loss on `val_blocks`
    blocks (0: none); the verdict on `init`'s own masked-LM head where it was measured (`init_head`)."""
    from cram import model
    from cram.stages.pretraining.telemetry import hardware_flops, mfu

    setup, elapsed_s, head = compiled.setup, state.elapsed_s, state.init_head_loss
    tokens_per_s = state.tokens_seen / elapsed_s if elapsed_s else 0.0
    flops_per_token = state.flops_seen / state.tokens_seen if state.tokens_seen else 0.0
    hardware_per_token = hardware_flops(state) / state.tokens_seen if state.tokens_seen else 0.0
    hfu = mfu(hardware_per_token, tokens_per_s, setup.device, ctx.world_size, setup.autocast)  # before MFU: see hooks
    return {
        "final_loss": state.loss_end,
        "loss_start": state.loss_start,
        "val_loss_start": state.val_loss_start,
        "val_loss_end": val_loss(setup, state.params, val_blocks) if val_blocks else None,
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        "flops_seen": state.flops_seen,  # model FLOPs: a budget that carries across hardware
        "wall_s": round(elapsed_s, 3),
        "compile_s": round(compiled.compile_s, 3),
        "canary_diff": compiled.choice.canary_diff,
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": mfu(flops_per_token, tokens_per_s, setup.device, ctx.world_size, setup.autocast),
        "hfu": hfu,  # hardware FLOPs utilisation: the optimizer's matmuls (Muon's Newton-Schulz) counted too
        **({"init_head": continued.head_figure(head, setup.model.vocab_size)} if head is not None else {}),
        "precision": setup.precision.name,
        "precision_reason": compiled.choice.reason,
        "data_wait": round(state.data_wait_s / elapsed_s, 4) if elapsed_s else 0.0,
        "num_params": model.num_params(state.params),
    }
