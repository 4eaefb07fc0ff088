"""Plan which stages to run and why, then run them into their run directory.

A stage runs into `RUN_DIR/.partial/<stage>-<key12>/` and is renamed to `RUN_DIR/<stage>/` only when
its `run` returns; the manifest says `done` only after that rename. Under torchrun every rank plans,
rank 0 alone holds the lock, writes the manifest and renames; stages with `DISTRIBUTED = True` run on
every rank, the others on rank 0 while the rest wait.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

import stages
from pipeline import config as cfg
from pipeline import logs, rundir

_VERSIONED = ("torch", "numpy", "datasets", "sentencepiece", "safetensors", "structlog", "typer")


class StageFailed(Exception):
    """A stage raised; `exit_code` is 2 for bad input or config (StageError), 1 otherwise."""

    def __init__(self, stage: str, message: str, exit_code: int, log_path: Path):
        super().__init__(f"stage '{stage}' failed: {message}")
        self.stage, self.exit_code, self.log_path = stage, exit_code, log_path


class PlanError(Exception):
    """The requested selection cannot run (an upstream is not done, an unknown stage); exit code 2."""


@dataclass(frozen=True)
class Step:
    name: str
    module: ModuleType
    key: str
    config_hash: str
    inputs_hash: str | None
    upstream_keys: dict[str, str]
    action: str  # "run" or "skip"
    reason: str


def default_stages() -> list[ModuleType]:
    return [stages.load(name) for name in stages.ORDER]


def config_classes(modules: list[ModuleType]) -> dict[str, type]:
    return {m.NAME: m.Config for m in modules}


def plan(
    config: cfg.PipelineConfig,
    modules: list[ModuleType],
    run_dir: Path,
    only: str | None = None,
    start: str | None = None,
    force: tuple[str, ...] = (),
) -> list[Step]:
    """Each stage with run/skip and why. `only` runs one stage; `start` forces it and all after it."""
    names = [m.NAME for m in modules]
    for given in (only, start, *force):
        if given is not None and given not in names:
            raise PlanError(f"unknown stage '{given}'; stages are: {', '.join(names)}")
    manifest = rundir.Manifest.load(run_dir)
    keys: dict[str, str] = {}
    steps: list[Step] = []
    for i, module in enumerate(modules):
        stage_config = config.stages[module.NAME]
        upstream = {u: keys[u] for u in module.UPSTREAM}
        config_hash = cfg.digest({"version": module.VERSION, "config": stage_config, "seed": config.run.seed})
        # A stage that reads files outside the run (a corpus) says what of them its output depends on.
        inputs_hash = cfg.digest(module.fingerprint(stage_config)) if hasattr(module, "fingerprint") else None
        key = cfg.digest(
            {
                "stage": module.NAME,
                "version": module.VERSION,
                "config": stage_config,
                "seed": config.run.seed,
                "upstream": upstream,
                "inputs": inputs_hash,
            }
        )
        keys[module.NAME] = key
        record = manifest.stage(module.NAME)
        done = _is_done(record, key, run_dir / module.NAME)
        selected = (only is None or module.NAME == only) and (start is None or i >= names.index(start))
        if not selected:
            action, reason = "skip", "done" if done else "not selected"
        elif module.NAME in force or start is not None:
            action, reason = "run", "forced"
        elif done:
            action, reason = "skip", "done"
        else:
            action, reason = "run", _why_not_done(record, key, config_hash, upstream)
        steps.append(Step(module.NAME, module, key, config_hash, inputs_hash, upstream, action, reason))
    _check_upstream_done(steps)
    _validate(config, steps)
    return steps


def _validate(config: cfg.PipelineConfig, steps: list[Step]) -> None:
    """Each stage's own checks (its optional `validate`), before any stage runs: a bad pretrain or
    evaluate setting fails now, not after the stages before it. A done stage passed them when it ran."""
    for step in steps:
        check = getattr(step.module, "validate", None)
        if check is not None and step.reason != "done":
            try:
                check(config.stages[step.name], config)
            except stages.StageError as e:
                raise PlanError(str(e)) from None


def _is_done(record: dict[str, Any] | None, key: str, out_dir: Path) -> bool:
    return bool(record) and record.get("status") == "done" and record.get("key") == key and out_dir.is_dir()


def _why_not_done(record: dict[str, Any] | None, key: str, config_hash: str, upstream: dict[str, str]) -> str:
    if not record or "key" not in record:
        return "new"
    if record["key"] == key:
        return "incomplete"
    if record.get("config_hash") != config_hash:
        return "config changed"
    if record.get("upstream_keys") != upstream:
        return "upstream changed"
    return "inputs changed"


def _check_upstream_done(steps: list[Step]) -> None:
    by_name = {s.name: s for s in steps}
    for step in steps:
        if step.action != "run":
            continue
        for name in step.module.UPSTREAM:
            up = by_name[name]
            if up.action == "skip" and up.reason != "done":
                raise PlanError(
                    f"stage '{step.name}' needs '{name}', which is not done; "
                    f"run it first (e.g. without --only/--from)"
                )


def execute(
    config: cfg.PipelineConfig,
    steps: list[Step],
    run_dir: Path,
    config_text: str,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """Run the steps marked `run`, in order. Returns the manifest's stage records."""
    main = rank == 0
    log = logs.get(run=run_dir.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    if main:
        rundir.write_atomic(run_dir / rundir.CONFIG, config_text)
    manifest = rundir.Manifest.load(run_dir)
    for step in steps:
        if step.action == "skip":
            if main:
                log.info("skip", stage=step.name, reason=step.reason)
            continue
        _run_step(config, step, run_dir, manifest, rank, world_size)
    return manifest.data["stages"]


def _run_step(
    config: cfg.PipelineConfig,
    step: Step,
    run_dir: Path,
    manifest: rundir.Manifest,
    rank: int,
    world_size: int,
) -> None:
    main = rank == 0
    resumable = getattr(step.module, "RESUMABLE", False)
    on_this_rank = main or getattr(step.module, "DISTRIBUTED", False)
    partial = run_dir / rundir.PARTIAL / f"{step.name}-{step.key[:12]}"
    log_path = run_dir / rundir.EVENTS
    structlog.contextvars.bind_contextvars(stage=step.name)
    log = logs.get(run=run_dir.name)
    try:
        if main:
            _clear_partials(run_dir, step.name, keep=partial if resumable and step.reason != "forced" else None)
            partial.mkdir(parents=True, exist_ok=True)
            manifest.update(
                step.name,
                key=step.key,
                config_hash=step.config_hash,
                inputs_hash=step.inputs_hash,
                upstream_keys=step.upstream_keys,
                version=step.module.VERSION,
                status="running",
                started=rundir.now(),
                ended=None,
                duration_s=None,
                outputs={},
                error=None,
                pid=os.getpid(),
                git_commit=_git_commit(),
                versions=_versions(),
            )
            log.info("start", reason=step.reason, key=step.key[:12], dir=str(partial))
        _barrier(world_size)
        # Other ranks read the manifest rank 0 has written, which holds the upstream outputs.
        records = manifest if main else rundir.Manifest.load(run_dir)
        inputs = {
            name: stages.Upstream(run_dir / name, records.stage(name)["outputs"])
            for name in step.module.UPSTREAM
        }
        ctx = stages.Context(
            seed=config.run.seed,
            device=config.run.device,
            run_dir=run_dir,
            log=log,
            rank=rank,
            world_size=world_size,
        )
        started = time.perf_counter()
        error: tuple[str, int] | None = None
        outputs: dict[str, Any] = {}
        if on_this_rank:
            try:
                outputs = step.module.run(config.stages[step.name], inputs, partial, ctx)
                json.dumps(outputs)  # outputs must be JSON: fail here, not when the manifest is saved
            except stages.StageError as e:
                error = (str(e), 2)
            except Exception as e:  # a stage's own bug or crash: keep the traceback in the log
                log.error("stage raised", exc_info=True)
                error = (f"{type(e).__name__}: {e}", 1)
        error = _agree(error, world_size)
        if error is not None:
            if main:
                manifest.update(step.name, status="failed", ended=rundir.now(), error=error[0],
                                duration_s=round(time.perf_counter() - started, 3))
                log.error("failed", error=error[0])
            raise StageFailed(step.name, error[0], error[1], log_path)
        if main:
            _put_in_place(partial, run_dir / step.name)
            duration = round(time.perf_counter() - started, 3)
            manifest.update(step.name, status="done", ended=rundir.now(), duration_s=duration,
                            outputs=outputs, pid=None)
            log.info("done", duration_s=duration)
        _barrier(world_size)
    except KeyboardInterrupt:
        if main and (manifest.stage(step.name) or {}).get("status") == "running":
            manifest.update(step.name, status="interrupted", ended=rundir.now(), error="interrupted (Ctrl-C)")
            log.warning("interrupted")
        raise
    finally:
        structlog.contextvars.unbind_contextvars("stage")


def _clear_partials(run_dir: Path, stage: str, keep: Path | None) -> None:
    """Remove this stage's leftover partial folders, except the one a resumable stage re-enters."""
    root = run_dir / rundir.PARTIAL
    if not root.is_dir():
        return
    for path in root.glob(f"{stage}-*"):
        if path != keep:
            shutil.rmtree(path)


def _put_in_place(partial: Path, final: Path) -> None:
    """Swap `partial` in as `final`; the old `final` is moved aside first, then deleted."""
    old = None
    if final.exists():
        old = partial.parent / f"{final.name}.old-{os.getpid()}"
        os.replace(final, old)
    os.replace(partial, final)
    if old is not None:
        shutil.rmtree(old)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def _agree(error: tuple[str, int] | None, world_size: int) -> tuple[str, int] | None:
    """Every rank learns whether the stage failed on any rank (rank 0's error wins)."""
    if world_size == 1:
        return error
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, error)
    return next((e for e in gathered if e is not None), None)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def init_distributed(device: str) -> tuple[int, int]:
    """(rank, world_size); under torchrun, also start the default process group.

    The group's time-out is long because ranks other than 0 wait in a barrier while rank 0 alone
    runs the non-distributed stages (tokenizing a large corpus can take hours).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    import datetime

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        use_cuda = device != "cpu" and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(hours=6))
    return dist.get_rank(), dist.get_world_size()
