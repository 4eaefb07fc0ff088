"""Sweeps: every combination of `--grid KEY=V1,V2,...` as its own run, named from its overrides.

    grid = parse_grid(["pretrain.optimizer.lr=1e-3,3e-3", "pretrain.model.layers=2,4"])
    for v in variants(config_path, classes, grid, overrides=["pretrain.budget.hours=0.01"]): ...

Every combination's config is validated before anything runs. Variants share every stage whose key
they share through the stage store, so a sweep over pretraining settings tokenizes and packs once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from cram.pipeline import config as cfg
from cram.pipeline import planning, rundir

_UNSAFE = re.compile(r"[^A-Za-z0-9.-]+")
_NAMED_BY_THE_SWEEP = ("run.name", "run.root")


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, str]  # grid key -> the value's text, as given
    config: cfg.PipelineConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run.root) / self.name


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
