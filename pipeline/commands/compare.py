"""Runs side by side (`cram compare`, and the end of `cram sweep`): one row per run, the config keys that
differ between the runs, then the headline figures of each stage.

    table = compare_table(expand(["runs/lr*"]), sort="mlm_loss")
    console.print(rich_table(table)); table.write(Path("table.md"))   # .csv or .md

Figures are the numbers the stages return (their manifest outputs), named `stage.figure`; a figure name
that one stage alone uses may be given bare (`mlm_loss`). The headline figures: pretrain's held-out and
final loss, tokens/s and MFU, and every evaluate figure except baselines and timings; `all_figures`
takes every number of every stage. Sorting puts the best run first: ascending for losses and times
(names holding "loss", or ending in "_s" but not "_per_s"), descending for the rest (accuracy,
throughputs such as tokens_per_s, MFU, GLUE);
`descending` overrides that. Runs without the figure go last, in the order given.
"""

from __future__ import annotations

import csv
import difflib
import glob
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from cram.pipeline import rundir
from cram.pipeline.commands import curves
from cram.pipeline.commands.curves import MISSING, CurvesError
from cram.stages.shared.figures import is_number
from cram.stages.shared.files import write_atomic

HEADLINE = {"pretrain": ("val_loss_end", "final_loss", "tokens_per_s", "mfu")}
HIDDEN_SUFFIXES = ("_baseline", "_time_s")  # per-task reference figures, the same for every run of a task
FORMATS = (".csv", ".md")


class CompareError(CurvesError):
    """A comparison that cannot be made (no such run, a figure no run has, an output format it cannot
    write): one line naming the pattern, path or figure. A kind of CurvesError, since the comparison
    reads the runs' figures and curves and fails the same way when they cannot be read."""


