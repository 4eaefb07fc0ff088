"""The real pipeline end to end, as small override runs of `pipeline.toml` (the default corpus, a tiny
budget): a fresh run, a cached re-run, a change that re-runs only downstream, and a SIGKILLed pretrain
that `cram resume` continues from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cram.pipeline.commands import cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

REPO = Path(__file__).resolve().parents[1]
TOPIC = '[{kind="heldout-topic", name="topic", epochs=1, seeds=1, lr=1e-3, max_length=32}]'
SMALL = {
    "tokenize.vocab_size": "1024",
    "pretrain.budget.steps": "12",
    "run.device": '"cpu"',
    "pretrain.compile": "false",
    "pretrain.precision": '"fp32"',
    "pretrain.val_blocks": "32",
    "evaluate.compile": "false",
    "evaluate.precision": '"fp32"',
    "evaluate.batch_size": "32",
    "evaluate.buckets": "[32]",
    "evaluate.max_length": "32",
    "evaluate.tasks": TOPIC,
}


def overrides(root: Path, **changes: str) -> list[str]:
    values = {"run.root": json.dumps(str(root)), **SMALL, **changes}
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def cram(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "250"})
    assert result.exit_code == code, result.output
    return result.output


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())["stages"]


def test_fresh_cached_and_changed_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "default"
    cram("run", str(REPO / "pipeline.toml"), *overrides(tmp_path / "runs"))
    first = manifest(run_dir)
    assert [r["status"] for r in first.values()] == ["done"] * 4
    trained = first["pretrain"]["outputs"]
    assert trained["steps"] == 12 and trained["val_loss_end"] < trained["val_loss_start"]
    results = json.loads((run_dir / "evaluate" / "results.json").read_text())
    assert results["mlm"]["loss"] > 0 and "topic" in results["tasks"]
    status = cram("status", str(run_dir))
    assert status.count("done") == 4 and "val_loss_end=" in status
    # The budget carries across hardware: tokens, steps and FLOPs are recorded, and inspect prints the
    # overrides that replay the same token budget (the time limit dropped).
    # pipeline.toml's batch where the step trains in fp32, as SMALL pins it: [pretrain.fp32]'s 16
    assert trained["flops_seen"] > 0 and trained["tokens_seen"] == 12 * 16 * 128 and trained["batch_size"] == 16
    replay = f"--set pretrain.budget.tokens={trained['tokens_seen']} --set pretrain.budget.hours=0"
    assert replay in cram("inspect", str(run_dir), "pretrain")

    cram("run", str(REPO / "pipeline.toml"), *overrides(tmp_path / "runs"))
    assert manifest(run_dir) == first  # all cached: nothing ran, nothing was rewritten

    cram("run", str(REPO / "pipeline.toml"), *overrides(tmp_path / "runs", **{"pretrain.optimizer.lr": "1e-3"}))
    changed = manifest(run_dir)
    for stage in ("tokenize", "pack"):
        assert changed[stage]["started"] == first[stage]["started"]
    for stage in ("pretrain", "evaluate"):
        assert changed[stage]["started"] != first[stage]["started"] and changed[stage]["status"] == "done"


def test_a_killed_pretrain_resumes_from_its_checkpoint(tmp_path):
    args = overrides(
        tmp_path / "runs",
        **{
            "pretrain.budget.steps": "80",
            "pretrain.checkpoint_every_steps": "5",
            "pretrain.microbatch": "8",
            "pretrain.batch_size": "8",
            "run.name": '"killed"',
        },
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cram.pipeline.commands.cli", "run", str(REPO / "pipeline.toml"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run_dir = tmp_path / "runs" / "killed"
    deadline = time.time() + 120
    while not list((run_dir.parent / ".store").glob("pretrain-*.partial/checkpoints/step-10")):
        assert proc.poll() is None and time.time() < deadline, "pretrain never reached its second checkpoint"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert manifest(run_dir)["pretrain"]["status"] == "running"

    result = subprocess.run(
        [sys.executable, "-m", "cram.pipeline.commands.cli", "resume", str(run_dir)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stages = manifest(run_dir)
    assert [r["status"] for r in stages.values()] == ["done"] * 4
    assert stages["pretrain"]["outputs"]["steps"] == 80
    events = [json.loads(line) for line in (run_dir / "logs" / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] >= 10
