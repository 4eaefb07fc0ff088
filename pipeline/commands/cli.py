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
    cram export runs/default --task topic --to out/topic [--format transformers]   the kept classifier
    cram predict runs/default --task topic texts.csv [--out labels.jsonl]   classify (or: cram predict out/topic ...)
    cram export runs/default --task search --to out/st --format sentence-transformers   a kept embedding model
    cram embed runs/default texts.txt --out vectors.npy [--task search] [--query]   embed (or: cram embed out/st ...)
    cram ls runs                                 every run with its newest stage
    cram sweep pipeline.toml --grid pretrain.optimizer.lr=1e-3,3e-3 [--grid ...] [--set ...]
    cram gc runs [--dry-run]                     remove store entries that no run refers to
    cram verify runs | runs/default              hash every stored output; name the damaged ones (exit 1)

Exit codes: 0 ok, 1 a stage failed, 2 bad usage, config or input, 130 interrupted, 141 the reader of
the output closed the pipe (`cram predict ... | head -1`; quietly, as Unix tools end).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from cram.pipeline import config as cfg
from cram.pipeline import errors, logs, planning, rundir, runner, store
from cram.pipeline.commands import compare as comparing
from cram.pipeline.commands import curves, reading, sweep
from cram.pipeline.commands import export as exporting
from cram.pipeline.commands.cli_output import (
    error,
    out,
    print_collected,
    print_elsewhere,
    print_plan,
    print_runs,
    print_stage,
    print_status,
    print_sweep,
    print_variant,
    print_verified,
)

# The modules' own errors: bad usage, config or input (exit 2). errors.CramError carries its own code.
_MODULE_ERRORS = (
    cfg.ConfigError,
    rundir.RunDirError,
    planning.PlanError,
    store.StoreError,
    exporting.ExportError,
    curves.CurvesError,
)


def _handled(command: Callable[..., None]) -> Callable[..., None]:
    """Where every command ends on an error: its one line on stderr and its exit code (errors.exit_code)."""

    @functools.wraps(command)
    def handled(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except (errors.CramError, *_MODULE_ERRORS) as e:
            error(str(e))
            raise typer.Exit(errors.exit_code(e)) from None
        except KeyboardInterrupt:  # outside a run (which says how to resume it): nothing to continue
            error("interrupted")
            raise typer.Exit(130) from None
        except BrokenPipeError:  # the reader left (`cram predict ... | head -1`): end as Unix tools do, quietly
            _stdout_to_null()
            raise typer.Exit(errors.CLOSED_PIPE) from None

    return handled


def _stdout_to_null() -> None:
    """Point stdout's descriptor at the null device: what Python still holds for the closed pipe is
    flushed when it exits, and would fail there again, with a message of its own on stderr."""
    import os
    import sys

    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout with no descriptor (captured): nothing to flush
        pass


class _Cram(typer.Typer):
    """Every command is registered through `_handled`."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
        register = super().command(*args, **kwargs)
        return lambda f: register(_handled(f))


app = _Cram(add_completion=False, no_args_is_help=True, help="Cram a BERT-style MLM from raw text.")


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
        raise errors.CramError(
            f"--only {only} and --from {start} do not combine: --only runs one stage, "
            "--from re-runs a stage and every stage after it"
        )
    modules = runner.default_stages()
    conf = cfg.load(config, runner.config_classes(modules), overrides)
    if name is not None:
        conf = dataclasses.replace(conf, run=dataclasses.replace(conf.run, name=name))
    rundir.validate_name(conf.run.name)
    run_dir = Path(conf.run.root) / conf.run.name
    _run(conf, run_dir, planning.plan(conf, modules, run_dir, only=only, start=start, force=tuple(force)), dry_run)


@app.command()
def resume(run_dir: Path = typer.Argument(..., help="A run directory.")) -> None:
    """Continue an interrupted run from its saved config; a checkpointed stage continues from its checkpoint."""
    modules = runner.default_stages()
    conf = runner.load_saved(run_dir, modules)
    _run(conf, run_dir, planning.plan(conf, modules, run_dir))


def _run(conf: cfg.PipelineConfig, run_dir: Path, steps: list[planning.Step], dry_run: bool = False) -> None:
    """Run the planned `steps` (with `dry_run`, print them) and the run's status after."""
    if dry_run:
        print_plan(steps, run_dir, conf)
    elif runner.run_pipeline(conf, run_dir, steps) == 0:
        print_status(run_dir, reading.status(run_dir))


@app.command()
def status(run_dir: Path = typer.Argument(..., help="A run directory.")) -> None:
    """One table: stage, status, key, duration, main figures."""
    print_status(run_dir, reading.status(run_dir))


@app.command()
def inspect(
    run_dir: Path = typer.Argument(..., help="A run directory."),
    stage: Optional[str] = typer.Argument(None, help="A stage; all stages when left out."),
    lines: int = typer.Option(15, "--lines", min=0, help="How many log events to show (0: none)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also save the pretraining curves as this PNG."),
) -> None:
    """The resolved config, a stage's outputs and figures, and its log tail."""
    stages = rundir.records(run_dir)
    if plot is not None:
        _check_plot_path(plot)
        curves.save(curves.plot_run(run_dir), plot)
        out.print(f"curves: {plot}")
    if stage is not None and stage not in stages:
        raise errors.CramError(f"{run_dir}: no stage '{stage}' in the manifest (it has: {', '.join(stages) or 'none'})")
    conf = rundir.saved_config(run_dir, required=False)
    events = run_dir / rundir.EVENTS
    for name in [stage] if stage else list(stages):
        print_stage(name, stages[name], conf, events, logs.tail(events, name, lines), run_dir)


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
    if out_file is not None:
        comparing.check_out(out_file)
    run_dirs = comparing.expand(runs)
    table = comparing.compare_table(run_dirs, sort=sort, descending=descending, all_figures=all_figures)
    if plot is not None:
        curves.save(curves.plot_losses(run_dirs), plot)
    if out_file is not None:
        table.write(out_file)
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
    fmt: str = typer.Option("cram", "--format", help=exporting.FORMAT_HELP),
    force: bool = typer.Option(False, "--force", help="Replace TO even if it is not empty."),
    task: Optional[str] = typer.Option(
        None, "--task", help="Export the classifier or embedding model evaluate kept for this task."
    ),
) -> None:
    """Export the pretrained encoder (or a kept classifier or embedding model) with its tokenizer and a model card."""
    exporting.export(run_dir, to, fmt, force, task)
    out.print(f"exported {run_dir}{'' if task is None else f' task {task}'} ({fmt}) to {to}")


