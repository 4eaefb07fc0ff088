"""bench/switches.py, issue 46's measurement: every row it can run is a pipeline the config reader and every
stage's checks accept, and its table measures each row against the baseline of its own preset."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from cram.pipeline import config as cfg
from cram.pipeline import planning, runner

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import switches  # noqa: E402

JOINED_ROWS = [f"{preset}+{row}" for preset in switches.PRESET_ROWS for row in switches.ROWS if row != preset]


@pytest.mark.parametrize("row", [*switches.ROWS, *JOINED_ROWS])
def test_every_row_is_a_pipeline_every_stage_accepts(row, tmp_path):
    modules = runner.default_stages()
    overrides = [f"run.root={str(tmp_path)!r}", "pretrain.budget.hours=0", "pretrain.budget.tokens=10000000"]
    conf = cfg.load(REPO / "pipeline.toml", runner.config_classes(modules), [*overrides, *switches.overrides_of(row)])
    steps = planning.plan(conf, modules, tmp_path / "run")
    assert [s.action for s in steps] == ["run"] * len(steps)


def test_the_deep_thin_rows_keep_their_presets_encoder_weights():
    from cram.model.bert import init
    from cram.model.config import PRESETS

    def encoder_weights(preset: str, row: str) -> int:
        dims = dict(o.removeprefix("pretrain.model.").split("=") for o in switches.ROWS[row])
        model = dataclasses.replace(PRESETS[preset], **{k: int(v) for k, v in dims.items()})
        return sum(v.numel() for k, v in init(model, 0).items() if k.startswith("layers.") and v.dim() == 2)

    for preset, row in [("tiny", "deep_thin"), ("small", "deep_thin_small")]:
        base = encoder_weights(preset, "default")
        assert abs(encoder_weights(preset, row) - base) / base < 0.001


def _result(row: str, seed: int, loss: float) -> dict:
    figures = {"mlm_loss@128": loss, "mlm_loss@512": loss, "tokens_per_s": 1000.0, "num_params": 10}
    return {"row": row, "seed": seed, **figures}


def test_a_row_joined_to_a_preset_is_measured_against_that_preset():
    results = [
        _result("default", 0, 4.0),
        _result("small", 0, 3.0),
        _result("qk_norm", 0, 3.9),
        _result("small+adamw", 0, 3.2),
    ]
    lines = {line.split(" | ")[0].removeprefix("| "): line for line in switches.table(results).splitlines()}
    assert "0/1 (+0.200)" in lines["small+adamw"]
    assert "1/1 (-0.100)" in lines["qk_norm"]
    assert "/1" not in lines["small"] and "/1" not in lines["default"]


def test_a_task_score_wins_higher_where_a_loss_wins_lower():
    base = {**_result("default", 0, 3.5), "topic_accuracy": 0.80, "retrieval_ndcg@10": 0.70}
    row = {**_result("qk_norm", 0, 3.4), "topic_accuracy": 0.75, "retrieval_ndcg@10": 0.72}
    line = switches.table([base, row]).splitlines()[-1]
    assert "1/1 (-0.100); 1/1 (-0.100); 0/1 (-0.050); 1/1 (+0.020)" in line
    assert "0.750 (0.750)" in line and "0.720 (0.720)" in line


@pytest.mark.parametrize("reused", [None, "2026-12-05T16:27:24.314+00:00"])
def test_a_record_says_whether_its_pretraining_came_from_the_store(reused, tmp_path):
    pretrain = {"outputs": {"tokens_per_s": 1.0, "wall_s": 2.0, "num_params": 3, "precision": "bf16"}}
    evaluate = {"outputs": {"mlm_loss@128": 3.5, "mlm_loss@512": 3.4, "retrieval_ndcg@10": 0.7}}
    stages = {"pretrain": {**pretrain, **({"reused": reused} if reused else {})}, "evaluate": evaluate}
    (tmp_path / "manifest.json").write_text(json.dumps({"stages": stages}))
    record = switches.figures(tmp_path)
    assert record["pretraining_reused"] is (reused is not None)
    assert record["retrieval_ndcg@10"] == 0.7 and "topic_accuracy" not in record
