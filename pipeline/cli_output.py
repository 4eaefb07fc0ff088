"""What the `cram` commands print: the error line that ends a command, and the tables and lines drawn
from run directories (a dry run's plan, a run's status, the runs under a root, a sweep's variants,
what `gc` removed, a stage's log tail). `pipeline/cli.py` parses the command line and decides; this
module only reads and shows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import typer
from cram.pipeline import curves, planning, rundir, store, sweep
from rich.console import Console
from rich.markup import escape
from rich.table import Table

out = Console()
err = Console(stderr=True)


def error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> NoReturn:
    error(message)
    raise typer.Exit(code)


def records(run_dir: Path) -> dict[str, Any]:
    """The stage records of a run directory's manifest; a command fails (exit 2) where there is none."""
    try:
        return rundir.records(run_dir)
    except rundir.RunDirError as e:
        fail(str(e))


def print_plan(steps: list[planning.Step], run_dir: Path) -> None:
    table = Table(title=f"{run_dir} (dry run)", title_justify="left")
    for column in ("stage", "action", "reason", "key"):
        table.add_column(column)
    for s in steps:
        style = {"run": "bold green", "reuse": "cyan"}.get(s.action, "dim")
        table.add_row(s.name, f"[{style}]{s.action}[/]", s.reason, s.key[:12])
    out.print(table)


def print_status(run_dir: Path) -> None:
    stages = records(run_dir)
    table = Table(title=str(run_dir), title_justify="left")
    for column in ("stage", "status", "key", "duration", "figures"):
        table.add_column(column, overflow="fold")
    for stage, r in stages.items():
        duration = "" if r.get("duration_s") is None else seconds(r["duration_s"])
        state, note = planning.describe(run_dir, stage, r, stages)
        detail = r.get("error") if state in ("failed", "killed") else _figures(r.get("outputs") or {})
        detail = " ".join(x for x in (detail, note) if x)
        table.add_row(stage, _styled(state), (r.get("key") or "")[:12], duration, escape(detail))
    out.print(table)


def print_runs(root: Path) -> None:
    """The runs under ROOT with their newest stage and its status; a manifest that cannot be read is a
    row and a warning, never the end of the list."""
    table = Table(title=str(root), title_justify="left")
    for column in ("run", "newest stage", "status", "started"):
        table.add_column(column)
    unreadable = []
    for path in sorted(p for p in root.iterdir() if (p / rundir.MANIFEST).is_file()):
        try:
            stages = rundir.Manifest.load(path).records
        except rundir.RunDirError as e:  # one bad run must not hide the others
            table.add_row(path.name, "-", "[red]unreadable manifest[/]", "-")
            unreadable.append(str(e))
            continue
        started = {k: r for k, r in stages.items() if r.get("started")}
        if not started:
            table.add_row(path.name, "-", "-", "-")
            continue
        newest = max(started, key=lambda k: started[k]["started"])
        r = started[newest]
        table.add_row(path.name, newest, _styled(planning.describe(path, newest, r)[0]), r["started"])
    out.print(table)
    for message in unreadable:
        err.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def print_sweep(found: list[sweep.Variant]) -> None:
    """One row per variant: its status, the config keys that differ, the figures of the last stage."""
    run_dirs = [v.run_dir for v in found if (v.run_dir / rundir.MANIFEST).is_file()]
    if not run_dirs:
        return
    try:
        diff, figures = curves.config_diff(run_dirs), curves.stage_figures(run_dirs)
    except curves.CurvesError as e:
        fail(str(e))
    diff.pop("run.name", None)  # the row says it
    last = list(figures.values())[-1] if figures else {}
    last = {k: v for k, v in last.items() if not k.endswith("_s")}  # timings: not a result
    table = Table(title="sweep", title_justify="left")
    for column in ("run", "status", *diff, *last):
        table.add_column(column, overflow="fold")
    for i, run_dir in enumerate(run_dirs):
        stages = records(run_dir)
        final = list(stages)[-1] if stages else None
        state = planning.describe(run_dir, final, stages[final])[0] if final else "-"
        table.add_row(
            run_dir.name,
            _styled(state),
            *(escape(json.dumps(v[i])) for v in diff.values()),
            *(f"{v[i]:.4g}" if isinstance(v[i], float) else str(v[i]) for v in last.values()),
        )
    out.print(table)


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


def log_tail(run_dir: Path, stage: str, n: int) -> list[str]:
    """The last `n` events of `stage` in the run's events.jsonl, one line each."""
    path = run_dir / rundir.EVENTS
    if n == 0 or not path.is_file():
        return []
    shown = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("stage") != stage:
            continue
        rest = {k: v for k, v in event.items() if k not in ("event", "timestamp", "level", "stage", "run", "logger")}
        extras = " ".join(f"{k}={v}" for k, v in rest.items())
        shown.append(f"{event.get('timestamp', '')} {event.get('level', ''):7} {event.get('event', '')} {extras}")
    return shown[-n:]


def seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.1f}m"


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _figures(outputs: dict[str, Any], limit: int = 6) -> str:
    numbers = [(k, v) for k, v in outputs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers[:limit])


def _styled(status: str) -> str:
    colour = {
        "done": "green",
        "failed": "red",
        "running": "yellow",
        "interrupted": "yellow",
        "killed": "yellow",
        "missing": "red",
    }.get(status, "white")
    return f"[{colour}]{status}[/]"
