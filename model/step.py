"""Whole training, accumulation, update and evaluation steps, each compiled as one graph.

Every step is a pure function: it returns new dicts and never mutates its inputs. The learning
rate, the step counter and the number of microbatches are 0-dim tensors, so new values never
recompile. bf16 autocast covers the forward only; params and optimizer state stay fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Collection
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from cram.model.bert import mlm_loss
from cram.model.config import Attention, ModelConfig
from cram.model.optim import optimizer_update, optimizer_update_
from cram.model.optimizers import OptimizerConfig

Params = dict[str, Tensor]
GradReducer = Callable[[Params], Params]
CompileOptions = dict[str, object] | None  # the backend's options for these graphs alone (inductor's config keys)
# The params a step trains (None: all of them); the others are constants of its graph, returned as they came,
# and so are their optimizer moments: a fresh head trained with the encoder frozen (`pretrain.head_warmup`).
Trained = Collection[str] | None


@dataclass(frozen=True)
class Compilation:
    """How a step runs: one graph compiled by `backend` (with its `options`), or eagerly; its forward under
    `autocast` (None: fp32); its attention computed as `attention`. The default: inductor, fp32.

    The inductor switches (`cuda_graphs`, `max_autotune`, `combo_kernels`) are its config keys set for these
    graphs alone, as `torch.compile`'s modes set them ("reduce-overhead" is `triton.cudagraphs`); other
    backends have no such keys and leave them unread. They change how fast a step runs, never what it
    computes, and are off until a GPU measures them winning (docs/compiling.md)."""

    compile: bool = True
    backend: str = "inductor"
    autocast: torch.dtype | None = None
    attention: Attention = "auto"
    options: CompileOptions = None  # the backend's options for these graphs alone (inductor's config keys)
    # The whole step replayed as CUDA graphs: one launch instead of ~1,000 per step. Its inputs (params,
    # optimizer state, batch) are copied into the graph's static buffers each step. CUDA only: refused on
    # another device when the step is called.
    cuda_graphs: bool = False
    max_autotune: bool = False  # inductor benchmarks GEMM templates and tile sizes while compiling (slower compile)
    combo_kernels: bool = False  # inductor launches independent small kernels (per-tensor updates) as one
    # The step's own ways of computing the same thing (model/optim.py, model/bert.py), off until measured:
    foreach_update: bool = False  # the gradient norm, clipping and AdamW as list ops (`torch._foreach_*`)
    fp32_logits: bool = True  # False: the loss reads autocast's logits, accumulating in fp32, with no fp32 copy
    bf16_newton_schulz: bool = False  # Muon's iterations in bf16 on CUDA (the reference's), fp32 elsewhere
    # The residual stream in autocast's dtype instead of fp32 (norms still compute in fp32): half its memory
    # traffic, and a different rounding, which the canary judges; no effect without autocast.
    autocast_residual: bool = False

    def eager(self) -> Compilation:
        """The same step run eagerly: the reference a compiled one is checked against."""
        return dataclasses.replace(self, compile=False, options=None)

    def backend_options(self) -> CompileOptions:
        """`options`, with inductor's keys of the switches that are on; None when there are none."""
        switches = {"triton.cudagraphs": self.cuda_graphs, "max_autotune": self.max_autotune}
        switches["combo_kernels"] = self.combo_kernels
        chosen = {key: True for key, on in switches.items() if on} if self.backend == "inductor" else {}
        return {**(self.options or {}), **chosen} or None


EAGER = Compilation(compile=False)


def make_train_step(
    cfg: ModelConfig,
    opt_cfg: OptimizerConfig,
    how: Compilation = Compilation(),
    *,
    reduce_grads: GradReducer | None = None,
    trained: Trained = None,
) -> Callable[[Params, Params, Params, Tensor], tuple[Params, Params, dict[str, Tensor]]]:
    """step(params, opt_state, batch, lr) -> (params, opt_state, {"loss", "grad_norm", "accuracy"}); only
    the `trained` params (None: all) change."""
    loss_and_grads = _loss_and_grads(cfg, how, trained)

    def train_step(params, opt_state, batch, lr):
        grads, (loss, aux) = loss_and_grads(params, batch)
        if reduce_grads is not None:
            grads = reduce_grads(grads)
        params, opt_state, grad_norm = _update(opt_cfg, how, params, opt_state, grads, lr)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm, "accuracy": aux["accuracy"]}

    return detached_params(compiled(train_step, how))


