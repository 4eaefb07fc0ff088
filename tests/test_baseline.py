"""Every continued run says what continuing bought (`[evaluate] baseline`): the checkpoint pretrain
continues is fine-tuned too, by the baseline stage, with evaluate's tasks, seeds and settings; its
scores are a zero-budget run's; a run that changes pretrain alone reuses them from the store; status,
inspect and compare show each task's continued and starting scores, their difference and spreads; a
pipeline without `pretrain.init` keeps its keys."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest
from test_bad_inputs import PIPELINE, cram, write_workspace

from cram.pipeline import config as cfg
from cram.pipeline import planning, rundir, runner
from cram.stages import evaluate

pytestmark = pytest.mark.usefixtures("one_thread")

# The workspace pipeline of test_bad_inputs with three seeds fine-tuned long enough at a high enough lr to
# part (a spread to show), its model table left out for the continued runs (the architecture is the
# checkpoint's).
SEEDS = PIPELINE.replace("seeds = 1", "seeds = 3\nlr = 1e-2").replace("epochs = 1", "epochs = 4")
CONTINUED = re.sub(r"\[pretrain\.model\]\n(.+\n)+\n", "", SEEDS).replace(
    "[pretrain]\n", '[pretrain]\ninit = "runs/base"\n'
)


def stages_of(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["stages"]


def results_of(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "results.json").read_text())


def started(run: Path) -> list[str]:
    """The stages the run computed (its `start` events), in order; a stage linked from the store has none."""
    events = [json.loads(line) for line in (run / rundir.EVENTS).read_text().splitlines()]
    return [e["stage"] for e in events if e.get("event") == "start"]


def learnable_task(folder: Path) -> None:
    """The workspace's task, its label said by its words (the workspace's own is drawn at random): seeds
    that learn it to different degrees give a spread. Test rows are drawn apart from training rows, as
    evaluate requires of a test set."""
    rng = random.Random(1)
    pools = [list(itertools.product(words, repeat=3)) for words in (["bad", "sad", "rain"], ["good", "happy", "sun"])]
    for pool in pools:
        rng.shuffle(pool)
    for split, n, first in (("train", 32, 0), ("test", 16, 16)):
        rows = [(" ".join(pools[i % 2][first + i // 2]), i % 2) for i in range(n)]
        (folder / f"{split}.csv").write_text("text,label\n" + "".join(f"{text},{label}\n" for text, label in rows))


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A finished run without init (`base`); continuing it (`cont`); the same with another pretrain lr
    (`cont-lr`); and its zero-budget run (`zero`), which evaluates the checkpoint as it is."""
    import os

    ws = tmp_path_factory.mktemp("baseline")
    write_workspace(ws)
    learnable_task(ws / "tasks")
    (ws / "pipeline.toml").write_text(SEEDS)
    (ws / "continued.toml").write_text(CONTINUED)
    cwd = os.getcwd()
    os.chdir(ws)
    try:
        runs = {
            "base": cram("run", "pipeline.toml"),
            "cont": cram("run", "continued.toml", "--name", "cont"),
            "plan-lr": cram(
                "run", "continued.toml", "--name", "cont-lr", "--set", "pretrain.optimizer.lr=3e-3", "--dry-run"
            ),
            "cont-lr": cram("run", "continued.toml", "--name", "cont-lr", "--set", "pretrain.optimizer.lr=3e-3"),
            "zero": cram("run", "continued.toml", "--name", "zero", "--set", "pretrain.budget.steps=0"),
        }
    finally:
        os.chdir(cwd)
    for name, result in runs.items():
        assert result.exit_code == 0, (name, result.output)
    (ws / "plan-lr.txt").write_text(runs["plan-lr"].output)
    return ws


def test_a_run_without_init_has_no_baseline_and_keeps_evaluates_key(ws, monkeypatch):
    monkeypatch.chdir(ws)
    base = stages_of(ws / "runs" / "base")
    assert list(base) == ["tokenize", "pack", "pretrain", "evaluate"]
    assert set(base["evaluate"]["upstream_keys"]) == {"tokenize", "pack", "pretrain"}
    assert not any(k.endswith(("_start", "_gain")) for k in base["evaluate"]["outputs"])
    modules = runner.default_stages()
    conf = cfg.load(ws / "pipeline.toml", runner.config_classes(modules))
    assert conf.stages["evaluate"].baseline == "none"  # "auto", resolved at load
    assert "baseline" not in planning.keyed_config(evaluate, conf.stages["evaluate"])
    steps = planning.plan(conf, modules, ws / "runs" / "base")
    assert [(s.name, s.action) for s in steps] == [(n, "skip") for n in ("tokenize", "pack", "pretrain", "evaluate")]
    assert steps[-1].key == base["evaluate"]["key"]


