"""The optimizers a step can run, one config class a kind, each registered under the `kind` that names it
(`[pretrain.optimizer] kind = "muon"`); torch-free, so that a stage's Config can hold one. What each runs is
`model/optim.py`'s (`optimizer_init`, `optimizer_update`), read from the class's traits, never from its name:

    AdamW        AdamW on every tensor (cramming's settings)
    StableAdamW  AdamW with its rate clipped per tensor (ModernBERT's and Ettin's): `clips_rate`
    Muon         Muon on the layers' hidden matrices (`model/muon.py`), AdamW on the rest, at one lr and weight
                 decay: `orthogonalises_hidden`

A new optimizer is a class here with its `register` line (and, if it runs something new, the trait and the
arithmetic in `model/optim.py`). All kinds share the settings below, so a config's key and a checkpoint's
optimizer state (`exp_avg.<name>`, `exp_avg_sq.<name>`, `step`) read the same whichever class holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

Registered = TypeVar("Registered", bound="OptimizerConfig")

# kind -> its config class, filled by `register`, in the order registered (the first is the default)
OPTIMIZERS: dict[str, type[OptimizerConfig]] = {}


def register(kind: str) -> Callable[[type[Registered]], type[Registered]]:
    """Register the config class it decorates as optimizer `kind`."""

    def add(cls: type[Registered]) -> type[Registered]:
        cls.KIND = kind
        OPTIMIZERS[kind] = cls
        return cls

    return add


@dataclass(frozen=True)
class OptimizerConfig:
    """The settings every optimizer shares; make a kind (`AdamW()`, `Muon(lr=7e-3)`) or `optimizer_config(kind,
    ...)`, never this class itself.

    `clip_norm` means the same for every kind: the global gradient norm is clipped before the update.
    StableAdamW clips each tensor's update itself, so ModernBERT and Ettin train it with no gradient
    clipping: `clip_norm = 0` is that recipe; a positive one clips the gradients first, as for AdamW."""

    KIND: ClassVar[str] = ""  # set by `register`
    # What the update runs (model/optim.py), beside AdamW's arithmetic:
    orthogonalises_hidden: ClassVar[bool] = False  # Muon for the layers' hidden matrices, which keep no 2nd moment
    clips_rate: ClassVar[bool] = False  # StableAdamW's rate clipped per tensor
    fuses_in_place: ClassVar[bool] = False  # an eager owner's update may run torch's fused AdamW kernel in place

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-12
    weight_decay: float = 0.01
    clip_norm: float = 0.5  # <= 0: no clipping
    kind: str = field(default="", init=False)  # the class's KIND: what a config file and a key say

    def __post_init__(self) -> None:
        if OPTIMIZERS.get(self.KIND) is not type(self):
            raise TypeError(f"{type(self).__name__}: not a registered optimizer; make one of {', '.join(OPTIMIZERS)}")
        object.__setattr__(self, "kind", self.KIND)
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr={self.lr}: must be positive")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas={self.betas}: two values in [0, 1)")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError("optimizer.eps must be positive and optimizer.weight_decay non-negative")

    @classmethod
    def kind_class(cls, kind: str | None) -> type[OptimizerConfig]:
        """The class of optimizer `kind` (None: the default, AdamW); ValueError naming the allowed ones. A
        config reader builds a table's settings with it (pipeline/config.py)."""
        if kind is None:
            return next(iter(OPTIMIZERS.values()))
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer.kind={kind!r}: allowed {', '.join(OPTIMIZERS)}")
        return OPTIMIZERS[kind]

    def as_kind(self, kind: str, **changes: float) -> OptimizerConfig:
        """These settings (with `changes`) as optimizer `kind`'s config."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return optimizer_config(kind, **{**settings, **changes})


def optimizer_config(kind: str, **settings: object) -> OptimizerConfig:
    """Optimizer `kind`'s config with `settings` (the shared fields); ValueError naming the allowed kinds."""
    return OptimizerConfig.kind_class(kind)(**settings)


@register("adamw")
@dataclass(frozen=True)
class AdamW(OptimizerConfig):
    """AdamW on every tensor: the arithmetic of `torch.optim.AdamW` after `clip_grad_norm_`."""

    fuses_in_place: ClassVar[bool] = True


@register("stable_adamw")
@dataclass(frozen=True)
class StableAdamW(OptimizerConfig):
    """StableAdamW (Wortsman et al. 2023, Algorithm 2): AdamW with each tensor's rate divided by the RMS of its
    gradient over its second moment where that exceeds 1 (model/optim.py's docstring)."""

    clips_rate: ClassVar[bool] = True


@register("muon")
@dataclass(frozen=True)
class Muon(OptimizerConfig):
    """Muon (model/muon.py) on the layers' hidden matrices, AdamW on the rest (embeddings, norms, head), at one
    lr and weight decay; the matrices keep their momentum in `exp_avg` and no second moment."""

    orthogonalises_hidden: ClassVar[bool] = True
