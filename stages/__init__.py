"""The pipeline's stages: ORDER, `load`, and what every stage shares (StageError, Upstream, Context).

A stage is a module in this package; its contract, every member with its default and meaning, is the
`Stage` protocol in `protocols.py`. Required: NAME, VERSION, UPSTREAM, Config (a frozen dataclass: the
stage's TOML section) and

    def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict

`run` writes everything into `out_dir` (a temporary folder that the runner renames into place once
`run` returns) and returns a small JSON-serialisable dict: paths relative to `out_dir` and figures.
Stages import heavy libraries (torch, datasets) inside `run`: a fully cached `cram run` must not pay
for them. `load(name)` reads a stage module once (`protocols.read`): the pipeline calls the members of
the `StageSpec` it returns, never looking one up on a module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cram.stages.protocols import Log, StageSpec, read
from cram.stages.protocols import Pipeline as Pipeline  # what `validate(config, pipeline)` is handed
from cram.stages.protocols import StageConfig as StageConfig  # a section: what `Linked.linked` is handed
from cram.stages.protocols import section as section  # a sibling's section read as its stage's Config
from cram.stages.shared import loggers

ORDER: tuple[str, ...] = ("tokenize", "pack", "pretrain", "baseline", "evaluate")


class StageError(Exception):
    """A failure caused by the stage's input or config: reported in one line, exit code 2."""


@dataclass(frozen=True)
class Upstream:
    """A finished upstream stage as its downstream sees it."""

    dir: Path
    outputs: dict[str, Any]  # its recorded outputs, as read from JSON

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
    log: Log = field(repr=False)  # a structlog logger bound to run and stage
    rank: int = 0
    world_size: int = 1
    metrics: loggers.Metrics = field(default=loggers.NONE, repr=False)  # `[run] loggers`: TensorBoard, W&B
    attention: str = "auto"  # `[run] attention`: how the model computes attention (model.ATTENTIONS)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def load(name: str) -> StageSpec:
    """The stage `name` of ORDER, read once: every member of its contract present."""
    if name not in ORDER:
        raise KeyError(name)
    return read(importlib.import_module(f"cram.stages.{name}"))
