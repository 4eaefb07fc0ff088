"""The runner and the CLI on small fake stages: cache, reasons, selection, failures, kill, lock."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import fake_stages
import pytest
from typer.testing import CliRunner

from cram.pipeline import rundir, runner, store
from cram.pipeline.commands import cli

TESTS = Path(__file__).parent
REPO = TESTS.parent


@pytest.fixture
def pipe(tmp_path, monkeypatch):
    """A pipeline file for the fake stages, and `cram` invoked in-process on it."""
    monkeypatch.setattr(runner, "default_stages", fake_stages.modules)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "pipeline.toml"
    path.write_text(fake_stages.PIPELINE.format(root=tmp_path / "runs"))

    class Pipe:
        config = path
        run_dir = tmp_path / "runs" / "t"

        def cram(self, *args: str, code: int = 0):
            result = CliRunner().invoke(cli.app, [str(a) for a in args], env={"COLUMNS": "250"})
            assert result.exit_code == code, result.output
            return result

        def run(self, *args: str, code: int = 0):
            return self.cram("run", path, *args, code=code)

        def calls(self) -> list[str]:
            log = self.run_dir / "calls.log"
            calls = log.read_text().split() if log.exists() else []
            log.unlink(missing_ok=True)
            return calls

        def manifest(self) -> dict:
            return json.loads((self.run_dir / "manifest.json").read_text())["stages"]

    return Pipe()


def test_first_run_runs_all_then_everything_is_a_cache_hit(pipe):
    pipe.run()
    assert pipe.calls() == ["alpha", "beta", "gamma"]
    stages = pipe.manifest()
    assert [s["status"] for s in stages.values()] == ["done"] * 3
    assert stages["gamma"]["outputs"]["total"] == 111
    assert json.loads((pipe.run_dir / "gamma" / "result.json").read_text()) == {"total": 111}
    assert not list((pipe.run_dir.parent / store.STORE).glob("*.partial"))
    assert (pipe.run_dir / "gamma").is_symlink()  # the run's view of its store entry
    pipe.run()
    assert pipe.calls() == []


def test_config_change_reruns_that_stage_and_downstream_only(pipe):
    pipe.run()
    pipe.calls()
    dry = pipe.run("--set", "beta.value=20", "--dry-run").output
    assert _reasons(dry) == {
        "alpha": ("skip", "done"),
        "beta": ("run", "config changed"),
        "gamma": ("run", "upstream changed"),
    }
    assert pipe.calls() == []  # a dry run runs nothing
    pipe.run("--set", "beta.value=20")
    assert pipe.calls() == ["beta", "gamma"]
    assert pipe.manifest()["gamma"]["outputs"]["total"] == 121
    assert "value = 20" in (pipe.run_dir / "config.toml").read_text()


def test_editing_an_input_file_reruns_the_stage_that_reads_it(pipe, tmp_path):
    (tmp_path / "input.txt").write_text("one")
    pipe.run()
    assert pipe.run("--dry-run").output.count("done") == 3
    (tmp_path / "input.txt").write_text("two")
    assert _reasons(pipe.run("--dry-run").output) == {
        "alpha": ("run", "inputs changed"),
        "beta": ("run", "upstream changed"),
        "gamma": ("run", "upstream changed"),
    }


def test_dry_run_on_a_new_run_says_new_and_creates_nothing(pipe):
    out = pipe.run("--dry-run").output
    assert _reasons(out) == {s: ("run", "new") for s in ("alpha", "beta", "gamma")}
    assert not pipe.run_dir.exists()


def test_force_only_and_from(pipe):
    pipe.run()
    pipe.calls()
    assert _reasons(pipe.run("--force", "beta", "--dry-run").output)["beta"] == ("run", "forced")
    pipe.run("--force", "beta")
    assert pipe.calls() == ["beta"]
    pipe.run("--only", "gamma")  # done: --only does not force
    assert pipe.calls() == []
    pipe.run("--only", "gamma", "--force", "gamma")
    assert pipe.calls() == ["gamma"]
    assert _reasons(pipe.run("--from", "beta", "--dry-run").output) == {
        "alpha": ("skip", "done"),
        "beta": ("run", "forced"),
        "gamma": ("run", "forced"),
    }
    pipe.run("--from", "beta")
    assert pipe.calls() == ["beta", "gamma"]


def test_only_with_an_upstream_not_done_is_a_usage_error(pipe):
    out = pipe.run("--only", "beta", code=2).output
    assert "needs 'alpha', which is not done" in out
    assert "unknown stage 'delta'" in pipe.run("--only", "delta", code=2).output


def test_a_crash_fails_the_stage_with_exit_1_and_stops_downstream(pipe):
    out = pipe.run("--set", "beta.fail='crash'", code=1).output
    assert "stage 'beta' failed: RuntimeError: boom" in out
    assert "events.jsonl" in out
    assert pipe.calls() == ["alpha", "beta"]
    stages = pipe.manifest()
    assert stages["beta"]["status"] == "failed" and "boom" in stages["beta"]["error"]
    assert "gamma" not in stages
    assert not (pipe.run_dir / "beta").exists()
    events = (pipe.run_dir / "logs" / "events.jsonl").read_text()
    assert "Traceback" in events  # the traceback is kept in the log, not printed


def test_a_crash_inside_sdpa_names_the_written_out_attention(pipe):
    out = pipe.run("--set", "beta.fail='sdpa'", code=1).output
    assert "_efficient_attention_backward" in out and "--set run.attention=written" in out
    out = pipe.run("--set", "beta.fail='sdpa'", "--set", "run.attention='written'", code=1).output
    assert "_efficient_attention_backward" in out and "run.attention" not in out  # nothing more to suggest
    assert "run.attention" not in pipe.run("--set", "beta.fail='crash'", code=1).output  # not SDPA's


@pytest.mark.parametrize("args", [(), ("--dry-run",)])
def test_cuda_n_under_torchrun_is_refused_before_any_stage(pipe, monkeypatch, args):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets; no process group is started
    out = pipe.run("--set", "run.device='cuda:1'", *args, code=2).output
    assert "run.device: 'cuda:1' under torchrun (WORLD_SIZE=2) would put every rank on one GPU" in out
    assert "use 'cuda' or 'auto'" in out and pipe.calls() == []


def test_bad_input_in_a_stage_is_exit_2(pipe):
    out = pipe.run("--set", "alpha.fail='input'", code=2).output
    assert "[alpha] value: 1 is not allowed here" in out


def test_ctrl_c_marks_the_stage_interrupted_not_done(pipe, monkeypatch):
    monkeypatch.setenv("FAKE_INTERRUPT", "beta")
    out = pipe.run(code=130).output
    assert "cram resume" in out
    assert pipe.manifest()["beta"]["status"] == "interrupted"
    assert not (pipe.run_dir / rundir.LOCK).exists()
    monkeypatch.delenv("FAKE_INTERRUPT")
    assert _reasons(pipe.run("--dry-run").output)["beta"] == ("run", "incomplete")
    pipe.run()
    assert pipe.calls() == ["alpha", "beta", "beta", "gamma"]


def test_duration_adds_up_every_try_and_the_manifest_keeps_each(pipe, monkeypatch):
    monkeypatch.setenv("FAKE_SLOW", "beta")
    monkeypatch.setenv("FAKE_INTERRUPT", "beta")
    pipe.run(code=130)
    pipe.run(code=130)
    monkeypatch.delenv("FAKE_INTERRUPT")
    pipe.run()
    beta = pipe.manifest()["beta"]
    tries = beta["attempts"]
    assert [t["status"] for t in tries] == ["interrupted", "interrupted", "done"]
    assert all(t["duration_s"] >= 3 and t["started"] < t["ended"] for t in tries)
    assert beta["duration_s"] == pytest.approx(sum(t["duration_s"] for t in tries), abs=0.01)
    assert len(pipe.manifest()["alpha"]["attempts"]) == 1  # done at once
    status = pipe.cram("status", pipe.run_dir).output
    assert f"{beta['duration_s']:.1f}s (3 tries)" in status


def test_a_killed_try_is_kept_with_its_duration_unknown(pipe, monkeypatch):
    monkeypatch.setenv("FAKE_INTERRUPT", "beta")
    pipe.run(code=130)
    monkeypatch.delenv("FAKE_INTERRUPT")
    manifest = json.loads((pipe.run_dir / "manifest.json").read_text())
    beta = manifest["stages"]["beta"]
    beta.update(status="running", pid=0, ended=None, duration_s=None, attempts=[])  # as a killed process leaves it
    (pipe.run_dir / "manifest.json").write_text(json.dumps(manifest))
    pipe.run()
    tries = pipe.manifest()["beta"]["attempts"]
    assert [(t["status"], t["duration_s"]) for t in tries][0] == ("killed", None)
    assert [t["status"] for t in tries] == ["killed", "done"]


def _start_hanging_in_beta(pipe, tmp_path) -> subprocess.Popen:
    """`cram run` in a subprocess, returned once it is inside stage beta (which then hangs)."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import fake_stages; "
        "from cram.pipeline import runner; from cram.pipeline.commands import cli; "
        "runner.default_stages = fake_stages.modules; "
        "sys.argv = ['cram', 'run', sys.argv[2]]; cli.main()"
    )
    env = {**os.environ, "FAKE_HANG": "beta"}
    # SIGINT at its default, so Python turns it into KeyboardInterrupt even when this test runs in
    # a background job (which starts with SIGINT ignored).
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(TESTS), str(pipe.config)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    partial = pipe.run_dir.parent / store.STORE
    deadline = time.time() + 60
    while not list(partial.glob("beta-*.partial/attempts")):
        assert proc.poll() is None and time.time() < deadline, "the runner never reached beta"
        time.sleep(0.05)
    return proc


