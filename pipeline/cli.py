"""The `cram` command line.

    cram run pipeline.toml                       run every stage that is not done
    cram run pipeline.toml --dry-run             say what would run and why
    cram run pipeline.toml --set pretrain.budget.steps=100 --name quick
    cram run pipeline.toml --only pack | --from pretrain | --force evaluate
    cram resume runs/default                     continue an interrupted run from its saved config
    cram status runs/default                     one table: stage, status, key, duration, figures
    cram inspect runs/default pretrain           config, outputs and log tail of a stage
    cram inspect runs/default --plot curves.png  loss, lr, tokens/s, grad norm against tokens seen
    cram compare 'runs/lr*' --sort mlm_loss [--out t.md] [--plot loss.png]   one row per run: config keys
                                                 that differ, headline figures, best first
    cram export runs/default --to out/default [--format transformers] [--force]
    cram ls runs                                 every run with its newest stage
    cram sweep pipeline.toml --grid pretrain.optimizer.lr=1e-3,3e-3 [--grid ...] [--set ...]
    cram gc runs [--dry-run]                     remove store entries that no run refers to

Exit codes: 0 ok, 1 a stage failed, 2 bad usage, config or input, 130 interrupted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import List, Optional

import typer
from cram.pipeline import compare as comparing
from cram.pipeline import config as cfg
from cram.pipeline import curves, logs, planning, ranks, rundir, runner, store, sweep
from cram.pipeline import export as exporting
from cram.pipeline.cli_output import (
    error,
    fail,
    log_tail,
    out,
    print_collected,
    print_plan,
    print_runs,
    print_status,
    print_sweep,
    records,
    seconds,
)
from rich.markup import escape

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Cram a BERT-style MLM from raw text.")


def main() -> None:
    app()


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
    if only is not None and start is not None:
        fail(
            f"--only {only} and --from {start} do not combine: --only runs one stage, "
            "--from re-runs a stage and every stage after it"
        )
    modules = runner.default_stages()
    try:
        conf = cfg.load(config, runner.config_classes(modules), overrides)
        if name is not None:
            conf = dataclasses.replace(conf, run=dataclasses.replace(conf.run, name=name))
        rundir.validate_name(conf.run.name)
    except (cfg.ConfigError, rundir.RunDirError) as e:
        fail(str(e))
    _run(conf, Path(conf.run.root) / conf.run.name, modules, only, start, tuple(force), dry_run)


@app.command()
def resume(run_dir: Path = typer.Argument(..., help="A run directory.")) -> None:
    """Continue an interrupted run from its saved config; a checkpointed stage continues from its checkpoint."""
    modules = runner.default_stages()
    saved = run_dir / rundir.CONFIG
    if not saved.is_file():
        fail(f"{saved}: no saved config; is {run_dir} a run directory?")
    try:
        conf = cfg.load(saved, runner.config_classes(modules))
    except cfg.ConfigError as e:
        fail(str(e))
    _run(conf, run_dir, modules, None, None, (), False)


def _run(
    conf: cfg.PipelineConfig, run_dir: Path, modules: list, only, start, force, dry_run: bool, show_status: bool = True
) -> None:
    blocking = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        fail(f"{blocking}: a file, where the run directory {run_dir} needs a folder (see run.root and run.name)")
    try:
        steps = planning.plan(conf, modules, run_dir, only=only, start=start, force=force)
    except (planning.PlanError, rundir.RunDirError) as e:
        fail(str(e))
    if dry_run:
        print_plan(steps, run_dir)
        return
    rank, world_size = ranks.init_distributed(conf.run.device)
    main = rank == 0
    try:
        logs.configure(run_dir / rundir.EVENTS if main else None, console=main)
    except OSError as e:
        fail(f"{run_dir}: cannot write the run's log ({e.strerror}: {e.filename})")
    log = logs.get(run=run_dir.name)
    try:
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            with rundir.locked(run_dir, log):
                runner.execute(conf, steps, run_dir, cfg.to_toml(conf.to_dict()), rank, world_size)
        else:
            runner.execute(conf, steps, run_dir, "", rank, world_size)
    except rundir.RunDirError as e:
        fail(str(e))
    except OSError as e:  # the run directory itself: read-only, full, or gone; a stage's own errors are StageFailed
        fail(f"{run_dir}: cannot write the run ({e.strerror}: {e.filename})")
    except runner.StageFailed as e:
        fail(f"{e} (log: {e.log_path})", e.exit_code)
    except KeyboardInterrupt:
        fail(f"interrupted; continue with: cram resume {run_dir}", 130)
    finally:
        ranks.finish_distributed()
    if main and show_status:
        print_status(run_dir)


@app.command()
def status(run_dir: Path = typer.Argument(..., help="A run directory.")) -> None:
    """One table: stage, status, key, duration, main figures."""
    print_status(run_dir)


@app.command()
def inspect(
    run_dir: Path = typer.Argument(..., help="A run directory."),
    stage: Optional[str] = typer.Argument(None, help="A stage; all stages when left out."),
    lines: int = typer.Option(15, "--lines", min=0, help="How many log events to show (0: none)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also save the pretraining curves as this PNG."),
) -> None:
    """The resolved config, a stage's outputs and figures, and its log tail."""
    stages = records(run_dir)
    if plot is not None:
        _check_plot_path(plot)
        try:
            curves.save(curves.plot_run(run_dir), plot)
        except curves.CurvesError as e:
            fail(str(e))
        out.print(f"curves: {plot}")
    if stage is not None and stage not in stages:
        fail(f"{run_dir}: no stage '{stage}' in the manifest (it has: {', '.join(stages) or 'none'})")
    saved = run_dir / rundir.CONFIG
    try:
        conf = cfg.tomllib.loads(saved.read_text(encoding="utf-8")) if saved.is_file() else {}
    except (OSError, UnicodeDecodeError, cfg.tomllib.TOMLDecodeError) as e:
        fail(f"{saved}: not a readable config ({e})")
    for name in [stage] if stage else list(stages):
        r = stages[name]
        out.rule(f"{name}: {r.get('status')}")
        out.print(
            f"key {r.get('key')}  started {r.get('started')}  ended {r.get('ended')}  "
            f"duration {seconds(r['duration_s']) if r.get('duration_s') is not None else '-'}"
        )
        if r.get("error"):
            out.print(f"[red]error:[/] {escape(r['error'])}", highlight=False)
        out.print("[bold]config[/]")
        out.print(cfg.to_toml({name: conf.get(name, {})}).strip(), highlight=False, markup=False)
        out.print("[bold]outputs[/]")
        out.print_json(json.dumps(r.get("outputs") or {}))
        if replay := _replay_budget(name, r.get("outputs") or {}):
            out.print(f"[bold]same token budget elsewhere[/]: {replay}", highlight=False)
        out.print(f"[bold]log tail[/] ({run_dir / rundir.EVENTS})")
        for event in log_tail(run_dir, name, lines):
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
    runs: List[str] = typer.Argument(..., help="Run directories or globs (runs/lr*, quoted or not)."),
    sort: Optional[str] = typer.Option(None, "--sort", help="Order by this figure, best first (e.g. mlm_loss)."),
    descending: Optional[bool] = typer.Option(
        None, "--desc/--asc", help="Order --sort this way (default: losses and times ascending, others descending)."
    ),
    all_figures: bool = typer.Option(False, "--all", help="Every figure of every stage, not only the headline ones."),
    out_file: Optional[Path] = typer.Option(None, "--out", help="Also write the table as .csv or .md."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Save the loss curves of all runs as this PNG."),
) -> None:
    """One row per run: the config keys that differ, then each stage's headline figures."""
    if plot is not None:
        _check_plot_path(plot)
    try:
        if out_file is not None:
            comparing.check_out(out_file)
        run_dirs = comparing.expand(runs)
        table = comparing.compare_table(run_dirs, sort=sort, descending=descending, all_figures=all_figures)
        if plot is not None:
            curves.save(curves.plot_losses(run_dirs), plot)
        if out_file is not None:
            table.write(out_file)
    except curves.CurvesError as e:
        fail(str(e))
    out.print(comparing.rich_table(table))
    if table.n_config == 0 and len(run_dirs) > 1:
        out.print("config: identical but for the run name")
    for path, what in ((out_file, "table"), (plot, "loss curves")):
        if path is not None:
            out.print(f"{what}: {path}")


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
        fail(str(e))
    out.print(f"exported {run_dir} ({fmt}) to {to}")