def test_auto_is_init_for_a_continued_run_on_a_budget_and_none_for_a_zero_budget(ws, monkeypatch):
    monkeypatch.chdir(ws)
    classes = runner.config_classes(runner.default_stages())
    continued = cfg.load(ws / "continued.toml", classes)
    zero = cfg.load(ws / "continued.toml", classes, ["pretrain.budget.steps=0"])
    told = cfg.load(ws / "continued.toml", classes, ["pretrain.budget.steps=0", 'evaluate.baseline="init"'])
    assert [c.stages["evaluate"].baseline for c in (continued, zero, told)] == ["init", "none", "init"]
    assert "baseline" not in stages_of(ws / "runs" / "zero")


def test_the_baseline_scores_are_a_zero_budget_runs_with_the_same_seeds(ws):
    start = results_of(ws / "runs" / "cont", "baseline")["tasks"]["sent"]
    zero = results_of(ws / "runs" / "zero", "evaluate")["tasks"]["sent"]
    assert start["seeds"] == zero["seeds"] == [0, 1, 2]
    assert start["scores"] == zero["scores"] and start["train_loss"] == zero["train_loss"]
    assert start["settings"] == zero["settings"]


def test_the_results_set_each_task_beside_its_start(ws):
    run = ws / "runs" / "cont"
    task = results_of(run, "evaluate")["tasks"]["sent"]
    start = results_of(run, "baseline")["tasks"]["sent"]
    assert task["start"]["median"] == start["median"] and task["start"]["scores"] == start["scores"]
    assert task["seeds"] == task["start"]["seeds"]
    scores, begun = task["scores"]["test"]["accuracy"], start["scores"]["test"]["accuracy"]
    assert max(scores) > min(scores) and max(begun) > min(begun)  # the learnable task parts the seeds
    assert task["spread"]["test"]["accuracy"] == max(scores) - min(scores)
    assert task["start"]["spread"]["test"]["accuracy"] == max(begun) - min(begun)
    gain = task["median"]["test"]["accuracy"] - start["median"]["test"]["accuracy"]
    assert task["gain"]["test"]["accuracy"] == pytest.approx(gain)
    outputs = stages_of(run)["evaluate"]["outputs"]
    assert outputs["sent_start"] == round(start["median"]["test"]["accuracy"], 4)
    assert outputs["sent_gain"] == round(gain, 4)
    assert outputs["sent_spread"] == round(max(scores) - min(scores), 4)
    assert outputs["sent_start_spread"] == round(max(begun) - min(begun), 4)
    assert set(stages_of(run)["evaluate"]["upstream_keys"]) == {"tokenize", "pack", "pretrain", "baseline"}


def test_a_changed_pretrain_lr_reuses_the_baseline_without_a_second_fine_tune(ws):
    assert re.search(r"│ baseline +│ reuse +│ in store", (ws / "plan-lr.txt").read_text())
    cont, lr = stages_of(ws / "runs" / "cont"), stages_of(ws / "runs" / "cont-lr")
    assert lr["pretrain"]["key"] != cont["pretrain"]["key"] and lr["evaluate"]["key"] != cont["evaluate"]["key"]
    assert lr["baseline"]["key"] == cont["baseline"]["key"] and "reused" in lr["baseline"]
    assert "baseline" in started(ws / "runs" / "cont")
    assert started(ws / "runs" / "cont-lr") == ["pretrain", "evaluate"]  # tokenize and pack reused too
    start = results_of(ws / "runs" / "cont-lr", "evaluate")["tasks"]["sent"]["start"]
    assert start == results_of(ws / "runs" / "cont", "evaluate")["tasks"]["sent"]["start"]


def test_status_inspect_and_compare_show_continued_starting_difference_and_spreads(ws, monkeypatch):
    monkeypatch.chdir(ws)
    task = results_of(ws / "runs" / "cont", "evaluate")["tasks"]["sent"]
    continued, start = task["median"]["test"]["accuracy"], task["start"]["median"]["test"]["accuracy"]
    shown = (f"{continued:.4f}", f"{start:.4f}", f"{continued - start:+.4f}")
    row = re.compile(r"│ sent +│ accuracy +│ +" + r" │ +".join(map(re.escape, shown)) + " │")
    for args in (("status", "runs/cont"), ("inspect", "runs/cont", "evaluate")):
        result = cram(*args)
        assert result.exit_code == 0, result.output
        for column in ("continued", "starting", "difference", "spread", "starting spread"):
            assert column in result.output, (args, result.output)
        assert row.search(result.output), (args, result.output)
    plain = cram("status", "runs/base")
    assert plain.exit_code == 0 and "starting" not in plain.output
    compared = cram("compare", "runs/cont", "runs/cont-lr", "runs/base", "--out", "table.csv")
    assert compared.exit_code == 0, compared.output
    header, *rows = (ws / "table.csv").read_text().splitlines()
    columns = header.split(",")
    for column in ("sent_accuracy", "sent_start", "sent_gain", "sent_spread", "sent_start_spread"):
        assert column in columns, columns
    by_run = {r.split(",")[0]: dict(zip(columns, r.split(","))) for r in rows}
    assert by_run["cont"]["sent_start"] == by_run["cont-lr"]["sent_start"] != ""
    assert by_run["base"]["sent_start"] == ""  # no baseline: an empty cell
