"""How long a fully cached `cram run` and `cram run --only pack` take (target: 1.0 s each, median of 10,
on the 2-core CPU machine).

    python bench/cached_run.py [CONFIG] [--set k=v ...] [--repeat 10]

Runs the pipeline once to fill the cache if it is not done (not timed), then times, as fresh processes
as a user would start them, interleaved: `cram run` (every stage done), and `cram run --only pack` in a
second run whose pretrain settings differ, so that its tokenize and pack are done (reused from the
store) while pretrain and evaluate are not: the stages that a plan validates without running them.
Each form runs once untimed first; prints the median and the worst of each.

`--against SRC` times another version too, interleaved (this one, SRC, this one, ...): SRC is put first
on PYTHONPATH, so it must hold that version's package as `SRC/cram/{model,pipeline,stages}`, e.g.

    git archive main | tar -x -C /tmp/base && mkdir /tmp/base/src/cram && touch /tmp/base/src/cram/__init__.py
    for d in model pipeline stages; do ln -s /tmp/base/$d /tmp/base/src/cram/$d; done
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CRAM = [sys.executable, "-c", "from cram.pipeline.commands.cli import main; main()"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="pipeline.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--against", type=Path, help="Also time the cram package under SRC, interleaved.")
    args = parser.parse_args()
    command = [*CRAM, "run", args.config, *[a for kv in args.overrides for a in ("--set", kv)]]

    dry = subprocess.run([*command, "--dry-run"], capture_output=True, text=True, check=True).stdout
    if " run " in dry.replace("│", " "):
        print("filling the cache first (not timed) ...", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)

    versions = {"this checkout": None, **({str(args.against): args.against} if args.against else {})}
    other_run = ["--set", "run.name='cached-run-only-pack'", "--set", "pretrain.optimizer.lr=0.0123"]
    forms = {"": [], " --only pack (pretrain, evaluate not done)": ["--only", "pack", *other_run]}
    times: dict[tuple[str, str], list[float]] = {(v, f): [] for v in versions for f in forms}
    for extra in forms.values():
        subprocess.run([*command, *extra], check=True, capture_output=True)
    for _ in range(args.repeat):
        for name, src in versions.items():
            env = {**os.environ, "PYTHONPATH": str(src)} if src else None
            for form, extra in forms.items():
                start = time.perf_counter()
                subprocess.run([*command, *extra], check=True, capture_output=True, env=env)
                times[name, form].append(time.perf_counter() - start)
    print("| command | code | runs | median s | max s |\n|---|---|---|---|---|")
    for (name, form), values in times.items():
        print(
            f"| cram run {Path(args.config)}{form} (all cached) | {name} | {args.repeat} | "
            f"{statistics.median(values):.2f} | {max(values):.2f} |"
        )


if __name__ == "__main__":
    main()
