"""The errors that end a `cram` command where no module's own error (cfg.ConfigError, rundir.RunDirError,
planning.PlanError, ...) fits, and the exit code of each: 0 ok, 1 a stage failed, 2 bad usage, config
or input, 130 interrupted, 141 (CLOSED_PIPE) the output's reader closed the pipe. `pipeline/commands/cli.py`
turns every one into its line and exit code in one place.
"""

from __future__ import annotations

# What a shell reports for `yes | head -1` and every Unix tool the reader of its output left: 128 + SIGPIPE
# (13). Not 0: the output was cut short, and `set -o pipefail` should see that as it does for any tool.
# No message: the one who closed the pipe knows.
CLOSED_PIPE = 141


class CramError(Exception):
    """An error whose message is the whole story for the person at the terminal (a missing folder, a
    file where a folder goes, a stage that failed): the command ends with it and `exit_code`."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(CramError):
    """Ctrl-C; the message says how to continue."""

    def __init__(self, message: str):
        super().__init__(message, 130)


def exit_code(error: Exception) -> int:
    """The exit code a command ends with after `error`: its own where it has one, 2 (bad usage, config
    or input) for the modules' own errors."""
    return error.exit_code if isinstance(error, CramError) else 2
