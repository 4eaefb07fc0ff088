"""Peak memory of a running process tree, sampled from /proc/PID/status: anonymous memory (RssAnon,
what a process's own arrays take) and all resident memory (VmRSS, mapped files' pages too)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path


class MemoryPeak:
    """The peak over time of RssAnon and of VmRSS, each summed over the processes `pids()` names,
    sampled every `every` seconds in a thread until `stop()`."""

    def __init__(self, pids: Callable[[], list[int]], every: float = 0.2):
        self.pids, self.every, self.anon, self.rss = pids, every, 0, 0
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
            self.anon, self.rss = max(self.anon, anon), max(self.rss, rss)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


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
