"""The pretrain stage: packed blocks in, a masked language model out, trained on a budget.

The budget (hours, steps or tokens, whichever runs out first) defines progress in [0, 1]; the lr
schedule and the batch-size ramp both follow that progress, as in cramming. This module holds the
stage's config, its checks and `run`; under `stages/pretraining/`: the loop (`loop.py`) and its hooks
(`hooks.py`: logging, checkpoints, the divergence check), the training state (`state.py`), checkpoints
(`checkpoint.py`), the batch stream (`batches.py`), the budget clock and what the ranks agree on
(`budget.py`), metrics, progress bar and MFU (`telemetry.py`).

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
from cram.stages.pretraining.phases import Phase, Plan, Span
from cram.stages.pretraining.phases import plan as plan_phases
from cram.stages.shared import device as devices
from cram.stages.shared import precision as precisions
from cram.stages.shared import pretrained
from cram.stages.shared.masking import Masking, MaskSpec, mask_spec

if TYPE_CHECKING:
    import numpy as np
    import torch

    from cram.stages.pretraining.batches import PhaseStream
    from cram.stages.pretraining.loop import Hook, Steps
    from cram.stages.pretraining.state import Params, TrainState
    from cram.stages.pretraining.telemetry import ProgressBar
    from cram.stages.shared.blocks import Boundary

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
)


# vocab_size, max_seq_len and pad_id come from the data; dropout is fine-tuning's (evaluate's).
_NOT_CONFIGURED_HERE = ("vocab_size", "max_seq_len", "pad_id", "dropout")
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
        if self.val_blocks < 0:
            raise ValueError(f"val_blocks: {self.val_blocks} must be >= 0")


def fingerprint(config: Config) -> list[list[str]] | None:
    """The contents of `init`'s checkpoint, which the stage's output depends on; None without one. One
    that cannot be found gives its error instead: `validate` reports it."""
    if not config.init:
        return None
    try:
        return pretrained.fingerprint(pretrained.locate(Path(config.init)))
    except pretrained.PretrainedError as e:
        return [["unavailable", f"pretrain.init: {e}"]]


def validate(config: Config, pipeline: Any) -> None:
    """What `run` would reject before training, checked by the runner before the first stage runs, with
    no torch: the model preset and overrides, or `init`'s checkpoint and what it must agree with (at the
    vocab size that tokenize is set to make and the longest phase's length), the phases, the schedule and
    its arguments, a masking rate or schedule that masks no token of a phase's blocks."""
    from cram import model

    if config.init:
        _check_not_its_own(config, Path(pipeline.run.root) / pipeline.run.name)
        _check_has_tokenizer(config, pipeline.stages.get("tokenize"))
    _planned_model(config, pipeline)
    _check_schedule(model, config)


def validate_runtime(config: Config, pipeline: Any) -> None:
    """What `validate` leaves to a stage that runs in this invocation, since it loads torch: the device,
    the compile backend, and a model and microbatch that cannot fit in the device's memory (in any phase)."""
    plan, cfg = _planned_model(config, pipeline)
    devices.check(pipeline.run.device)
    devices.check_backend(config.backend, "pretrain.backend")
    for span in plan.spans:
        _check_memory(config, cfg, span, pipeline.run.device)


def _planned_model(config: Config, pipeline: Any) -> tuple[Plan, ModelConfig]:
    """The phases and the model as the stage will make them, from the config of the stages before it."""
    from cram import model

    tokenize, pack = pipeline.stages.get("tokenize"), pipeline.stages.get("pack")
    preset = model.PRESETS.get(config.model.preset)
    vocab_size, special = _tokenizer_facts(tokenize, preset)
    seq_len = pack.seq_len if pack is not None else getattr(preset, "max_seq_len", 0)
    plan = plan_phases(config, seq_len, special, vocab_size)
    return plan, _model_config(model, config, vocab_size, plan.chunk, special["pad"])


def _check_not_its_own(config: Config, run_dir: Path) -> None:
    """Refuse an `init` that is the run's own directory, or lies in it or in the entry its pretrain links
    to: the stage would start from its own result, so its key (which holds init's contents) would change
    with every result and each identical `cram run` would train again."""
    import os

    init = Path(config.init).expanduser()
    inside = [Path(os.path.abspath(run_dir)), Path(os.path.realpath(run_dir)), Path(os.path.realpath(run_dir / NAME))]
    seen = (Path(os.path.abspath(init)), Path(os.path.realpath(init)))
    if any(path == folder or folder in path.parents for path in seen for folder in inside):
        raise StageError(
            f"pretrain.init: {config.init} is this run's own directory ({run_dir}) or inside it: pretrain would "
            "start from its own result and train again at every run; give another run directory or an export"
        )


