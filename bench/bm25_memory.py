"""BM25's index build against the corpus's size: peak RssAnon over the process's own baseline, divided by
the postings it holds (bytes a posting), and its wall time, while `stages/retrieval/bm25.index` reads a
stream of synthetic documents (Zipf-distributed words, made a block at a time, so the texts are never all
in memory); then the wall time of 1,000 queries.

    python bench/bm25_memory.py [--docs 100000 1000000] [--words 60] [--vocabulary 200000]

Each corpus size runs in a fresh process, after its imports, so the figure is the build's own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np

BLOCK = 10_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--words", type=int, default=60, help="mean words a document")
    parser.add_argument("--vocabulary", type=int, default=200_000)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.words, args.vocabulary)
        return
    print(f"{os.cpu_count()} cores, load {_load()}", flush=True)
    columns = ["documents", "postings", "terms", "build s", "peak RssAnon MB over baseline", "bytes a posting"]
    print("| " + " | ".join([*columns, "1,000 queries s", "load"]) + " |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for docs in args.docs:
        command = [sys.executable, __file__, "--child", str(docs), "--words", str(args.words)]
        done = subprocess.run([*command, "--vocabulary", str(args.vocabulary)], capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"| {docs:,} | {r['postings']:,} | {r['terms']:,} | {r['build_s']:.1f} | {r['anon_mb']:.0f} | "
            f"{r['anon_mb'] * 2**20 / r['postings']:.1f} | {r['queries_s']:.1f} | {_load()} |",
            flush=True,
        )


def documents(n: int, mean_words: int, vocabulary: int, seed: int = 0) -> Iterator[str]:
    """`n` synthetic documents, a block at a time: lengths uniform in [1, 2 * mean_words), words Zipf(1.1)."""
    rng = np.random.default_rng(seed)
    names = np.array([f"w{i}" for i in range(vocabulary)], dtype=object)
    for start in range(0, n, BLOCK):
        lengths = rng.integers(1, 2 * mean_words, size=min(BLOCK, n - start))
        ids = np.minimum(rng.zipf(1.1, size=int(lengths.sum())), vocabulary) - 1
        ends = np.cumsum(lengths)
        for end, length in zip(ends, lengths):
            yield " ".join(names[ids[end - length : end]])


def _child(docs: int, mean_words: int, vocabulary: int) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from memory import MemoryPeak, status

    from cram.stages.retrieval import bm25

    baseline = status(os.getpid()).get("RssAnon", 0)
    peak = MemoryPeak(lambda: [os.getpid()], every=0.05)
    start = time.perf_counter()
    idx = bm25.index(documents(docs, mean_words, vocabulary))
    build = time.perf_counter() - start
    peak.stop()
    queries = list(documents(1000, 5, vocabulary, seed=1))
    start = time.perf_counter()
    for query in queries:
        bm25.search(idx, query, 100)
    searched = time.perf_counter() - start
    figures = {"postings": len(idx.docs), "terms": len(idx.vocabulary), "build_s": build, "queries_s": searched}
    print(json.dumps({**figures, "anon_mb": (peak.anon - baseline) / 2**20}))


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
