"""The stage store on the default pipeline: a second run name and a 4-variant sweep share tokenize and pack;
and what the store's checksums cost on a large corpus.

    python bench/store.py [CONFIG] [--root /tmp/cram-store-bench] [--repeat 3]
    python bench/store.py --hash-mb 600 [--repeat 3]

In a fresh runs root: `cram run CONFIG --only tokenize`, then `--only pack` (both computed, timed together),
then `cram run CONFIG --name second --only pack` as a fresh process, several times under new names
(target: under 3 s), then a 4-variant `cram sweep` over two pretrain keys with a short budget in a root of its own, and
counts from its runs' events logs how many times each stage was computed and how many times linked.

`--hash-mb MB`: writes a synthetic text corpus of MB megabytes (bench/data.py's `write_corpus`) in a temporary
folder, runs `cram run --only tokenize` then `--only pack` on it (8k BPE, `num_proc = 2`, 1% held out), each as
a fresh process, then hashes each entry's files `--repeat` times, sha256 and BLAKE2b interleaved, and times
`cram verify` of the root and `cram status` of the run (the plan's cheap check of each entry). The stages
hash as the pipeline does: each entry once when it is finished, and tokenize's again when pack (a new
process) starts reading it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from data import write_corpus

from cram.pipeline.store import MARKER, STORE

CRAM = [sys.executable, "-c", "from cram.pipeline.commands.cli import main; main()"]
SHORT = [
    "pretrain.budget.steps=10",
    "pretrain.budget.hours=1.0",
    "pretrain.compile=false",
    "pretrain.val_blocks=8",
    "evaluate.tasks=[]",
    "evaluate.compile=false",
]
GRID = ["pretrain.optimizer.lr=1e-3,3e-3", "pretrain.masking.rate=0.15,0.25"]
HASH_PIPELINE = """
[run]
name = "hash"
root = "{root}/runs"
device = "cpu"

[tokenize]
heldout_fraction = 0.01
vocab_size = 8192
num_proc = 2

[tokenize.corpus]
kind = "files"
paths = ["{root}/corpus/*.txt"]
format = "text"

[evaluate]
tasks = []
"""


def cram(*args: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([*CRAM, *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"cram {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - start


def hash_seconds(folder: Path, algorithm: str) -> float:
    """Seconds to hash every file of an entry (its marker aside), as the store does."""
    start = time.perf_counter()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        with open(path, "rb") as f:
            hashlib.file_digest(f, algorithm)
    return time.perf_counter() - start


def hash_cost(megabytes: int, repeat: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="cram-store-hash-"))
    try:
        write_corpus(tmp / "corpus", megabytes)
        config = tmp / "hash.toml"
        config.write_text(HASH_PIPELINE.format(root=tmp))
        stages = {stage: cram("run", str(config), "--only", stage) for stage in ("tokenize", "pack")}
        entries = {p.name.split("-")[0]: p for p in (tmp / "runs" / STORE).iterdir() if p.is_dir()}
        sha, blake = {s: [] for s in entries}, {s: [] for s in entries}
        for _ in range(repeat):  # interleaved, so that load from other work hits both alike
            for stage, entry in entries.items():
                sha[stage].append(hash_seconds(entry, "sha256"))
                blake[stage].append(hash_seconds(entry, "blake2b"))
        verify = [cram("verify", str(tmp / "runs")) for _ in range(repeat)]
        status = [cram("status", str(tmp / "runs" / "hash")) for _ in range(repeat)]  # the plan's check of both
        size = {s: sum(p.stat().st_size for p in e.rglob("*") if p.is_file()) / 1e6 for s, e in entries.items()}
    finally:
        shutil.rmtree(tmp)
    median = {s: statistics.median(sha[s]) for s in entries}
    print(f"{megabytes} MB of text; load average after: {' '.join(map(str, os.getloadavg()))}")
    print("| entry | MB | sha256 s (median) | sha256 MB/s | BLAKE2b s (median) | stage wall s (with its hashing) |")
    print("|---|---|---|---|---|---|")
    for stage in ("tokenize", "pack"):
        print(
            f"| {stage} | {size[stage]:.0f} | {median[stage]:.2f} | {size[stage] / median[stage]:.0f} | "
            f"{statistics.median(blake[stage]):.2f} | {stages[stage]:.1f} |"
        )
    hashing = 2 * median["tokenize"] + median["pack"]  # tokenize's entry is hashed again by pack's process
    total = sum(stages.values())
    print(f"\nhashing in tokenize + pack: {hashing:.2f} s of {total:.1f} s, {100 * hashing / (total - hashing):.1f}%")
    print(f"`cram verify` of the root: median {statistics.median(verify):.2f} s, max {max(verify):.2f} s")
    print(f"`cram status` of the run: median {statistics.median(status):.2f} s, max {max(status):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="pipeline.toml")
    parser.add_argument("--root", type=Path, default=None, help="A runs root to create (default: a temp dir).")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hash-mb", type=int, help="Measure the checksums' cost on a corpus of this size.")
    args = parser.parse_args()
    if args.hash_mb:
        hash_cost(args.hash_mb, args.repeat)
        return
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
