"""The `cram` command line.

    cram run pipeline.toml                       run every stage that is not done
    cram run pipeline.toml --dry-run             say what would run and why
    cram run pipeline.toml --set pretrain.budget.steps=100 --name quick
    cram run pipeline.toml --only pack | --from pretrain | --force evaluate
    cram resume runs/default                     continue an interrupted run from its saved config
    cram status runs/default                     one table: stage, status, key, duration, figures
    cram inspect runs/default pretrain           config, outputs and log tail of a stage
    cram inspect runs/default --plot curves.png  loss, lr, tokens/s, grad norm against tokens seen
    cram compare runs/a runs/b [--plot loss.png] differing config keys, then each stage's figures
    cram export runs/default --to out/default [--format transformers] [--force]
    cram ls runs                                 every run with its newest stage

Exit codes: 0 ok, 1 a stage failed, 2 bad usage, config or input, 130 interrupted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline import config as cfg
from pipeline import curves, logs, rundir, runner
from pipeline import export as exporting

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Cram a BERT-style MLM from raw text.")
out = Console()
err = Console(stderr=True)


def main() -> None:
    app()


def _fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def run(
    config: Path = typer.Argument(..., help="The pipeline TOML file."),
    name: Optional[str] = typer.Option(None, "--name", help="Run name (default: [run].name)."),
    only: Optional[str] = typer.Option(None, "--only", help="Run this stage alone; its upstream must be done."),
    start: Optional[str] = typer.Option(None, "--from", help="Re-run this stage and every stage after it."),
    force: List[str] = typer.Option([], "--force", help="Re-run this stage even if it is done (repeatable)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would run and why; run nothing."),
    overrides: List[str] = typer.Option([], "--set", help="Override a key: section.key=value (repeatable)."),
) -> None:
    """Run the pipeline of CONFIG: every stage that is not done, in order."""
    modules = runner.default_stages()
    try:
        conf = cfg.load(config, runner.config_classes(modules), overrides)
        if name is not None:
            conf = dataclasses.replace(conf, run=dataclasses.replace(conf.run, name=name))
        rundir.validate_name(conf.run.name)
    except (cfg.ConfigError, rundir.RunDirError) as e:
        _fail(str(e))
    _run(conf, Path(conf.run.root) / conf.run.name, modules, only, start, tuple(force), dry_run)


@app.command()
def resume(run_dir: Path = typer.Argument(..., help="A run directory.")) -> None:
    """Continue an interrupted run from its saved config; a checkpointed stage continues from its checkpoint."""
    modules = runner.default_stages()
    saved = run_dir / rundir.CONFIG
    if not saved.is_file():
        _fail(f"{saved}: no saved config; is {run_dir} a run directory?")
    try:
        conf = cfg.load(saved, runner.config_classes(modules))
    except cfg.ConfigError as e:
        _fail(str(e))
    _run(conf, run_dir, modules, None, None, (), False)


def _run(conf: cfg.PipelineConfig, run_dir: Path, modules: list, only, start, force, dry_run: bool) -> None:
    try:
        steps = runner.plan(conf, modules, run_dir, only=only, start=start, force=force)
    except (runner.PlanError, rundir.RunDirError) as e:
        _fail(str(e))
    if dry_run:
        _print_plan(steps, run_dir)
        return
    rank, world_size = runner.init_distributed(conf.run.device)
    main = rank == 0
    logs.configure(run_dir / rundir.EVENTS if main else None, console=main)
    log = logs.get(run=run_dir.name)
    try:
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            with rundir.locked(run_dir, log):
                runner.execute(conf, steps, run_dir, cfg.to_toml(conf.to_dict()), rank, world_size)
        else:
            runner.execute(conf, steps, run_dir, "", rank, world_size)
    except rundir.RunDirError as e:
        _fail(str(e))
    except runner.StageFailed as e:
        _fail(f"{e} (log: {e.log_path})", e.exit_code)
    except KeyboardInterrupt:
        _fail(f"interrupted; continue with: cram resume {run_dir}", 130)
    if main:
        _print_status(run_dir)


def _print_plan(steps: list[runner.Step], run_dir: Path) -> None:
    table = Table(title=f"{run_dir} (dry run)", title_justify="left")
    for column in ("stage", "action", "reason", "key"):
        table.add_column(column)
    for s in steps:
        style = "bold green" if s.action == "run" else "dim"
        table.add_row(s.name, f"[{style}]{s.action}[/]", s.reason, s.key[:12])
    out.print(table)


@app.command()
def status(run_dir: Path = typer.Argument(..., help="A run directory.")) -> None:
    """One table: stage, status, key, duration, main figures."""
    _print_status(run_dir)


def _print_status(run_dir: Path) -> None:
    records = _records(run_dir)
    table = Table(title=str(run_dir), title_justify="left")
    for column in ("stage", "status", "key", "duration", "figures"):
        table.add_column(column, overflow="fold")
    for stage, r in records.items():
        duration = "" if r.get("duration_s") is None else _seconds(r["duration_s"])
        detail = r.get("error") if r.get("status") == "failed" else _figures(r.get("outputs") or {})
        table.add_row(stage, _styled(r.get("status", "?")), (r.get("key") or "")[:12], duration, escape(detail or ""))
    out.print(table)


@app.command()
def inspect(
    run_dir: Path = typer.Argument(..., help="A run directory."),
    stage: Optional[str] = typer.Argument(None, help="A stage; all stages when left out."),
    lines: int = typer.Option(15, "--lines", help="How many log events to show."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also save the pretraining curves as this PNG."),
) -> None:
    """The resolved config, a stage's outputs and figures, and its log tail."""
    records = _records(run_dir)
    if plot is not None:
        try:
            curves.save(curves.plot_run(run_dir), plot)
        except curves.CurvesError as e:
            _fail(str(e))
        out.print(f"curves: {plot}")
    if stage is not None and stage not in records:
        _fail(f"{run_dir}: no stage '{stage}' in the manifest (it has: {', '.join(records) or 'none'})")
    saved = run_dir / rundir.CONFIG
    conf = cfg.tomllib.loads(saved.read_text()) if saved.is_file() else {}
    for name in [stage] if stage else list(records):
        r = records[name]
        out.rule(f"{name}: {r.get('status')}")
        out.print(f"key {r.get('key')}  started {r.get('started')}  ended {r.get('ended')}  "
                  f"duration {_seconds(r['duration_s']) if r.get('duration_s') is not None else '-'}")
        if r.get("error"):
            out.print(f"[red]error:[/] {escape(r['error'])}", highlight=False)
        out.print("[bold]config[/]")
        out.print(cfg.to_toml({name: conf.get(name, {})}).strip(), highlight=False, markup=False)
        out.print("[bold]outputs[/]")
        out.print_json(json.dumps(r.get("outputs") or {}))
        if replay := _replay_budget(name, r.get("outputs") or {}):
            out.print(f"[bold]same token budget elsewhere[/]: {replay}", highlight=False)
        out.print(f"[bold]log tail[/] ({run_dir / rundir.EVENTS})")
        for event in _log_tail(run_dir, name, lines):
            out.print(event, highlight=False, markup=False)


