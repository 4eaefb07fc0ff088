"""Peak memory of a running process tree, sampled from /proc/PID/status: anonymous memory (RssAnon,
what a process's own arrays take) and all resident memory (VmRSS, mapped files' pages too); and the CPU
seconds its processes used (/proc/PID/stat), which load disturbs far less than wall time."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path


class MemoryPeak:
    """The peak over time of RssAnon and of VmRSS, each summed over the processes `pids()` names,
    sampled every `every` seconds in a thread until `stop()`; and `user`/`system`, the CPU seconds of
    every process seen, as last sampled (a process loses at most its last `every` seconds)."""

    def __init__(self, pids: Callable[[], list[int]], every: float = 0.2):
        self.pids, self.every, self.anon, self.rss = pids, every, 0, 0
        self._cpu: dict[int, tuple[float, float]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.every):
            anon = rss = 0
            for pid in self.pids():
                fields = status(pid)
                anon += fields.get("RssAnon", 0)
                rss += fields.get("VmRSS", 0)
                self._cpu[pid] = cpu_seconds(pid) or self._cpu.get(pid, (0.0, 0.0))
            self.anon, self.rss = max(self.anon, anon), max(self.rss, rss)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    @property
    def user(self) -> float:
        return sum(u for u, _ in self._cpu.values())

    @property
    def system(self) -> float:
        return sum(s for _, s in self._cpu.values())


def cpu_seconds(pid: int) -> tuple[float, float] | None:
    """(user, system) CPU seconds of process `pid` itself, from /proc/PID/stat; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def status(pid: int) -> dict[str, int]:
    """The memory lines of /proc/PID/status, in bytes."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile", "VmRSS"):
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # gone meanwhile
    return fields
