"""Plan a run: each stage's cache key, and whether to run it, link it from the store or skip it, and why.

A stage's key is a digest of its name, version, config (less the fields its `NOT_IN_KEY` names), the run's
seed, its upstream stages' keys and, for a stage that reads files outside the run, their fingerprint. A
stage whose manifest record is done under that key, with its files intact (`store.problem`: sizes, and
the hash of any file written to since), is skipped; one whose key has an entry in the stage store (made
by any run under the same root) is reused; the others run, with the reason ("new", "config changed",
"files damaged", ...). Each stage's own `validate` runs here, so bad config fails before the first
stage runs. A stage whose `config_of` says it has nothing to do with this config (the baseline stage
without `evaluate.baseline = "init"`) has no step, and is no upstream of any: the stages after it keep
the keys they had before it existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cram import stages
from cram.pipeline import config as cfg
from cram.pipeline import ranks, rundir, store
from cram.pipeline.schema import StageRecord
from cram.stages.protocols import StageLike, StageSpec, read
from cram.stages.shared.files import hashes_from


class PlanError(Exception):
    """The requested selection cannot run (an upstream is not done, an unknown stage); exit code 2."""


@dataclass(frozen=True)
class Step:
    name: str
    stage: StageSpec
    key: str
    config_hash: str
    inputs_hash: str | None
    upstream_keys: dict[str, str]
    action: str  # "run", "reuse" (link the store's entry) or "skip"
    reason: str
    inputs: list[list[Any]] | None = None  # the fingerprint `inputs_hash` digests
    config: Any = None  # the stage's config (`stage_config`)


def plan(
    config: cfg.PipelineConfig,
    modules: Sequence[StageLike],
    run_dir: Path,
    only: str | None = None,
    start: str | None = None,
    force: tuple[str, ...] = (),
) -> list[Step]:
    """Each stage with run/skip and why. `only` runs one stage; `start` forces it and all after it."""
    _check_run(config, run_dir)
    specs = [read(m) for m in modules]
    names = [s.NAME for s in specs]
    for given in (only, start, *force):
        if given is not None and given not in names:
            raise PlanError(f"unknown stage '{given}'; stages are: {', '.join(names)}")
    manifest = rundir.Manifest.load(run_dir)
    stored = store.Store.of(run_dir)
    keys: dict[str, str] = {}
    steps: list[Step] = []
    selected: dict[str, bool] = {}
    for i, stage in enumerate(specs):
        stage_config = stage.config_in(config)
        if stage_config is None:
            continue
        keyed = keyed_config(stage, stage_config)
        upstream = {u: keys[u] for u in stage.UPSTREAM if u in keys}
        config_hash = cfg.digest({"version": stage.VERSION, "config": keyed, "seed": config.run.seed})
        # A stage that reads files outside the run (a corpus, a checkpoint) says what of them its output
        # depends on; None: none with this config.
        outside = fingerprint(stage, stage_config, stored)
        inputs_hash = None if outside is None else cfg.digest(outside)
        key = _key(stage, keyed, config.run.seed, upstream, inputs_hash)
        keys[stage.NAME] = key
        record = manifest.stage(stage.NAME)
        done, broken = _is_done(record, key, run_dir / stage.NAME)
        in_store = not done and store.problem(stored.entry(stage.NAME, key), key) is None
        chosen = (only is None or stage.NAME == only) and (start is None or i >= names.index(start))
        selected[stage.NAME] = chosen
        if chosen and (stage.NAME in force or start is not None):
            action, reason = "run", "forced"
        elif done:
            action, reason = "skip", "done"
        elif in_store:
            action, reason = "reuse", "in store"
        elif chosen:
            action, reason = "run", _why_not_done(record, key, config_hash, upstream, broken)
        else:
            action, reason = "skip", "not selected"
        steps.append(
            Step(stage.NAME, stage, key, config_hash, inputs_hash, upstream, action, reason, outside, stage_config)
        )
    _check_present(steps, specs, (only, *force))
    steps = _link_only_what_is_needed(steps, selected)
    _check_upstream_done(steps)
    _validate(config, steps)
    return steps


def _check_present(steps: list[Step], specs: list[StageSpec], given: tuple[str | None, ...]) -> None:
    """Refuse --only or --force of a stage that this config leaves out (`config_of`: nothing to do),
    saying what setting runs it (its `RUNS_WITH`)."""
    present = {s.name for s in steps}
    for stage in specs:
        if stage.NAME in given and stage.NAME not in present:
            raise PlanError(f"stage '{stage.NAME}' has nothing to do with this config; it runs with {stage.RUNS_WITH}")


def _key(stage: StageSpec, keyed: dict[str, Any], seed: int, upstream: dict[str, str], inputs: str | None) -> str:
    return cfg.digest(
        {
            "stage": stage.NAME,
            "version": stage.VERSION,
            "config": keyed,
            "seed": seed,
            "upstream": upstream,
            "inputs": inputs,
        }
    )


def _check_run(config: cfg.PipelineConfig, run_dir: Path) -> None:
    """The run directory's place, and a device that can serve every torchrun rank (checked before any
    stage's `validate` resolves it)."""
    _check_folder(run_dir)
    problem = ranks.device_problem(config.run.device)
    if problem is not None:
        raise PlanError(problem)


