"""What the `cram` commands print: the error line that ends a command, and the tables and lines drawn
from what the pipeline modules read (a dry run's plan, a run's status, what `inspect` shows of a stage,
the runs under a root, a sweep's variants, what `gc` removed). `pipeline/commands/cli.py` parses the command
line and calls; this module only shows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cram.pipeline import config as cfg
from cram.pipeline import planning, store
from cram.pipeline.commands import reading, sweep
from cram.pipeline.schema import StageRecord
from cram.stages.shared.figures import is_number

out = Console()
err = Console(stderr=True)


def error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def print_plan(steps: list[planning.Step], run_dir: Path, config: cfg.PipelineConfig | None = None) -> None:
    """A dry run's plan; below it, what each stage that would run says of its work (its
    `describe(config, pipeline)`: evaluate's fine-tune steps), given the run's `config`."""
    table = Table(title=f"{run_dir} (dry run)", title_justify="left")
    for column in ("stage", "action", "reason", "key"):
        table.add_column(column)
    for s in steps:
        style = {"run": "bold green", "reuse": "cyan"}.get(s.action, "dim")
        table.add_row(s.name, f"[{style}]{s.action}[/]", s.reason, s.key[:12])
    out.print(table)
    for s in steps:
        if config is not None and s.action == "run":
            if described := s.stage.describe(s.config, config):
                out.print(f"{s.name}: {escape(described)}", highlight=False, soft_wrap=True)


def print_status(run_dir: Path, stages: list[reading.Stage]) -> None:
    table = Table(title=str(run_dir), title_justify="left")
    for column in ("stage", "status", "key", "duration", "figures"):
        table.add_column(column, overflow="fold")
    for s in stages:
        r = s.record
        duration = _duration(r)
        detail = r.error if s.state in ("failed", "killed") else _figures(r.outputs)
        detail = " ".join(x for x in (detail, s.note) if x)
        table.add_row(s.name, _styled(s.state), (r.key or "")[:12], duration, escape(detail))
    out.print(table)
    for s in stages:
        if s.name == "evaluate" and s.state == "done":
            print_versus(reading.versus(run_dir, s.record))


def print_versus(rows: list[reading.Versus]) -> None:
    """What continuing bought, per task (`[evaluate] baseline = "init"`): the continued model's median
    score, the starting checkpoint's, the difference, and each one's spread over the seeds; nothing
    for a run without a baseline."""
    if not rows:
        return
    table = Table(title="continued against the starting checkpoint (medians over the seeds)", title_justify="left")
    for column in ("task", "metric", "continued", "starting", "difference", "spread", "starting spread"):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for v in rows:
        shown = [f"{v.continued:.4f}", f"{v.start:.4f}", f"{v.gain:+.4f}", f"{v.spread:.4f}", f"{v.start_spread:.4f}"]
        table.add_row(escape(v.task), escape(v.metric), *shown)
    out.print(table)


def print_stage(
    name: str, record: StageRecord, config: dict[str, Any], events: Path, tail: list[str], run_dir: Path
) -> None:
    """What `cram inspect` shows of a stage: its record, its config section, outputs (evaluate's beside
    the starting checkpoint's, where it was scored too) and log tail."""
    out.rule(f"{name}: {record.status}")
    out.print(f"key {record.key}  started {record.started}  ended {record.ended}  duration {_duration(record) or '-'}")
    if record.error:
        out.print(f"[red]error:[/] {escape(record.error)}", highlight=False)
    out.print("[bold]config[/]")
    out.print(cfg.to_toml({name: config.get(name, {})}).strip(), highlight=False, markup=False)
    out.print("[bold]outputs[/]")
    out.print_json(json.dumps(record.outputs))
    if reason := record.outputs.get("precision_reason"):
        out.print(f"[bold]precision[/]: {record.outputs.get('precision')} ({escape(reason)})", highlight=False)
    if name == "evaluate":
        print_versus(reading.versus(run_dir, record))
    if replay := _replay_budget(name, record.outputs):
        out.print(f"[bold]same token budget elsewhere[/]: {replay}", highlight=False)
    out.print(f"[bold]log tail[/] ({events})")
    for event in tail:
        out.print(event, highlight=False, markup=False)


def print_runs(root: Path, found: list[reading.Newest]) -> None:
    """The runs under ROOT with their newest stage and its status; a manifest that cannot be read is a
    row and a warning."""
    table = Table(title=str(root), title_justify="left")
    for column in ("run", "newest stage", "status", "started"):
        table.add_column(column)
    for run in found:
        if run.unreadable is not None:
            table.add_row(run.run, "-", "[red]unreadable manifest[/]", "-")
        elif run.stage is None:
            table.add_row(run.run, "-", "-", "-")
        else:
            table.add_row(run.run, run.stage, _styled(run.state), run.started)
    out.print(table)
    for run in found:
        if run.unreadable is not None:
            err.print(f"[yellow]warning:[/] {escape(run.unreadable)}", highlight=False, soft_wrap=True)


def print_variant(outcome: sweep.Outcome, of: int, dry_run: bool) -> None:
    """A sweep variant's line before it runs; on a dry run, its plan."""
    doing = outcome.doing
    if outcome.holder is not None:
        doing = f"in use by pid {outcome.holder}: left to it (another `cram sweep`?)"
    out.rule(f"{outcome.number}/{of} {outcome.variant.name}: {doing or 'done'}")
    if dry_run and outcome.doing and outcome.holder is None:
        print_plan(outcome.steps, outcome.variant.run_dir, outcome.variant.config)


def print_sweep(results: sweep.Results) -> None:
    """One row per variant: its status, the config keys that differ, the figures of the last stage."""
    if not results.runs:
        return
    table = Table(title="sweep", title_justify="left")
    for column in ("run", "status", *results.diff, *results.figures):
        table.add_column(column, overflow="fold")
    for i, (run, state) in enumerate(zip(results.runs, results.states)):
        table.add_row(
            run,
            _styled(state),
            *(escape(json.dumps(v[i])) for v in results.diff.values()),
            *(f"{v[i]:.4g}" if isinstance(v[i], float) else str(v[i]) for v in results.figures.values()),
        )
    out.print(table)


def print_elsewhere(outcomes: list[sweep.Outcome]) -> None:
    """The variants left to another process running them."""
    elsewhere = [o.variant.name for o in outcomes if o.holder is not None]
    if elsewhere:
        out.print(
            f"{len(elsewhere)} variant(s) run by another process: {', '.join(elsewhere)}; "
            "run this sweep again once it is done to see them finished here",
            highlight=False,
        )


def print_collected(removed: list[store.Garbage], busy: list[Path], dry_run: bool) -> None:
    """What `gc` removed (or would remove) with sizes, and what it kept because it is being written."""
    verb = "would remove" if dry_run else "removed"
    for item in removed:
        out.print(f"{verb} {item.path} ({_bytes(item.size)})", highlight=False, soft_wrap=True)
    for path in busy:
        out.print(f"kept {path} (being written: its key is locked)", highlight=False, soft_wrap=True)
    total = sum(g.size for g in removed)
    summary = f"{verb} {len(removed)} store item(s), {_bytes(total)}" if removed else "nothing to remove"
    out.print(summary, highlight=False)


def print_verified(checked: list[store.Checked]) -> None:
    """What `verify` found: a line for each damaged (or missing) stage output, then the count of each kind."""
    for c in checked:
        if c.problem is not None:
            label = "damaged" if c.problem.damaged else "missing"
            out.print(f"{label}: {c.problem}", highlight=False, soft_wrap=True)
    intact = [c for c in checked if c.problem is None]
    sizes_only = sum(not c.hashed for c in intact)
    note = f" ({sizes_only} made before checksums: sizes checked)" if sizes_only else ""
    out.print(f"{len(intact)} of {len(checked)} stage output(s) intact{note}", highlight=False)


def _replay_budget(stage: str, outputs: dict[str, Any]) -> str:
    """The overrides that train a finished pretrain's token count again on any hardware: a time budget
    buys different tokens on another machine, a token budget does not."""
    if stage != "pretrain" or not outputs.get("tokens_seen"):
        return ""
    limits = {"tokens": outputs["tokens_seen"], "hours": 0, "steps": 0}  # 0: no such limit
    return " ".join(f"--set pretrain.budget.{k}={v}" for k, v in limits.items())


def _duration(record: StageRecord) -> str:
    """A stage's time: every try's added up (the manifest's `duration_s`), and how many tries when more
    than one (an interrupted and resumed stage)."""
    if record.duration_s is None:
        return ""
    tries = len(record.attempts)
    return seconds(record.duration_s) + (f" ({tries} tries)" if tries > 1 else "")


def seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.1f}m"


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _figures(outputs: dict[str, Any], limit: int = 12) -> str:
    """A stage's first `limit` numeric figures, in the stage's order; times per task left out (the row has the
    stage's duration), so that evaluate's task scores follow its masked-LM figures at several lengths."""
    numbers = [(k, v) for k, v in outputs.items() if is_number(v) and not k.endswith("_time_s")]
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers[:limit])


def _styled(status: str) -> str:
    colour = {
        "done": "green",
        "failed": "red",
        "running": "yellow",
        "interrupted": "yellow",
        "killed": "yellow",
        "missing": "red",
        "damaged": "red",
    }.get(status, "white")
    return f"[{colour}]{status}[/]"
