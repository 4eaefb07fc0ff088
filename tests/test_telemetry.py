"""What pretraining reports of its speed: MFU, in the step log and in the stage's figures alike, is a
fraction of the best peak FLOP/s the run has seen, never above 1."""

from __future__ import annotations

import pytest
import torch
from test_pretrain import metrics, pack, small  # noqa: F401 (pack: a fixture)

from cram import model
from cram.stages import pretrain
from cram.stages.pretraining import telemetry

CPU = torch.device("cpu")


@pytest.fixture
def measured(monkeypatch) -> list[float]:
    """The peaks a fake matmul measures, in order (the last one again when they run out); a fresh cache."""
    peaks: list[float] = []
    calls = [0]

    def measure(device, dtype=None):
        calls[0] += 1
        return peaks[min(calls[0], len(peaks)) - 1]

    monkeypatch.setattr(model, "peak_flops", measure)
    monkeypatch.setattr(telemetry, "_PEAKS", {})
    return peaks


def test_a_rate_above_the_start_up_peak_measures_it_again_and_the_best_stays(measured):
    measured += [100.0, 150.0]
    assert telemetry.mfu(1.0, 50.0, CPU, 1) == 0.5  # below the peak: nothing measured again
    assert telemetry.mfu(1.0, 120.0, CPU, 1) == 0.8  # above 100: measured again, 150
    assert telemetry.mfu(1.0, 300.0, CPU, 1) == 1.0  # above every measure: the step's rate is the peak
    assert telemetry.mfu(1.0, 150.0, CPU, 1) == 0.5  # against the best seen, 300
    assert telemetry.mfu(2.0, 150.0, CPU, 2) == 0.5  # per device


def test_no_step_and_no_stage_figure_says_more_than_the_whole_device(measured, pack, tmp_path, make_ctx):  # noqa: F811
    measured += [1.0]  # a start-up measure far below what the steps reach, as under a passing load
    out = pretrain.run(small(log_every_steps=1), {"pack": pack}, tmp_path / "out", make_ctx())
    steps = [m["mfu"] for m in metrics(tmp_path / "out")]
    assert len(steps) == 6 and all(0 < m <= 1 for m in steps) and 0 < out["mfu"] <= 1
    assert max(steps) == 1.0


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_hardware_flops_count_muons_newton_schulz_beside_the_models(measured, pack, tmp_path, make_ctx, kind):  # noqa: F811
    measured += [1e10]
    config = small(log_every_steps=2, optimizer=model.optimizer_config(kind))
    out = pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())
    cfg = model.ModelConfig.from_json(tmp_path / "out" / "model.json")
    per_step = model.optimizer_flops(cfg, config.optimizer)
    assert (per_step > 0) == (kind == "muon")
    # 6 steps: HFU is MFU times (model FLOPs + 6 updates' Newton-Schulz) / model FLOPs (each rounded to 1e-5)
    expected = out["mfu"] * (out["flops_seen"] + 6 * per_step) / out["flops_seen"]
    assert out["hfu"] == pytest.approx(expected, abs=3e-5)
    assert (out["hfu"] > 1.1 * out["mfu"]) == (kind == "muon")  # a 1-layer model: Newton-Schulz is a quarter more
    for record in metrics(tmp_path / "out"):
        assert record["hfu"] >= record["mfu"] > 0
