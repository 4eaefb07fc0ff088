"""The crammed-BERT encoder, its optimizers and its compiled steps: pure functions over `dict[str, Tensor]`.

    from cram.model import PRESETS, AdamW, init, optimizer_init, make_train_step
    cfg, opt = PRESETS["tiny"], AdamW()       # or Muon(), StableAdamW(), optimizer_config("muon", lr=7e-3)
    params = init(cfg, seed=0)
    opt_state = optimizer_init(opt, params)
    step = make_train_step(cfg, opt)
    params, opt_state, metrics = step(params, opt_state, batch, torch.tensor(1e-3))

Parameter names are listed in `model/bert.py`. This package knows nothing of stages, TOML or the CLI.
"""

import importlib
from typing import Any

from cram.model.config import PRESETS, ModelConfig
from cram.model.optimizers import OPTIMIZERS, AdamW, Muon, OptimizerConfig, StableAdamW, optimizer_config

# Everything that needs torch is imported on first use: `model.config` alone stays torch-free, so a
# stage's Config (which uses ModelConfig and an OptimizerConfig) loads without torch.
_LAZY = {
    "attends_with": "cram.model.bert",
    "encode": "cram.model.bert",
    "init": "cram.model.bert",
    "mlm_logits": "cram.model.bert",
    "mlm_loss": "cram.model.bert",
    "MemoryEstimate": "cram.model.memory",
    "parameter_count": "cram.model.memory",
    "training_memory": "cram.model.memory",
    "flops_per_token": "cram.model.flops",
    "num_params": "cram.model.flops",
    "optimizer_flops": "cram.model.flops",
    "peak_flops": "cram.model.flops",
    "step_gemms": "cram.model.flops",
    "SCHEDULES": "cram.model.schedules",
    "DECAY_SHAPES": "cram.model.schedules",
    "optimizer_init": "cram.model.optim",
    "optimizer_update": "cram.model.optim",
    "drop_unused": "cram.model.optim",
    "lr_schedule": "cram.model.schedules",
    "Compilation": "cram.model.step",
    "EAGER": "cram.model.step",
    "make_accumulate_step": "cram.model.step",
    "make_apply_step": "cram.model.step",
    "make_eval_step": "cram.model.step",
    "make_grad_all_reduce": "cram.model.step",
    "make_train_step": "cram.model.step",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "PRESETS",
    "Compilation",
    "EAGER",
    "MemoryEstimate",
    "SCHEDULES",
    "DECAY_SHAPES",
    "ModelConfig",
    "OPTIMIZERS",
    "AdamW",
    "Muon",
    "OptimizerConfig",
    "StableAdamW",
    "optimizer_config",
    "optimizer_init",
    "optimizer_update",
    "attends_with",
    "drop_unused",
    "encode",
    "flops_per_token",
    "init",
    "lr_schedule",
    "make_accumulate_step",
    "make_apply_step",
    "make_eval_step",
    "make_grad_all_reduce",
    "make_train_step",
    "mlm_logits",
    "mlm_loss",
    "num_params",
    "optimizer_flops",
    "parameter_count",
    "peak_flops",
    "step_gemms",
    "training_memory",
]
