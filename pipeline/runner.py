"""Run a plan's steps (see planning.py) into the stage store and link them into the run.

A stage runs into `ROOT/.store/<stage>-<key>.partial/` under the key's lock; when its `run` returns the
folder is renamed to the store entry `ROOT/.store/<stage>-<key>/` and `RUN_DIR/<stage>` is pointed at
it; the manifest says `done` only after that. A key whose entry is already in the store (made by any
run under the same root) is linked, not computed. A failed or interrupted attempt never replaces a
stage's earlier done record: it is kept beside it as `attempt`. Under torchrun every rank plans, rank 0
alone holds the locks, writes the manifest and links; stages with `DISTRIBUTED = True` run on every
rank, the others on rank 0 while the rest wait. `default_stages` is the one place the CLI (and bench/)
finds the stages to run, and where tests swap in fake ones.

    steps = plan(conf, modules, run_dir, only="pretrain")
    rank = run_pipeline(conf, run_dir, steps)  # raises StageFailed, Interrupted, rundir.RunDirError, ...
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import time
import traceback
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from cram import stages
from cram.pipeline import config as cfg
from cram.pipeline import logs, ranks, rundir, store
from cram.pipeline.errors import CramError, Interrupted
from cram.pipeline.planning import Step, fingerprint
from cram.pipeline.schema import StageRecord, Try, TryStatus
from cram.stages.protocols import Log, StageLike, StageSpec, read
from cram.stages.shared import loggers as stage_loggers

_VERSIONED = ("torch", "numpy", "datasets", "sentencepiece", "tokenizers", "safetensors", "structlog", "typer")


class StageFailed(CramError):
    """A stage raised; `exit_code` is 2 for bad input or config (StageError), 1 otherwise. The message
    names the log, where the traceback is."""

    def __init__(self, stage: str, message: str, exit_code: int, log_path: Path):
        super().__init__(f"stage '{stage}' failed: {message} (log: {log_path})", exit_code)
        self.stage, self.log_path = stage, log_path


def default_stages() -> list[StageSpec]:
    return [stages.load(name) for name in stages.ORDER]


def config_classes(modules: Sequence[StageLike]) -> dict[str, type]:
    """The TOML sections: one per stage, less those whose config is made from the others' (`config_of`)."""
    return {s.NAME: s.Config for s in map(read, modules) if s.has_section}


def load_saved(run_dir: Path, modules: Sequence[StageLike]) -> cfg.PipelineConfig:
    """The config a run was started with, to continue it."""
    saved = run_dir / rundir.CONFIG
    if not saved.is_file():
        raise CramError(f"{saved}: no saved config; is {run_dir} a run directory?")
    return cfg.load(saved, config_classes(modules))


def run_pipeline(config: cfg.PipelineConfig, run_dir: Path, steps: list[Step]) -> int:
    """Execute `steps` as this process's part of the run: under torchrun, inside the process group (ended
    on every path, see ranks.finish_distributed); logging to the run's events file; rank 0 holding the
    run's lock. Returns this process's rank."""
    rank, world_size = ranks.init_distributed(config.run.device)
    main = rank == 0
    try:
        try:
            logs.configure(run_dir / rundir.EVENTS if main else None, console=main)
        except OSError as e:
            raise CramError(f"{run_dir}: cannot write the run's log ({e.strerror}: {e.filename})") from None
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            with rundir.locked(run_dir, logs.get(run=run_dir.name)):
                execute(config, steps, run_dir, cfg.to_toml(config.to_dict()), rank, world_size)
        else:
            execute(config, steps, run_dir, "", rank, world_size)
    except OSError as e:  # the run directory itself: read-only, full, or gone; a stage's own errors are StageFailed
        raise CramError(f"{run_dir}: cannot write the run ({e.strerror}: {e.filename})") from None
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; continue with: cram resume {run_dir}") from None
    finally:
        ranks.finish_distributed()
    return rank


