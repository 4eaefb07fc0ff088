"""`cram export`: a finished run's encoder, or a classifier or embedding model its evaluate stage kept,
written to a folder in cram's format, transformers' or (an embedding model) sentence-transformers' (the
writing: stages/kept/exporting.py).

    export(Path("runs/default"), Path("out/default"))                       # cram's format
    export(Path("runs/default"), Path("out/hf"), fmt="transformers")        # a ModernBERT (or BERT) directory
    export(Path("runs/default"), Path("out/topic"), task="topic")           # the kept topic classifier
    export(Path("runs/default"), Path("out/st"), fmt="sentence-transformers", task="search")  # an embedding model

A cram-format export is read back by `cram.stages.kept.load_export` (an encoder), `cram predict`
(a classifier) or `cram embed` (an embedding model, which also reads the sentence-transformers format).
`--force` replaces a folder only when it holds an earlier export's marker: never a run, the runs folder or
anything else.
"""

from __future__ import annotations

from pathlib import Path

from cram.pipeline import errors, rundir
from cram.pipeline.commands import classifiers
from cram.stages.kept import FORMATS, MARKER, MODEL, PARAMS, Card, KeptError, Source, write_export

FORMAT_HELP = "; ".join(f"{name} ({holds})" for name, holds in FORMATS.items()) + "."


class ExportError(errors.CramError):
    """A run directory, target or architecture that cannot be exported; one line, exit code 2."""


def export(run_dir: Path, to: Path, fmt: str = "cram", force: bool = False, task: str | None = None) -> Path:
    """Write the final params of RUN_DIR's pretrain stage (or, with `task`, the classifier or embedding
    model its evaluate stage kept for that task) to TO, atomically; return TO."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: allowed {', '.join(FORMATS)}")
    try:
        run = classifiers.finished_run(run_dir)
    except classifiers.RunError as e:
        raise ExportError(str(e)) from None
    if task is None:
        source = Source(run.params, run.model, run.tokenizer, run.special_ids)
    elif task in classifiers.kept_embedders(run_dir):
        embedder = classifiers.find_embedder(run_dir, task)
        files = (embedder.folder / PARAMS, embedder.folder / MODEL)
        source = Source(*files, run.tokenizer, run.special_ids, embedder=embedder)
    else:
        kept = classifiers.find(run_dir, task)
        source = Source(kept.folder / PARAMS, kept.folder / MODEL, run.tokenizer, run.special_ids, kept)
    target = _check_target(run_dir, to, force)
    try:
        write_export(source, _card(run_dir), fmt, target, run_dir)
    except KeptError as e:
        raise ExportError(str(e)) from None
    return to


def _card(run_dir: Path) -> Card:
    """What the model card quotes of the run: its figures per stage and its resolved config."""
    stages = rundir.Manifest.load(run_dir).records
    saved = run_dir / rundir.CONFIG
    try:
        config = saved.read_text(encoding="utf-8") if saved.is_file() else ""
    except (OSError, UnicodeDecodeError) as e:
        raise ExportError(f"{saved}: not a readable config ({e}); the model card quotes it") from None
    return Card(run_dir.name, {stage: record.outputs for stage, record in stages.items()}, config)


def _check_target(run_dir: Path, to: Path, force: bool) -> Path:
    """TO resolved, once it is known to be safe to write: never a run, the runs folder or what holds
    them, never inside them, and, when it exists and is not empty, an earlier export to replace."""
    target, run = to.resolve(), run_dir.resolve()
    runs_root = run.parent
    if target == runs_root or runs_root in target.parents:
        raise ExportError(
            f"--to {to}: inside the runs folder {runs_root} (it holds run {run_dir.name}); "
            "export to a folder outside it"
        )
    if target in runs_root.parents or target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise ExportError(
            f"--to {to}: holds the runs folder {runs_root} or the current directory; "
            "name a new folder for the export, e.g. --to exports/" + run_dir.name
        )
    inside = next((p for p in target.parents if (p / rundir.MANIFEST).is_file()), None)
    if inside is not None:
        raise ExportError(f"--to {to}: inside the run directory {inside}; export to a folder outside it")
    if target.exists() and not target.is_dir():
        raise ExportError(f"--to {to}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        if not (target / MARKER).is_file():
            raise ExportError(
                f"--to {to}: not empty and not an earlier export (no {MARKER}); "
                "--force replaces only an earlier export: choose a new or empty folder"
            )
        if not force:
            raise ExportError(f"--to {to}: holds an earlier export; pass --force to replace it")
        run_inside = next(target.rglob(rundir.MANIFEST), None)
        if run_inside is not None:
            raise ExportError(f"--to {to}: holds a run directory ({run_inside.parent}); not replacing it")
    return target
