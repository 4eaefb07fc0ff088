"""Sweeps: every combination of `--grid KEY=V1,V2,...` as its own run, named from its overrides.

    grid = parse_grid(["pretrain.optimizer.lr=1e-3,3e-3", "pretrain.model.layers=2,4"])
    found = variants(config_path, classes, grid, overrides=["pretrain.budget.hours=0.01"])
    outcomes = run_sweep(found, modules)
    raise_for_failures(outcomes)

Every combination's config is validated, and planned, before anything runs. Variants share every
stage whose key they share through the stage store, so a sweep over pretraining settings tokenizes
and packs once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cram.pipeline import config as cfg
from cram.pipeline import planning, rundir, runner
from cram.pipeline.commands import curves, reading
from cram.pipeline.errors import CramError, Interrupted, exit_code

_UNSAFE = re.compile(r"[^A-Za-z0-9.-]+")
_NAMED_BY_THE_SWEEP = ("run.name", "run.root")
_ENDS_A_VARIANT = (CramError, planning.PlanError, rundir.RunDirError)  # a failed stage, a held lock, ...


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, str]  # grid key -> the value's text, as given
    config: cfg.PipelineConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run.root) / self.name


@dataclass
class Outcome:
    """A variant's turn in a sweep: its plan, what that does in a line ("" when the variant is done), the
    pid of another process running it (left to it), and the error that ended it."""

    number: int
    variant: Variant
    steps: list[planning.Step] = field(default_factory=list)
    doing: str = ""
    holder: int | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class Results:
    """The variants that have a run directory, each one's status, the config keys that differ and the
    figures of the last stage (each a value per run)."""

    runs: list[str]
    states: list[str]
    diff: dict[str, list[Any]]
    figures: dict[str, list[Any]]


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`KEY=V1,V2` items as {KEY: [V1, V2]}; commas inside brackets or quotes do not split."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        values = [v.strip() for v in _split(text)] if sep else []
        if not key or not values or not all(values):
            raise cfg.ConfigError(f"--grid {item!r}: expected section.key=V1,V2,..., e.g. pretrain.budget.steps=50,100")
        if key in grid:
            raise cfg.ConfigError(f"--grid {key}: given twice; put all its values in one --grid")
        if key in _NAMED_BY_THE_SWEEP:
            raise cfg.ConfigError(f"--grid {key}: the sweep names and places its runs itself; use --name or --set")
        if len(set(values)) != len(values):
            raise cfg.ConfigError(f"--grid {key}: a value is repeated in {text!r}")
        grid[key] = values
    return grid


def variants(
    config_path: Path,
    config_classes: dict[str, type],
    grid: dict[str, list[str]],
    overrides: list[str] = (),
    name: str | None = None,
) -> list[Variant]:
    """Every combination, validated (each value alone first, so an error names it), in grid order."""
    base = name or cfg.load(config_path, config_classes, list(overrides)).run.name
    for key, values in grid.items():
        for value in values:
            cfg.load(config_path, config_classes, [*overrides, f"{key}={value}"], flag=f"--grid {key}={value}")
    labels = _labels(list(grid))
    found: list[Variant] = []
    for combination in itertools.product(*grid.values()):
        chosen = dict(zip(grid, combination))
        items = [f"{k}={v}" for k, v in chosen.items()]
        conf = cfg.load(config_path, config_classes, [*overrides, *items], flag="--grid " + " ".join(items))
        found.append(Variant(_name(base, labels, chosen), chosen, conf))
    names = [v.name for v in found]
    if len(set(names)) < len(names):  # values that differ only in characters a name cannot hold
        found = [dataclasses.replace(v, name=_with_digest(v.name, v.overrides)) for v in found]
    return [
        dataclasses.replace(
            v,
            config=dataclasses.replace(
                v.config, run=dataclasses.replace(v.config.run, name=rundir.validate_name(v.name))
            ),
        )
        for v in found
    ]


def summary(steps: list[planning.Step]) -> str:
    """What a variant's plan does, in a line: "pretrain, evaluate to run; tokenize, pack from the store"."""
    return "; ".join(
        f"{', '.join(s.name for s in steps if s.action == action)} {what}"
        for action, what in (("run", "to run"), ("reuse", "from the store"))
        if any(s.action == action for s in steps)
    )