def _check_has_tokenizer(config: Config, tokenize: Any) -> None:
    """A checkpoint that is there, and a tokenizer for it: its own (tokenize's default), or one given."""
    from cram.stages.shared.tokenizer import FILE_NAMES as tokenizer_files

    _pretrained(config)
    if tokenize is not None and not tokenize.tokenizer:
        raise StageError(
            f"pretrain.init: {config.init} holds no tokenizer ({' or '.join(tokenizer_files)}) and "
            "tokenize.tokenizer is not set; a tokenizer trained anew would not match the checkpoint's "
            "embeddings: set tokenize.tokenizer to the one the checkpoint was trained with"
        )


def _tokenizer_facts(tokenize: Any, preset: ModelConfig | None) -> tuple[int, dict[str, int]]:
    """(vocab size, special ids) that tokenize is set to make: a given tokenizer's, or those it trains."""
    from cram.stages.shared.special import SPECIAL_IDS

    if tokenize is None:
        return getattr(preset, "vocab_size", 0), dict(SPECIAL_IDS)
    if not tokenize.tokenizer:
        return tokenize.vocab_size, dict(SPECIAL_IDS)
    from cram.stages.shared.tokenizer import TokenizerError, load

    try:
        found = load(Path(tokenize.tokenizer))
    except TokenizerError as e:
        raise StageError(f"tokenize.tokenizer: {e}") from None
    return found.vocab_size, found.special_ids


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    import torch

    from cram.stages.pretraining.batches import PhaseStream
    from cram.stages.pretraining.loop import train
    from cram.stages.pretraining.telemetry import ProgressBar, peak_flops

    setup = _setup(config, inputs["pack"], ctx)
    if ctx.is_main:
        _warn_of_data_limits(config, setup, ctx)
    state = _start(config, setup, out_dir, ctx)
    data = PhaseStream(
        setup.blocks,
        setup.plan,
        seed=ctx.seed,
        rank=ctx.rank,
        world_size=ctx.world_size,
        depth=config.prefetch,
        pin=setup.device.type == "cuda",
        waited_s=state.data_wait_s,
    )
    # One graph per phase shape, each compiled before the budget clock: a further one is a bug, not a
    # silent fall back to eager.
    recompiles = torch._dynamo.config.patch(recompile_limit=setup.plan.shapes, fail_on_recompile_limit_hit=True)
    with recompiles, data:
        setup, steps, choice, compile_s = _compiled_steps(config, setup, ctx, state, data)
        if ctx.is_main and config.val_blocks and state.val_loss_start is None:
            state.val_loss_start = _val_loss(config, setup, state.params)
        if ctx.is_main:  # measured on a CPU, which takes seconds: before the budget clock starts
            peak_flops(setup.device, setup.autocast)
        with ProgressBar(ctx.is_main) as bar:
            hooks = _hooks(config, ctx, steps, out_dir, bar, last_saved=state.step)
            train(config, ctx, steps, state, data, hooks)

    outputs = {
        "params": "params.safetensors",
        "model_config": "model.json",
        "metrics": "metrics.jsonl",
        "checkpoints": "checkpoints",
        "masking": dataclasses.asdict(config.masking),
        "seq_lens": setup.plan.lengths,
        "document_attention": config.document_attention,
    }
    if not ctx.is_main:
        return outputs
    if _planned_passes(config, setup, ctx.world_size) is None:  # a time budget: the passes are known now
        _warn_of_repeats(setup.plan.position(state) / setup.blocks.size, len(setup.blocks), ctx, "made")
    _write_model(out_dir / outputs["params"], out_dir / outputs["model_config"], setup, state)
    figures = _figures(config, setup, ctx, state, compile_s, choice)
    ctx.log.info("trained", **figures)
    ctx.metrics.log(state.step, figures, prefix="final/")
    return {**outputs, **figures}


@dataclass(frozen=True)
class _Setup:
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