def test_a_real_sigint_marks_the_stage_interrupted(pipe, tmp_path):
    proc = _start_hanging_in_beta(pipe, tmp_path)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, output
    assert f"continue with: cram resume {pipe.run_dir}" in output
    assert pipe.manifest()["beta"]["status"] == "interrupted"
    assert not (pipe.run_dir / rundir.LOCK).exists()


def test_sigkill_mid_stage_leaves_it_not_done_and_it_reruns(pipe, tmp_path):
    proc = _start_hanging_in_beta(pipe, tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert pipe.manifest()["beta"]["status"] == "running"
    assert not (pipe.run_dir / "beta").exists()
    assert (pipe.run_dir / rundir.LOCK).exists()  # left behind by the dead process
    status = pipe.cram("status", pipe.run_dir).output
    assert "killed" in status and "running" not in status  # its pid is gone
    assert _reasons(pipe.run("--dry-run").output)["beta"] == ("run", "incomplete")
    out = pipe.run().output
    assert "stale lock" in out
    assert pipe.calls() == ["alpha", "beta", "beta", "gamma"]
    assert pipe.manifest()["beta"]["outputs"]["attempts"] == 1  # the half-written folder was wiped


def test_a_resumable_stage_reenters_its_partial_folder(tmp_path, monkeypatch, pipe):
    monkeypatch.setattr(runner, "default_stages", lambda: fake_stages.modules(resumable_beta=True))
    monkeypatch.setenv("FAKE_INTERRUPT", "beta")
    pipe.run(code=130)
    monkeypatch.delenv("FAKE_INTERRUPT")
    pipe.run()
    assert pipe.manifest()["beta"]["outputs"]["attempts"] == 2
    pipe.run("--force", "beta")  # forced means from scratch
    assert pipe.manifest()["beta"]["outputs"]["attempts"] == 1


def test_a_live_lock_refuses_a_second_runner(pipe):
    pipe.run_dir.mkdir(parents=True)
    (pipe.run_dir / rundir.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename}))
    out = pipe.run(code=2).output
    assert f"in use by pid {os.getpid()}" in out
    assert pipe.calls() == []


