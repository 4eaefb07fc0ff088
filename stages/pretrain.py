"""The pretrain stage: packed blocks in, a masked language model out, trained on a budget.

The budget (hours, steps or tokens, whichever runs out first) defines progress in [0, 1]; the lr
schedule and the batch-size ramp both follow that progress, as in cramming. This module holds the
stage's config, its checks and `run`; under `stages/pretraining/`: what it reads and checks before
training (`setup.py`), its steps, compiled and checked in the precision chosen for them (`steps.py`),
the loop (`loop.py`) and its hooks (`hooks.py`: logging, checkpoints, the divergence check), the training
state (`state.py`), checkpoints (`checkpoint.py`), the batch stream (`batches.py`), the budget clock and
what the ranks agree on (`budget.py`), metrics, progress bar and MFU (`telemetry.py`).

Checkpoints in `checkpoints/step-N/` make the stage resumable: a re-run in the same folder continues
from the newest one, and since batches and masks are functions of (seed, data position) alone, a
resumed CPU run ends bit-identical to an uninterrupted one (for step and token budgets).

Under torchrun every rank runs this stage on its own shard of each global batch; gradients are
averaged inside the compiled step; rank 0 alone writes files.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cram.model.config import ModelConfig, OptimizerConfig
from cram.stages import Context, StageError, Upstream
from cram.stages.pretraining import start
from cram.stages.pretraining.phases import Phase
from cram.stages.pretraining.setup import (
    Setup,
    check_has_tokenizer,
    check_memory,
    check_not_its_own,
    check_schedule,
    planned_model,
    planned_passes,
    prepare,
    warn_of_data_limits,
    warn_of_repeats,
)
from cram.stages.pretraining.steps import compiled_steps, val_loss
from cram.stages.shared import device as devices
from cram.stages.shared import precision as precisions
from cram.stages.shared import pretrained
from cram.stages.shared.masking import Masking

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
NOT_IN_KEY = ("log_every_steps", "checkpoint_every_minutes", "checkpoint_every_steps", "keep_checkpoints", "init")
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
    "model.activation",
    "model.qk_norm",
    "model.value_residual",
    "model.zero_init_out",
)


# vocab_size, max_seq_len and pad_id come from the data; dropout is fine-tuning's (evaluate's); a pooler
# only a checkpoint brings (pretraining never trains one).
_NOT_CONFIGURED_HERE = ("vocab_size", "max_seq_len", "pad_id", "dropout", "pooler")
# `[pretrain.model]`: a preset of `model.PRESETS` and overrides of any other `ModelConfig` field (None:
# the preset's). Made from ModelConfig's fields, so an architecture option is never copied by hand.
Architecture = dataclasses.make_dataclass(
    "Architecture",
    [("preset", str, field(default="tiny"))]
    + [
        (f.name, typing.Optional[typing.get_type_hints(ModelConfig)[f.name]], field(default=None))
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _NOT_CONFIGURED_HERE
    ],
    frozen=True,
)
Architecture.__module__ = __name__  # pickled by name (torchrun workers, tests)
Architecture.__doc__ = "A preset of `model.PRESETS` plus overrides of its `ModelConfig` fields (None: the preset's)."


DEFAULT_HOURS = 3.5 / 60  # the budget when no limit is given at all


@dataclass(frozen=True)
class Budget:
    """Training stops at the first limit reached; a limit left out does not apply.

    With no limit given at all, the budget is `DEFAULT_HOURS` (3.5 minutes). `0` switches a limit off
    (TOML has no null): `--set pretrain.budget.hours=0` drops a file's time limit, say to replay a
    token budget. A limit switched off is stored as None, so `0` and leaving it out share a cache key.
    Every limit given 0 is a zero budget (stored as `tokens = 0`): no step is taken, and the model is
    the one training would start from (`pretrain.init`'s checkpoint), evaluated as it is.
    """

    hours: float | None = None
    steps: int | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        limits = {"hours": self.hours, "steps": self.steps, "tokens": self.tokens}
        if all(v is None for v in limits.values()):
            object.__setattr__(self, "hours", DEFAULT_HOURS)
            return
        for key, value in limits.items():
            if value is not None and value < 0:
                raise ValueError(f"{key}: {value} must be > 0, or 0 for no {key} limit")
        zero = all(not value for value in limits.values())
        for key, value in limits.items():
            if value == 0:
                object.__setattr__(self, key, None)
        if zero:
            object.__setattr__(self, "tokens", 0)


@dataclass(frozen=True)
class Config:
    model: Architecture = field(default_factory=Architecture)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    budget: Budget = field(default_factory=Budget)
    masking: Masking = field(default_factory=Masking)
    schedule: str = "budget-triangle"  # a name in model.SCHEDULES
    schedule_args: dict[str, float] = field(default_factory=dict)  # e.g. {warmup = 0.1}
    # The schedule's decay (model/schedules.py): its shape ("": the schedule's own) and the fraction
    # of the peak it ends at, e.g. schedule = "wsd", decay_shape = "1-sqrt", decay_to = 0.02 (mmBERT's).
    decay_shape: Literal["", "linear", "cosine", "1-sqrt"] = ""
    decay_to: float = 0.0
    microbatch: int = 32  # sequences per rank per forward/backward; its shape never changes within a phase
    batch_size: int = 32  # target global batch in sequences, reached by the ramp (cramming: 8192)
    ramp: float = 0.6  # fraction of the budget at which batch_size is reached; 0: from the start
    # Sequence-length phases, e.g. [{seq_len = 128, until = 0.9}, {seq_len = 512}]: each phase trains on
    # blocks of its length until `until` of the budget's progress (the last: to the end); microbatch and
    # batch_size (in sequences of pack.seq_len) scale to hold the same tokens. Empty: pack's length throughout.
    phases: tuple[Phase, ...] = ()
    # A token attends only to the tokens of its own document in a packed block (the batch carries
    # `document_ids`, counted from pack's boundary tokens). False: to the whole block.
    document_attention: bool = False
    compile: bool = True
    backend: str = "inductor"
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA and on CPUs with native bf16
    log_every_steps: int = 20
    checkpoint_every_minutes: float = 10.0  # 0: off (the end of training still writes one)
    checkpoint_every_steps: int = 0  # 0: off
    keep_checkpoints: int = 2
    val_blocks: int = 256  # held-out blocks for the loss before and after training; 0: skip
    prefetch: int = 4  # microbatches read ahead
    # Before the budget clock: this many steps compiled and eagerly from the same state on the same
    # batches; a relative difference in loss, accuracy or gradient norm above the tolerance stops the
    # stage before it spends the budget on a miscompiled step. 0: off (and off when compile is false).
    canary_steps: int = 2
    canary_tolerance: float = 0.02
    # torchrun with an hours budget: rank 0's clock is broadcast every this many steps, extrapolated between
    clock_sync_every_steps: int = 10
    # An existing encoder to start from instead of a random init (stages/shared/pretrained.py): a transformers
    # model folder (ModernBERT, BERT, RoBERTa), a cram export or a run directory. The architecture is the
    # checkpoint's (`[pretrain.model]` may only repeat it), its tokenizer the default of `tokenize.tokenizer`,
    # its files' contents part of the cache key; the optimizer starts fresh. "": the preset's random init.
    init: str = ""
    # The masked-LM head alone first, the encoder frozen (stages/pretraining/head_warmup.py), then the whole
    # model with a fresh AdamW and its lr schedule over the rest of the budget: a fraction of the budget (< 1)
    # or tokens (>= 1); 0: off. "auto": head_warmup.AUTO_FRACTION where `init`'s checkpoint lacks its head
    # (the stage makes one), none where it brought its own. At the constant lr `head_lr` (0: the peak lr).
    head_warmup: float | Literal["auto"] = "auto"
    head_lr: float = 0.0
    # The peak lr of a run that continues `init`'s checkpoint (start.peak_lr): a number, or "auto": optimizer.lr
    # capped at the rate measured for continuing such a checkpoint (1.5e-3 * 128 / hidden for a masked-LM
    # encoder, 3.3e-5 for a sentence encoder), so that a from-scratch lr, as above, does not undo it.
    init_lr: float | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        positive = {
            "microbatch": self.microbatch,
            "batch_size": self.batch_size,
            "log_every_steps": self.log_every_steps,
            "keep_checkpoints": self.keep_checkpoints,
            "prefetch": self.prefetch,
            "clock_sync_every_steps": self.clock_sync_every_steps,
        }
        for key, value in positive.items():
            if not value > 0:
                raise ValueError(f"{key}: {value} must be > 0")
        if self.canary_steps < 0 or not self.canary_tolerance > 0:
            raise ValueError(
                f"canary_steps, canary_tolerance: {self.canary_steps}, {self.canary_tolerance} must be >= 0 and > 0"
            )
        for key in ("checkpoint_every_minutes", "checkpoint_every_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}: {getattr(self, key)} must be > 0, or 0 for off")
        if self.batch_size % self.microbatch:
            raise ValueError(f"batch_size: {self.batch_size} must be a multiple of microbatch ({self.microbatch})")
        if not 0 <= self.ramp <= 1:
            raise ValueError(f"ramp: {self.ramp} must be in [0, 1]")
        if not 0 <= self.decay_to < 1:
            raise ValueError(f"decay_to: {self.decay_to} must be in [0, 1) (a fraction of the peak lr)")
        if self.schedule == "constant" and (self.decay_shape or self.decay_to):
            raise ValueError("decay_shape, decay_to: schedule 'constant' has no decay for them to shape")
        if self.val_blocks < 0:
            raise ValueError(f"val_blocks: {self.val_blocks} must be >= 0")
        warmup = self.head_warmup
        if warmup != "auto" and (warmup < 0 or (warmup >= 1 and warmup != int(warmup))):
            raise ValueError(
                f"head_warmup: {warmup} must be a fraction of the budget in [0, 1), a whole number of tokens, or 'auto'"
            )
        if self.head_lr < 0:
            raise ValueError(f"head_lr: {self.head_lr} must be > 0, or 0 for the peak lr")
        if self.init_lr != "auto" and not self.init_lr > 0:
            raise ValueError(f"init_lr: {self.init_lr} must be > 0, or 'auto'")


def fingerprint(config: Config) -> list[list[str]] | None:
    """The contents of `init`'s checkpoint, which the stage's output depends on; None without one. One
    that cannot be found gives its error instead: `validate` reports it."""
    if not config.init:
        return None
    try:
        return pretrained.fingerprint(pretrained.locate(Path(config.init)))
    except pretrained.PretrainedError as e:
        return [["unavailable", f"pretrain.init: {e}"]]


def key_config(config: Config) -> Config:
    """The config as the key sees it: `head_warmup` as it runs, "auto" (left out of the key) where none
    runs, so that a run without a warm-up keeps the key it had before the option existed; `optimizer.lr`
    the peak it trains at (`start.resolved`). A checkpoint that cannot be read leaves it as given: `validate`
    names the problem."""
    try:
        runs = start.warmup_setting(config)
        config = start.resolved(config)
    except StageError:
        return config
    return dataclasses.replace(config, head_warmup=runs or "auto")


def validate(config: Config, pipeline: Any) -> None:
    """What `run` would reject before training, checked by the runner before the first stage runs, with
    no torch: the model preset and overrides, or `init`'s checkpoint and what it must agree with (at the
    vocab size that tokenize is set to make and the longest phase's length), the phases, the schedule and
    its arguments, a masking rate or schedule that masks no token of a phase's blocks."""
    from cram import model

    if config.init:
        check_not_its_own(config, Path(pipeline.run.root) / pipeline.run.name)
        check_has_tokenizer(config, pipeline.stages.get("tokenize"))
    elif config.init_lr != "auto":
        raise StageError(
            f"pretrain.init_lr: {config.init_lr} is the peak lr of continuing `pretrain.init`'s checkpoint, and the "
            "run has no init: set pretrain.optimizer.lr instead, or pretrain.init"
        )
    _, cfg = planned_model(config, pipeline)
    check_schedule(model, config)
    start.check_head_warmup(config, cfg, pipeline.stages.get("pack"))


def validate_runtime(config: Config, pipeline: Any) -> None:
    """What `validate` leaves to a stage that runs in this invocation, since it loads torch: the device,
    the compile backend, and a model and microbatch that cannot fit in the device's memory (in any phase)."""
    plan, cfg = planned_model(config, pipeline)
    devices.check(pipeline.run.device)
    devices.check_backend(config.backend, "pretrain.backend")
    for span in plan.spans:
        check_memory(config, cfg, span, pipeline.run.device)


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    import torch

    from cram.stages.pretraining.batches import PhaseStream
    from cram.stages.pretraining.loop import train
    from cram.stages.pretraining.telemetry import ProgressBar, peak_flops

    given, config = config.optimizer.lr, start.resolved(config)
    if config.init and ctx.is_main:
        ctx.log.info("continuing", init=config.init, peak_lr=config.optimizer.lr, optimizer_lr=given)
    setup = prepare(config, inputs["pack"], ctx)
    if ctx.is_main:
        warn_of_data_limits(config, setup, ctx)
    made = start.made_head(config)
    # A head made for a zero budget never trains: no held-out loss of it means anything.
    measured = config.val_blocks > 0 and not (made and config.budget.tokens == 0)
    setup = dataclasses.replace(setup, warmup=start.warmup_of(config, setup.model))
    state = start.start(config, setup, out_dir, ctx)
    data = PhaseStream(
        setup.blocks, setup.plan, seed=ctx.seed, rank=ctx.rank, world_size=ctx.world_size, depth=config.prefetch,
        pin=setup.device.type == "cuda", waited_s=state.data_wait_s,
    )  # fmt: skip
    # One graph per phase shape, each compiled before the budget clock: a further one is a bug, not a
    # silent fall back to eager.
    recompiles = torch._dynamo.config.patch(recompile_limit=setup.plan.shapes, fail_on_recompile_limit_hit=True)
    with recompiles, data:
        setup, steps, choice, compile_s = compiled_steps(config, setup, ctx, state, data)
        if ctx.is_main and measured and state.val_loss_start is None:
            state.val_loss_start = val_loss(config, setup, state.params)
        if ctx.is_main:  # measured on a CPU, which takes seconds: before the budget clock starts
            peak_flops(setup.device, setup.autocast)
        with ProgressBar(ctx.is_main) as bar:
            hooks = _hooks(config, ctx, steps, out_dir, bar, last_saved=state.step)
            train(config, ctx, steps, state, data, hooks, setup.warmup)

    outputs = {
        "params": "params.safetensors",
        "model_config": "model.json",
        "metrics": "metrics.jsonl",
        "checkpoints": "checkpoints",
        "masking": dataclasses.asdict(config.masking),
        "seq_lens": setup.plan.lengths,
        "document_attention": config.document_attention,
        "peak_lr": config.optimizer.lr,
        **({"head_initialised": made} if made else {}),
        # The budget's progress at which the whole model began training after the head's warm-up.
        **({"head_warmup_until": state.full_start} if setup.warmup else {}),
    }
    if not ctx.is_main:
        return outputs
    if setup.warmup and state.full_start is None:
        ctx.log.warning("the budget ended within pretrain.head_warmup: only the masked-LM head trained")
    if planned_passes(config, setup, ctx.world_size) is None:  # a time budget: the passes are known now
        warn_of_repeats(setup.plan.position(state) / setup.blocks.size, len(setup.blocks), ctx, "made")
    _write_model(out_dir / outputs["params"], out_dir / outputs["model_config"], setup, state)
    figures = _figures(config, setup, ctx, state, compile_s, choice, measured)
    ctx.log.info("trained", **figures)
    ctx.metrics.log(state.step, figures, prefix="final/")
    return {**outputs, **figures}


def _hooks(config: Config, ctx: Context, steps: Steps, out_dir: Path, bar: ProgressBar, last_saved: int) -> list[Hook]:
    """The loop's side jobs, in the order they run: the divergence check, the report, checkpoints (rank 0)."""
    from cram.stages.pretraining.hooks import Checkpointer, DivergenceCheck, Report
    from cram.stages.pretraining.telemetry import MetricsLog

    hooks: list[Hook] = [
        DivergenceCheck(config.log_every_steps, out_dir / "checkpoints"),
        Report(config, ctx, steps, MetricsLog(out_dir / "metrics.jsonl"), bar),
    ]
    if ctx.is_main:
        hooks.append(Checkpointer(config, out_dir / "checkpoints", last_saved, ctx.log))
    return hooks


def _write_model(params_path: Path, config_path: Path, setup: Setup, state: TrainState) -> None:
    from cram.stages.pretraining import checkpoint

    checkpoint.write_tensors(params_path, state.saved_params())
    config_path.write_text(json.dumps(dataclasses.asdict(setup.model), indent=1) + "\n")


def _figures(
    config: Config,
    setup: Setup,
    ctx: Context,
    state: TrainState,
    compile_s: float,
    choice: precisions.Choice,
    measured: bool,
) -> dict[str, Any]:
    """The stage's results: losses, throughput, what training cost."""
    from cram import model
    from cram.stages.pretraining.telemetry import mfu

    elapsed_s = state.elapsed_s
    tokens_per_s = state.tokens_seen / elapsed_s if elapsed_s else 0.0
    flops_per_token = state.flops_seen / state.tokens_seen if state.tokens_seen else 0.0
    return {
        "final_loss": state.loss_end,
        "loss_start": state.loss_start,
        "val_loss_start": state.val_loss_start,
        "val_loss_end": val_loss(config, setup, state.params) if measured else None,
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        "flops_seen": state.flops_seen,  # model FLOPs: a budget that carries across hardware
        "wall_s": round(elapsed_s, 3),
        "compile_s": round(compile_s, 3),
        "canary_diff": choice.canary_diff,
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": mfu(flops_per_token, tokens_per_s, setup.device, ctx.world_size, setup.autocast),
        "precision": setup.precision.name,
        "precision_reason": choice.reason,
        "data_wait": round(state.data_wait_s / elapsed_s, 4) if elapsed_s else 0.0,
        "num_params": model.num_params(state.params),
    }
