"""The benchmarks' child processes (bench/children.py, bench/step.py's report): a child that hangs is
stopped at its limit with its process group, one that fails shows the end of its log, every row is
printed as its child ends, and the overall deadline skips what would start past it. Fake children
(plain `python -c` scripts) keep each case to a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import children  # noqa: E402


def test_a_hanging_child_is_stopped_at_its_limit_with_what_it_started(tmp_path, monkeypatch):
    monkeypatch.setattr(children, "GRACE_S", 0.5)
    pid_file = tmp_path / "grandchild.pid"
    script = f"""
import subprocess, sys, time
sys.path.insert(0, {str(BENCH)!r})
import children
children.dump_stacks_on_term()
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open({str(pid_file)!r}, "w").write(str(grandchild.pid))
print("started", flush=True)


def hang_here():
    time.sleep(120)


hang_here()
"""
    outcome = children.run([sys.executable, "-c", script], limit_s=2.0, log=tmp_path / "hang.log")
    assert outcome.returncode is None and not outcome.ok
    assert outcome.why().startswith("timed out after 2 s") and str(tmp_path / "hang.log") in outcome.why()
    assert outcome.stdout == "started\n"
    assert "in hang_here" in outcome.log.read_text()  # its stack, dumped on SIGTERM: where it hung
    assert not alive(int(pid_file.read_text()))  # the grandchild went with its group


def alive(pid: int) -> bool:
    """Whether `pid` runs: a killed process whose parent is gone may stay a zombie until init reaps it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_failing_child_keeps_its_whole_stderr_and_shows_its_last_40_lines(tmp_path):
    script = "import sys\nfor i in range(100): print(f'line {i}', file=sys.stderr)\nsys.exit(3)"
    outcome = children.run([sys.executable, "-c", script], limit_s=30.0, log=tmp_path / "fail.log")
    assert outcome.returncode == 3 and outcome.why().startswith("failed (exit 3)")
    assert outcome.tail().splitlines() == [f"line {i}" for i in range(60, 100)]
    assert len(outcome.log.read_text().splitlines()) == 100


def test_the_deadline_caps_a_childs_limit():
    deadline = children.Deadline(100.0)
    assert 99.0 < deadline.limit(300.0) <= 100.0 and deadline.limit(5.0) == 5.0
    assert children.Deadline(None).limit(300.0) == 300.0


FAKE_CHILD = """
import json, os, sys, time
mode, row, folder = sys.argv[1:4]
if mode == "peak":
    print(json.dumps({"device": "fake", "sheet": 2e12, "matmul": 1e12}))
    sys.exit(0)
result = {"row": row, "step_ms": 10.0, "tokens_per_s": 1000.0, "flops_per_token": 1e9, "peak_mem_mb": 1.0,
          "compile_cold_s": 1.5, "compile_warm_s": None}
if row == "cram-eager":  # waits until the test has read the row before it: the report must flush it
    for _ in range(400):
        if os.path.exists(os.path.join(folder, "go")):
            break
        time.sleep(0.05)
    else:
        sys.exit(9)
if row == "bert-eager":
    time.sleep(120)
if row == "bert-compiled":
    for i in range(50):
        print(f"compile error line {i}", file=sys.stderr)
    sys.exit(3)
print(json.dumps(result))
"""

DRIVER = """
import sys
sys.path.insert(0, {bench!r})
import step
step.MIN_START_S = 1.0
step.command = lambda args, mode, rows: [sys.executable, {fake!r}, mode, rows or args.rows, {folder!r}]
sys.argv = ["step.py", "--no-in-turn", "--out", {out!r}, *{flags!r}]
args = step.parse_args()
step.report(args, args.rows.split(","))
"""


def start_report(tmp_path: Path, *flags: str) -> subprocess.Popen:
    fake = tmp_path / "fake_child.py"
    fake.write_text(FAKE_CHILD)
    driver = DRIVER.format(
        bench=str(BENCH), fake=str(fake), folder=str(tmp_path), out=str(tmp_path / "logs"), flags=flags
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # the report must flush by itself
    return subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True, env=env)


def test_each_row_is_printed_as_its_child_ends_and_failures_show_their_log(tmp_path):
    rows = "cram-compiled,cram-eager,bert-eager,bert-compiled"
    report = start_report(tmp_path, "--rows", rows, "--row-limit", "2")
    lines = []
    for line in report.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("| cram-compiled |"):
            (tmp_path / "go").touch()  # only now may the next child finish
    assert report.wait(timeout=60) == 0
    text = "\n".join(lines)
    # By hand: 1e9 FLOPs/token x 1000 tokens/s = 1e12 FLOP/s, 50% of the 2e12 data sheet, 100% of the 1e12 matmul.
    assert "| cram-compiled | 10.0 | 1,000 | 50.0 | 100.0 | 1 | 1.5 | - |" in lines
    assert "| cram-eager | 10.0 | 1,000 | 50.0 | 100.0 | 1 | 1.5 | - |" in lines  # it saw "go": printed in time
    assert "| bert-eager | timed out after 2 s" in text
    assert "| bert-compiled | failed (exit 3)" in text
    tail = text.split("| bert-compiled |")[1]
    assert "compile error line 49" in tail and "compile error line 10" in tail and "compile error line 9\n" not in tail
    assert len((tmp_path / "logs" / "bert-compiled.log").read_text().splitlines()) == 50  # the whole stderr kept
    assert "device fake; MFU against 2 TFLOP/s (data sheet); matmul measured here (fp32): 1 TFLOP/s" in text


def test_rows_that_would_start_past_the_deadline_are_skipped_with_a_line(tmp_path):
    report = start_report(tmp_path, "--rows", "bert-eager,cram-compiled", "--deadline", "3")
    out, _ = report.communicate(timeout=60)
    assert report.returncode == 0
    assert "| bert-eager | timed out after" in out  # its limit was what was left of the deadline
    assert "skipped, past the overall deadline of 3 s: cram-compiled" in out
    assert "| cram-compiled |" not in out.split("|---|")[-1]