@app.command("ls")
def list_runs(root: Path = typer.Argument(Path("runs"), help="The runs root.")) -> None:
    """The runs under ROOT with their newest stage and its status."""
    if not root.is_dir():
        fail(f"{root}: no such directory")
    print_runs(root)


@app.command("sweep")
def sweep_runs(
    config: Path = typer.Argument(..., help="The pipeline TOML file."),
    grid: List[str] = typer.Option(..., "--grid", help="KEY=V1,V2,...: a run per value (repeatable)."),
    overrides: List[str] = typer.Option([], "--set", help="Override a key in every variant: section.key=value."),
    name: Optional[str] = typer.Option(None, "--name", help="Prefix of the variants' run names (default: [run].name)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each variant's plan; run nothing."),
) -> None:
    """Run every combination of the --grid values as its own run, sharing stages through the store.

    Each variant is named from its overrides (e.g. default-lr_1e-3-layers_4). Re-running the same sweep
    skips finished variants and resumes an interrupted one; a variant that fails does not stop the others.
    """
    modules = runner.default_stages()
    try:
        found = sweep.variants(config, runner.config_classes(modules), sweep.parse_grid(grid), overrides, name)
        plans = [planning.plan(v.config, modules, v.run_dir) for v in found]  # all checked before any runs
    except (cfg.ConfigError, rundir.RunDirError, planning.PlanError) as e:
        fail(str(e))
    failed: list[tuple[str, int]] = []
    elsewhere: list[str] = []  # variants another process is running: several sweeps can share the work
    made: dict[str, str] = {}  # with --dry-run: key -> the variant that would compute it
    for i, (variant, steps) in enumerate(zip(found, plans), 1):
        if i > 1:  # planned again: the variants before it may have made some of its stages
            try:
                steps = planning.plan(variant.config, modules, variant.run_dir)
            except (planning.PlanError, rundir.RunDirError) as e:
                error(str(e))
                failed.append((variant.name, 2))
                continue
        if dry_run:
            steps = sweep.made_earlier(steps, made, variant.name)
        doing = sweep.summary(steps)
        holder = rundir.read_lock(variant.run_dir / rundir.LOCK)
        if doing and holder is not None and rundir.holder_state(holder) == "live":
            doing = f"in use by pid {holder['pid']}: left to it (another `cram sweep`?)"
            elsewhere.append(variant.name)
        out.rule(f"{i}/{len(found)} {variant.name}: {doing or 'done'}")
        if not doing or variant.name in elsewhere:
            continue
        if dry_run:
            print_plan(steps, variant.run_dir)
            continue
        try:
            _run(variant.config, variant.run_dir, modules, None, None, (), False, show_status=False)
        except typer.Exit as e:
            if e.exit_code == 130:
                fail("sweep interrupted; run the same `cram sweep` command to continue it", 130)
            failed.append((variant.name, e.exit_code))
    if not dry_run:
        print_sweep(found)
    if elsewhere:
        out.print(
            f"{len(elsewhere)} variant(s) run by another process: {', '.join(elsewhere)}; "
            "run this sweep again once it is done to see them finished here",
            highlight=False,
        )
    if failed:
        fail(f"{len(failed)} of {len(found)} variants failed: {', '.join(n for n, _ in failed)}", failed[0][1])


@app.command("gc")
def collect_garbage(
    root: Path = typer.Argument(Path("runs"), help="The runs root."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be removed and its size; remove nothing."),
) -> None:
    """Remove store entries (and unfinished partials) that no run directory under ROOT refers to."""
    if not root.is_dir():
        fail(f"{root}: no such directory")
    logs.configure(None)
    try:
        removed, busy = store.collect(root, logs.get(), dry_run)
    except store.StoreError as e:
        fail(str(e))
    print_collected(removed, busy, dry_run)


def _check_plot_path(plot: Path) -> None:
    if not plot.parent.is_dir():
        fail(f"--plot {plot}: the folder {plot.parent} does not exist; create it or choose another path")


if __name__ == "__main__":  # pragma: no cover
    main()
