"""Experiment loggers (`[run] loggers`): names validated with the config, TensorBoard events and offline W&B
runs read back from disk, and the real pipeline streaming pretrain and evaluate figures to both."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from cram.pipeline import config as cfg
from cram.stages.shared import loggers


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a TensorBoard run directory, as (step, value) points, purged steps dropped."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_records(root: Path) -> list[list]:
    """The protobuf `Record`s of every offline W&B run under `root` (wandb/offline-run-*/run-*.wandb), oldest first.

    The .wandb file is a LevelDB-style log after a 7-byte header: 32 KiB blocks of chunks, each with a
    crc32 (4 bytes), a length (2) and a type (1: full, 2: first, 3: middle, 4: last), holding protobuf
    `Record`s. wandb ships no reader for it any more, so the test reads it by hand."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunk, records = path.read_bytes(), 7, b"", []
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(chunk)
                chunk = b""
                records.append(record)
        runs.append(records)
    return runs


def wandb_history(root: Path) -> list[list[dict]]:
    """The history rows of every offline W&B run under `root`, oldest first."""
    return [
        [
            {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        for records in wandb_records(root)
    ]


def wandb_exit_codes(root: Path) -> dict[str, int]:
    """The exit code each offline W&B run under `root` was closed with, by job type (the stage)."""
    codes = {}
    for records in wandb_records(root):
        kinds = {r.WhichOneof("record_type"): r for r in records}
        codes[kinds["run"].run.job_type] = kinds["exit"].exit.exit_code
    return codes


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """wandb's own settings and caches in the test's folder; offline whatever the environment says."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def test_logger_names_are_checked_with_the_config(monkeypatch):
    parse = lambda text: cfg.parse(text, {})  # noqa: E731
    assert parse("[run]\n").run.loggers == ()
    with pytest.raises(
        cfg.ConfigError,
        match=r"\[run\] loggers: 'tensorbord' is not a logger; choose from "
        r"'tensorboard', 'wandb'",
    ):
        parse('[run]\nloggers = ["tensorbord"]\n')
    with pytest.raises(cfg.ConfigError, match="listed twice"):
        parse('[run]\nloggers = ["wandb", "wandb"]\n')
    with pytest.raises(cfg.ConfigError, match="expected a list of a string"):
        parse('[run]\nloggers = "wandb"\n')
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(cfg.ConfigError, match=r"'wandb' needs the wandb package: pip install -e '\.\[wandb\]'"):
        parse('[run]\nloggers = ["wandb"]\n')


def test_a_missing_logger_package_fails_before_any_stage_runs(tmp_path, monkeypatch):
    import fake_stages
    from typer.testing import CliRunner

    from cram.pipeline import runner
    from cram.pipeline.commands import cli

    monkeypatch.setattr(runner, "default_stages", fake_stages.modules)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    path = tmp_path / "pipeline.toml"
    path.write_text(
        fake_stages.PIPELINE.format(root=tmp_path / "runs").replace(
            'device = "cpu"', 'device = "cpu"\nloggers = ["tensorboard"]'
        )
    )
    result = CliRunner().invoke(cli.app, ["run", str(path)], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and "pip install -e '.[tensorboard]'" in result.output
    assert not (tmp_path / "runs").exists()


def test_no_loggers_is_a_no_op():
    loggers.NONE.log(1, {"loss": 1.0})
    loggers.NONE.close()
    assert loggers.make((), Path("unused"), "r", "pretrain").sinks == ()


def test_tensorboard_events_read_back_and_a_resumed_stage_replaces_its_tail(tmp_path):
    pytest.importorskip("tensorboard")
    metrics = loggers.make(("tensorboard",), tmp_path / "logs", "r", "pretrain")
    for step in (1, 2, 3):
        metrics.log(
            step, {"step": step, "loss": 10.0 - step, "lr": 1e-3 * step, "note": "x", "val": None, "diverged": False}
        )
    metrics.log(3, {"tokens_per_s": 2500.0}, prefix="final/")
    metrics.close()
    log_dir = tmp_path / "logs" / "tensorboard" / "pretrain"
    scalars = tensorboard_scalars(log_dir)
    assert sorted(scalars) == ["final/tokens_per_s", "loss", "lr"]  # numbers only; step is the x-axis
    assert scalars["loss"] == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert dict(scalars["lr"]) == pytest.approx({1: 1e-3, 2: 2e-3, 3: 3e-3})  # float32 in the event file
    assert scalars["final/tokens_per_s"] == [(3, 2500.0)]

    # A resumed attempt starts again at step 2: what the first attempt wrote from step 2 on is dropped.
    metrics = loggers.make(("tensorboard",), tmp_path / "logs", "r", "pretrain")
    metrics.log(2, {"loss": 5.0})
    metrics.close()
    assert tensorboard_scalars(log_dir)["loss"] == [(1, 9.0), (2, 5.0)]


def test_wandb_offline_run_holds_the_logged_keys(tmp_path, wandb_home):
    pytest.importorskip("wandb")
    metrics = loggers.make(("wandb",), tmp_path / "logs", "r", "pretrain", config={"pretrain": {"lr": 1e-3}})
    metrics.log(1, {"step": 1, "loss": 9.0, "lr": 1e-3, "note": "x"})
    metrics.log(2, {"loss": 8.0, "lr": 2e-3})
    metrics.log(2, {"val_loss_end": 7.5}, prefix="final/")
    metrics.close()
    (rows,) = wandb_history(tmp_path / "logs")
    assert [(r["_step"], r["loss"], r["lr"]) for r in rows] == [(1, 9.0, 1e-3), (2, 8.0, 2e-3)]
    assert rows[-1]["final/val_loss_end"] == 7.5  # same step: one row
    assert not any("note" in r or "step" in r for r in rows)


@pytest.mark.parametrize("failure", ["crash", "input", "interrupt"])
def test_a_stage_that_fails_closes_its_wandb_run_as_failed(tmp_path, monkeypatch, wandb_home, failure):
    pytest.importorskip("wandb")
    import fake_stages
    from typer.testing import CliRunner

    from cram.pipeline import runner
    from cram.pipeline.commands import cli

    def logging(module):  # the fake stages log nothing: log one record, then run as before
        def run(config, inputs, out_dir, ctx):
            ctx.metrics.log(1, {"value": config.value})
            return stage_run(config, inputs, out_dir, ctx)

        stage_run, module.run = module.run, run
        return module

    monkeypatch.setattr(runner, "default_stages", lambda: [logging(m) for m in fake_stages.modules()])
    path = tmp_path / "pipeline.toml"
    path.write_text(
        fake_stages.PIPELINE.format(root=tmp_path / "runs").replace(
            'device = "cpu"', 'device = "cpu"\nloggers = ["wandb"]'
        )
    )
    if failure == "interrupt":
        monkeypatch.setenv("FAKE_INTERRUPT", "beta")
        args = ()
    else:
        args = ("--set", f'beta.fail="{failure}"')
    result = CliRunner().invoke(cli.app, ["run", str(path), *args], env={"COLUMNS": "250"})
    assert result.exit_code == {"crash": 1, "input": 2, "interrupt": 130}[failure], result.output
    # alpha finished, beta failed, gamma never started (so it has no run)
    assert wandb_exit_codes(tmp_path / "runs" / "t" / "logs") == {"alpha": 0, "beta": 1}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_pipeline_streams_pretrain_and_evaluate_figures(tmp_path, monkeypatch, wandb_home):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from test_pipeline import REPO, cram, overrides

    monkeypatch.chdir(tmp_path)
    cram(
        "run",
        str(REPO / "pipeline.toml"),
        *overrides(tmp_path / "runs", **{"run.loggers": '["tensorboard", "wandb"]', "pretrain.log_every_steps": "4"}),
    )
    run_dir = tmp_path / "runs" / "default"
    figures = json.loads((run_dir / "manifest.json").read_text())["stages"]
    rows = [json.loads(line) for line in (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == [1, 4, 8, 12]

    pretrain = tensorboard_scalars(run_dir / "logs" / "tensorboard" / "pretrain")
    for key in ("loss", "lr", "tokens_per_s", "mfu", "grad_norm", "accuracy", "tokens_seen"):
        assert [s for s, _ in pretrain[key]] == steps, key
        assert dict(pretrain[key]) == pytest.approx({r["step"]: r[key] for r in rows}), key
    trained = figures["pretrain"]["outputs"]
    assert dict(pretrain["final/val_loss_end"]) == pytest.approx({12: trained["val_loss_end"]})
    evaluate = tensorboard_scalars(run_dir / "logs" / "tensorboard" / "evaluate")
    results = figures["evaluate"]["outputs"]
    assert dict(evaluate["mlm_loss"]) == pytest.approx({12: results["mlm_loss"]})
    assert dict(evaluate["topic_accuracy"]) == pytest.approx({12: results["topic_accuracy"]})
    assert not (run_dir / "logs" / "tensorboard" / "tokenize").exists()  # stages that log nothing leave nothing

    pretrain_run, evaluate_run = wandb_history(run_dir / "logs")
    assert [r["_step"] for r in pretrain_run] == steps
    assert [r["loss"] for r in pretrain_run] == pytest.approx([r["loss"] for r in rows])
    assert pretrain_run[-1]["final/val_loss_end"] == pytest.approx(trained["val_loss_end"])
    assert evaluate_run[0]["mlm_loss"] == pytest.approx(results["mlm_loss"])
