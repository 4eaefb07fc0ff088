"""Throughput and memory of the data stages (targets on the 2-core CPU machine: tokenize >= 5 MB/s
of text and >= 1.6x faster with num_proc 2 than 1, pack >= 50M tokens/s; peak RSS of each stage at
600 MB of text <= 1.5 GB and <= 1.3x (+0.2 GB) its RSS at 150 MB).

    python bench/data.py [CONFIG] [--set k=v ...] [--repeat 3]
    python bench/data.py --synthetic 150 600 [--num-proc 1 2] [--rounds 2] [--keep DIR]

Default mode: runs the tokenize and pack stages of CONFIG (default pipeline.toml) in this process,
into a temporary folder, `--repeat` times each, and prints the medians. Tokenize is reported twice:
encoding alone (the part that grows with the corpus) and the whole stage (reading, held-out split,
tokenizer training, encoding, writing). Pack is timed after its imports, as the stage figures are.

Synthetic mode: for each size (MB of text), writes a plain-text corpus of that size into a
temporary folder (documents of 3-12 sentences drawn from the default corpus's Wikipedia text, in
files of 50 MB: `kind = "files"`, `format = "text"`), then runs every stage in a fresh child process
and reports its seconds and peak RSS: the child's own (`resource.getrusage`) and the peak of the
sum over the child and all its worker processes (sampled from /proc every 50 ms). Tokenize runs once
per `--num-proc` value, interleaved (1, 2, 1, 2 with `--rounds 2`) so that load from other work hits
both alike; pack runs on the first tokenize output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import structlog

from cram.pipeline import config as cfg
from cram.pipeline import runner
from cram.stages import Context, Upstream, pack, tokenize

_FILE_MB = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="pipeline.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--synthetic", type=int, nargs="+", metavar="MB", help="corpus sizes, MB of text")
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="synthetic: write corpora and outputs here, and keep them")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    if args.child:
        _child(json.loads(args.child))
    elif args.synthetic:
        _synthetic(args)
    else:
        _default_corpus(args)


def _default_corpus(args: argparse.Namespace) -> None:
    config = cfg.load(args.config, runner.config_classes(runner.default_stages()), args.overrides)
    with tempfile.TemporaryDirectory(prefix="cram-bench-data-") as tmp:
        ctx = Context(seed=config.run.seed, device="cpu", run_dir=Path(tmp), log=structlog.get_logger())
        tokenized = [
            _run(tokenize, config.stages["tokenize"], {}, Path(tmp) / f"tokenize-{i}", ctx) for i in range(args.repeat)
        ]
        upstream = {"tokenize": Upstream(Path(tmp) / "tokenize-0", tokenized[0])}
        packed = [_run(pack, config.stages["pack"], upstream, Path(tmp) / f"pack-{i}", ctx) for i in range(args.repeat)]

    first = tokenized[0]
    print(
        f"corpus: {first['documents']:,} training documents, {first['text_mb']} MB of text, "
        f"{first['total_tokens']:,} tokens (vocab {first['vocab_size']}, {first['model_type']}); "
        f"{args.repeat} runs each, medians"
    )
    print("| stage | figure | median | min | max |\n|---|---|---|---|---|")
    rows = [
        ("tokenize", "encode MB/s", [t["mb_per_s"] for t in tokenized]),
        ("tokenize", "whole stage MB/s", [t["text_mb"] / t["seconds"] for t in tokenized]),
        ("tokenize", "whole stage s", [t["seconds"] for t in tokenized]),
        ("tokenize", "tokenizer training s", [t["train_seconds"] for t in tokenized]),
        ("pack", "M tokens/s", [p["tokens_per_s"] / 1e6 for p in packed]),
        ("pack", "stage s", [p["seconds"] for p in packed]),
    ]
    for stage, figure, values in rows:
        print(f"| {stage} | {figure} | {statistics.median(values):.3g} | {min(values):.3g} | {max(values):.3g} |")


def _run(stage, config, inputs: dict, out_dir: Path, ctx: Context) -> dict:
    out_dir.mkdir()
    return stage.run(config, inputs, out_dir, ctx)


def _synthetic(args: argparse.Namespace) -> None:
    print(f"machine: {os.cpu_count()} cores, load average before: {' '.join(map(str, os.getloadavg()))}")
    print("| text MB | stage | num_proc | s | encode MB/s | M tokens/s | peak RSS MB (main) | all processes MB |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.synthetic:
        with tempfile.TemporaryDirectory(prefix="cram-bench-corpus-", dir=args.keep) as tmp:
            root = Path(tmp)
            write_corpus(root / "corpus", size)
            tokenized = []
            for run in range(args.rounds):
                for num_proc in args.num_proc:
                    out = root / f"tokenize-{run}-{num_proc}"
                    result = in_child(
                        {
                            "stage": "tokenize",
                            "out": str(out),
                            "num_proc": num_proc,
                            "corpus": str(root / "corpus" / "*.txt"),
                        }
                    )
                    t = result["outputs"]
                    tokenized.append((out, t))
                    print(
                        f"| {t['text_mb']:.0f} | tokenize | {num_proc} | {t['seconds']:.1f} | {t['mb_per_s']:.2f} | "
                        f"| {result['self_mb']:.0f} | {result['tree_mb']:.0f} |",
                        flush=True,
                    )
            out, t = tokenized[0]
            result = in_child({"stage": "pack", "out": str(root / "pack"), "tokens": str(out), "outputs": t})
            p = result["outputs"]
            print(
                f"| {t['text_mb']:.0f} | pack | | {p['seconds']:.1f} | | {p['tokens_per_s'] / 1e6:.1f} | "
                f"{result['self_mb']:.0f} | {result['tree_mb']:.0f} |",
                flush=True,
            )
            print(
                f"<!-- {size} MB: {t['documents']:,} training documents, {t['total_tokens']:,} tokens, "
                f"{p['train_blocks']:,} train blocks -->",
                flush=True,
            )
            if args.keep:
                os.rename(tmp, f"{tmp}-kept")
                os.makedirs(tmp)  # for TemporaryDirectory's clean-up
    print(f"load average after: {' '.join(map(str, os.getloadavg()))}")


def write_corpus(folder: Path, megabytes: int, seed: int = 0) -> None:
    """Plain-text files of paragraphs (documents), `megabytes` MB of UTF-8 in all: each document
    3-12 sentences drawn at random from the default corpus, so the text is real English."""
    from cram.stages.data.corpus import package_file
    from cram.stages.data.source import CorpusConfig

    default = CorpusConfig()
    records = json.loads(package_file(default.package, default.file).read_text())
    sentences = [s for r in records.values() for s in re.split(r"(?<=\.) ", r["extract"].replace("\n", " ")) if s]
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    written, index = 0, 0
    while written < megabytes * 1_000_000:
        size = min(_FILE_MB, megabytes - written // 1_000_000) * 1_000_000
        with open(folder / f"part-{index:04d}.txt", "wb") as f:
            while size > 0 and written < megabytes * 1_000_000:
                doc = (" ".join(rng.choices(sentences, k=rng.randint(3, 12))) + "\n\n").encode()
                f.write(doc)
                size -= len(doc)
                written += len(doc)
        index += 1


def in_child(spec: dict, script: str = __file__) -> dict:
    """`script --child SPEC` in a fresh process: its last stdout line, read as JSON."""
    done = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"child failed ({spec['stage']}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(spec: dict) -> None:
    """One stage in this fresh process; prints its outputs and peak RSS as one JSON line."""
    import resource
    import threading

    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], _tree_rss_mb(os.getpid()))

    threading.Thread(target=sample, daemon=True).start()
    out = Path(spec["out"])
    out.mkdir()
    ctx = Context(seed=0, device="cpu", run_dir=out.parent, log=structlog.get_logger())
    if spec["stage"] == "tokenize":
        from cram.stages.data.source import CorpusConfig

        corpus = CorpusConfig(kind="files", paths=(spec["corpus"],), format="text")
        config = tokenize.Config(corpus=corpus, num_proc=spec["num_proc"], heldout_fraction=0.01)
        outputs = tokenize.run(config, {}, out, ctx)
    else:
        outputs = pack.run(pack.Config(), {"tokenize": Upstream(Path(spec["tokens"]), spec["outputs"])}, out, ctx)
    done.set()
    print(
        json.dumps(
            {
                "outputs": outputs,
                "self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "tree_mb": peak[0],
            }
        )
    )


def process_tree(root: int) -> list[int]:
    """`root` and its descendants (the workers are children of a forkserver, itself a child of `root`)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def _tree_rss_mb(root: int) -> float:
    """The resident memory of process `root` and all its descendants (worker processes are
    children of a forkserver, not of the stage's process: getrusage does not see them)."""
    pages = 0
    for pid in process_tree(root):
        try:
            pages += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # gone meanwhile
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


if __name__ == "__main__":
    main()
