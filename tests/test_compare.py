"""`cram compare` over many hand-made run dirs: globs, the differing config keys, headline figures, sorting
best first, CSV and markdown files, and one-line errors for bad input."""

import csv
import io
import json

import pytest
from test_curves import fake_run
from typer.testing import CliRunner

from cram.pipeline.commands import cli, curves
from cram.pipeline.commands.compare import MISSING, compare_table, expand
from cram.pipeline.commands.curves import CurvesError


def set_outputs(run, stage, **figures):
    """Change a stage's manifest outputs; `drop=True` removes the stage, as if it never ran."""
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    if figures.get("drop"):
        del manifest["stages"][stage]
    else:
        manifest["stages"][stage]["outputs"].update(figures)
    path.write_text(json.dumps(manifest))


@pytest.fixture
def runs(tmp_path):
    """Four variants: three learning rates (one with other epochs) and one whose evaluate never ran."""
    root = tmp_path / "runs"
    a = fake_run(root, "lr3e-3", lr=0.003, final_loss=6.1)
    b = fake_run(root, "lr1e-3", lr=0.001, final_loss=5.5)
    c = fake_run(root, "lr1e-2", lr=0.01, epochs=3, final_loss=7.0)
    d = fake_run(root, "lr5e-4", lr=0.0005, final_loss=5.9)
    set_outputs(a, "evaluate", topic_accuracy=0.70, topic_baseline=0.2, topic_time_s=3.0)
    set_outputs(b, "evaluate", topic_accuracy=0.75)
    set_outputs(c, "evaluate", topic_accuracy=0.61)
    set_outputs(d, "evaluate", drop=True)
    (root / "notes.txt").write_text("not a run")
    (root / "lr-empty").mkdir()  # matches the glob, holds no manifest
    return root


def cram(*args, code=0):
    result = CliRunner().invoke(cli.app, ["compare", *map(str, args)], env={"COLUMNS": "250"})
    assert result.exit_code == code, result.output
    return result.output


def test_globs_expand_to_run_dirs_in_order_each_once(runs):
    assert [p.name for p in expand([f"{runs}/lr1e*", runs / "lr3e-3", f"{runs}/lr*"])] == [
        "lr1e-2",
        "lr1e-3",
        "lr3e-3",
        "lr5e-4",
    ]
    with pytest.raises(CurvesError, match=r"lrx\*: matches no run directory"):
        expand([f"{runs}/lrx*"])
    with pytest.raises(CurvesError, match=r"lr-empty: not a run directory \(no manifest.json\)"):
        expand([runs / "lr-empty"])
    with pytest.raises(CurvesError, match=r"runs: not a run directory .*the runs under it: '.*runs/\*'"):
        expand([runs])


def test_differing_keys_and_headline_figures_sorted_best_first(runs):
    table = compare_table(expand([f"{runs}/lr*"]), sort="mlm_loss")
    assert table.columns == [
        "run",
        "evaluate.tasks.0.epochs",
        "pretrain.optimizer.lr",
        "final_loss",
        "tokens_per_s",
        "mfu",
        "mlm_loss",
        "topic_accuracy",
    ]
    assert table.n_config == 2 and table.sort == "mlm_loss" and not table.descending
    # Lowest loss first; the run that has no evaluate goes last, its figures missing.
    assert [row[0] for row in table.rows] == ["lr1e-3", "lr3e-3", "lr1e-2", "lr5e-4"]
    assert table.rows[0] == ["lr1e-3", 2, 0.001, 5.5, 25000.0, 0.5, pytest.approx(5.6), 0.75]
    assert table.rows[-1][-2:] == [MISSING, MISSING]

    by_accuracy = compare_table(expand([f"{runs}/lr*"]), sort="evaluate.topic_accuracy")
    assert [row[0] for row in by_accuracy.rows] == ["lr1e-3", "lr3e-3", "lr1e-2", "lr5e-4"] and by_accuracy.descending
    reverse = compare_table(expand([f"{runs}/lr*"]), sort="topic_accuracy", descending=False)
    assert [row[0] for row in reverse.rows] == ["lr1e-2", "lr3e-3", "lr1e-3", "lr5e-4"]
    # A figure outside the headline ones is shown when sorted by, and all of them with all_figures.
    assert "steps" in compare_table(expand([f"{runs}/lr*"]), sort="steps").columns
    everything = compare_table(expand([f"{runs}/lr*"]), all_figures=True).columns
    assert {"steps", "topic_baseline", "topic_time_s"} <= set(everything)
    assert [row[0] for row in compare_table(expand([runs / "lr5e-4", runs / "lr1e-2"])).rows] == ["lr5e-4", "lr1e-2"]


