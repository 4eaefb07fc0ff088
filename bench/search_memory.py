"""Exact top-k search's memory against the corpus's size: peak RssAnon (the process's own arrays) and
peak RSS (mapped file pages too), sampled every 0.05 s, while `stages/retrieval/search.top_k` searches
synthetic normalised fp16 embeddings on disk; and its wall time.

    python bench/search_memory.py [--docs 100000 1000000] [--dim 384] [--queries 1000] [--k 100] [--dir D]

Each corpus size is written first (random unit rows, in batches, to a temporary folder under `--dir`,
removed after), then searched in a fresh process, after its imports and queries are made, so the figure
is the search's own: memory flat in the corpus size beyond one chunk (`search.CHUNK_ROWS` rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--dir", type=Path, help="where the temporary folder goes")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.queries, args.k)
        return
    print(f"{os.cpu_count()} cores, load {_load()}", flush=True)
    print("| documents | dim, dtype | file MB | queries, k | wall s | peak RssAnon MB | peak RSS MB | load |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for docs in args.docs:
        with tempfile.TemporaryDirectory(prefix="cram-bench-search-", dir=args.dir) as tmp:
            path = Path(tmp) / "corpus.npy"
            _write_corpus(path, docs, args.dim)
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(path), "--queries", str(args.queries), "--k", str(args.k)],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"| {docs:,} | {args.dim}, fp16 | {path.stat().st_size / 2**20:.0f} | {args.queries}, {args.k} | "
                f"{r['seconds']:.1f} | {r['anon_mb']:.0f} | {r['rss_mb']:.0f} | {_load()} |",
                flush=True,
            )


def _write_corpus(path: Path, docs: int, dim: int, batch: int = 65536) -> None:
    from cram.stages.retrieval.search import write_embeddings

    rng = np.random.default_rng(0)
    batches = (rng.standard_normal((min(batch, docs - i), dim), np.float32) for i in range(0, docs, batch))
    write_embeddings(path, batches, docs, "float16")


def _child(path: Path, queries: int, k: int) -> None:
    from memory import MemoryPeak

    from cram.stages.retrieval.search import Embeddings, normalised, top_k

    embeddings = Embeddings.open(path)
    rows = normalised(np.random.default_rng(1).standard_normal((queries, embeddings.dim), np.float32))
    peak = MemoryPeak(lambda: [os.getpid()], every=0.05)
    start = time.perf_counter()
    top_k(rows, embeddings, k)
    seconds = time.perf_counter() - start
    peak.stop()
    print(json.dumps({"seconds": seconds, "anon_mb": peak.anon / 2**20, "rss_mb": peak.rss / 2**20}))


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
