"""The pipeline's stages and the contract each one keeps.

A stage is a module in this package that exposes:

    NAME: str                 # the TOML section and the output folder name
    VERSION: str              # bump when the stage's output changes meaning
    UPSTREAM: tuple[str, ...] # stages whose outputs it reads
    RESUMABLE: bool           # True: an interrupted run re-enters the same partial dir
    Config                    # a frozen dataclass: the stage's TOML section
    def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict

A stage without a TOML section of its own defines `config_of(pipeline) -> Config | None` instead: its
config, made from other stages' sections (the baseline stage's, from evaluate's and pretrain's); None
where it has nothing to do, and the planner then leaves it out of the run (an upstream left out is no
part of its downstream's key), and `RUNS_WITH`, the setting that gives it something to do (for the
error that refuses `--only` of it).

`run` writes everything into `out_dir` (a temporary folder that the runner renames into place once
`run` returns) and returns a small JSON-serialisable dict: paths relative to `out_dir` and figures.
Stages import heavy libraries (torch, datasets) inside `run`: a fully cached `cram run` must not pay
for them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from cram.stages.shared import loggers

ORDER: tuple[str, ...] = ("tokenize", "pack", "pretrain", "baseline", "evaluate")


class StageError(Exception):
    """A failure caused by the stage's input or config: reported in one line, exit code 2."""


@dataclass(frozen=True)
class Upstream:
    """A finished upstream stage as its downstream sees it."""

    dir: Path
    outputs: dict[str, Any]

    def path(self, key: str) -> Path:
        """`dir / outputs[key]`; StageError naming the folder and the key where the outputs name no such
        file (a manifest edited by hand, or damaged): a downstream stage cannot go on without it."""
        name = self.outputs.get(key)
        if not isinstance(name, str) or not name:
            raise StageError(
                f"{self.dir}: its stage's recorded outputs name no '{key}' (got {name!r}); "
                f"re-run it with --force {self.dir.name}"
            )
        return self.dir / name


@dataclass(frozen=True)
class Context:
    """What a stage may know of the run besides its own section."""

    seed: int
    device: str  # "auto", "cpu", "cuda" or "cuda:N"
    run_dir: Path
    log: Any = field(repr=False)  # a structlog logger bound to run and stage
    rank: int = 0
    world_size: int = 1
    metrics: loggers.Metrics = field(default=loggers.NONE, repr=False)  # `[run] loggers`: TensorBoard, W&B
    attention: str = "auto"  # `[run] attention`: how the model computes attention (model.ATTENTIONS)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def load(name: str) -> ModuleType:
    if name not in ORDER:
        raise KeyError(name)
    return importlib.import_module(f"cram.stages.{name}")