def make_tuning_step(
    loss_fn: Callable[[Params, Params], Tensor],
    opt_cfg: OptimizerConfig,
    how: Compilation = Compilation(),
    *,
    reduce_grads: GradReducer | None = None,
) -> Callable[..., tuple[Params, Params, dict[str, Tensor]]]:
    """step(params, opt_state, batch, lr, donate=False) -> (params, opt_state, {"loss", "grad_norm"}): the
    gradient of `loss_fn(params, batch)` over every param (reduced across ranks by `reduce_grads`) and the
    update of optimizer `opt_cfg` (`optimizer_update`), in one graph per batch shape: a fine-tune's step, a
    classifier's or an embedder's.

    `donate=True` says the caller owns `params` and `opt_state` and keeps only what the step returns:
    eager, the step then writes the new params and moments into the tensors given (`optimizer_update_`:
    AdamW's fused kernel instead of a dozen ops per tensor); compiled, it is the same graph either way."""

    def updating(update: Callable) -> Callable:
        def step(params, opt_state, batch, lr):
            grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
            if reduce_grads is not None:
                grads = reduce_grads(grads)
            params, opt_state, grad_norm = update(opt_cfg, params, opt_state, grads, lr)
            return params, opt_state, {"grad_norm": grad_norm, "loss": loss.detach()}

        return step

    pure = detached_params(compiled(updating(optimizer_update), how))
    in_place = pure if how.compile else detached_params(updating(optimizer_update_))

    def step(params, opt_state, batch, lr, donate: bool = False):
        return (in_place if donate else pure)(params, opt_state, batch, lr)

    return step


def make_accumulate_step(
    cfg: ModelConfig, how: Compilation = Compilation(), *, trained: Trained = None
) -> Callable[[Params, Params, Params], tuple[Params, dict[str, Tensor]]]:
    """accumulate(params, grads, batch) -> (grads + this microbatch's grads, {"loss", "accuracy"}); `grads`
    holds the `trained` params' alone (None: all)."""
    loss_and_grads = _loss_and_grads(cfg, how, trained)

    def accumulate_step(params, grads, batch):
        micro, (loss, aux) = loss_and_grads(params, batch)
        return {name: grads[name] + g for name, g in micro.items()}, {"loss": loss, "accuracy": aux["accuracy"]}

    return detached_params(compiled(accumulate_step, how))


def make_apply_step(
    opt_cfg: OptimizerConfig, how: Compilation = Compilation(), *, reduce_grads: GradReducer | None = None
) -> Callable[[Params, Params, Params, Tensor, Tensor], tuple[Params, Params, dict[str, Tensor]]]:
    """apply(params, opt_state, grads, n_micro, lr) -> (params, opt_state, {"grad_norm"}).

    Summed microbatch gradients are divided by `n_micro` (a tensor: a growing batch never
    recompiles), reduced across ranks, clipped and applied to the params they are of. No forward: `how`'s
    autocast and attention do not apply.
    """

    def apply_step(params, opt_state, grads, n_micro, lr):
        grads = {name: g / n_micro for name, g in grads.items()}
        if reduce_grads is not None:
            grads = reduce_grads(grads)
        params, opt_state, grad_norm = _update(opt_cfg, how, params, opt_state, grads, lr)
        return params, opt_state, {"grad_norm": grad_norm}

    return compiled(apply_step, how)


def make_eval_step(cfg: ModelConfig, how: Compilation = Compilation()) -> Callable[[Params, Params], dict[str, Tensor]]:
    """evaluate(params, batch) -> {"loss", "accuracy"}; compiled apart from the train step."""

    def eval_step(params, batch):
        with autocast(batch["input_ids"], how.autocast):
            loss, aux = mlm_loss(params, cfg, batch, how.attention)
        return {"loss": loss, "accuracy": aux["accuracy"]}

    return compiled(eval_step, how)


def make_grad_all_reduce(world_size: int, group=None) -> GradReducer:
    """Mean of the gradients over ranks, traceable inside a compiled step (functional collectives).

    DDP cannot be used here: its reducer hangs off autograd hooks, which `torch.func` never fires.
    """
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD if group is None else group

    def all_reduce_mean(grads: Params) -> Params:
        names = list(grads)
        summed = funcol.all_reduce_coalesced([grads[n] for n in names], "sum", group)
        return {name: g / world_size for name, g in zip(names, summed)}

    return all_reduce_mean