def _setup(config: Config, pack: Upstream, ctx: Context) -> _Setup:
    """The packed data and the model config, checked; what `StageError`s a bad config or input raises."""
    import numpy as np

    from cram import model
    from cram.stages.shared.blocks import blocks_of, boundary

    blocks = np.load(pack.path("train"), mmap_mode="r")
    val = np.load(pack.path("val"), mmap_mode="r")
    seq_len, special = int(pack.outputs["seq_len"]), pack.outputs["special_ids"]
    vocab_size = int(pack.outputs["vocab_size"])  # the tokenizer's: a checkpoint may have more embedding rows
    _check_data(blocks, val, seq_len, pack)
    _check_schedule(model, config)
    if config.batch_size % (ctx.world_size * config.microbatch):
        raise StageError(
            f"pretrain.batch_size: {config.batch_size} must be a multiple of microbatch x ranks "
            f"({ctx.world_size * config.microbatch})"
        )
    plan = plan_phases(config, seq_len, special, vocab_size, ctx.world_size)
    cfg = _model_config(model, config, vocab_size, plan.chunk, special["pad"])
    plan = plan.with_flops(lambda span: _flops_per_token(model, cfg, span))
    first = plan.spans[0].seq_len
    spec = mask_spec(config.masking, special, vocab_size, first)  # random replacements are real tokens
    device = devices.resolve(ctx.device)
    precision = precisions.candidates(config.precision, device, config.backend, config.compile)[0]
    documents = boundary(pack.outputs["boundary"], special) if config.document_attention else None
    return _Setup(blocks, blocks_of(val, first), cfg, plan, spec, documents, device, precision, ctx.attention)


def _flops_per_token(model, cfg: ModelConfig, span: Span) -> float:
    """Model FLOPs per token of a phase: attention's share grows with its length."""
    return model.flops_per_token(
        dataclasses.replace(cfg, max_seq_len=span.seq_len), span.spec.per_sequence / span.seq_len
    )


MAX_PASSES = 4  # more passes over the training blocks than this: a warning that the data is too small


def _warn_of_data_limits(config: Config, setup: _Setup, ctx: Context) -> None:
    """Say when the data holds less than the config asks for: fewer held-out blocks than `val_blocks`,
    or so few training blocks that a step or token budget passes over them many times."""
    if config.val_blocks > len(setup.val):
        ctx.log.warning(
            f"pretrain.val_blocks = {config.val_blocks}, but pack's val holds {len(setup.val)} blocks: "
            f"the held-out loss uses those {len(setup.val)}"
        )
    passes = _planned_passes(config, setup, ctx.world_size)
    if passes is not None:
        _warn_of_repeats(passes, len(setup.blocks), ctx, "makes about")


def _planned_passes(config: Config, setup: _Setup, world_size: int) -> float | None:
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


def _warn_of_repeats(passes: float, blocks: int, ctx: Context, verb: str) -> None:
    if passes > MAX_PASSES:
        ctx.log.warning(
            f"the budget {verb} {passes:.1f} passes over the {blocks} training blocks (more than "
            f"{MAX_PASSES}): each block is seen that often; a larger corpus or a smaller budget repeats less"
        )


def _start(config: Config, setup: _Setup, out_dir: Path, ctx: Context) -> TrainState:
    """The state of the newest checkpoint (the one rank 0 sees, on every rank), or a fresh one (the init's,
    which a checkpoint would only repeat), on the device. Rank 0's metrics.jsonl loses the lines written
    after that state (a killed run's), all of them on a fresh start."""
    from cram import model
    from cram.stages.pretraining import checkpoint
    from cram.stages.pretraining.state import TrainState
    from cram.stages.pretraining.telemetry import MetricsLog
    from cram.stages.shared.collectives import agree_on

    resume_from = agree_on(checkpoint.latest(out_dir / "checkpoints", ctx.log), ctx.world_size)
    if resume_from is None:
        params = _pretrained_params(config, ctx) if config.init else model.init(setup.model, ctx.seed)
        state = TrainState(seed=ctx.seed, params=params, opt_state=model.adamw_init(params))
    else:
        params, opt_state, counters = checkpoint.load(resume_from)
        state = TrainState.from_json(counters, params, opt_state)
        if state.seed != ctx.seed:
            raise StageError(f"{resume_from}: saved with seed {state.seed}, the run has seed {ctx.seed}")
        ctx.log.info("resume", checkpoint=str(resume_from), step=state.step, elapsed_s=state.elapsed_s)
    state.params = {k: v.to(setup.device) for k, v in state.params.items()}
    state.opt_state = {k: v.to(setup.device) for k, v in state.opt_state.items()}
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        MetricsLog(out_dir / "metrics.jsonl").truncate(state.step)
    return state


