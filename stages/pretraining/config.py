"""Pretrain's config: what `[pretrain]` in a pipeline file holds, checked as it is read.

`Config` is the whole section, as the file says it: never rewritten (the values a run resolves from it, its
batch and peak lr on the device, the optimizer continuing a checkpoint takes, are `resolved.py`'s);
`Architecture` its `[pretrain.model]`, `Budget` its `[pretrain.budget]`,
`InFp32` its `[pretrain.fp32]`, `Phase` an entry of its `phases`. `stages/pretrain.py` re-exports them
(`pretrain.Config`), and the stage's helpers under `stages/pretraining/` are typed with them.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from cram.model.config import RETIRED, ModelConfig
from cram.model.optimizers import OPTIMIZERS, AdamW, OptimizerConfig
from cram.stages.shared.masking import Masking
from cram.stages.shared.precision import check_canary


@dataclass(frozen=True)
class Phase:
    """An entry of `[pretrain] phases`: blocks of `seq_len` tokens until `until` of the budget's progress
    (the last phase has none: it runs to the end). `microbatch` None: pretrain.microbatch scaled so that
    a microbatch holds as many tokens as at pack's length (`microbatch * pack.seq_len // seq_len`)."""

    seq_len: int
    until: float | None = None
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len: {self.seq_len} must be >= 1")
        if self.until is not None and not 0 < self.until < 1:
            raise ValueError(f"until: {self.until} must be in (0, 1)")
        if self.microbatch is not None and self.microbatch < 1:
            raise ValueError(f"microbatch: {self.microbatch} must be >= 1")


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
Architecture.RETIRED = RETIRED  # the switches model.json no longer holds read as model.json reads them


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
class InFp32:
    """`[pretrain.fp32]`: the batch and peak lr a run takes where its step trains in fp32 (`precision = "fp32"`,
    or "auto" on a CPU without native bf16), in place of `[pretrain]`'s; None: `[pretrain]`'s. Such a CPU
    trains a fraction of the tokens a bf16 one does in the same hours, and few tokens want more, smaller
    steps (bench/README.md, "switches"). The precision `auto` picks decides, not a canary's fall back."""

    microbatch: int | None = None
    batch_size: int | None = None
    lr: float | None = None

    def __post_init__(self) -> None:
        for key in ("microbatch", "batch_size", "lr"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{key}: {value} must be > 0")


@dataclass(frozen=True)
class Config:
    # Settings removed after they won no setting in every seed (issue 46), at the value that computes what
    # the stage now does: a run folder's config.toml written while they existed saves them, and still reads.
    RETIRED: ClassVar[dict[str, object]] = {"average_last": 1}

    model: Architecture = field(default_factory=Architecture)
    optimizer: OptimizerConfig = field(default_factory=AdamW)  # a kind of model/optimizers.py, by its `kind`
    budget: Budget = field(default_factory=Budget)
    fp32: InFp32 = field(default_factory=InFp32)
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
    # batches; a difference above the tolerance (relative in loss and gradient norm, absolute in accuracy)
    # stops the stage before it spends the budget on a miscompiled step. 0: off (and off when compile is false).
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
    # or tokens (>= 1); 0: off. "auto": continued.AUTO_FRACTION where `init`'s checkpoint lacks its head
    # (the stage makes one), none where it brought its own. At the constant lr `head_lr` (0: the peak lr).
    head_warmup: float | Literal["auto"] = "auto"
    head_lr: float = 0.0
    # The peak lr of a run that continues `init`'s checkpoint (continued.peak_lr): a number, or "auto": optimizer.lr
    # capped at the rate measured for continuing such a checkpoint (1.5e-3 * 128 / hidden for a masked-LM
    # encoder, 3.3e-5 for a sentence encoder), so that a from-scratch lr, as above, does not undo it.
    init_lr: float | Literal["auto"] = "auto"
    # The optimizer of a run that continues `init`'s checkpoint (continued.optimizer_kind): one of optimizer.kind's
    # values, or "auto": AdamW, the one continuing was measured with, whatever optimizer.kind a run from scratch
    # takes (the default pipeline's Muon was measured from scratch only).
    init_optimizer: str = "auto"
    # A layout switch that adds parameters `init`'s checkpoint lacks (`pretrain.model.qk_norm`): false refuses
    # it; true makes them as a fresh init does (QK-norm weights 1).
    init_switch_params: bool = False

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
        check_canary(self.canary_steps, self.canary_tolerance)
        for key in ("checkpoint_every_minutes", "checkpoint_every_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}: {getattr(self, key)} must be > 0, or 0 for off")
        if self.batch_size % self.microbatch:
            raise ValueError(f"batch_size: {self.batch_size} must be a multiple of microbatch ({self.microbatch})")
        microbatch, batch_size = self.fp32.microbatch or self.microbatch, self.fp32.batch_size or self.batch_size
        if batch_size % microbatch:
            raise ValueError(
                f"fp32: batch_size {batch_size} must be a multiple of microbatch ({microbatch}) where the step "
                "trains in fp32 ([pretrain.fp32] or [pretrain]'s where it leaves one out)"
            )
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
        if self.init_optimizer not in ("auto", *OPTIMIZERS):
            raise ValueError(f"init_optimizer: {self.init_optimizer!r}: allowed auto, {', '.join(OPTIMIZERS)}")
        self._check_init_settings()

    def _check_init_settings(self) -> None:
        """The settings of continuing `init`'s checkpoint, refused without one whether or not pretrain runs
        (a config check, so a stored pretrain cannot skip it)."""
        if self.init:
            return
        if self.init_lr != "auto":
            raise ValueError(
                f"init_lr: {self.init_lr} is the peak lr of continuing `pretrain.init`'s checkpoint, and the run "
                "has no init: set pretrain.optimizer.lr instead, or pretrain.init"
            )
        if self.init_optimizer != "auto":
            raise ValueError(
                f"init_optimizer: {self.init_optimizer!r} is the optimizer of continuing `pretrain.init`'s checkpoint, "
                "and the run has no init: set pretrain.optimizer.kind instead, or pretrain.init"
            )
        if self.init_switch_params:
            raise ValueError(
                "init_switch_params: true initialises the switches' parameters that `pretrain.init`'s checkpoint "
                "lacks, and the run has no init (a random init makes them all): leave it out, or set pretrain.init"
            )
        if self.head_warmup != "auto" and self.head_warmup:
            raise ValueError(
                f"head_warmup: {self.head_warmup} warms up the masked-LM head of `pretrain.init`'s checkpoint, and "
                "the run has no init (a random init trains head and encoder together): set pretrain.init, or "
                "head_warmup = 0"
            )