def execute(
    config: cfg.PipelineConfig,
    steps: list[Step],
    run_dir: Path,
    config_text: str,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """Run (or link from the store) the steps not marked `skip`, in order. Returns the manifest's records."""
    main = rank == 0
    log = logs.get(run=run_dir.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    if main:
        rundir.write_atomic(run_dir / rundir.CONFIG, config_text)
    here = _Process(config, run_dir, rundir.Manifest.load(run_dir), rank, world_size)
    for step in steps:
        if step.action == "skip":
            if main:
                log.info("skip", stage=step.name, reason=step.reason)
            continue
        _run_step(here, step)
    return here.manifest.records


@dataclass(frozen=True)
class _Process:
    """This process's part of a run: the config, the run directory and its manifest, and which of the
    `world_size` torchrun ranks it is (rank 0 alone locks, writes the manifest and links)."""

    config: cfg.PipelineConfig
    run_dir: Path
    manifest: rundir.Manifest
    rank: int
    world_size: int

    @property
    def main(self) -> bool:
        return self.rank == 0


def _run_step(here: _Process, step: Step) -> None:
    main, run_dir, world_size = here.main, here.run_dir, here.world_size
    stored = store.Store.of(run_dir)
    structlog.contextvars.bind_contextvars(stage=step.name)
    log = logs.get(run=run_dir.name)
    try:
        with ExitStack() as held:
            if main:  # held until the entry is linked: no other process computes this key meanwhile
                held.enter_context(stored.locked(step.name, step.key, log))
            entry = stored.entry(step.name, step.key)
            # Looked at again under the lock: another process may have finished (or gc removed) it.
            reuse = main and step.reason != "forced" and _intact(entry, step, log)
            if ranks.from_rank_0(reuse, world_size):
                if main:
                    _reuse(step, run_dir, entry, here.manifest, log)
                ranks.barrier(world_size)
                return
            _compute(here, step, stored, log)
    finally:
        structlog.contextvars.unbind_contextvars("stage")


def _intact(entry: Path, step: Step, log: Log) -> bool:
    """Whether the store's entry for the step's key can be linked: there, and every file hashes as it was
    written (a run that links it reads it). A damaged one is computed again, as a missing one is."""
    trouble = store.verify(entry, step.key)
    if trouble is not None and trouble.damaged:
        log.warning("a damaged store entry is computed again", problem=str(trouble))
    return trouble is None


def _damaged_upstream(step: Step, run_dir: Path) -> tuple[str, int] | None:
    """Rank 0: the error that stops the step before it starts when an upstream output it reads no longer
    hashes as written (a change that kept its size and time, unseen by the plan). The entry is noted as
    damaged, so the next `cram run` computes it again."""
    for name in step.upstream_keys:
        trouble = store.verify(run_dir / name, step.upstream_keys[name])
        if trouble is not None:
            return f"{trouble}; stage '{step.name}' did not start: cram run computes {name} again", 2
    return None


def _reuse(step: Step, run_dir: Path, entry: Path, manifest: rundir.Manifest, log: Log) -> None:
    record = store.entry_record(entry)
    store.link(run_dir, step.name, entry)
    manifest.put(step.name, replace(record, key=step.key, status="done", reused=rundir.now(), attempt=None))
    log.info("reused from the store", key=step.key[:12], entry=str(entry))


@dataclass
class _Attempt:
    """This try at a stage as the manifest records it. Where the stage has a done result that is still
    intact (`keep`), the attempt is saved beside it and replaces it only by succeeding."""

    manifest: rundir.Manifest
    stage: str
    keep: bool = False
    record: StageRecord | None = None  # None until `_begin` records the try as running

    def save(self, record: StageRecord) -> None:
        """Record `record` as this try, beside a kept result or in its place."""
        self.record = record
        if self.keep:
            self.manifest.update(self.stage, attempt=record)
        else:
            self.manifest.put(self.stage, record)

    def closed(self, status: TryStatus, duration_s: float, **changes: Any) -> StageRecord:
        """This try's record once it ended with `status` (and `changes`, fields of StageRecord): its end,
        every try at this key with this one last (`attempts`), and `duration_s`, their durations added up:
        a stage interrupted and resumed took all of its tries' time, not the last one's."""
        if self.record is None:
            raise RuntimeError(f"{self.stage}: a try closed before it began")
        ended = rundir.now()
        tries = (*self.record.attempts, Try(self.record.started, ended, duration_s, status))
        total = round(sum(t.duration_s for t in tries if t.duration_s is not None), 3)
        return replace(self.record, status=status, ended=ended, attempts=tries, duration_s=total, **changes)


def _earlier_tries(previous: StageRecord | None, key: str) -> tuple[Try, ...]:
    """The unfinished tries at `key` before this one, from the record it follows (or the attempt kept
    beside a done result): their `attempts`, and the try a killed process could not close (its
    duration unknown)."""
    for record in (previous.attempt, previous) if previous is not None else ():
        if record is not None and record.key == key and record.status != "done":
            if record.status == "running":  # its process was killed: it could not close its try
                return (*record.attempts, Try(record.started, record.ended, record.duration_s, "killed"))
            return record.attempts
    return ()


def _compute(here: _Process, step: Step, stored: store.Store, log: Log) -> None:
    config, run_dir, manifest, main, world_size = here.config, here.run_dir, here.manifest, here.main, here.world_size
    damaged = ranks.agree(_damaged_upstream(step, run_dir) if main else None, world_size)
    if damaged is not None:
        raise CramError(*damaged)
    partial = stored.partial(step.name, step.key)
    attempt = _Attempt(manifest, step.name)
    started = time.perf_counter()
    try:
        if main:
            _begin(attempt, step, run_dir, stored, partial, log)
        ranks.barrier(world_size)
        # Other ranks read the manifest rank 0 has written, which holds the upstream outputs.
        records = manifest if main else rundir.Manifest.load(run_dir)
        inputs = {name: stages.Upstream(run_dir / name, _outputs(records, name)) for name in step.upstream_keys}
        ctx = _context(here, step, log)
        outputs: dict[str, Any] = {}
        error: tuple[str, int] | None = None
        if main or step.stage.DISTRIBUTED:
            outputs, error = _call(config, step, inputs, partial, ctx, log)
        if main and error is None:
            error = _changed_inputs(config, step, stored)
        error = ranks.agree(error, world_size)
        duration = round(time.perf_counter() - started, 3)
        if error is not None:
            if main:
                if not step.stage.RESUMABLE:  # nothing to continue from: free its disk now
                    shutil.rmtree(partial, ignore_errors=True)
                attempt.save(attempt.closed("failed", duration, error=error[0]))
                log.error("failed", error=error[0], **({"kept": "the earlier result"} if attempt.keep else {}))
            raise StageFailed(step.name, error[0], error[1], run_dir / rundir.EVENTS)
        if main:
            record = attempt.closed("done", duration, outputs=outputs, pid=None)
            store.link(run_dir, step.name, stored.finish(partial, step.name, step.key, record))
            manifest.put(step.name, record)
            log.info("done", duration_s=record.duration_s)
        ranks.barrier(world_size)
    except KeyboardInterrupt:
        if main and attempt.record is not None and attempt.record.status == "running":
            duration = round(time.perf_counter() - started, 3)
            attempt.save(attempt.closed("interrupted", duration, error="interrupted (Ctrl-C)"))
            log.warning("interrupted")
        raise


def _begin(attempt: _Attempt, step: Step, run_dir: Path, stored: store.Store, partial: Path, log: Log) -> None:
    """Rank 0: make the partial folder (re-entered by a resumable stage) and record the attempt as running."""
    previous = attempt.manifest.stage(step.name)
    attempt.keep = (
        previous is not None
        and previous.status == "done"
        and store.problem(run_dir / step.name, previous.key or "") is None
    )
    _mention_other_partial(previous, step, stored, log)
    if partial.exists() and not (step.stage.RESUMABLE and step.reason != "forced"):
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    attempt.save(
        StageRecord(
            key=step.key,
            config_hash=step.config_hash,
            inputs_hash=step.inputs_hash,
            upstream_keys=step.upstream_keys,
            version=step.stage.VERSION,
            status="running",
            started=rundir.now(),
            attempts=_earlier_tries(previous, step.key),
            pid=os.getpid(),
            host=socket.gethostname(),
            git_commit=_git_commit(),
            versions=_versions(),
        )
    )
    log.info("start", reason=step.reason, key=step.key[:12], dir=str(partial))


def _outputs(manifest: rundir.Manifest, name: str) -> dict[str, Any]:
    record = manifest.stage(name)
    return record.outputs if record is not None else {}


def _context(here: _Process, step: Step, log: Log) -> stages.Context:
    config, run_dir, rank = here.config, here.run_dir, here.rank
    return stages.Context(
        seed=config.run.seed,
        device=config.run.device,
        attention=config.run.attention,
        run_dir=run_dir,
        log=log,
        rank=rank,
        world_size=here.world_size,
        metrics=stage_loggers.make(
            config.run.loggers if rank == 0 else (), run_dir / "logs", run_dir.name, step.name, config.to_dict()
        ),
    )


def _changed_inputs(config: cfg.PipelineConfig, step: Step, stored: store.Store) -> tuple[str, int] | None:
    """The stage's outside inputs fingerprinted again once it returned: one that changed while it ran (a
    tokenizer file rewritten, a corpus file cut short or deleted) would leave outputs under a key they do
    not match, so the error names it and nothing is kept. (A large file costs a `stat`: the hash cache.)"""
    if step.inputs is None:
        return None
    now = fingerprint(step.stage, step.config, stored) or []
    if cfg.digest(now) == step.inputs_hash:
        return None
    before = {json.dumps(entry) for entry in step.inputs}
    entry = next((e for e in now if json.dumps(e) not in before), None) or next(
        (e for e in step.inputs if e not in now), ["inputs"]
    )
    name = next((str(x) for x in entry if isinstance(x, str) and x not in ("tokenizer", "unavailable")), str(entry))
    return f"{name}: changed while {step.name} ran; nothing was kept: run it again", 2


def _call(
    config: cfg.PipelineConfig,
    step: Step,
    inputs: dict[str, stages.Upstream],
    partial: Path,
    ctx: stages.Context,
    log: Log,
) -> tuple[dict[str, Any], tuple[str, int] | None]:
    """The stage's outputs, or the error it raised with its exit code (2 bad input or config, 1 a crash)."""
    finished = False
    try:
        outputs = step.stage.run(step.config, inputs, partial, ctx)
        json.dumps(outputs)  # outputs must be JSON: fail here, not when the manifest is saved
        finished = True
        return outputs, None
    except stages.StageError as e:
        return {}, (str(e), 2)
    except Exception as e:  # a stage's own bug or crash: keep the traceback in the log
        log.error("stage raised", exc_info=True)
        return {}, (f"{type(e).__name__}: {e}" + _attention_hint(e, config.run.attention), 1)
    finally:
        ctx.metrics.close(failed=not finished)  # an error or Ctrl-C: the experiment run is marked failed


# Names of SDPA and its kernels, as they appear in the errors and tracebacks of a failure inside them.
_SDPA_MARKS = ("scaled_dot_product", "sdpa", "flash_attention", "efficient_attention", "cudnn_attention")


def _attention_hint(error: BaseException, attention: str) -> str:
    """The one-line way round a crash inside SDPA (known under compiled torch.func gradients, pytorch#181177):
    the written-out attention, which computes the same."""
    if attention == "written":
        return ""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__)).lower()
    if not any(mark in text for mark in _SDPA_MARKS):
        return ""
    return '; it failed in SDPA: set run.attention = "written" (--set run.attention=written) to attend without it'


def _mention_other_partial(previous: StageRecord | None, step: Step, stored: store.Store, log: Log) -> None:
    """Say where an unfinished attempt with another key is kept: nothing is dropped without a word."""
    for record in (previous, previous.attempt if previous is not None else None):
        key = record.key if record is not None and record.status != "done" else None
        if key and key != step.key and stored.partial(step.name, key).is_dir():
            log.warning(
                "an unfinished attempt with another config is kept; return to that config to continue it, "
                "or remove it with cram gc",
                partial=str(stored.partial(step.name, key)),
            )


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