@app.command("predict")
def predict_files(
    source: Path = typer.Argument(..., help="A run directory (with --task) or a `cram export --task` folder."),
    files: List[Path] = typer.Argument(..., help="CSV, TSV, JSON-lines or text files holding the task's fields."),
    task: Optional[str] = typer.Option(None, "--task", help="The task whose kept classifier to use."),
    out_file: Optional[Path] = typer.Option(None, "--out", help="Write the rows here (.jsonl, .csv); default stdout."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="Compile the prediction (one graph per bucket)."),
    batch_size: int = typer.Option(128, "--batch-size", min=1, help="Texts per batch."),
) -> None:
    """Classify every text of FILES with a kept classifier: one row per text, label and probabilities."""
    from cram.pipeline.commands import predict
    from cram.stages.kept.predicting import tuned_allocator

    settings = predict.Settings(compile=compile, batch_size=batch_size)
    with tuned_allocator():
        written = predict.predict(source, files, task, out_file, settings)
    if out_file is not None:
        out.print(f"{written:,} rows: {out_file}")


@app.command("embed")
def embed_texts(
    source: Path = typer.Argument(..., help="A run directory, or an exported embedding model's folder."),
    files: List[Path] = typer.Argument(..., help="Text (a line a text), CSV, TSV or JSON-lines files."),
    out_file: Path = typer.Option(
        ..., "--out", help="The .npy (a unit vector per text, in order) or .parquet (ids and vectors) to write."
    ),
    task: Optional[str] = typer.Option(None, "--task", help="The task whose kept embedding model to use."),
    field: str = typer.Option("text", "--field", help="The field holding the text (CSV, TSV, JSON lines)."),
    id_field: Optional[str] = typer.Option(
        None, "--id-field", help="The field holding each record's id, for a .parquet --out (default: row numbers)."
    ),
    query: bool = typer.Option(False, "--query", help="The texts are queries: cut at the model's query length."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or float16 (half the size)."),
    precision: str = typer.Option(
        "auto",
        "--precision",
        help="auto (bf16 on CUDA or a CPU with native bf16, else fp32), fp32 (as sentence-transformers: 1e-4) "
        "or bf16 (~1e-3 apart).",
    ),
    compile: bool = typer.Option(
        False, "--compile/--no-compile", help="Compile the embedding (one graph per length bucket; eager is faster)."
    ),
    batch_size: int = typer.Option(128, "--batch-size", min=1, help="Texts per batch."),
    prompt: Optional[str] = typer.Option(
        None, "--prompt", help="A sentence-transformers folder's prompt to put before each text (default: its own)."
    ),
) -> None:
    """Embed every text of FILES with a kept or exported embedding model into one .npy of unit vectors,
    or a .parquet of ids and vectors."""
    from cram.pipeline.commands import embed
    from cram.stages.kept.predicting import tuned_allocator

    request = embed.Request(
        field=field, query=query, dtype=dtype, id_field=id_field, precision=precision, prompt=prompt
    )
    with tuned_allocator():
        written = embed.embed(
            source, files, out_file, task, request, embed.Settings(compile=compile, batch_size=batch_size)
        )
    out.print(f"{written.rows:,} vectors ({dtype}, computed in {written.precision}): {out_file}")


@app.command("search")
def search_corpus(
    source: Path = typer.Argument(..., help="A run directory, or an exported embedding model's folder."),
    queries: List[Path] = typer.Argument(..., help="Query files: text (a line a query), CSV, TSV or JSON lines."),
    corpus: List[Path] = typer.Option(..., "--corpus", help="A corpus file (repeatable): text, CSV, TSV, JSON lines."),
    out_file: Path = typer.Option(..., "--out", help="The .jsonl to write: a line a query, its hits' ids and scores."),
    task: Optional[str] = typer.Option(None, "--task", help="The task whose kept embedding model to use."),
    top_k: int = typer.Option(10, "--top-k", help="Hits a query."),
    mode: str = typer.Option("hybrid", "--mode", help="hybrid (dense and BM25 fused), dense or bm25."),
    fusion: Optional[str] = typer.Option(
        None, "--fusion", help="convex (a mix of min-max scores) or rrf (default: the model's own, else convex)."
    ),
    weight: Optional[float] = typer.Option(
        None,
        "--weight",
        help="The dense run's share in the convex mix, in [0, 1] (default: the model's own, else 0.5).",
    ),
    field: str = typer.Option("text", "--field", help="The corpus field holding the text (CSV, TSV, JSON lines)."),
    id_field: Optional[str] = typer.Option(None, "--id-field", help="The corpus field of ids (default: row numbers)."),
    query_field: str = typer.Option("text", "--query-field", help="The query files' text field."),
    query_id_field: Optional[str] = typer.Option(
        None, "--query-id-field", help="The query files' id field (default: row numbers)."
    ),
    cache: Path = typer.Option(Path(".cram-search"), "--cache", help="Where corpus indexes are kept and reused."),
    precision: str = typer.Option("auto", "--precision", help="auto, fp32 or bf16: the encoder's arithmetic."),
) -> None:
    """Search a corpus for each query of QUERIES: hybrid (an embedding model and BM25 fused) by default; the
    corpus's index is built once and reused."""
    from cram.pipeline.commands import search
    from cram.stages.kept.searching import Corpus

    how = search.query_settings(mode, top_k, fusion, weight, query_field, query_id_field)
    done = search.search(source, queries, out_file, Corpus(tuple(corpus), field, id_field), how, task, cache, precision)
    index = "reused" if done.reused else "built"
    out.print(f"{done.queries:,} queries over {done.documents:,} documents ({mode}, index {index}): {out_file}")


@app.command("ls")
def list_runs(root: Path = typer.Argument(Path("runs"), help="The runs root.")) -> None:
    """The runs under ROOT with their newest stage and its status."""
    print_runs(root, reading.newest(root))


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
    found = sweep.variants(config, runner.config_classes(modules), sweep.parse_grid(grid), overrides, name)
    outcomes = sweep.run_sweep(
        found,
        modules,
        dry_run,
        show=lambda o: print_variant(o, len(found), dry_run),
        failed=lambda o: error(str(o.error)),
    )
    if not dry_run:
        print_sweep(sweep.results(found))
    print_elsewhere(outcomes)
    sweep.raise_for_failures(outcomes)


@app.command("gc")
def collect_garbage(
    root: Path = typer.Argument(Path("runs"), help="The runs root."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be removed and its size; remove nothing."),
) -> None:
    """Remove store entries (and unfinished partials) that no run directory under ROOT refers to."""
    reading.folder(root)
    logs.configure(None)
    removed, busy = store.collect(root, logs.get(), dry_run)
    print_collected(removed, busy, dry_run)


@app.command("verify")
def verify(path: Path = typer.Argument(Path("runs"), help="A runs root (its whole store) or a run directory.")) -> None:
    """Hash every stage output under PATH; name each damaged one, which the next run computes again."""
    checked = store.check_all(path)
    print_verified(checked)
    broken = sum(c.problem is not None for c in checked)
    if broken:
        raise errors.CramError(f"{broken} damaged or missing; cram run (or cram resume RUN) computes them again", 1)


def _check_plot_path(plot: Path) -> None:
    if not plot.parent.is_dir():
        raise errors.CramError(
            f"--plot {plot}: the folder {plot.parent} does not exist; create it or choose another path"
        )


if __name__ == "__main__":  # pragma: no cover
    main()
