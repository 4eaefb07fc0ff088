"""What the optimizers of `model/optimizers.py` run, as pure functions (optax style): `optimizer_init` (the
state before the first step) and `optimizer_update` (one clipped step), for AdamW, StableAdamW and Muon
(`model/muon.py`), read from the config's class traits; the learning-rate schedules are in
`model/schedules.py`.

StableAdamW (Wortsman et al. 2023, "Stable and low-precision training for large-scale vision-language
models", Algorithm 2; ModernBERT's and Ettin's optimizer) is AdamW with its rate clipped per tensor:
lr_t = lr / max(1, RMS_t), RMS_t = sqrt(mean(g_t^2 / max(v_hat_t, eps^2))) over the tensor's entries, v_hat_t
the bias-corrected second moment after this step's gradient. A tensor whose gradient spikes far above
its running second moment takes a smaller step (its decay too) instead of a huge one.

Muon (`Muon`, `kind = "muon"`) updates the layers' hidden matrices, AdamW the rest, at one lr and weight decay
(the rule that maps Muon's rate onto AdamW's is in `model/muon.py`).

`optimizer_update_` is the same AdamW written into the tensors it is given (torch's fused kernel), for an eager
caller that owns them: one pass over each tensor instead of a dozen out-of-place ones, each allocating a
tensor as large as it (over MiniLM's 83 tensors on 2 shared cores, interleaved: 2.3 s out of place, 0.45 s
fused in place, torch.optim.AdamW's default 0.96 s; bench/NOTEBOOK.md, "Fine-tune speed on a released
encoder"). Compiled steps keep the pure update: the compiler fuses it.

The optimizer state is a flat dict of tensors, so it saves directly as safetensors:
`step` (0-dim fp32), `exp_avg.<param name>` and `exp_avg_sq.<param name>`. Muon keeps its momentum in
`exp_avg` and has no second moment: its matrices have no `exp_avg_sq` (`optimizer_init(Muon(), params)`; 377 MB
of zeros at base otherwise). A state that holds them anyway (a checkpoint written before they were
dropped, all zeros) is carried through unchanged, or put in Muon's layout by `drop_unused`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cram.model import muon
from cram.model.optimizers import OptimizerConfig


def decays(param: Tensor) -> bool:
    """Weight decay applies to matrices only: norms and the sinusoidal scale are left alone."""
    return param.ndim >= 2


def optimizer_init(cfg: OptimizerConfig, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """The state of optimizer `cfg` before the first step: the step count and zero moments (no second moment
    where `cfg` never reads one: Muon's matrices)."""
    state = {"step": torch.zeros((), dtype=torch.float32, device=next(iter(params.values())).device)}
    for name, p in params.items():
        state[f"exp_avg.{name}"] = torch.zeros_like(p)
        if not unused_second_moment(cfg, name):
            state[f"exp_avg_sq.{name}"] = torch.zeros_like(p)
    return state


def unused_second_moment(cfg: OptimizerConfig, name: str) -> bool:
    """Whether optimizer `cfg` never reads the second moment of param `name`: Muon's matrices."""
    return cfg.orthogonalises_hidden and muon.takes(name)


def drop_unused(cfg: OptimizerConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state` without the second moments that optimizer `cfg` never reads and that are all zero (a Muon
    checkpoint written before they were dropped): the layout `optimizer_init(cfg, params)` makes, so that a
    resumed step compiles for the same inputs as a fresh one. A non-zero one (not Muon's) is kept."""
    prefix = "exp_avg_sq."

    def unused(key: str) -> bool:
        name = key[len(prefix) :]
        return key.startswith(prefix) and unused_second_moment(cfg, name) and not bool(state[key].any())

    return {key: value for key, value in state.items() if not unused(key)}


def global_norm(tensors: dict[str, Tensor], foreach: bool = False) -> Tensor:
    """The 2-norm of all `tensors` together. `foreach`: every tensor's norm in one `_foreach_norm` (one
    multi-tensor kernel on CUDA instead of one reduction per tensor), the same value to rounding."""
    if foreach:
        norms = torch._foreach_norm([t.float() for t in tensors.values()])
    else:
        norms = [torch.linalg.vector_norm(t.float()) for t in tensors.values()]
    return torch.linalg.vector_norm(torch.stack(norms))


def optimizer_update(
    cfg: OptimizerConfig,
    params: dict[str, Tensor],
    state: dict[str, Tensor],
    grads: dict[str, Tensor],
    lr: Tensor,
    *,
    foreach: bool = False,
    bf16_newton_schulz: bool = False,
) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    """One clipped step of optimizer `cfg` (AdamW; StableAdamW where it `clips_rate`; Muon for the hidden
    matrices and AdamW for the rest where it `orthogonalises_hidden`); returns new params, new state and the
    gradient norm before clipping.

    AdamW is the same arithmetic as `torch.optim.AdamW` (decoupled decay, bias correction) after
    `clip_grad_norm_`, so the two agree to rounding; Muon's is `torch.optim.Muon`'s (`model/muon.py`).
    The kind is the config's class: the compiled step holds one kind's graph, no branch.

    How, never what: `foreach` computes the norm, the clipping and AdamW's (not StableAdamW's) tensors as
    list ops (`torch._foreach_*`: a few multi-tensor kernels instead of a dozen per tensor on CUDA, the same
    operations in the same order); `bf16_newton_schulz` runs Muon's iterations in bf16 on CUDA (as the
    reference does), in fp32 elsewhere.
    """
    grad_norm = global_norm(grads, foreach)
    if cfg.clip_norm > 0:
        scale = torch.clamp(cfg.clip_norm / (grad_norm + 1e-6), max=1.0)
        if foreach:
            grads = dict(zip(grads, torch._foreach_mul(list(grads.values()), scale)))
        else:
            grads = {name: g * scale for name, g in grads.items()}
    step = state["step"] + 1
    new_params, new_state = {}, {"step": step}
    factors = _AdamwFactors.of(cfg, step, lr)  # per step, not per tensor: eager runs a few ops, not hundreds
    shapes = {name: p.shape for name, p in params.items()}
    listed = []  # AdamW's tensors left to the list ops
    for name, p in params.items():
        g, exp_avg = grads[name], state[f"exp_avg.{name}"]
        if unused_second_moment(cfg, name):
            blocks = muon.stacked(name, shapes)
            new_params[name], new_state[f"exp_avg.{name}"] = muon.muon_param(
                p, g, exp_avg, blocks, lr, cfg.weight_decay, bf16=bf16_newton_schulz
            )
            if f"exp_avg_sq.{name}" in state:  # an older state's zeros, carried as they came
                new_state[f"exp_avg_sq.{name}"] = state[f"exp_avg_sq.{name}"]
        elif foreach and not cfg.clips_rate:
            listed.append(name)
        else:
            new_params[name], new_state[f"exp_avg.{name}"], new_state[f"exp_avg_sq.{name}"] = _adamw_param(
                cfg, p, g, (exp_avg, state[f"exp_avg_sq.{name}"]), factors
            )
    for decay in (True, False):  # weight decay applies to matrices only (`decays`)
        group = [name for name in listed if decays(params[name]) == decay]
        if group:
            _adamw_listed(cfg, group, (params, state, grads), factors, decay, (new_params, new_state))
    # in the order they came: a compiled step's outputs are its next inputs, guarded on their keys' order
    return {n: new_params[n] for n in params}, {k: new_state[k] for k in state if k in new_state}, grad_norm


@dataclass(frozen=True)
class _AdamwFactors:
    """The 0-dim factors of AdamW's step number `step`, shared by every tensor's update."""

    lr: Tensor
    bias2_sqrt: Tensor  # sqrt(1 - beta2^step)
    step_size: Tensor  # lr / (1 - beta1^step)

    @classmethod
    def of(cls, cfg: OptimizerConfig, step: Tensor, lr: Tensor) -> _AdamwFactors:
        beta1, beta2 = cfg.betas
        return cls(lr, torch.sqrt(1 - beta2**step), lr / (1 - beta1**step))


def _adamw_param(
    cfg: OptimizerConfig, p: Tensor, g: Tensor, moments: tuple[Tensor, Tensor], factors: _AdamwFactors
) -> tuple[Tensor, Tensor, Tensor]:
    """(new param, exp_avg, exp_avg_sq) of one tensor's AdamW (or StableAdamW) step."""
    beta1, beta2 = cfg.betas
    bias2_sqrt = factors.bias2_sqrt
    exp_avg = torch.lerp(moments[0], g, 1 - beta1)
    exp_avg_sq = moments[1] * beta2 + g * g * (1 - beta2)
    clip = _update_clip(g, exp_avg_sq / (bias2_sqrt * bias2_sqrt), cfg.eps) if cfg.clips_rate else 1
    if decays(p) and cfg.weight_decay:  # a decay of 0 multiplies by exactly 1: a pass over p for nothing
        p = p * (1 - factors.lr * clip * cfg.weight_decay)
    return p - (factors.step_size * clip) * exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt + cfg.eps), exp_avg, exp_avg_sq


def _adamw_listed(
    cfg: OptimizerConfig,
    names: list[str],
    given: tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]],
    factors: _AdamwFactors,
    decay: bool,
    into: tuple[dict[str, Tensor], dict[str, Tensor]],
) -> None:
    """`_adamw_param`'s arithmetic over the tensors `names` of (params, state, grads) as list ops, written
    into (new params, new state)."""
    params, state, grads = given
    beta1, beta2 = cfg.betas
    g = [grads[n] for n in names]
    p = [params[n] for n in names]
    exp_avg = torch._foreach_lerp([state[f"exp_avg.{n}"] for n in names], g, 1 - beta1)
    squared = torch._foreach_mul(torch._foreach_mul(g, g), 1 - beta2)
    exp_avg_sq = torch._foreach_add(torch._foreach_mul([state[f"exp_avg_sq.{n}"] for n in names], beta2), squared)
    if decay and cfg.weight_decay:
        p = torch._foreach_mul(p, 1 - factors.lr * cfg.weight_decay)
    denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(exp_avg_sq), factors.bias2_sqrt), cfg.eps)
    p = torch._foreach_sub(p, torch._foreach_div(torch._foreach_mul(exp_avg, factors.step_size), denom))
    for n, new_p, m, v in zip(names, p, exp_avg, exp_avg_sq):
        into[0][n], into[1][f"exp_avg.{n}"], into[1][f"exp_avg_sq.{n}"] = new_p, m, v


def _update_clip(g: Tensor, v_hat: Tensor, eps: float) -> Tensor:
    """StableAdamW's factor of the rate for one tensor: 1 / max(1, RMS(g / sqrt(v_hat)))."""
    rms = torch.sqrt(torch.mean(g * g / torch.clamp(v_hat, min=eps * eps)))
    return 1 / torch.clamp(rms, min=1.0)


def optimizer_update_(
    cfg: OptimizerConfig, params: dict[str, Tensor], state: dict[str, Tensor], grads: dict[str, Tensor], lr: Tensor
) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    """`optimizer_update` with `params`, the moments of `state` and `grads` donated: AdamW (a config that
    `fuses_in_place`) is written into their tensors by torch's fused kernel (eager only: a graph's inputs are
    not its to overwrite); the other kinds are `optimizer_update`'s. Use the tensors it returns, never the
    ones given. The same arithmetic as `optimizer_update` to rounding."""
    if not cfg.fuses_in_place:
        return optimizer_update(cfg, params, state, grads, lr)
    grad_norm = global_norm(grads)
    if cfg.clip_norm > 0:
        torch._foreach_mul_(list(grads.values()), torch.clamp(cfg.clip_norm / (grad_norm + 1e-6), max=1.0))
    step = state["step"] + 1
    for decay in (True, False):  # weight decay applies to matrices only (`decays`)
        names = [name for name, p in params.items() if decays(p) == decay]
        if names:
            torch._fused_adamw_(
                [params[n] for n in names],
                [grads[n] for n in names],
                [state[f"exp_avg.{n}"] for n in names],
                [state[f"exp_avg_sq.{n}"] for n in names],
                [],
                [step] * len(names),
                lr=lr,
                beta1=cfg.betas[0],
                beta2=cfg.betas[1],
                weight_decay=cfg.weight_decay if decay else 0.0,
                eps=cfg.eps,
                amsgrad=False,
                maximize=False,
            )
    return dict(params), {**state, "step": step}, grad_norm