@dataclass(frozen=True)
class Table:
    """`rows[i][j]` is run i's value in `columns[j]`; the first column is the run, then `n_config` config
    keys, then figures. Missing values are `MISSING`."""

    columns: list[str]
    rows: list[list[Any]]
    n_config: int
    sort: str | None = None  # the figure column the rows are sorted by
    descending: bool = False

    def cells(self) -> list[list[str]]:
        """The values as a person reads them: floats to four significant digits."""
        return [[_text(v, short=True) for v in row] for row in self.rows]

    def csv(self) -> str:
        """Full precision; a missing value is an empty cell."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(self.columns)
        writer.writerows([["" if v == MISSING else _text(v, short=False) for v in row] for row in self.rows])
        return buffer.getvalue()

    def markdown(self) -> str:
        align = ["---"] * (1 + self.n_config) + ["---:"] * (len(self.columns) - 1 - self.n_config)
        lines = [self.columns, align, *self.cells()]
        return "".join("| " + " | ".join(c.replace("|", "\\|") for c in line) + " |\n" for line in lines)

    def write(self, path: Path) -> None:
        """Write as CSV or markdown by the suffix of `path`, atomically."""
        check_out(path)
        try:
            write_atomic(path, self.csv() if path.suffix.lower() == ".csv" else self.markdown())
        except OSError as e:
            raise CompareError(f"--out {path}: cannot be written ({e.strerror}: {e.filename})") from None


def check_out(path: Path) -> None:
    """Refuse an --out that cannot be written before anything is read: a format other than CSV and
    markdown, a folder that does not exist, or a folder in its place."""
    if path.suffix.lower() not in FORMATS:
        raise CompareError(f"--out {path}: write a .csv or a .md file")
    if not path.parent.is_dir():
        raise CompareError(f"--out {path}: the folder {path.parent} does not exist; create it or choose another path")
    if path.is_dir():
        raise CompareError(f"--out {path}: a folder; name a .csv or .md file")


def expand(patterns: Sequence[str | Path]) -> list[Path]:
    """Run directories from paths and globs (`runs/lr*`, also when quoted so the shell left it alone), in
    the order given, each once. A glob keeps what it matches that is a run directory and must match one;
    a plain path must be one."""
    found: dict[Path, None] = {}
    for pattern in map(str, patterns):
        if glob.has_magic(pattern):
            matches = [Path(p) for p in sorted(glob.glob(pattern)) if _is_run_dir(Path(p))]
            if not matches:
                raise CompareError(f"{pattern}: matches no run directory")
        else:
            if not _is_run_dir(Path(pattern)):
                hint = f"; the runs under it: '{Path(pattern) / '*'}'" if Path(pattern).is_dir() else ""
                raise CompareError(f"{pattern}: not a run directory (no {rundir.MANIFEST}){hint}")
            matches = [Path(pattern)]
        found.update(dict.fromkeys(matches))
    return list(found)


def compare_table(
    run_dirs: Sequence[Path],
    sort: str | None = None,
    descending: bool | None = None,
    all_figures: bool = False,
) -> Table:
    """The comparison of `run_dirs`; `sort` is a figure name (`mlm_loss` or `evaluate.mlm_loss`), best
    first unless `descending` says the order. Raises CompareError for a run directory without a config
    or manifest, or an unknown figure (naming the closest ones)."""
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise CompareError("no run directories to compare")
    diff = {k: v for k, v in curves.config_diff(run_dirs).items() if k != "run.name"}  # the run column says it
    figures = {
        f"{stage}.{name}": [v if is_number(v) else MISSING for v in values]
        for stage, table in curves.stage_figures(run_dirs).items()
        for name, values in table.items()
    }
    sort_key = _resolve(sort, figures) if sort is not None else None
    shown = [k for k in figures if all_figures or _is_headline(k) or k == sort_key]
    labels = _labels(run_dirs)
    headers = _figure_headers(shown, figures)
    rows = [[labels[i], *(diff[k][i] for k in diff), *(figures[k][i] for k in shown)] for i in range(len(run_dirs))]
    if sort_key is not None:
        if descending is None:
            descending = not _lower_is_better(sort_key)
        column = figures[sort_key]
        present = sorted((i for i, v in enumerate(column) if v != MISSING), key=lambda i: column[i], reverse=descending)
        rows = [rows[i] for i in present] + [rows[i] for i, v in enumerate(column) if v == MISSING]
    sorted_by = headers[shown.index(sort_key)] if sort_key is not None else None
    return Table(["run", *diff, *headers], rows, len(diff), sorted_by, bool(descending))


def rich_table(table: Table, title: str | None = None) -> Any:
    """The table for a terminal (a rich Table): config columns in cyan, figures right-aligned."""
    from rich.markup import escape
    from rich.table import Table as RichTable

    if title is None:
        order = "descending" if table.descending else "ascending"
        title = f"{len(table.rows)} run{'s' if len(table.rows) != 1 else ''}"
        title += f", by {table.sort} ({order})" if table.sort else ""
    rich = RichTable(title=title, title_justify="left")
    for j, column in enumerate(table.columns):
        config = 0 < j <= table.n_config
        rich.add_column(
            escape(column),
            style="cyan" if config else None,
            justify="left" if j <= table.n_config else "right",
            overflow="fold",
        )
    for row in table.cells():
        rich.add_row(*map(escape, row))
    return rich


def _resolve(name: str, figures: dict[str, list[Any]]) -> str:
    if name in figures:
        return name
    bare = [k for k in figures if k.split(".", 1)[1] == name]
    if len(bare) == 1:
        return bare[0]
    if len(bare) > 1:
        raise CompareError(f"--sort {name}: more than one stage has it; use one of {', '.join(bare)}")
    names = sorted({k.split(".", 1)[1] for k in figures} | set(figures))
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    hint = f"; closest: {', '.join(close)}" if close else f"; figures: {', '.join(figures) or 'none'}"
    raise CompareError(f"--sort {name}: no run has this figure{hint}")


def _is_headline(key: str) -> bool:
    stage, name = key.split(".", 1)
    if stage in HEADLINE:
        return name in HEADLINE[stage]
    return stage == "evaluate" and not name.endswith(HIDDEN_SUFFIXES)


def _lower_is_better(key: str) -> bool:
    """Losses and times (`wall_s`, `sent_time_s`); a rate per second (`tokens_per_s`) is a throughput."""
    name = key.split(".", 1)[1]
    return "loss" in name or (name.endswith("_s") and not name.endswith("_per_s"))


def _figure_headers(shown: list[str], figures: dict[str, list[Any]]) -> list[str]:
    """Bare figure names where no other stage's figure has the same name, `stage.name` otherwise."""
    bare = [k.split(".", 1)[1] for k in figures]
    return [k.split(".", 1)[1] if bare.count(k.split(".", 1)[1]) == 1 else k for k in shown]


def _labels(run_dirs: list[Path]) -> list[str]:
    names = [d.name for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def _is_run_dir(path: Path) -> bool:
    return (path / rundir.MANIFEST).is_file()


def _text(value: object, short: bool) -> str:
    if isinstance(value, float) and short:
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"  # 25000 tokens/s, not 2.5e+04
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value)