def run_sweep(
    found: list[Variant],
    modules: Sequence[planning.StageLike],
    dry_run: bool = False,
    show: Callable[[Outcome], None] = lambda outcome: None,
    failed: Callable[[Outcome], None] = lambda outcome: None,
) -> list[Outcome]:
    """Run each variant that is not done and that no other process is running, in order; several sweeps
    can share the work. `show` is told of each variant before it runs (or, on a dry run, instead),
    `failed` of each that fails, which does not stop the others; Ctrl-C stops the sweep (Interrupted)."""
    for v in found:  # all checked before any runs
        planning.plan(v.config, modules, v.run_dir)
    outcomes = []
    made: dict[str, str] = {}  # with dry_run: key -> the variant that would compute it
    for number, variant in enumerate(found, 1):
        outcome = Outcome(number, variant)
        outcomes.append(outcome)
        try:
            # Planned again: the variants before it may have made some of its stages.
            steps = planning.plan(variant.config, modules, variant.run_dir)
            outcome.steps = made_earlier(steps, made, variant.name) if dry_run else steps
            outcome.doing = summary(outcome.steps)
            holder = rundir.read_lock(variant.run_dir / rundir.LOCK)
            if outcome.doing and holder is not None and rundir.holder_state(holder) == "live":
                outcome.holder = holder["pid"]
            show(outcome)
            if outcome.doing and outcome.holder is None and not dry_run:
                runner.run_pipeline(variant.config, variant.run_dir, outcome.steps)
        except Interrupted as e:
            outcome.error = e
            failed(outcome)
            raise Interrupted("sweep interrupted; run the same `cram sweep` command to continue it") from None
        except _ENDS_A_VARIANT as e:
            outcome.error = e
            failed(outcome)
    return outcomes


def raise_for_failures(outcomes: list[Outcome]) -> None:
    """One error naming the variants that failed, with the first one's exit code."""
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        names = ", ".join(o.variant.name for o in failed)
        raise CramError(f"{len(failed)} of {len(outcomes)} variants failed: {names}", exit_code(failed[0].error))


def results(found: list[Variant]) -> Results:
    run_dirs = [v.run_dir for v in found if (v.run_dir / rundir.MANIFEST).is_file()]
    if not run_dirs:
        return Results([], [], {}, {})
    diff, figures = curves.config_diff(run_dirs), curves.stage_figures(run_dirs)
    diff.pop("run.name", None)  # the row says it
    last = list(figures.values())[-1] if figures else {}
    last = {k: v for k, v in last.items() if not k.endswith("_s")}  # timings: not a result
    states = []
    for run_dir in run_dirs:
        stages = rundir.records(run_dir)
        final = list(stages)[-1] if stages else None
        states.append(reading.checked_status(run_dir, final, stages[final])[0] if final else "-")
    return Results([d.name for d in run_dirs], states, diff, last)


def made_earlier(steps: list[planning.Step], made: dict[str, str], name: str) -> list[planning.Step]:
    """For a dry run: a stage an earlier variant would compute is linked, not run (`made`: key -> variant,
    updated with what this one computes)."""
    steps = [
        dataclasses.replace(s, action="reuse", reason=f"made by {made[s.key]}")
        if s.action == "run" and s.key in made
        else s
        for s in steps
    ]
    made.update({s.key: name for s in steps if s.action == "run"})
    return steps


def _labels(keys: list[str]) -> dict[str, str]:
    """Each key's shortest dotted suffix that no other grid key ends with: lr, model.layers, ..."""
    labels = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            label = ".".join(parts[-n:])
            if not any(other != key and other.split(".")[-n:] == parts[-n:] for other in keys):
                break
        labels[key] = label
    return labels


def _name(base: str, labels: dict[str, str], chosen: dict[str, str]) -> str:
    parts = [f"{labels[k]}_{_UNSAFE.sub('_', v).strip('_.') or 'x'}" for k, v in chosen.items()]
    name = "-".join([base, *parts])
    return name if len(name) <= 128 else _with_digest(name[:110], chosen)


def _with_digest(name: str, chosen: dict[str, str]) -> str:
    return f"{name}-{hashlib.sha256(repr(sorted(chosen.items())).encode()).hexdigest()[:8]}"


def _split(text: str) -> list[str]:
    values, depth, quote, current = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(current)
            current = ""
            continue
        current += ch
    return [*values, current]
