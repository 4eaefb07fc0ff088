"""The training state: the tensors being trained and the counters that say where training stands.

The counters are a checkpoint's `state.json`; their JSON keys are a file format that resumes read, so
a field here is a key there, in this order. The seed and the data position are the whole random state:
batches and masks derive from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

Params = dict[str, "Tensor"]

# Fields that are tensors, saved as safetensors beside state.json rather than in it.
_TENSORS = ("params", "opt_state", "kept")
# Counters added after the format was fixed: left out while at their default, so a checkpoint that
# lacks them reads and writes back as it was (its run had one phase; its FLOPs count restarts at 0).
_NEW = {
    "phase": 0,
    "phase_start": 0,
    "flops_seen": 0.0,
    "optimizer_flops_seen": 0.0,
    "full_start": 0.0,
    "init_head_loss": None,
    "fp32_batch": False,
}


@dataclass(kw_only=True)
class TrainState:
    step: int = 0
    sequences: int = 0  # data position: global sequences consumed in the current phase
    phase: int = 0  # the sequence-length phase (`phases.py`)
    phase_start: int = 0  # where that phase began in the stream, in tokens
    tokens_seen: int = 0
    flops_seen: float = 0.0  # model FLOPs: each phase's per-token count times its tokens
    optimizer_flops_seen: float = 0.0  # the optimizer's matmuls (Muon's Newton-Schulz), beside the model's
    elapsed_s: float = 0.0  # budget time spent, carried over across resumes
    data_wait_s: float = 0.0  # of which waiting for batches
    progress: float = 0.0  # schedule position
    # The budget's progress at which the whole model began training; None while a fresh head trains
    # alone (`head_warmup.py`), 0.0 when it trained whole from the start.
    full_start: float | None = 0.0
    seed: int
    loss_start: float | None = None
    loss_end: float | None = None
    val_loss_start: float | None = None
    # The held-out loss of `init`'s own masked-LM head before training (continued.untrained); None: not
    # measured. Kept so that a resume continues with the head, lr and warm-up the start chose.
    init_head_loss: float | None = None
    # Whether `[pretrain.fp32]` set the batch and lr (the step trained in fp32): a resume on a machine that
    # decides otherwise would continue at another batch, which is refused (start.py).
    fp32_batch: bool = False
    unlogged: list[list[float]] = field(default_factory=list)  # [loss, accuracy, grad_norm] of the steps
    # since the last log line, so that a resumed run logs the curve an uninterrupted one would
    params: Params = field(default_factory=dict, repr=False)
    opt_state: Params = field(default_factory=dict, repr=False)
    # What the checkpoint brought that training never reads (BERT's pooler): carried as it is, saved
    # beside the params in the same file (`saved_params`), never given to the steps or the optimizer.
    kept: Params = field(default_factory=dict, repr=False)

    @classmethod
    def split(cls, params: Params) -> tuple[Params, Params]:
        """(what training updates, what it carries unchanged) of a model's params, each in their order."""
        from cram.model.bert import POOLER

        return {k: v for k, v in params.items() if k not in POOLER}, {k: v for k, v in params.items() if k in POOLER}

    def saved_params(self) -> Params:
        """The whole model: the trained params, then the kept ones."""
        return {**self.params, **self.kept}

    def advance(
        self,
        params: Params,
        opt_state: Params,
        sequences: int,
        seq_len: int,
        flops_per_token: float,
        optimizer_flops: float = 0.0,
    ) -> None:
        """Take the result of one optimizer step over `sequences` (global) sequences of `seq_len` tokens, whose
        update ran `optimizer_flops` matmul FLOPs."""
        self.params, self.opt_state = params, opt_state
        self.optimizer_flops_seen += optimizer_flops
        self.step += 1
        self.sequences += sequences
        self.tokens_seen += sequences * seq_len
        self.flops_seen += sequences * seq_len * flops_per_token

    def to_json(self) -> dict[str, Any]:
        """The counters, as `state.json` holds them."""
        counters = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _TENSORS}
        return {k: v for k, v in counters.items() if k not in _NEW or v != _NEW[k]}

    @classmethod
    def from_json(
        cls, counters: dict[str, Any], params: Params | None = None, opt_state: Params | None = None
    ) -> TrainState:
        """The state of a checkpoint: its `state.json` and its tensors (`params` as `saved_params` wrote them)."""
        trained, kept = cls.split(params or {})
        return cls(**counters, params=trained, opt_state=opt_state or {}, kept=kept)