def test_resume_status_inspect_and_ls(pipe, monkeypatch):
    monkeypatch.setenv("FAKE_INTERRUPT", "gamma")
    pipe.run(code=130)
    monkeypatch.delenv("FAKE_INTERRUPT")
    status = pipe.cram("status", pipe.run_dir).output
    assert "interrupted" in status and "total=11" in status
    pipe.cram("resume", pipe.run_dir)
    assert pipe.calls() == ["alpha", "beta", "gamma", "gamma"]
    assert pipe.manifest()["gamma"]["status"] == "done"
    inspect = pipe.cram("inspect", pipe.run_dir, "beta").output
    assert "[beta]" in inspect and "value = 10" in inspect and '"total": 11' in inspect
    assert "computed" in inspect and "total=11" in inspect  # the log tail
    assert "no stage 'delta'" in pipe.cram("inspect", pipe.run_dir, "delta", code=2).output
    listing = pipe.cram("ls", pipe.run_dir.parent).output
    rows = [[cell.strip() for cell in line.strip("│").split("│")] for line in listing.splitlines() if line[:1] == "│"]
    assert [row[:3] for row in rows] == [["t", "gamma", "done"]], listing  # the one run, its newest stage
    assert "not a run directory" in pipe.cram("status", pipe.run_dir.parent, code=2).output
    assert "no saved config" in pipe.cram("resume", pipe.run_dir.parent, code=2).output


