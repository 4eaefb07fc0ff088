"""AdamW, StableAdamW and Muon (`model/muon.py`) as pure functions (optax style); the learning-rate
schedules are in `model/schedules.py`.

StableAdamW (Wortsman et al. 2023, "Stable and low-precision training for large-scale vision-language
models", Algorithm 2; ModernBERT's and Ettin's optimizer) is AdamW with its rate clipped per tensor:
lr_t = lr / max(1, RMS_t), RMS_t = sqrt(mean(g_t^2 / max(v_hat_t, eps^2))) over the tensor's entries, v_hat_t
the bias-corrected second moment after this step's gradient. A tensor whose gradient spikes far above
its running second moment takes a smaller step (its decay too) instead of a huge one.

Muon (`kind = "muon"`) updates the layers' hidden matrices, AdamW the rest, at one lr and weight decay
(the rule that maps Muon's rate onto AdamW's is in `model/muon.py`).

The optimizer state is a flat dict of tensors, so it saves directly as safetensors:
`step` (0-dim fp32), `exp_avg.<param name>` and `exp_avg_sq.<param name>`. Every kind has this layout:
Muon keeps its momentum in `exp_avg` and leaves `exp_avg_sq` of its matrices at zero, so checkpoints,
the head warm-up's fresh state and the memory estimate have one layout for every kind.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cram.model import muon
from cram.model.config import OptimizerConfig


def decays(param: Tensor) -> bool:
    """Weight decay applies to matrices only: norms and the sinusoidal scale are left alone."""
    return param.ndim >= 2


def adamw_init(params: dict[str, Tensor]) -> dict[str, Tensor]:
    state = {"step": torch.zeros((), dtype=torch.float32, device=next(iter(params.values())).device)}
    for name, p in params.items():
        state[f"exp_avg.{name}"] = torch.zeros_like(p)
        state[f"exp_avg_sq.{name}"] = torch.zeros_like(p)
    return state


def global_norm(tensors: dict[str, Tensor]) -> Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors.values()]))


def adamw_update(
    cfg: OptimizerConfig, params: dict[str, Tensor], state: dict[str, Tensor], grads: dict[str, Tensor], lr: Tensor
) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    """One clipped step of `cfg.kind` (AdamW, StableAdamW, or Muon with AdamW for what Muon does not
    take); returns new params, new state and the gradient norm before clipping.

    AdamW is the same arithmetic as `torch.optim.AdamW` (decoupled decay, bias correction) after
    `clip_grad_norm_`, so the two agree to rounding; Muon's is `torch.optim.Muon`'s (`model/muon.py`).
    `cfg.kind` is a Python string: the compiled step holds one kind's graph, no branch.
    """
    grad_norm = global_norm(grads)
    if cfg.clip_norm > 0:
        scale = torch.clamp(cfg.clip_norm / (grad_norm + 1e-6), max=1.0)
        grads = {name: g * scale for name, g in grads.items()}
    step = state["step"] + 1
    new_params, new_state = {}, {"step": step}
    for name, p in params.items():
        g, exp_avg = grads[name], state[f"exp_avg.{name}"]
        if cfg.kind == "muon" and muon.takes(name):
            blocks = muon.stacked(name, params)
            new_params[name], new_state[f"exp_avg.{name}"] = muon.muon_param(
                p, g, exp_avg, blocks, lr, cfg.weight_decay
            )
            new_state[f"exp_avg_sq.{name}"] = state[f"exp_avg_sq.{name}"]
            continue
        new_params[name], new_state[f"exp_avg.{name}"], new_state[f"exp_avg_sq.{name}"] = _adamw_param(
            cfg, p, g, (exp_avg, state[f"exp_avg_sq.{name}"]), step, lr
        )
    return new_params, new_state, grad_norm


def _adamw_param(
    cfg: OptimizerConfig, p: Tensor, g: Tensor, moments: tuple[Tensor, Tensor], step: Tensor, lr: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(new param, exp_avg, exp_avg_sq) of one tensor's AdamW (or StableAdamW) step number `step`."""
    beta1, beta2 = cfg.betas
    bias2_sqrt = torch.sqrt(1 - beta2**step)
    exp_avg = torch.lerp(moments[0], g, 1 - beta1)
    exp_avg_sq = moments[1] * beta2 + g * g * (1 - beta2)
    clip = _update_clip(g, exp_avg_sq / (bias2_sqrt * bias2_sqrt), cfg.eps) if cfg.kind == "stable_adamw" else 1
    if decays(p):
        p = p * (1 - lr * clip * cfg.weight_decay)
    step_size = lr / (1 - beta1**step)
    return p - (step_size * clip) * exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt + cfg.eps), exp_avg, exp_avg_sq


def _update_clip(g: Tensor, v_hat: Tensor, eps: float) -> Tensor:
    """StableAdamW's factor of the rate for one tensor: 1 / max(1, RMS(g / sqrt(v_hat)))."""
    rms = torch.sqrt(torch.mean(g * g / torch.clamp(v_hat, min=eps * eps)))
    return 1 / torch.clamp(rms, min=1.0)