def _pretrained_params(config: Config, ctx: Context) -> Params:
    import time

    started = time.perf_counter()
    found = _pretrained(config)
    try:
        _, params = pretrained.load(found)
    except pretrained.PretrainedError as e:
        raise StageError(f"pretrain.init: {e}") from None
    ctx.log.info("init", checkpoint=str(found.folder), kind=found.kind, seconds=round(time.perf_counter() - started, 2))
    return params


def _make_steps(config: Config, setup: _Setup, world_size: int, compile: bool) -> Steps:
    """The training steps, compiled or eager. One microbatch per step (no ramp to grow): the whole step is
    one graph. Otherwise two graphs, accumulate (per microbatch) and apply (per step), since a graph cannot
    loop over a varying count."""
    import torch

    from cram import model
    from cram.stages.pretraining.loop import Steps

    reduce_grads = model.make_grad_all_reduce(world_size) if world_size > 1 else None
    single = all(span.batch_size == world_size * span.microbatch for span in setup.plan.spans)
    how = dict(compile=compile, backend=config.backend, options=setup.precision.compile_options())
    forward = dict(autocast_dtype=setup.autocast, attention=setup.attention)
    whole = accumulate = apply = None
    if single:
        whole = model.make_train_step(setup.model, config.optimizer, reduce_grads=reduce_grads, **how, **forward)
    else:
        accumulate = model.make_accumulate_step(setup.model, **how, **forward)
        apply = model.make_apply_step(config.optimizer, reduce_grads=reduce_grads, **how)
    generator = torch.Generator(device=setup.device)
    return Steps(whole, accumulate, apply, generator, setup.device, setup.autocast, setup.documents)


def _val_loss(config: Config, setup: _Setup, params: Params) -> float:
    """The held-out MLM loss on the first `val_blocks` blocks, masked as evaluate masks them. Two forward
    passes over a few hundred blocks are not worth a compile."""
    from cram import model
    from cram.stages.shared.val_mlm import MASK_SEED, val_mlm

    evaluate = model.make_eval_step(
        setup.model, compile=False, autocast_dtype=setup.autocast, attention=setup.attention
    )
    return val_mlm(
        evaluate,
        params,
        setup.val[: config.val_blocks],
        setup.spec,
        seed=MASK_SEED,
        batch_size=setup.plan.spans[0].microbatch,
        device=setup.device,
        documents=setup.documents,
    )["loss"]


def _compiled_steps(
    config: Config, setup: _Setup, ctx: Context, state: TrainState, data: PhaseStream
) -> tuple[_Setup, Steps, precisions.Choice, float]:
    """The training steps in the precision they will train in, and the seconds spent compiling them.

    Before the budget clock, unless the steps are eager or the budget is spent: each candidate precision
    (`precision.candidates`) is compiled for every phase's shape and, with the canary on, checked against
    eager steps at the first phase's; the first that agrees is kept (`precision.choose`)."""
    from cram.stages.pretraining.budget import progress

    if not config.compile or not progress(config.budget, state, state.elapsed_s) < 1:
        why = "eager steps" if not config.compile else "the budget is spent"
        choice = precisions.unchecked(config.precision, setup.device, f"{why}: no compile canary")
        setup = dataclasses.replace(setup, precision=choice.precision)
        return setup, _make_steps(config, setup, ctx.world_size, compile=config.compile), choice, 0.0
    built: dict[precisions.Precision, tuple[_Setup, Steps]] = {}
    compile_s = 0.0

    def check(candidate: precisions.Precision) -> float:
        nonlocal compile_s
        trial = dataclasses.replace(setup, precision=candidate)
        built[candidate] = trial, _make_steps(config, trial, ctx.world_size, compile=True)
        compile_s += _warm_up(setup, built[candidate][1], state)
        diff = _canary(config, ctx, trial, built[candidate][1], state, data)
        ctx.log.info("canary", precision=candidate.label, steps=config.canary_steps, max_relative_diff=diff)
        return diff

    if config.canary_steps:
        choice = precisions.choose(
            config.precision, setup.device, config.backend, check, config.canary_tolerance, ctx.log, NAME
        )
    else:
        choice = precisions.unchecked(config.precision, setup.device, "canary_steps = 0: not checked against eager")
        check(choice.precision)
    setup, steps = built[choice.precision]
    return setup, steps, choice, compile_s