def test_manifest_records_what_a_run_needs_to_be_trusted(pipe):
    pipe.run()
    stages = pipe.manifest()
    alpha, beta = stages["alpha"], stages["beta"]
    assert (alpha["status"], alpha["error"], alpha["outputs"]) == (
        "done",
        None,
        {"result": "result.json", "total": 1, "attempts": 1},
    )
    for name in ("key", "config_hash"):
        assert re.fullmatch("[0-9a-f]{64}", alpha[name]), alpha[name]
    assert alpha["key"] != beta["key"] and alpha["config_hash"] != beta["config_hash"]  # values 1 and 10
    assert alpha["upstream_keys"] == {} and beta["upstream_keys"] == {"alpha": alpha["key"]}
    started, ended = (datetime.datetime.fromisoformat(alpha[name]) for name in ("started", "ended"))
    assert started.tzinfo is not None and started <= ended
    assert alpha["duration_s"] == pytest.approx((ended - started).total_seconds(), abs=0.01)
    assert alpha["attempts"] == [
        {"started": alpha["started"], "ended": alpha["ended"], "duration_s": alpha["duration_s"], "status": "done"}
    ]
    versions = alpha["versions"]
    assert versions["python"] == platform.python_version() and versions["structlog"] == metadata.version("structlog")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert alpha["git_commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    events = [json.loads(line) for line in (pipe.run_dir / "logs" / "events.jsonl").read_text().splitlines()]
    computed = [e for e in events if e["event"] == "computed"]
    assert {(e["run"], e["stage"]) for e in computed} == {("t", "alpha"), ("t", "beta"), ("t", "gamma")}
    stdlib = [(e["event"], e["stage"]) for e in events if e.get("logger") == "thirdparty"]
    assert stdlib[:2] == [("library chatter from alpha", "alpha"), ("a standard-library record from alpha", "alpha")]


def test_console_shows_other_libraries_warnings_but_not_their_info(pipe):
    output = pipe.run().output
    assert "computed" in output  # cram's own INFO
    assert "a standard-library record from alpha" in output
    assert "library chatter" not in output
    events = (pipe.run_dir / "logs" / "events.jsonl").read_text()
    assert "library chatter from alpha" in events  # the events file still holds everything


def test_run_name_and_seed_come_from_run_section_and_overrides(pipe):
    other = pipe.run_dir.parent / "other"
    pipe.run("--name", "other")
    assert (other / "gamma").is_dir() and not pipe.run_dir.exists()
    assert "not allowed" in pipe.run("--name", "../escape", code=2).output
    before = json.loads((other / "manifest.json").read_text())["stages"]["alpha"]["key"]
    pipe.run("--name", "other", "--set", "run.seed=2")
    after = json.loads((other / "manifest.json").read_text())["stages"]["alpha"]["key"]
    assert before != after  # the seed is part of every key
    assert (other / "calls.log").read_text().split() == ["alpha", "beta", "gamma"] * 2


@pytest.mark.slow
def test_under_torchrun_rank_0_runs_plain_stages_and_every_rank_the_distributed_one(pipe, tmp_path, free_port):
    script = tmp_path / "cram_fake.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import fake_stages\n"
        "from cram.pipeline import runner\nfrom cram.pipeline.commands import cli\n"
        "runner.default_stages = lambda: fake_stages.modules(distributed_beta=True)\n"
        "cli.main()\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(script),
            "run",
            str(pipe.config),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(pipe.calls()) == ["alpha", "beta@0", "beta@1", "gamma"]
    assert [r["status"] for r in pipe.manifest().values()] == ["done"] * 3
    assert not (pipe.run_dir / rundir.LOCK).exists()


def _reasons(dry_run_output: str) -> dict[str, tuple[str, str]]:
    found = {}
    for line in dry_run_output.splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if len(cells) == 4 and cells[0] in ("alpha", "beta", "gamma"):
            found[cells[0]] = (cells[1], cells[2])
    return found
