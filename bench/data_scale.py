"""Tokenize + pack over gigabytes of text, with cram's sentencepiece path and with a given byte-level BPE
(~50k tokens, trained here with `tokenizers` on a 50 MB sample): wall time, MB/s, tokens/s, peak memory
(RssAnon and RSS, summed over the stage's process and its workers, sampled from /proc/PID/status every
0.2 s), the CPU seconds of those processes (per MB and per token: the figures load disturbs least) and
peak disk use of the working folder (its files' allocated blocks, sampled every second).

    python bench/data_scale.py --gb 2 [--paths bpe sp] [--dir bench-out] [--num-proc 2]

The corpus is `bench/data.py`'s synthetic text (documents of 3-12 sentences drawn at random from the
default corpus's Wikipedia extracts, one per paragraph, files of 50 MB): every document is a new draw,
so de-duplication removes next to none. Each stage runs in a fresh child process (`bench/data.py
--child`'s protocol); after each path its outputs are deleted, and at the end the whole folder. Rows are
printed as they are measured (flushed), so a run cut short still tells what it reached.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from data import in_child, process_tree, write_corpus
from memory import MemoryPeak

_VOCAB = 50_000
_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0, help="text to tokenize, GB")
    parser.add_argument("--paths", nargs="+", choices=["sp", "bpe"], default=["bpe", "sp"])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the work folder goes")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(json.loads(args.child))
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="cram-bench-scale-", dir=args.dir))
    disk = _DiskPeak(root)
    try:
        _measure(args, root, disk)
    finally:
        disk.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"peak disk use of the work folder: {disk.peak / 1e9:.1f} GB; load after: {_load()}", flush=True)


def _measure(args: argparse.Namespace, root: Path, disk: _DiskPeak) -> None:
    print(f"{os.cpu_count()} cores; load before: {_load()}; work folder {root}", flush=True)
    t0 = time.perf_counter()
    write_corpus(root / "corpus", round(args.gb * 1000))
    print(f"corpus: {args.gb} GB written in {time.perf_counter() - t0:.0f} s", flush=True)
    if "bpe" in args.paths:
        t0 = time.perf_counter()
        _train_bpe(sorted((root / "corpus").glob("*.txt"))[0], root / "bpe")
        print(f"byte-level BPE of {_VOCAB} tokens trained on 50 MB in {time.perf_counter() - t0:.0f} s", flush=True)
    print(
        "| path | stage | wall s | CPU s (user + system) | text MB/s (stage) | text MB per CPU s | encode MB/s "
        "| M tokens/s | M tokens per CPU s | peak RssAnon MB | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for path in args.paths:
        spec = {"corpus": str(root / "corpus" / "*.txt"), "num_proc": args.num_proc, "out": str(root / f"tok-{path}")}
        spec["tokenizer"] = str(root / "bpe") if path == "bpe" else ""
        t = in_child({**spec, "stage": "tokenize"}, __file__)
        out = t["outputs"]
        _row(path, "tokenize", t, out["text_mb"], out["total_tokens"], f"{out['mb_per_s']:.2f}")
        p = in_child(
            {"stage": "pack", "out": str(root / f"pack-{path}"), "tokens": spec["out"], "outputs": out}, __file__
        )
        packed = p["outputs"]
        _row(path, "pack", p, out["text_mb"], out["total_tokens"], "")
        print(
            f"<!-- {path}: {out['text_mb']:.0f} MB, {out['documents']:,} documents, {out['total_tokens']:,} tokens, "
            f"vocab {out['vocab_size']}, read {out['read_seconds']:.0f} s, tokenizer {out['train_seconds']:.0f} s, "
            f"encode {out['encode_seconds']:.0f} s; pack {packed['seconds']:.0f} s in-stage, "
            f"{packed['duplicates_removed']:,} duplicates, {packed['train_blocks']:,} train blocks; "
            f"disk peak so far {disk.peak / 1e9:.1f} GB; load {_load()} -->",
            flush=True,
        )
        shutil.rmtree(spec["out"])
        shutil.rmtree(root / f"pack-{path}")


def _row(path: str, stage: str, measured: dict, text_mb: float, tokens: int, encode: str) -> None:
    """One table row: a stage's wall time and CPU time (the stage's process and its workers) per text and token."""
    wall, cpu = measured["wall_s"], measured["user_s"] + measured["system_s"]
    print(
        f"| {path} | {stage} | {wall:.1f} | {cpu:.1f} ({measured['user_s']:.1f} + {measured['system_s']:.1f}) | "
        f"{text_mb / wall:.2f} | {text_mb / cpu:.2f} | {encode} | {tokens / wall / 1e6:.2f} | "
        f"{tokens / cpu / 1e6:.2f} | {measured['anon_mb']:.0f} | {measured['rss_mb']:.0f} |",
        flush=True,
    )


def _train_bpe(sample: Path, folder: Path) -> None:
    """A RoBERTa/ModernBERT-style byte-level BPE, as `transformers` would save its tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    with open(sample, encoding="utf-8") as f:
        tok.train_from_iterator((line for line in f if line.strip()), trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))


def _child(spec: dict) -> None:
    """One stage in this fresh process; prints its outputs, wall time and peak memory as one JSON line."""
    import structlog

    from cram.stages import Context, Upstream, pack, tokenize
    from cram.stages.data.source import CorpusConfig

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    sampler = MemoryPeak(lambda: process_tree(os.getpid()))
    out = Path(spec["out"])
    out.mkdir()
    ctx = Context(seed=0, device="cpu", run_dir=out.parent, log=structlog.get_logger())
    started = time.perf_counter()
    if spec["stage"] == "tokenize":
        corpus = CorpusConfig(kind="files", paths=(spec["corpus"],), format="text")
        config = tokenize.Config(
            corpus=corpus, num_proc=spec["num_proc"], heldout_fraction=0.01, tokenizer=spec["tokenizer"]
        )
        outputs = tokenize.run(config, {}, out, ctx)
    else:
        outputs = pack.run(pack.Config(), {"tokenize": Upstream(Path(spec["tokens"]), spec["outputs"])}, out, ctx)
    wall = time.perf_counter() - started
    sampler.stop()
    peaks = {"anon_mb": sampler.anon / 2**20, "rss_mb": sampler.rss / 2**20}
    cpu = {"user_s": sampler.user, "system_s": sampler.system}
    print(json.dumps({"outputs": outputs, "wall_s": wall, **peaks, **cpu}))


class _DiskPeak:
    """The peak over time of the bytes allocated to the files under `root`."""

    def __init__(self, root: Path):
        self.root, self.peak = root, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(1.0):
            used = 0
            for folder, _, names in os.walk(self.root):
                for name in names:
                    try:
                        used += os.lstat(os.path.join(folder, name)).st_blocks * 512
                    except OSError:
                        pass  # removed meanwhile
            self.peak = max(self.peak, used)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