def _loss_and_grads(cfg: ModelConfig, how: Compilation, trained: Trained):
    """(params, batch) -> (gradients of the `trained` params (None: all), (loss, aux))."""
    residual = how.autocast if how.autocast_residual else None

    def loss(learned, fixed, batch):
        with autocast(batch["input_ids"], how.autocast):
            return mlm_loss({**fixed, **learned}, cfg, batch, how.attention, how.fp32_logits, residual)

    grad = torch.func.grad_and_value(loss, has_aux=True)

    def loss_and_grads(params, batch):
        if trained is None:
            return grad(params, {}, batch)
        return grad({k: params[k] for k in trained}, {k: v for k, v in params.items() if k not in trained}, batch)

    return loss_and_grads


def _update(opt_cfg: OptimizerConfig, how: Compilation, params: Params, opt_state: Params, grads: Params, lr: Tensor):
    """Optimizer `opt_cfg`'s update (`optimizer_update`) of the params that `grads` holds; the others, and
    their moments, come back as they were."""
    ways = {"foreach": how.foreach_update, "bf16_newton_schulz": how.bf16_newton_schulz}
    if len(grads) == len(params):
        return optimizer_update(opt_cfg, params, opt_state, grads, lr, **ways)
    keys = [f"{moment}.{name}" for name in grads for moment in ("exp_avg", "exp_avg_sq")]
    moments = {key: opt_state[key] for key in keys if key in opt_state}  # Muon's matrices have no exp_avg_sq
    learned, state, grad_norm = optimizer_update(
        opt_cfg, {k: params[k] for k in grads}, {"step": opt_state["step"], **moments}, grads, lr, **ways
    )
    return {**params, **learned}, {**opt_state, **state}, grad_norm


def detached_params(step: Callable) -> Callable:
    """`step`, refusing params that require grad: `torch.func` takes the gradients itself, and a traced
    SDPA whose inputs require grad is a known crash of compiled `torch.func` steps (pytorch#181177)."""

    def checked(params: Params, *rest):
        tracked = next((name for name, p in params.items() if p.requires_grad), None)
        if tracked is not None:
            raise ValueError(
                f"params[{tracked!r}] requires grad: pass the step detached tensors "
                "(torch.func computes the gradients; e.g. {k: v.detach() for k, v in params.items()})"
            )
        return step(params, *rest)

    return checked


def autocast(like: Tensor, dtype: torch.dtype | None):
    """bf16 (or `dtype`) autocast on `like`'s device for the forward; nothing when `dtype` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(like.device.type, dtype=dtype)


def compiled(fn: Callable, how: Compilation) -> Callable:
    """`fn` as one static-shape graph (`fullgraph=True`, `dynamic=False`), or `fn` itself when not `how.compile`.

    Each new batch shape compiles once, so the graph count is bounded by the shapes a caller uses.
    `how.options` patch the backend's config while it compiles these graphs (e.g. inductor's
    `cpp.simdlen`), leaving the process's config as it was."""
    if not how.compile:
        return fn
    # Dynamo caches compiled graphs on the function's code object, shared by every closure that
    # make_* returns: a second step (another config, a test) would count as a recompile of the
    # first and, past the recompile limit, fall back to eager. A copied code object gets its own cache.
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    graph = torch.compile(fresh, fullgraph=True, dynamic=False, backend=how.backend, options=how.backend_options())
    return _replayed(graph) if how.cuda_graphs else graph


def _replayed(graph: Callable) -> Callable:
    """`graph` compiled with CUDA graphs, called as a training loop calls one: refused off CUDA (inductor
    would compile a CPU graph without them and say so only in its log), and each call marked as a new step
    (`cudagraph_mark_step_begin`): the last step's outputs, which come back in as this step's inputs, are
    copied into the graph's input buffers before it replays over the memory they were in."""

    def step(*args):
        device = _first_tensor(args).device
        if device.type != "cuda":
            raise ValueError(f"cuda_graphs=True: CUDA graphs need a CUDA device; the step's tensors are on {device}")
        torch.compiler.cudagraph_mark_step_begin()
        return graph(*args)

    return step


def _first_tensor(args: tuple) -> Tensor:
    for arg in args:
        found = next(iter(arg.values())) if isinstance(arg, dict) else arg
        if isinstance(found, Tensor):
            return found
    raise ValueError("a compiled step takes tensors: none among its arguments")
