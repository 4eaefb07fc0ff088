"""The crammed-BERT encoder, its AdamW and its compiled steps: pure functions over `dict[str, Tensor]`.

    from model import PRESETS, OptimizerConfig, init, adamw_init, make_train_step
    cfg = PRESETS["tiny"]
    params, opt_state = init(cfg, seed=0), adamw_init(params)
    step = make_train_step(cfg, OptimizerConfig())
    params, opt_state, metrics = step(params, opt_state, batch, torch.tensor(1e-3))

Parameter names are listed in `model/bert.py`. This package knows nothing of stages, TOML or the CLI.
"""

from model.bert import encode, init, mlm_logits, mlm_loss
from model.config import PRESETS, ModelConfig
from model.flops import flops_per_token, num_params, peak_flops
from model.optim import SCHEDULES, OptimizerConfig, adamw_init, adamw_update, lr_schedule
from model.step import (
    make_accumulate_step,
    make_apply_step,
    make_eval_step,
    make_grad_all_reduce,
    make_train_step,
)

__all__ = [
    "PRESETS",
    "SCHEDULES",
    "ModelConfig",
    "OptimizerConfig",
    "adamw_init",
    "adamw_update",
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
    "peak_flops",
]