def _warm_up(setup: _Setup, steps: Steps, state: TrainState) -> float:
    """Compile `steps` for every phase's shape; return seconds."""
    from cram.stages.shared.blocks import blocks_of

    shapes = {(s.microbatch, s.seq_len, s.spec.per_sequence): s for s in setup.plan.spans}
    return sum(
        steps.warm_up(state.params, state.opt_state, blocks_of(setup.blocks, s.seq_len), s.microbatch, s.spec)
        for s in shapes.values()
    )


def _canary(config: Config, ctx: Context, setup: _Setup, steps: Steps, state: TrainState, data: PhaseStream) -> float:
    """The compiled steps' largest relative difference from eager steps in the same precision; 0 when
    the canary is off."""
    from cram.stages.pretraining.loop import canary

    if not config.canary_steps:
        return 0.0
    eager = _make_steps(config, setup, ctx.world_size, compile=False)
    return canary(config, ctx, steps, eager, state.params, state.opt_state, data)


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


def _write_model(params_path: Path, config_path: Path, setup: _Setup, state: TrainState) -> None:
    from cram.stages.pretraining import checkpoint

    checkpoint.write_tensors(params_path, state.params)
    config_path.write_text(json.dumps(dataclasses.asdict(setup.model), indent=1) + "\n")


def _figures(
    config: Config,
    setup: _Setup,
    ctx: Context,
    state: TrainState,
    compile_s: float,
    choice: precisions.Choice,
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
        "val_loss_end": _val_loss(config, setup, state.params) if config.val_blocks else None,
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


def _model_config(model, config: Config, vocab_size: int, seq_len: int, pad_id: int) -> ModelConfig:
    if config.init:
        return _checkpoint_config(config, vocab_size, seq_len, pad_id)
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


def _pretrained(config: Config):
    try:
        return pretrained.locate(Path(config.init))
    except pretrained.PretrainedError as e:
        raise StageError(f"pretrain.init: {e}") from None


def _checkpoint_config(config: Config, vocab_size: int, seq_len: int, pad_id: int) -> ModelConfig:
    """`init`'s architecture, checked against `[pretrain.model]`, the tokenizer and the block length; its
    weights are read from the files' headers only."""
    try:
        cfg, _ = pretrained.load(_pretrained(config), shapes_only=True)
    except pretrained.PretrainedError as e:
        raise StageError(f"pretrain.init: {e}") from None
    if config.model.preset != Architecture().preset:
        raise StageError(
            f"pretrain.model.preset: {config.model.preset!r}, but the architecture is pretrain.init's "
            f"checkpoint ({config.init}); leave the preset out"
        )
    for key, value in dataclasses.asdict(config.model).items():
        if key != "preset" and value is not None and value != getattr(cfg, key):
            raise StageError(
                f"pretrain.model.{key}: {value!r} contradicts the checkpoint's {getattr(cfg, key)!r} "
                f"(pretrain.init = {config.init}); leave it out"
            )
    if vocab_size > cfg.vocab_size:
        raise StageError(
            f"tokenize.tokenizer: {vocab_size:,} tokens, more than the {cfg.vocab_size:,} embedding rows of "
            f"pretrain.init's checkpoint ({config.init}): it is not the tokenizer the checkpoint was trained with"
        )
    if cfg.position == "learned" and seq_len > cfg.max_seq_len:
        raise StageError(
            f"pack.seq_len: {seq_len} is beyond the {cfg.max_seq_len} positions of pretrain.init's "
            f"checkpoint ({config.init})"
        )
    try:
        return dataclasses.replace(cfg, pad_id=pad_id)
    except ValueError as e:
        raise StageError(f"pretrain.init: {e}") from None


# Refused only past this share of the device's memory: the estimate is rough, and a config that
# may just fit is left to try rather than refused.
MEMORY_SHARE = 0.9


def _check_memory(config: Config, cfg: ModelConfig, span: Span, device_name: str) -> None:
    """StageError when one training step's estimated peak (`model.training_memory`) in the phase `span`
    clearly exceeds the device's memory, naming the estimate, the memory and the settings that lower it."""
    from cram import model

    device = devices.resolve(device_name)
    autocast = devices.autocast_dtype(config.precision, device) is not None
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


def _check_schedule(model, config: Config) -> None:
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
