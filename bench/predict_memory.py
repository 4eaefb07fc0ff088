"""Peak memory of `cram predict` against the number of lines it classifies: it reads, encodes, predicts
and writes a chunk at a time, so its memory should not grow with the file.

    .venv/bin/python bench/predict_memory.py --lines 100000 1000000

The classifier: bench/predict.py's (a random encoder of `--preset`, ModernBERT's head, 3 labels, exported
in cram's format). The texts: the default corpus's opening sections, cycled to `--lines` lines and cut
to `--chars` characters. Each size runs `cram predict EXPORT texts.txt --out rows.jsonl --no-compile` in
a process of its own, sampled by bench/memory.py (RssAnon: the process's own memory; VmRSS: with mapped
files' pages). Prints one row per size.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import MemoryPeak  # noqa: E402  (bench/memory.py, beside this file)
from predict import make_exports, wiki_texts  # noqa: E402  (bench/predict.py)


def write_lines(path: Path, texts: list[str], lines: int, chars: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i in range(lines):
            f.write(texts[i % len(texts)][:chars].replace("\n", " ") + "\n")


def measure(export: Path, texts: Path, out: Path) -> tuple[int, int, float]:
    """(peak RssAnon, peak VmRSS, wall seconds) of one `cram predict` process."""
    cram = Path(sys.executable).with_name("cram")
    began = time.perf_counter()
    child = subprocess.Popen([str(cram), "predict", str(export), str(texts), "--out", str(out), "--no-compile"])
    peak = MemoryPeak(lambda: [child.pid])
    code = child.wait()
    peak.stop()
    if code != 0:
        raise SystemExit(f"cram predict exited {code}")
    return peak.anon, peak.rss, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--chars", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cram-predict-memory-") as folder:
        root = Path(folder)
        texts = wiki_texts(4000)
        export, _ = make_exports(root, texts, args.preset, max_length=128, batch=128)
        print("| lines | peak RssAnon MB | peak VmRSS MB | wall s | rows written |")
        print("|---|---|---|---|---|")
        for lines in args.lines:
            source, out = root / f"texts-{lines}.txt", root / f"rows-{lines}.jsonl"
            write_lines(source, texts, lines, args.chars)
            anon, rss, wall = measure(export, source, out)
            with out.open("rb") as f:
                written = sum(1 for _ in f)
            print(f"| {lines:,} | {anon / 1e6:.0f} | {rss / 1e6:.0f} | {wall:.1f} | {written:,} |", flush=True)
            source.unlink()
            out.unlink()


if __name__ == "__main__":
    main()
