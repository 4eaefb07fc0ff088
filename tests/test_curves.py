"""Training curves (`cram inspect --plot`) and run comparison (`cram compare`) on hand-made run dirs."""

import json
import sys

import pytest
from typer.testing import CliRunner

from cram.pipeline.commands import cli, curves

CONFIG = """[run]
name = "{name}"
seed = 0

[pretrain]
microbatch = 32

[pretrain.optimizer]
lr = {lr}
betas = [0.9, 0.98]

[[evaluate.tasks]]
name = "topic"
epochs = {epochs}
"""


def fake_run(root, name, lr=0.003, epochs=2, final_loss=6.1, extra_config=""):
    """A finished run as compare and plot see it: config.toml, manifest.json and pretrain metrics."""
    run = root / name
    (run / "pretrain").mkdir(parents=True)
    (run / "config.toml").write_text(CONFIG.format(name=name, lr=lr, epochs=epochs) + extra_config)
    rows = [
        {
            "step": s,
            "tokens_seen": 4096 * s,
            "loss": 9.0 - s / 10,
            "lr": lr * s / 40,
            "tokens_per_s": 25000.0 + s,
            "grad_norm": 1.0 / s,
        }
        for s in range(1, 41)
    ]
    (run / "pretrain" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stages = {
        "pretrain": {
            "status": "done",
            "outputs": {
                "metrics": "metrics.jsonl",
                "final_loss": final_loss,
                "tokens_per_s": 25000.0,
                "mfu": 0.5,
                "steps": 40,
            },
        },
        "evaluate": {
            "status": "done",
            "outputs": {"results": "results.json", "mlm_loss": final_loss + 0.1, "topic_accuracy": 0.73},
        },
    }
    (run / "manifest.json").write_text(json.dumps({"run": name, "stages": stages}))
    return run


def test_config_diff_lists_exactly_the_differing_keys(tmp_path):
    a = fake_run(tmp_path, "a")
    b = fake_run(tmp_path, "b", lr=0.001, epochs=3, extra_config='\n[pack]\nboundary = "none"\n')
    assert curves.config_diff([a, b]) == {
        "evaluate.tasks.0.epochs": [2, 3],
        "pack.boundary": [curves.MISSING, "none"],
        "pretrain.optimizer.lr": [0.003, 0.001],
        "run.name": ["a", "b"],
    }
    assert curves.config_diff([a, fake_run(tmp_path / "copy", "a")]) == {}


def test_compare_prints_differing_keys_then_figures_side_by_side(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = fake_run(tmp_path, "a"), fake_run(tmp_path, "b", lr=0.001, final_loss=5.5)
    assert curves.stage_figures([a, b]) == {
        "pretrain": {
            "final_loss": [6.1, 5.5],
            "tokens_per_s": [25000.0, 25000.0],
            "mfu": [0.5, 0.5],
            "steps": [40, 40],
        },
        "evaluate": {"mlm_loss": [pytest.approx(6.2), 5.6], "topic_accuracy": [0.73, 0.73]},
    }
    png = tmp_path / "loss.png"
    result = CliRunner().invoke(cli.app, ["compare", str(a), str(b), "--plot", str(png)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "pretrain.optimizer.lr" in result.output and "run.name" not in result.output  # the run column
    assert "microbatch" not in result.output and "betas" not in result.output
    assert "final_loss" in result.output and "5.5" in result.output and png.stat().st_size > 0

    fig = curves.plot_losses([a, b])
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["a", "b"] and len(lines[0].get_xdata()) == 40


def test_plot_run_draws_four_curves_and_saves_a_real_png(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    run = fake_run(tmp_path, "a")
    fig = curves.plot_run(run)
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "learning rate", "tokens/s", "grad norm"]
    assert all(len(ax.get_lines()) == 1 and len(ax.get_lines()[0].get_xdata()) == 40 for ax in fig.axes)
    assert list(fig.axes[0].get_lines()[0].get_ydata()[:2]) == [8.9, 8.8]
    assert "mlm_loss 6.2" in fig._suptitle.get_text()

    png = tmp_path / "curves.png"
    result = CliRunner().invoke(cli.app, ["inspect", str(run), "pretrain", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1000, 700)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50  # anti-aliased curves and text, not a blank canvas


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    run = fake_run(tmp_path, "a")
    result = CliRunner().invoke(cli.app, ["inspect", str(run), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "pip install -e '.[plot]'" in result.output
    result = CliRunner().invoke(cli.app, ["compare", str(run), str(tmp_path / "missing")])
    assert result.exit_code == 2 and "missing" in result.output and "run directory" in result.output
