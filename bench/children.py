"""Child processes of the benchmarks: each with its own time limit and its whole stderr in a log file,
and the overall deadline of a run, so that one hang or crash costs its own row and never the report.

A child is started in a process group of its own; at its limit the group gets SIGTERM (a child that
called `dump_stacks_on_term` writes every thread's stack to its log: where it hung), then SIGKILL.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

TAIL_LINES = 40  # of a failed child's log, shown where its row would be
GRACE_S = 5.0  # between SIGTERM and SIGKILL


@dataclass(frozen=True)
class Outcome:
    """How a child ended: its stdout, exit code (None: stopped at its limit), seconds and log."""

    stdout: str
    returncode: int | None
    seconds: float
    limit_s: float
    log: Path

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def why(self) -> str:
        """One line: why the child gave no result."""
        if self.returncode is None:
            return f"timed out after {self.limit_s:.0f} s (log: {self.log})"
        return f"failed (exit {self.returncode}) after {self.seconds:.0f} s (log: {self.log})"

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The last `lines` lines of the child's stderr."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:]) or "(no output on stderr)"


def run(command: list[str], *, limit_s: float, log: Path, env: dict[str, str] | None = None) -> Outcome:
    """Run `command` to its end or for at most `limit_s` seconds; stderr goes to `log` (its stdout beside
    it, `log` with the suffix `.out`), so a child that prints much can never block on a full pipe."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out_path = log.with_suffix(".out")
    began = time.monotonic()
    with open(out_path, "w") as out, open(log, "w") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            returncode: int | None = child.wait(timeout=max(limit_s, 0.0))
        except subprocess.TimeoutExpired:
            _stop(child)
            returncode = None
        finally:  # also when the parent itself is stopped (`stop_children_on_term`)
            _kill_group(child.pid)  # what the child left behind (compile workers) goes with it
    return Outcome(out_path.read_text(errors="replace"), returncode, time.monotonic() - began, limit_s, log)


def _stop(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _kill_group(child.pid)
    child.wait()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def dump_stacks_on_term() -> None:
    """In a child: on SIGTERM (its limit reached), write every thread's stack to stderr and go on until
    the SIGKILL that follows, so the log says where the child was."""
    import faulthandler

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=False)


def stop_children_on_term() -> None:
    """In a parent: SIGTERM (an outer `timeout`) ends it as SystemExit, which stops the child it waits for:
    a child runs in a process group of its own, which the outer signal never reaches."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


class Deadline:
    """The end of a whole run, `seconds` from now (None: none); a child's limit never passes it."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.end = math.inf if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def limit(self, own: float) -> float:
        """A child's time limit: its own, or what is left of the run when that is less."""
        return min(own, self.left())


def result(outcome: Outcome, row: str) -> dict:
    """The child's JSON result (its last stdout line), or a row that says why there is none."""
    if not outcome.ok:
        return {"row": row, "skipped": outcome.why()}
    try:
        return json.loads(outcome.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"row": row, "skipped": f"no result line on stdout (log: {outcome.log})"}


def say(text: str) -> None:
    """A line of a bench's report, out at once (a parent's stdout is often a file)."""
    print(text, flush=True)


def read_rows(path: Path) -> list[dict]:
    """The rows a bench has appended to its JSON-lines results file, none where there is no file yet."""
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