def fingerprint(stage: StageSpec, stage_config: Any, stored: store.Store) -> list[list[Any]] | None:
    """The stage's `fingerprint(config)`, its large files hashed through the store's cache."""
    with hashes_from(store.hash_cache(stored.root)):
        return stage.fingerprint(stage_config)


def _check_folder(run_dir: Path) -> None:
    """Refuse a file where the run directory or a folder above it must be."""
    blocking = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise PlanError(
            f"{blocking}: a file, where the run directory {run_dir} needs a folder (see run.root and run.name)"
        )


def _validate(config: cfg.PipelineConfig, steps: list[Step]) -> None:
    """Each stage's own checks, before any stage runs: a bad pretrain or evaluate setting fails now, not
    after the stages before it. A done stage passed them when it ran. A stage's `validate` is torch-free
    and checks every stage not done; its `validate_runtime` (device, backend, memory) loads torch and
    checks only the stages that run now, so `--only pack` starts in well under a second."""
    for step in steps:
        if step.reason in ("done", "in store"):
            continue
        try:
            step.stage.validate(step.config, config)
            if step.action == "run":
                step.stage.validate_runtime(step.config, config)
        except stages.StageError as e:
            raise PlanError(str(e)) from None


def keyed_config(stage: StageLike, stage_config: Any) -> dict[str, Any]:
    """The stage's config as its cache key sees it: without the fields its `NOT_IN_KEY` names (dotted
    paths such as "log_every_steps"), which change how a stage reports, not what it computes; and without
    the fields its `NEW_OPTIONS` names while they hold their default. Those are options added after the
    stage's key was fixed: at their default they compute what the stage computed before them, so a store
    filled before they existed stays valid. A stage's `key_config(config)` first sets what its output
    does not depend on in that config (tokenize: the training fields, beside a given tokenizer)."""
    spec = read(stage)
    plain = cfg.as_plain(spec.key_config(stage_config))
    for dotted in spec.NOT_IN_KEY:
        _pop(plain, dotted)
    if spec.NEW_OPTIONS:
        defaults = cfg.as_plain(type(stage_config)())
        for dotted in spec.NEW_OPTIONS:
            if _get(plain, dotted) == _get(defaults, dotted):
                _pop(plain, dotted)
    return plain


def _get(table: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        table = table.get(part) if isinstance(table, dict) else None
    return table


def _pop(table: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        table = table.get(part) or {}
    table.pop(leaf, None)


def _link_only_what_is_needed(steps: list[Step], selected: dict[str, bool]) -> list[Step]:
    """A stage left out by --only/--from is linked from the store only when a chosen stage reads it."""
    needed: set[str] = set()
    for i in reversed(range(len(steps))):
        step = steps[i]
        if step.action == "reuse" and not selected[step.name] and step.name not in needed:
            steps[i] = replace(step, action="skip", reason="not selected")
        elif step.action != "skip":
            needed.update(step.upstream_keys)
    return steps


def _is_done(record: StageRecord | None, key: str, view: Path) -> tuple[bool, store.Problem | None]:
    """Whether the stage is done under `key` with its files intact; if recorded done, why they are not."""
    if record is None or record.status != "done" or record.key != key:
        return False, None
    broken = store.problem(view, key)
    return broken is None, broken


def _why_not_done(
    record: StageRecord | None,
    key: str,
    config_hash: str,
    upstream: dict[str, str],
    broken: store.Problem | None,
) -> str:
    if record is None or record.key is None:
        return "new"
    if record.key == key:
        if record.status != "done":
            return "incomplete"
        return "files damaged" if broken is not None and broken.damaged else "files missing"
    if record.attempt is not None and record.attempt.key == key:
        return "incomplete"
    if record.config_hash != config_hash:
        return "config changed"
    if record.upstream_keys != upstream:
        return "upstream changed"
    return "inputs changed"


def _check_upstream_done(steps: list[Step]) -> None:
    by_name = {s.name: s for s in steps}
    for step in steps:
        if step.action == "skip":
            continue
        for name in step.upstream_keys:
            up = by_name[name]
            if up.action == "skip" and up.reason != "done":
                raise PlanError(
                    f"stage '{step.name}' needs '{name}', which is not done; run it first (e.g. without --only/--from)"
                )
