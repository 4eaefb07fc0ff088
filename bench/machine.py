"""What a bench prints about the machine it ran on: the CPU and the flags that decide its bf16 path, and the
load average (the shared machine's other work shows there). Imported by the benches beside it."""

from __future__ import annotations

import os
import subprocess

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def load() -> str:
    """The 1, 5 and 15-minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu() -> str:
    """lscpu's model name, the core count, and each of FLAGS as present or "no FLAG"."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    have = " ".join(f if f in flags else f"no {f}" for f in FLAGS)
    return f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} cores; {have}"
