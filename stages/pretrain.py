"""The pretrain stage: packed blocks in, a masked language model out, trained on a budget.

Each optimizer step accumulates `n_micro` microbatches of a fixed shape and then applies AdamW. The
budget (hours, steps or tokens, whichever runs out first) defines progress in [0, 1]; the lr schedule
and the batch-size ramp (n_micro grows until the target batch is reached) both follow that progress,
as in cramming. Because n_micro and lr reach the compiled steps as tensors, nothing recompiles.

Checkpoints in `checkpoints/step-N/` make the stage resumable: a re-run in the same folder continues
from the newest one, and since batches and masks are functions of (seed, data position) alone, a
resumed CPU run ends bit-identical to an uninterrupted one (for step and token budgets).

Under torchrun every rank runs this stage on its own shard of each global batch; gradients are
averaged inside the compiled step; rank 0 alone writes files.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stages import Context, StageError, Upstream
from stages import device as devices

NAME = "pretrain"
VERSION = "2"
UPSTREAM = ("pack",)
RESUMABLE = True
DISTRIBUTED = True  # the runner calls `run` on every rank


@dataclass(frozen=True)
class Architecture:
    """A preset of `model.PRESETS` plus overrides; vocab size and sequence length come from the data."""

    preset: str = "tiny"
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    intermediate: int | None = None
    position: Literal["sinusoidal", "learned", "rope"] | None = None
    rope_theta: float | None = None
    position_scale: float | None = None
    glu: bool | None = None
    head_transform: bool | None = None
    embedding_norm: bool | None = None
    first_attn_norm: bool | None = None
    norm_bias: bool | None = None
    norm_eps: float | None = None


@dataclass(frozen=True)
class Budget:
    """Training stops at the first limit reached; a limit left out does not apply."""

    hours: float | None = 3.5 / 60
    steps: int | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        limits = {"hours": self.hours, "steps": self.steps, "tokens": self.tokens}
        if all(v is None for v in limits.values()):
            raise ValueError("set at least one of hours, steps, tokens")
        for key, value in limits.items():
            if value is not None and not value > 0:
                raise ValueError(f"{key}: {value} must be > 0")


@dataclass(frozen=True)
class Optimizer:
    """AdamW as `model.OptimizerConfig` (cramming's values)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-12
    weight_decay: float = 0.01
    clip_norm: float = 0.5  # <= 0: no clipping


@dataclass(frozen=True)
class Masking:
    """Exactly round(rate * seq_len) positions per sequence; of those, `mask_token` become [MASK],
    `random_token` a random token, the rest keep their token."""

    rate: float = 0.25
    mask_token: float = 0.8
    random_token: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.rate < 1:
            raise ValueError(f"rate: {self.rate} must be in (0, 1)")
        if not (0 <= self.mask_token and 0 <= self.random_token and self.mask_token + self.random_token <= 1):
            raise ValueError(
                f"mask_token, random_token: {self.mask_token}, {self.random_token} must be >= 0 with sum <= 1"
            )


@dataclass(frozen=True)
class Config:
    model: Architecture = field(default_factory=Architecture)
    optimizer: Optimizer = field(default_factory=Optimizer)
    budget: Budget = field(default_factory=Budget)
    masking: Masking = field(default_factory=Masking)
    schedule: str = "budget-triangle"  # a name in model.SCHEDULES
    schedule_args: dict[str, float] = field(default_factory=dict)  # e.g. {warmup = 0.1}
    microbatch: int = 32  # sequences per rank per forward/backward; its shape never changes
    batch_size: int = 32  # target global batch in sequences, reached by the ramp (cramming: 8192)
    ramp: float = 0.6  # fraction of the budget at which batch_size is reached; 0: from the start
    compile: bool = True
    backend: str = "inductor"
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    log_every_steps: int = 20
    checkpoint_every_minutes: float | None = 10.0
    checkpoint_every_steps: int | None = None
    keep_checkpoints: int = 2
    val_blocks: int = 256  # held-out blocks for the loss before and after training; 0: skip
    prefetch: int = 4  # microbatches read ahead

    def __post_init__(self) -> None:
        positive = {
            "microbatch": self.microbatch,
            "batch_size": self.batch_size,
            "log_every_steps": self.log_every_steps,
            "keep_checkpoints": self.keep_checkpoints,
            "prefetch": self.prefetch,
            "checkpoint_every_minutes": self.checkpoint_every_minutes,
            "checkpoint_every_steps": self.checkpoint_every_steps,
        }
        for key, value in positive.items():
            if value is not None and not value > 0:
                raise ValueError(f"{key}: {value} must be > 0")
        if self.batch_size % self.microbatch:
            raise ValueError(f"batch_size: {self.batch_size} must be a multiple of microbatch ({self.microbatch})")
        if not 0 <= self.ramp <= 1:
            raise ValueError(f"ramp: {self.ramp} must be in [0, 1]")
        if self.val_blocks < 0:
            raise ValueError(f"val_blocks: {self.val_blocks} must be >= 0")


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    import numpy as np
    import torch

    import model
    from stages import checkpoint

    pack = inputs["pack"]
    train = np.load(pack.path("train"), mmap_mode="r")
    val = np.load(pack.path("val"), mmap_mode="r")
    seq_len, special = int(pack.outputs["seq_len"]), pack.outputs["special_ids"]
    _check_data(train, val, seq_len, pack)
    cfg = _model_config(model, config.model, int(pack.outputs["vocab_size"]), seq_len, special["pad"])
    try:
        opt_cfg = model.OptimizerConfig(**dataclasses.asdict(config.optimizer))
    except ValueError as e:
        raise StageError(f"pretrain.{e}") from None
    _check_schedule(model, config)
    if config.batch_size % (ctx.world_size * config.microbatch):
        raise StageError(f"pretrain.batch_size: {config.batch_size} must be a multiple of microbatch x ranks "
                         f"({ctx.world_size * config.microbatch})")
    spec = mask_spec(config.masking, special, cfg.vocab_size, seq_len)
    device = devices.resolve(ctx.device)
    autocast = devices.autocast_dtype(config.precision, device)

    # Continue from the newest checkpoint (the one rank 0 sees, on every rank), or start afresh.
    resume_from = _agree_on(checkpoint.latest(out_dir / "checkpoints"), ctx)
    if resume_from is None:
        params = model.init(cfg, ctx.seed)
        opt_state, state = model.adamw_init(params), _fresh_state(ctx.seed)
    else:
        params, opt_state, state = checkpoint.load(resume_from)
        if state["seed"] != ctx.seed:
            raise StageError(f"{resume_from}: saved with seed {state['seed']}, the run has seed {ctx.seed}")
        ctx.log.info("resume", checkpoint=str(resume_from), step=state["step"], elapsed_s=state["elapsed_s"])
    params = {k: v.to(device) for k, v in params.items()}
    opt_state = {k: v.to(device) for k, v in opt_state.items()}
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(out_dir / "metrics.jsonl", state["step"])

    steps = _Steps(
        accumulate=model.make_accumulate_step(
            cfg, compile=config.compile, backend=config.backend, autocast_dtype=autocast),
        apply=model.make_apply_step(
            opt_cfg, compile=config.compile, backend=config.backend,
            reduce_grads=model.make_grad_all_reduce(ctx.world_size) if ctx.world_size > 1 else None),
        spec=spec,
        generator=torch.Generator(device=device),
        device=device,
    )
    # Two forward passes over a few hundred blocks are not worth a compile.
    evaluate = model.make_eval_step(cfg, compile=False, autocast_dtype=autocast)
    if ctx.is_main and config.val_blocks and state["val_loss_start"] is None:
        state["val_loss_start"] = _val_loss(evaluate, params, val, steps, config, ctx.seed)
    compile_s = 0.0
    if config.compile and _progress(config.budget, state, state["elapsed_s"]) < 1:
        compile_s = steps.warm_up(params, opt_state, train, config.microbatch)
    flops_per_token = model.flops_per_token(cfg, spec.per_sequence / seq_len)
    if ctx.is_main:
        _peak_flops(device)  # measured on a CPU, which takes seconds: before the budget clock starts

    last_saved = -1 if resume_from is None else state["step"]
    params, opt_state = _train(config, ctx, steps, params, opt_state, state, train, out_dir, last_saved,
                               flops_per_token)

    outputs = {"params": "params.safetensors", "model_config": "model.json", "metrics": "metrics.jsonl",
               "checkpoints": "checkpoints", "masking": dataclasses.asdict(config.masking)}
    if not ctx.is_main:
        return outputs
    checkpoint.write_tensors(out_dir / outputs["params"], params)
    (out_dir / outputs["model_config"]).write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
    tokens_per_s = state["tokens_seen"] / state["elapsed_s"] if state["elapsed_s"] else 0.0
    figures = {
        "final_loss": state["loss_end"],
        "loss_start": state["loss_start"],
        "val_loss_start": state["val_loss_start"],
        "val_loss_end": _val_loss(evaluate, params, val, steps, config, ctx.seed) if config.val_blocks else None,
        "steps": state["step"],
        "tokens_seen": state["tokens_seen"],
        "wall_s": round(state["elapsed_s"], 3),
        "compile_s": round(compile_s, 3),
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": _mfu(flops_per_token, tokens_per_s, device, ctx.world_size),
        "data_wait": round(state["data_wait_s"] / state["elapsed_s"], 4) if state["elapsed_s"] else 0.0,
        "num_params": model.num_params(params),
    }
    ctx.log.info("trained", **figures)
    return {**outputs, **figures}


_LOGGED = ("step", "loss", "accuracy", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_gb", "data_wait")


class DivergedError(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


@dataclass
class _Steps:
    """The compiled steps, and what turns a prefetched microbatch into their input on the device."""

    accumulate: Any
    apply: Any
    spec: Any
    generator: Any
    device: Any

    def batch(self, micro) -> dict:
        from stages.batches import mask_tokens

        self.generator.manual_seed(micro.mask_seed)
        ids = micro.ids.to(self.device, non_blocking=True)
        return mask_tokens(ids, self.spec, self.generator)

    def scalar(self, value: float):
        import torch

        t = torch.tensor(value, dtype=torch.float32)
        # A pageable host-to-device copy would wait for the GPU to drain; a pinned one does not.
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def warm_up(self, params: dict, opt_state: dict, train, microbatch: int) -> float:
        """Compile both steps on a throwaway batch, before the budget clock starts; return seconds.

        The steps are pure functions, so discarding their results leaves the training state as it was.
        """
        import torch

        from stages.batches import Microbatch, read_sequences

        began = time.perf_counter()
        ids = torch.from_numpy(read_sequences(train, 0, 0, microbatch, {}))
        grads = {k: torch.zeros_like(v) for k, v in params.items()}
        grads, _ = self.accumulate(params, grads, self.batch(Microbatch(ids, 0, 0)))
        _, _, metrics = self.apply(params, opt_state, grads, self.scalar(1.0), self.scalar(0.0))
        float(metrics["grad_norm"])  # wait for the device
        return time.perf_counter() - began


def _train(config: Config, ctx: Context, steps: _Steps, params: dict, opt_state: dict, state: dict, train,
           out_dir: Path, last_saved: int, flops_per_token: float) -> tuple[dict, dict]:
    """Step until the budget is spent, logging and checkpointing (the last checkpoint is the end).

    Returns the final (params, opt_state); `state` is updated in place."""
    import torch

    import model
    from stages import checkpoint
    from stages.batches import Prefetcher

    seq_len = train.shape[1]
    target_micro = config.batch_size // (ctx.world_size * config.microbatch)
    clock = _Clock(state["elapsed_s"], agree=ctx.world_size > 1 and config.budget.hours is not None,
                   device=steps.device)
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    last_saved_at = time.perf_counter()
    metrics_path = out_dir / "metrics.jsonl"
    lr = batch = 0.0
    wait_before_s = state["data_wait_s"]

    def save() -> None:
        """Write a checkpoint, unless the state went non-finite: then the next log step raises."""
        nonlocal last_saved, last_saved_at
        if interval.first_bad_step() is not None or not _all_finite(params):
            return
        state["elapsed_s"] = clock.local()
        state["data_wait_s"] = wait_before_s + data.wait_s
        state["progress"] = _progress(config.budget, state, state["elapsed_s"])
        state["unlogged"] = interval.fetch()
        checkpoint.save(out_dir / "checkpoints", state["step"], params, opt_state, state, config.keep_checkpoints)
        last_saved, last_saved_at = state["step"], time.perf_counter()
        ctx.log.info("checkpoint", step=state["step"])

    def log(interval: _Interval) -> None:
        """Raise if the interval diverged (on every rank alike), else record its metrics."""
        stats = interval.close(state, data.wait_s, ctx.world_size, steps.device)
        if stats["bad_step"] is not None:
            raise DivergedError(
                f"pretrain: loss or gradient norm is not finite at step {stats['bad_step']}; last good "
                f"checkpoint: {checkpoint.latest(out_dir / 'checkpoints') or 'none'} (try a lower optimizer.lr)"
            )
        if state["loss_start"] is None:
            state["loss_start"] = stats["loss"]
        state["loss_end"] = stats["loss"]
        if not ctx.is_main:
            return
        elapsed = clock.local()
        record = {
            "step": state["step"],
            "progress": round(_progress(config.budget, state, elapsed), 6),
            "elapsed_s": round(elapsed, 3),
            "loss": stats["loss"],
            "accuracy": stats["accuracy"],
            "grad_norm": stats["grad_norm"],
            "lr": lr,
            "batch_size": batch,
            "tokens_seen": state["tokens_seen"],
            "tokens_per_s": round(stats["tokens_per_s"], 1),
            "mfu": _mfu(flops_per_token, stats["tokens_per_s"], steps.device, ctx.world_size),
            "data_wait": round(stats["data_wait"], 4),
            "peak_mem_gb": round(_peak_memory_gb(steps.device), 3),
        }
        with open(metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        # One line per log step (torchtitan's): what a job log or a console without the bar shows.
        ctx.log.info("step", **{k: _short(record[k]) for k in _LOGGED})
        bar.update(record)

    with Prefetcher(
        train,
        seed=ctx.seed,
        start=state["sequences"],
        microbatch=config.microbatch,
        rank=ctx.rank,
        world_size=ctx.world_size,
        depth=config.prefetch,
        pin=steps.device.type == "cuda",
    ) as data, _ProgressBar(ctx.is_main) as bar:
        interval = _Interval(state, data.wait_s, rows=state["unlogged"])
        while (progress := _progress(config.budget, state, clock.agreed())) < 1:
            n_micro = _n_micro(progress, config.ramp, target_micro)
            lr = config.optimizer.lr * model.lr_schedule(config.schedule, progress, **config.schedule_args)
            grads, loss, accuracy = zeros, 0.0, 0.0
            for _ in range(n_micro):
                grads, m = steps.accumulate(params, grads, steps.batch(data.next()))
                loss, accuracy = loss + m["loss"], accuracy + m["accuracy"]
            params, opt_state, m = steps.apply(params, opt_state, grads, steps.scalar(n_micro), steps.scalar(lr))
            interval.add(torch.stack([loss / n_micro, accuracy / n_micro, m["grad_norm"]]))
            batch = n_micro * ctx.world_size * config.microbatch
            state["step"] += 1
            state["sequences"] += batch
            state["tokens_seen"] += batch * seq_len
            if state["step"] == 1 or state["step"] % config.log_every_steps == 0:
                log(interval)
                interval = _Interval(state, data.wait_s)
            if ctx.is_main and _checkpoint_due(config, state["step"], last_saved_at):
                save()
        if interval.rows or interval.pending:
            log(interval)
            interval = _Interval(state, data.wait_s)
        state["elapsed_s"] = clock.local()
        state["data_wait_s"] = wait_before_s + data.wait_s
        if ctx.is_main and last_saved != state["step"]:
            save()
    return params, opt_state


def _short(value: Any) -> Any:
    """Four significant digits: what a person reads in a log line (metrics.jsonl keeps them all)."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def _all_finite(params: dict) -> bool:
    import torch

    return bool(torch.stack([p.isfinite().all() for p in params.values()]).all())


def _checkpoint_due(config: Config, step: int, last_saved_at: float) -> bool:
    by_steps = config.checkpoint_every_steps is not None and step % config.checkpoint_every_steps == 0
    by_time = config.checkpoint_every_minutes is not None and (
        time.perf_counter() - last_saved_at >= 60 * config.checkpoint_every_minutes
    )
    return by_steps or by_time


def _progress(budget: Budget, state: dict, elapsed_s: float) -> float:
    """How much of the budget is spent, in [0, 1+): the largest fraction of any limit."""
    spent = [0.0]
    if budget.hours is not None:
        spent.append(elapsed_s / (3600 * budget.hours))
    if budget.steps is not None:
        spent.append(state["step"] / budget.steps)
    if budget.tokens is not None:
        spent.append(state["tokens_seen"] / budget.tokens)
    return max(spent)


def _n_micro(progress: float, ramp: float, target: int) -> int:
    """Microbatches per step: one at the start, growing linearly to `target` at `ramp` (cramming)."""
    if ramp == 0:
        return target
    return min(target, int(progress / ramp * target) + 1)


def _fresh_state(seed: int) -> dict[str, Any]:
    # The seed and the data position are the whole random state: batches and masks derive from them.
    return {
        "step": 0,
        "sequences": 0,  # data position: global sequences consumed
        "tokens_seen": 0,
        "elapsed_s": 0.0,  # budget time spent, carried over across resumes
        "data_wait_s": 0.0,  # of which waiting for batches
        "progress": 0.0,  # schedule position
        "seed": seed,
        "loss_start": None,
        "loss_end": None,
        "val_loss_start": None,
        "unlogged": [],  # metrics of the steps since the last log line, so that resuming keeps the curve
    }


class _Interval:
    """The per-step metrics since the last log line, kept on the device until they are needed."""

    def __init__(self, state: dict, wait_s: float, rows: list[list[float]] = ()):
        self.rows = list(rows)  # [loss, accuracy, grad_norm] per step, fetched (some from a checkpoint)
        self.pending: list = []  # the same, still on the device
        self.first_step = state["step"] + 1 - len(self.rows)
        self.tokens = state["tokens_seen"]
        self.started = time.perf_counter()
        self.wait_s = wait_s

    def add(self, row) -> None:
        self.pending.append(row)

    def first_bad_step(self) -> int | None:
        for i, row in enumerate(self.fetch()):
            if not all(math.isfinite(v) for v in row):
                return self.first_step + i
        return None

    def close(self, state: dict, wait_s: float, world_size: int, device) -> dict[str, Any]:
        rows = self.fetch()
        loss = sum(r[0] for r in rows) / len(rows)
        accuracy = sum(r[1] for r in rows) / len(rows)
        if world_size > 1:  # every rank reaches each log step, so a collective is safe here
            loss, accuracy = _mean_over_ranks([loss, accuracy], world_size, device)
        seconds = time.perf_counter() - self.started
        return {
            "loss": loss,
            "accuracy": accuracy,
            "grad_norm": rows[-1][2],
            "tokens_per_s": (state["tokens_seen"] - self.tokens) / seconds,
            "data_wait": (wait_s - self.wait_s) / seconds,
            "bad_step": self.first_bad_step(),
        }

    def fetch(self) -> list[list[float]]:
        import torch

        if self.pending:
            self.rows += torch.stack(self.pending).tolist()
            self.pending = []
        return self.rows


class _Clock:
    """Budget seconds: those carried over from a checkpoint plus this process's. `agreed()` is rank
    0's reading on every rank, so that with a time budget all ranks take the same number of steps."""

    def __init__(self, before_s: float, agree: bool, device):
        self.before_s, self.agree, self.device = before_s, agree, device
        self.started = time.perf_counter()

    def local(self) -> float:
        return self.before_s + time.perf_counter() - self.started

    def agreed(self) -> float:
        if not self.agree:
            return self.local()
        import torch
        import torch.distributed as dist

        reading = torch.tensor([self.local()], dtype=torch.float64, device=self.device)
        dist.broadcast(reading, src=0)
        return reading.item()


class _ProgressBar:
    """A progress bar against the budget with ETA, for people: rank 0, in a terminal only."""

    def __init__(self, enabled: bool):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

        console = Console(stderr=True)
        self.bar = Progress(
            TextColumn("pretrain"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            disable=not (enabled and console.is_terminal),
        )
        self.task = self.bar.add_task("pretrain", total=1.0, info="")

    def __enter__(self) -> _ProgressBar:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def update(self, r: dict) -> None:
        p, elapsed = r["progress"], r["elapsed_s"]
        eta = elapsed * (1 - p) / p if p > 0 else float("nan")
        mfu = "" if r["mfu"] is None else f"  mfu {100 * r['mfu']:.1f}%"
        info = (f"step {r['step']}  loss {r['loss']:.3f}  {r['tokens_per_s']:,.0f} tok/s{mfu}  "
                f"ETA {_duration(max(eta, 0.0))}")
        self.bar.update(self.task, completed=min(p, 1.0), info=info)


def _duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "?"
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _val_loss(evaluate, params: dict, val, steps: _Steps, config: Config, seed: int) -> float | None:
    """Mean MLM loss on the first `val_blocks` held-out blocks, with masks fixed by the seed."""
    import numpy as np
    import torch

    from stages.batches import mask_seed, mask_tokens

    n = min(config.val_blocks, len(val))
    size = min(config.microbatch, n)
    if size == 0:
        return None
    losses = []
    with torch.no_grad():
        for first in range(0, n - size + 1, size):
            steps.generator.manual_seed(mask_seed(seed, first, stream=1))
            ids = torch.from_numpy(np.asarray(val[first:first + size], dtype=np.int32)).to(steps.device)
            losses.append(evaluate(params, mask_tokens(ids, steps.spec, steps.generator))["loss"].float())
    return torch.stack(losses).mean().item()


def mask_spec(masking: Masking, special: dict[str, int], vocab_size: int, seq_len: int):
    """The masking of pretraining for blocks of `seq_len`; evaluate masks its held-out blocks alike."""
    from stages.batches import MaskSpec

    per_sequence = round(masking.rate * seq_len)
    if per_sequence < 1:
        raise StageError(f"pretrain.masking.rate: {masking.rate} masks no token of a {seq_len}-token block")
    return MaskSpec(
        per_sequence=per_sequence,
        mask_id=special["mask"],
        vocab_size=vocab_size,
        special_ids=tuple(sorted(set(special.values()))),
        replace_with_mask=masking.mask_token,
        replace_with_random=masking.random_token,
    )


def _model_config(model, arch: Architecture, vocab_size: int, seq_len: int, pad_id: int):
    if arch.preset not in model.PRESETS:
        raise StageError(f"pretrain.model.preset: {arch.preset!r} is not one of {', '.join(model.PRESETS)}")
    overrides = {k: v for k, v in dataclasses.asdict(arch).items() if k != "preset" and v is not None}
    try:
        return dataclasses.replace(
            model.PRESETS[arch.preset], vocab_size=vocab_size, max_seq_len=seq_len, pad_id=pad_id, **overrides
        )
    except (TypeError, ValueError) as e:
        raise StageError(f"pretrain.model: {e}") from None


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




def _agree_on(path: Path | None, ctx: Context) -> Path | None:
    """Rank 0's value of `path` on every rank."""
    if ctx.world_size == 1:
        return path
    import torch.distributed as dist

    box = [None if path is None else str(path)]
    dist.broadcast_object_list(box, src=0)
    return None if box[0] is None else Path(box[0])


def _mean_over_ranks(values: list[float], world_size: int, device) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / world_size).tolist()


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines a killed run wrote after its last checkpoint (all of them on a fresh start)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except json.JSONDecodeError:  # the half-written last line of a killed run
            pass
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _peak_memory_gb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


@functools.cache
def _peak_flops(device) -> float:
    """The device's peak FLOP/s; on a CPU it is measured, which takes seconds, so once per process."""
    from model import peak_flops

    return peak_flops(device)


def _mfu(flops_per_token: float, tokens_per_s: float, device, world_size: int) -> float:
    """Model FLOPs utilisation (PaLM's convention): against the bf16 dense peak on a GPU, a measured
    fp32 matmul on a CPU."""
    return round(flops_per_token * tokens_per_s / (_peak_flops(device) * world_size), 5)