def _replay_budget(stage: str, outputs: dict) -> str:
    """The overrides that train a finished pretrain's token count again on any hardware: a time budget
    buys different tokens on another machine, a token budget does not."""
    if stage != "pretrain" or not outputs.get("tokens_seen"):
        return ""
    limits = {"tokens": outputs["tokens_seen"], "hours": 0, "steps": 0}  # 0: no such limit
    return " ".join(f"--set pretrain.budget.{k}={v}" for k, v in limits.items())


@app.command()
def compare(
    run_dirs: List[Path] = typer.Argument(..., help="Two or more run directories."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Save the loss curves of all runs as this PNG."),
) -> None:
    """The config keys that differ between runs, then each stage's figures side by side."""
    if len(run_dirs) < 2:
        _fail("compare needs at least two run directories")
    try:
        diff, figures = curves.config_diff(run_dirs), curves.stage_figures(run_dirs)
        if plot is not None:
            curves.save(curves.plot_losses(run_dirs), plot)
    except curves.CurvesError as e:
        _fail(str(e))
    names = [str(d) for d in run_dirs]
    table = Table(title="config keys that differ", title_justify="left")
    for column in ("key", *names):
        table.add_column(column, overflow="fold")
    for key, values in diff.items():
        table.add_row(key, *(escape(json.dumps(v)) for v in values))
    out.print(table if diff else "config: identical")
    for stage, rows in figures.items():
        table = Table(title=stage, title_justify="left")
        for column in ("figure", *names):
            table.add_column(column, justify="right")
        for key, values in rows.items():
            table.add_row(key, *(f"{v:.4g}" if isinstance(v, float) else str(v) for v in values))
        out.print(table)
    if plot is not None:
        out.print(f"loss curves: {plot}")


@app.command("export")
def export_run(
    run_dir: Path = typer.Argument(..., help="A run directory whose pretrain stage is done."),
    to: Path = typer.Option(..., "--to", help="The directory to write."),
    fmt: str = typer.Option("cram", "--format", help="cram (params, model.json, tokenizer) or transformers."),
    force: bool = typer.Option(False, "--force", help="Replace TO even if it is not empty."),
) -> None:
    """Export the pretrained encoder with its tokenizer and a model card."""
    try:
        exporting.export(run_dir, to, fmt, force)
    except exporting.ExportError as e:
        _fail(str(e))
    out.print(f"exported {run_dir} ({fmt}) to {to}")


@app.command("ls")
def list_runs(root: Path = typer.Argument(Path("runs"), help="The runs root.")) -> None:
    """The runs under ROOT with their newest stage and its status."""
    if not root.is_dir():
        _fail(f"{root}: no such directory")
    table = Table(title=str(root), title_justify="left")
    for column in ("run", "newest stage", "status", "started"):
        table.add_column(column)
    for path in sorted(p for p in root.iterdir() if (p / rundir.MANIFEST).is_file()):
        records = rundir.Manifest.load(path).data.get("stages", {})
        started = {k: r for k, r in records.items() if r.get("started")}
        if not started:
            table.add_row(path.name, "-", "-", "-")
            continue
        newest = max(started, key=lambda k: started[k]["started"])
        r = started[newest]
        table.add_row(path.name, newest, _styled(r.get("status", "?")), r["started"])
    out.print(table)


def _records(run_dir: Path) -> dict[str, Any]:
    if not (run_dir / rundir.MANIFEST).is_file():
        _fail(f"{run_dir}: no {rundir.MANIFEST}; not a run directory")
    try:
        return rundir.Manifest.load(run_dir).data.get("stages", {})
    except rundir.RunDirError as e:
        _fail(str(e))


def _log_tail(run_dir: Path, stage: str, n: int) -> list[str]:
    path = run_dir / rundir.EVENTS
    if not path.is_file():
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


def _figures(outputs: dict[str, Any], limit: int = 6) -> str:
    numbers = [(k, v) for k, v in outputs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers[:limit])


def _seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.1f}m"


def _styled(status: str) -> str:
    colour = {"done": "green", "failed": "red", "running": "yellow", "interrupted": "yellow"}.get(status, "white")
    return f"[{colour}]{status}[/]"


if __name__ == "__main__":  # pragma: no cover
    main()
