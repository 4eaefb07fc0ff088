"""What the plan's fingerprint of a `[pretrain] init` checkpoint costs: hashed in full without the store's
cache, and through it the first time and when nothing changed (target: under 0.05 s, no byte read).

    python bench/init_hash.py [--mb 600] [--repeat 5]

The checkpoint is a transformers-style folder (config.json + model.safetensors of random bytes: the
fingerprint never parses it) in a temporary folder, removed after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from cram.pipeline import store
from cram.stages.shared import files, pretrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=600)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cram-bench-init-") as tmp:
        folder = Path(tmp) / "ckpt"
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "modernbert"}')
        with open(folder / "model.safetensors", "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        found = pretrained.locate(folder)
        root = Path(tmp) / "runs" / store.STORE
        root.mkdir(parents=True)
        uncached = [_timed(lambda: pretrained.fingerprint(found)) for _ in range(args.repeat)]
        with files.hashes_from(store.hash_cache(root)):
            first = _timed(lambda: pretrained.fingerprint(found))
            hits = [_timed(lambda: pretrained.fingerprint(found)) for _ in range(args.repeat)]
    print(f"| checkpoint MB | no cache s (median of {args.repeat}) | cache, first s | cache hit s (median, max) |")
    print("|---|---|---|---|")
    print(
        f"| {args.mb} | {statistics.median(uncached):.3f} | {first:.3f} | "
        f"{statistics.median(hits):.5f}, {max(hits):.5f} |"
    )


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
