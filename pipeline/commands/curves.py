"""Training curves and run comparison, read from run directories (manifest, config, metrics.jsonl).

    fig = plot_run(Path("runs/default")); save(fig, Path("curves.png"))
    config_diff([run_a, run_b])       # {"pretrain.optimizer.lr": [0.003, 0.001]}: only differing keys
    stage_figures([run_a, run_b])     # {"pretrain": {"final_loss": [6.1, 5.9], ...}, ...}

matplotlib is optional (`pip install -e '.[plot]'`) and imported only by the plotting functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cram.pipeline import rundir
from cram.pipeline.schema import StageRecord
from cram.stages.shared.figures import is_number

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"), ("grad_norm", "grad norm"))
MISSING = "-"  # a key or figure that a run does not have


class CurvesError(Exception):
    """A run directory without what a curve or a comparison needs, or no matplotlib; exit code 2."""


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The pretrain stage's metrics.jsonl rows, in order."""
    record = _stages(run_dir).get("pretrain")
    name = record.outputs.get("metrics") if record is not None else None
    path = run_dir / "pretrain" / name if isinstance(name, str) and name else None
    if path is None or not path.is_file():
        raise CurvesError(f"{run_dir}: no pretrain metrics (stage status {record.status if record else 'missing'})")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CurvesError(f"{path}: cannot be read ({e})") from None
    return [_row(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]


def _row(path: Path, number: int, line: str) -> dict[str, Any]:
    """A metrics.jsonl line as a row (an object with `tokens_seen`, the plots' x axis): CurvesError naming
    the file and line otherwise."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise CurvesError(f"{path}: line {number} is not valid JSON ({e})") from None
    if not isinstance(row, dict) or not is_number(row.get("tokens_seen")):
        raise CurvesError(f"{path}: line {number} is not a metrics row (an object with tokens_seen): {line[:60]}")
    return row


def plot_run(run_dir: Path) -> Any:
    """A 2x2 matplotlib figure: loss, lr, tokens/s and grad norm against tokens seen; eval figures on top."""
    plt = _pyplot()
    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (key, label) in zip(axes.flat, PANELS):
        points = [(r["tokens_seen"], r[key]) for r in rows if is_number(r.get(key))]
        ax.plot([x for x, _ in points], [y for _, y in points], linewidth=1.2)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("tokens seen")
    evaluate = _outputs(_stages(run_dir), "evaluate")
    results = "  ".join(f"{k} {v:.4g}" for k, v in evaluate.items() if is_number(v) and not k.endswith("_time_s"))
    fig.suptitle(f"{run_dir.name}\n{results or 'not evaluated'}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_losses(run_dirs: list[Path]) -> Any:
    """One chart: the pretraining loss of every run against tokens seen."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for run_dir in run_dirs:
        rows = [r for r in read_metrics(run_dir) if is_number(r.get("loss"))]
        ax.plot([r["tokens_seen"] for r in rows], [r["loss"] for r in rows], label=run_dir.name, linewidth=1.2)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def save(fig: Any, path: Path) -> None:
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise CurvesError(f"--plot {path}: cannot be written ({e.strerror or e})") from None
    finally:
        _pyplot().close(fig)


def config_diff(run_dirs: list[Path]) -> dict[str, list[Any]]:
    """The dotted keys of the resolved configs whose values differ between the runs, value per run."""
    flat = [_flatten(_config(d)) for d in run_dirs]
    diff = {}
    for key in sorted(set().union(*flat)):
        values = [f.get(key, MISSING) for f in flat]
        if len({json.dumps(v, sort_keys=True) for v in values}) > 1:
            diff[key] = values
    return diff


def stage_figures(run_dirs: list[Path]) -> dict[str, dict[str, list[Any]]]:
    """Per stage, every number that some run's manifest outputs hold, value per run."""
    stages = [_stages(d) for d in run_dirs]
    table: dict[str, dict[str, list[Any]]] = {}
    for name in dict.fromkeys(n for s in stages for n in s):
        outputs = [_outputs(s, name) for s in stages]
        keys = dict.fromkeys(k for o in outputs for k, v in o.items() if is_number(v))
        if keys:
            table[name] = {k: [o.get(k, MISSING) for o in outputs] for k in keys}
    return table


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise CurvesError("plotting needs matplotlib: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")  # files only: no display, and no GUI toolkit to import
    import matplotlib.pyplot as plt

    return plt


def _stages(run_dir: Path) -> dict[str, StageRecord]:
    try:
        return rundir.records(run_dir)
    except rundir.RunDirError as e:
        raise CurvesError(str(e)) from None


def _outputs(records: dict[str, StageRecord], name: str) -> dict[str, Any]:
    record = records.get(name)
    return record.outputs if record is not None else {}


def _config(run_dir: Path) -> dict[str, Any]:
    try:
        return rundir.saved_config(run_dir)
    except rundir.RunDirError as e:
        raise CurvesError(str(e)) from None


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):  # [[evaluate.tasks]]
            flat |= _flatten({str(i): v for i, v in enumerate(value)}, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat
