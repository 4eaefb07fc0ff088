"""Experiment loggers: a stage's figures streamed to TensorBoard or Weights & Biases, besides metrics.jsonl.

    metrics = loggers.make(("tensorboard",), run_dir / "logs", run="default", stage="pretrain")
    metrics.log(step, {"loss": 6.2, "lr": 1e-3})    # every number of the record, at `step`
    metrics.close()                                  # close(failed=True): the stage raised or was interrupted

Each backend is an optional extra (`pip install -e '.[tensorboard]'`, `'.[wandb]'`); `check` names the
extra to install when its package is missing, so that a bad `[run] loggers` fails before any stage runs.
Backends open on the first record, so a stage that logs nothing (tokenize, pack) leaves no trace.

- tensorboard: `logs/tensorboard/<stage>/`, one TensorBoard run per stage, tags named as in
  metrics.jsonl. A stage that resumes or re-runs logs from some step again: the writer opens with
  `purge_step` at that step, so TensorBoard drops what an earlier attempt wrote from there on.
- wandb: `logs/wandb/`, one W&B run per stage and attempt, grouped by run name, job type the stage,
  the resolved pipeline config as its config; a stage that failed closes its run with exit code 1, so W&B
  shows it as failed, not finished. Offline unless the environment says otherwise
  (`WANDB_MODE=online`); `wandb sync RUN/logs/wandb/offline-run-*` uploads later.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from cram.stages.shared.figures import is_number

BACKENDS = ("tensorboard", "wandb")  # each name is also its pip extra and the package that extra installs


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


class Metrics:
    """Fans a stage's records out to its sinks. Numbers only: strings, None and flags are left out,
    and so is `step`, which is the x-axis."""

    def __init__(self, sinks: Sequence[Sink] = ()):
        self.sinks = tuple(sinks)

    def log(self, step: int, record: Mapping[str, Any], prefix: str = "") -> None:
        if not self.sinks:
            return
        values = {prefix + k: float(v) for k, v in record.items() if k != "step" and is_number(v)}
        for sink in self.sinks:
            sink.log(int(step), values)

    def close(self, failed: bool = False) -> None:
        """Close every sink; `failed`: the stage did not finish (it raised, or was interrupted)."""
        for sink in self.sinks:
            sink.close(failed)


NONE = Metrics()  # no loggers: what a stage sees on other ranks, in tests, or without `[run] loggers`


def check(names: Sequence[str]) -> None:
    """Raise ValueError naming what is wrong: an unknown logger, one listed twice, a missing package."""
    for i, name in enumerate(names):
        if name not in BACKENDS:
            raise ValueError(f"loggers: {name!r} is not a logger; choose from {', '.join(map(repr, BACKENDS))}")
        if name in names[:i]:
            raise ValueError(f"loggers: {name!r} is listed twice")
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"loggers: {name!r} needs the {name} package: pip install -e '.[{name}]'")


def make(names: Sequence[str], root: Path, run: str, stage: str, config: Mapping[str, Any] | None = None) -> Metrics:
    """The sinks `names` asks for, writing under `root` (the run directory's `logs/`)."""
    makers = {
        "tensorboard": lambda: TensorBoard(root / "tensorboard" / stage),
        "wandb": lambda: WandB(root, run, stage, config or {}),
    }
    return Metrics([makers[name]() for name in names])


class TensorBoard:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.writer: Any = None

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir), purge_step=step)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # once per log step: a crash loses nothing, and a live TensorBoard sees it

    def close(self, failed: bool = False) -> None:  # a TensorBoard run has no outcome to record
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandB:
    def __init__(self, root: Path, run: str, stage: str, config: Mapping[str, Any]):
        self.root, self.group, self.stage, self.config = root, run, stage, dict(config)
        self.run: Any = None

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.run is None:
            import wandb

            self.root.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "cram"),
                dir=str(self.root),
                mode=os.environ.get("WANDB_MODE", "offline"),
                group=self.group,
                job_type=self.stage,
                name=f"{self.group}/{self.stage}",
                config=self.config,
                # The console stays ours: no stdout capture, no banner lines between the step lines.
                settings=wandb.Settings(console="off", silent=True),
            )
        self.run.log(values, step=step)

    def close(self, failed: bool = False) -> None:
        if self.run is not None:
            import wandb

            self.run.finish(exit_code=1 if failed else 0)  # non-zero: W&B marks the run failed
            # finish returns before wandb's service process has written the run's file; teardown waits
            # for it, so the run is complete on disk when the stage ends (the next one starts a service anew).
            wandb.teardown()
            self.run = None
