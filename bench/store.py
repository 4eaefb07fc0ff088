"""The stage store on the default pipeline: a second run name and a 4-variant sweep share tokenize and pack.

    python bench/store.py [CONFIG] [--root /tmp/cram-store-bench] [--repeat 3]

In a fresh runs root: `cram run CONFIG --only tokenize`, then `--only pack` (both computed, timed together),
then `cram run CONFIG --name second --only pack` as a fresh process, several times under new names
(target: under 3 s), then a 4-variant `cram sweep` over two pretrain keys with a short budget in a root of its own, and
counts from its runs' events logs how many times each stage was computed and how many times linked.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

CRAM = [sys.executable, "-c", "from cram.pipeline.cli import main; main()"]
SHORT = [
    "pretrain.budget.steps=10",
    "pretrain.budget.hours=1.0",
    "pretrain.compile=false",
    "pretrain.val_blocks=8",
    "evaluate.tasks=[]",
    "evaluate.compile=false",
]
GRID = ["pretrain.optimizer.lr=1e-3,3e-3", "pretrain.masking.rate=0.15,0.25"]


def cram(*args: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([*CRAM, *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"cram {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="pipeline.toml")
    parser.add_argument("--root", type=Path, default=None, help="A runs root to create (default: a temp dir).")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="cram-store-bench-"))
    if root.exists() and any(root.iterdir()):
        sys.exit(f"{root}: not empty; give a new --root")
    at = ["--set", f"run.root='{root}'"]

    first = cram("run", args.config, *at, "--only", "tokenize") + cram("run", args.config, *at, "--only", "pack")
    again = [cram("run", args.config, *at, "--name", f"second-{i}", "--only", "pack") for i in range(args.repeat)]
    sets = [a for kv in SHORT for a in ("--set", kv)]
    grid = [a for kv in GRID for a in ("--grid", kv)]
    sweep_root = root / "sweep"  # a root of its own: its store starts empty
    sweep = cram("sweep", args.config, "--set", f"run.root='{sweep_root}'", *sets, *grid)

    computed, linked = Counter(), Counter()
    for events in sweep_root.glob("*/logs/events.jsonl"):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "start":
                computed[event["stage"]] += 1
            elif event.get("event") == "reused from the store":
                linked[event["stage"]] += 1
    print("| step | runs | median s | max s |\n|---|---|---|---|")
    print(f"| `cram run --only pack`, new root (tokenize + pack computed) | 1 | {first:.2f} | {first:.2f} |")
    print(
        f"| `cram run --name NEW --only pack` (both linked from the store) | {args.repeat} | "
        f"{statistics.median(again):.2f} | {max(again):.2f} |"
    )
    print(f"| `cram sweep` 4 variants ({' x '.join(GRID)}; {', '.join(SHORT)}) | 1 | {sweep:.1f} | {sweep:.1f} |")
    print("\n| stage, in the sweep | computed | linked from the store |\n|---|---|---|")
    for stage in ("tokenize", "pack", "pretrain", "evaluate"):
        print(f"| {stage} | {computed[stage]} | {linked[stage]} |")
    if args.root is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
