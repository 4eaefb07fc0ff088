"""How long a fully cached `cram run` takes (target: under 3 s on the 2-core CPU machine).

    python bench/cached_run.py [CONFIG] [--set k=v ...] [--repeat 5]

Runs the pipeline once to fill the cache if it is not done (not timed), then times `cram run` as a
fresh process, as a user would start it, several times, and prints the median and the worst.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

CRAM = [sys.executable, "-c", "from cram.pipeline.cli import main; main()"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="pipeline.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    command = [*CRAM, "run", args.config, *[a for kv in args.overrides for a in ("--set", kv)]]

    dry = subprocess.run([*command, "--dry-run"], capture_output=True, text=True, check=True).stdout
    if " run " in dry.replace("│", " "):
        print("filling the cache first (not timed) ...", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)

    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    print("| command | runs | median s | max s |\n|---|---|---|---|")
    print(
        f"| cram run {Path(args.config)} (all cached) | {args.repeat} | "
        f"{statistics.median(times):.2f} | {max(times):.2f} |"
    )


if __name__ == "__main__":
    main()