# Three runs that differ in every figure, no two figures ranking them alike.
FIGURES = {
    "fast": {
        "pretrain": {"tokens_per_s": 30000.0, "wall_s": 300.0, "final_loss": 6.0, "mfu": 0.2},
        "evaluate": {"mlm_loss": 5.0, "topic_accuracy": 0.7, "topic_time_s": 9.0},
    },
    "slow": {
        "pretrain": {"tokens_per_s": 10000.0, "wall_s": 100.0, "final_loss": 5.0, "mfu": 0.6},
        "evaluate": {"mlm_loss": 6.0, "topic_accuracy": 0.8, "topic_time_s": 7.0},
    },
    "mid": {
        "pretrain": {"tokens_per_s": 20000.0, "wall_s": 200.0, "final_loss": 7.0, "mfu": 0.4},
        "evaluate": {"mlm_loss": 4.0, "topic_accuracy": 0.6, "topic_time_s": 8.0},
    },
}
BEST_FIRST = {  # read off the table above by hand
    "tokens_per_s": ["fast", "mid", "slow"],  # a throughput: descending
    "mfu": ["slow", "mid", "fast"],
    "topic_accuracy": ["slow", "fast", "mid"],
    "wall_s": ["slow", "mid", "fast"],  # a time: ascending
    "topic_time_s": ["slow", "mid", "fast"],
    "final_loss": ["slow", "fast", "mid"],  # a loss: ascending
    "mlm_loss": ["mid", "fast", "slow"],
}


@pytest.mark.parametrize("figure", BEST_FIRST)
def test_sort_puts_the_best_run_first_throughputs_descending_times_and_losses_ascending(tmp_path, figure):
    for name, stages in FIGURES.items():
        run = fake_run(tmp_path, name)
        for stage, figures in stages.items():
            set_outputs(run, stage, **figures)
    table = compare_table(expand([f"{tmp_path}/*"]), sort=figure)
    assert [row[0] for row in table.rows] == BEST_FIRST[figure]
    stage = "pretrain" if figure in FIGURES["fast"]["pretrain"] else "evaluate"
    shown = [row[table.columns.index(figure)] for row in table.rows]
    assert shown == [FIGURES[name][stage][figure] for name in BEST_FIRST[figure]]  # each row's own figures


def test_a_figure_two_stages_share_is_named_with_its_stage(runs):
    set_outputs(runs / "lr1e-3", "evaluate", final_loss=1.0)
    with pytest.raises(
        CurvesError, match="final_loss: more than one stage has it; use one of pretrain.final_loss, evaluate.final_loss"
    ):
        compare_table(expand([f"{runs}/lr*"]), sort="final_loss")
    table = compare_table(expand([f"{runs}/lr*"]), sort="pretrain.final_loss")
    assert "pretrain.final_loss" in table.columns and "evaluate.final_loss" in table.columns
    assert table.sort == "pretrain.final_loss"


def test_cli_writes_csv_and_markdown_atomically(runs, tmp_path):
    out_csv, out_md = tmp_path / "table.csv", tmp_path / "table.md"
    out_csv.write_text("old")
    text = cram(f"{runs}/lr*", "--sort", "mlm_loss", "--out", out_csv)
    assert "4 runs, by mlm_loss (ascending)" in text and "pretrain.optimizer.lr" in text and "25000" in text
    rows = list(csv.reader(io.StringIO(out_csv.read_text())))
    assert rows[0][:3] == ["run", "evaluate.tasks.0.epochs", "pretrain.optimizer.lr"]
    assert rows[1][0] == "lr1e-3" and float(rows[1][rows[0].index("mlm_loss")]) == pytest.approx(5.6)
    assert rows[4][0] == "lr5e-4" and rows[4][-2:] == ["", ""]  # missing: empty cells
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "table.csv"]  # no temp file left

    cram(f"{runs}/lr*", "--sort", "topic_accuracy", "--asc", "--out", out_md)
    lines = out_md.read_text().splitlines()
    assert lines[0].startswith("| run | evaluate.tasks.0.epochs | pretrain.optimizer.lr | final_loss |")
    assert lines[1].startswith("| --- | --- | --- | ---: |")
    assert lines[2].startswith("| lr1e-2 | 3 | 0.01 | 7 | 25000 | 0.5 |") and lines[-1].endswith("| - | - |")


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path):
    out = tmp_path / "t.csv"
    text = cram(f"{runs}/lr*", "--sort", "topic_acuracy", "--out", out, code=2)
    assert "--sort topic_acuracy: no run has this figure; closest: topic_accuracy" in text
    assert len(text.strip().splitlines()) == 1 and not out.exists()
    assert "write a .csv or a .md file" in cram(runs / "lr1e-3", "--out", tmp_path / "t.txt", code=2)
    assert "matches no run directory" in cram(f"{runs}/nothing*", code=2)
    assert "not a run directory" in cram(runs / "lr1e-3", tmp_path / "missing", code=2)


def test_plot_overlays_every_run(runs, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "loss.png"
    assert "loss curves" in cram(f"{runs}/lr1e*", runs / "lr3e-3", "--plot", png) and png.stat().st_size > 0
    lines = curves.plot_losses(expand([f"{runs}/lr1e*", runs / "lr3e-3"])).axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["lr1e-2", "lr1e-3", "lr3e-3"]
