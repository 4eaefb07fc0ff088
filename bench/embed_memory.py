"""Peak memory of `cram embed` against the size of the `.npy` it writes: it embeds a chunk at a time and
appends each chunk's vectors to the file, so its memory should not grow with the output.

    .venv/bin/python bench/embed_memory.py --rows 50000 200000

The model: a random encoder of the tiny preset cut to `--layers` layers at `--hidden` wide (the output's
width: few layers, so the run is spent writing rows rather than computing them), kept in a run directory
as evaluate keeps an embedding model (bench/predict.py's `make_embedder_run`). The texts: the default
corpus's opening sections, cycled to `--rows` lines and cut to `--chars` characters. Each size runs
`cram embed RUN texts.txt --out v.npy --precision fp32` in a process of its own, sampled by bench/memory.py
(RssAnon: the process's own memory; VmRSS: with mapped files' pages, which a memory-mapped output adds).
Prints the command, `uptime`, then one row per size with the load averages after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import MemoryPeak  # noqa: E402  (bench/memory.py, beside this file)
from predict import make_embedder_run, wiki_texts  # noqa: E402  (bench/predict.py)
from predict_memory import write_lines  # noqa: E402  (bench/predict_memory.py)

from cram import model  # noqa: E402


def measure(run: Path, texts: Path, out: Path, batch: int) -> tuple[int, int, float]:
    """(peak RssAnon, peak VmRSS, wall seconds) of one `cram embed` process."""
    cram = Path(sys.executable).with_name("cram")
    command = [str(cram), "embed", str(run), str(texts), "--out", str(out), "--precision", "fp32"]
    began = time.perf_counter()
    child = subprocess.Popen([*command, "--batch-size", str(batch)], stdout=subprocess.DEVNULL)
    peak = MemoryPeak(lambda: [child.pid])
    code = child.wait()
    peak.stop()
    if code != 0:
        raise SystemExit(f"cram embed exited {code}")
    return peak.anon, peak.rss, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[50_000, 200_000])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--chars", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=512)
    args = parser.parse_args()
    print("$", " ".join(sys.argv), flush=True)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    cfg = dataclasses.replace(
        model.PRESETS["tiny"], hidden=args.hidden, layers=args.layers, heads=4, intermediate=2 * args.hidden
    )
    with tempfile.TemporaryDirectory(prefix="cram-embed-memory-") as folder:
        root = Path(folder)
        texts = wiki_texts(4000)
        run = make_embedder_run(root, texts, cfg, max_length=32)
        print("| rows | output bytes | peak RssAnon MB | peak VmRSS MB | wall s | load 1 / 5 / 15 min, after |")
        print("|---|---|---|---|---|---|")
        for rows in args.rows:
            source, out = root / f"texts-{rows}.txt", root / f"v-{rows}.npy"
            write_lines(source, texts, rows, args.chars)
            anon, rss, wall = measure(run, source, out, args.batch_size)
            size = out.stat().st_size
            load = " / ".join(f"{x:.2f}" for x in os.getloadavg())  # the machine's, as `uptime` prints it
            row = f"| {rows:,} | {size:,} | {anon / 1e6:.0f} | {rss / 1e6:.0f} | {wall:.1f} | {load} |"
            print(row, flush=True)
            source.unlink()
            out.unlink()


if __name__ == "__main__":
    main()
