"""Pretrain's run-time values, each resolved once under a name of its own: the batch the run trains at
(`Batch`), and the optimizer, peak lr, head warm-up and made head params it trains with (`Resolved`).
`Config` stays what the TOML says: `config.optimizer.lr` is the lr the file asks for, wherever it is read.

What changes them, in the order they resolve: the device (`Batch.on`: `[pretrain.fp32]`'s batch and lr where
the step trains in fp32), `init`'s checkpoint (its continuation rate and optimizer: `continued.py`) and the
verdict on the checkpoint's own masked-LM head, measured at the start (`start.py`). The batch is known
before the data is planned, the rest once the verdict is: `Resolved` carries the `Batch` it was made from.
The key holds the values the files alone give, under the TOML's names (`pretrain.key_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cram.model.config import ModelConfig
from cram.model.optimizers import OptimizerConfig
from cram.stages.pretraining import continued
from cram.stages.pretraining.config import Config, InFp32
from cram.stages.pretraining.head_warmup import HeadWarmup
from cram.stages.shared import device as devices


@dataclass(frozen=True)
class Batch:
    """The batch a run trains at on its device, and the peak lr asked for with it (before continuing a
    checkpoint caps it): `[pretrain]`'s, or `[pretrain.fp32]`'s where the step trains in fp32 (`by_fp32`)."""

    microbatch: int
    batch_size: int
    lr: float
    by_fp32: bool = False

    @classmethod
    def given(cls, config: Config) -> Batch:
        """`[pretrain]`'s batch and `optimizer.lr`."""
        return cls(config.microbatch, config.batch_size, config.optimizer.lr)

    @classmethod
    def on(cls, config: Config, device_name: str) -> Batch:
        """On `device_name`: `[pretrain.fp32]`'s where the step trains in fp32 there (`precision`'s first
        candidate on the device, not a canary's fall back) and the table sets one; `[pretrain]`'s otherwise."""
        in_fp32 = devices.autocast_dtype(config.precision, devices.resolve(device_name)) is None
        table = config.fp32
        if not in_fp32 or table == InFp32():
            return cls.given(config)
        return cls(
            microbatch=table.microbatch or config.microbatch,
            batch_size=table.batch_size or config.batch_size,
            lr=table.lr or config.optimizer.lr,
            by_fp32=True,
        )


@dataclass(frozen=True)
class Resolved:
    """What a run trains with: its `batch`, its `optimizer` (the kind it runs, at the peak lr `peak_lr`), the
    head `warmup` it takes first (None: none), and the masked-LM head params the stage made (`made_head`:
    those `init`'s checkpoint lacks, or its whole head where its own measured untrained)."""

    batch: Batch
    optimizer: OptimizerConfig
    warmup: HeadWarmup | None = None
    made_head: tuple[str, ...] = ()

    @property
    def peak_lr(self) -> float:
        """The lr the schedule peaks at."""
        return self.optimizer.lr

    @classmethod
    def of(cls, config: Config, batch: Batch, cfg: ModelConfig, untrained: bool = False) -> Resolved:
        """The values a run of `config` at `batch` trains with, its model `cfg`, where `init`'s own head
        measured `untrained` (or not)."""
        peak = continued.peak_lr(config, batch.lr, untrained)
        optimizer = config.optimizer.as_kind(continued.optimizer_kind(config), lr=peak)
        warmup = continued.warmup_of(config, cfg, peak, untrained)
        return cls(batch, optimizer, warmup, tuple(continued.made_head(config, untrained)))
