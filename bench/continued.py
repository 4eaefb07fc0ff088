"""Continued pretraining against training from scratch, on a second corpus at equal tokens.

    python bench/continued.py [--work bench-out/continued] [--tokens-a 2000000] [--tokens-b 1000000]
        [--seeds 0,1,2]

1. Corpus A is the default pipeline's (Wikipedia openings): `pipeline.toml`'s tokenize, pack and
   pretrain for `--tokens-a` tokens, then `cram export` of that run.
2. Corpus B is another domain, built here from what every Python install has: the docstrings of the
   standard library (modules, classes, functions; tests left out), one document each, labelled by
   their top-level package where it is one of the largest (`TOPICS`), unlabelled otherwise.
3. On B, with A's tokenizer (so both rows' losses are over the same vocabulary), for `--tokens-b`
   tokens and each seed: `continued` starts from A's export (`pretrain.init`), `scratch` from the
   tiny preset's random init, same schedule and lr. Each is evaluated by the held-out masked-LM loss
   on B's held-out documents and by classifying those documents' packages (`heldout-topic`).

Prints the table (median over seeds, and each seed): held-out MLM loss on B at the start and end of
pretraining, evaluate's MLM loss, and the package accuracy.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPICS = ("tkinter", "idlelib", "distutils", "email", "asyncio", "turtle", "xml", "logging", "importlib", "http")
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages"}


def stdlib_corpus(path: Path, min_chars: int = 100) -> int:
    """Write the standard library's docstrings as JSON lines {title, text, topic}; return the count."""
    root = Path(sysconfig.get_paths()["stdlib"])
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for source in sorted(root.rglob("*.py")):
            rel = source.relative_to(root)
            if SKIP_PARTS & set(rel.parts):
                continue
            try:
                tree = ast.parse(source.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            package = rel.parts[0].removesuffix(".py")
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    title = f"{rel}:{getattr(node, 'name', '<module>')}:{getattr(node, 'lineno', 0)}"
                    topic = package if package in TOPICS else ""
                    out.write(json.dumps({"title": title, "text": doc, "topic": topic}) + "\n")
                    count += 1
    return count


def cram(*args: str) -> None:
    print("$ cram", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "cram.pipeline.commands.cli", *args], check=True, cwd=REPO)


def config_b(work: Path, tokenizer: Path, corpus: Path) -> Path:
    """pipeline.toml with corpus B, A's tokenizer, and a topic task over B's held-out docstrings."""
    text = (REPO / "pipeline.toml").read_text(encoding="utf-8")
    head, _, _ = text.partition("[tokenize.corpus]")
    head = head.replace("[tokenize]\n", f'[tokenize]\ntokenizer = "{tokenizer}"\n', 1)
    rest = text.partition("[pack]")[2]
    corpus_table = (
        f'[tokenize.corpus]\nkind = "files"\npaths = ["{corpus}"]\nformat = "jsonl"\n'
        'text_field = "text"\ntitle_field = "title"\nlabel_field = "topic"\n\n'
    )
    path = work / "corpus-b.toml"
    path.write_text(head + corpus_table + "[pack]" + rest, encoding="utf-8")
    return path


def figures(run_dir: Path) -> dict[str, float]:
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    pretrain, evaluate = stages["pretrain"]["outputs"], stages["evaluate"]["outputs"]
    results = json.loads((run_dir / "evaluate" / evaluate["results"]).read_text())
    topic = results["tasks"]["topic"]["median"]
    return {
        "val_start": pretrain["val_loss_start"],
        "val_end": pretrain["val_loss_end"],
        "mlm_loss": results["mlm"]["loss"],
        "topic_acc": next(iter(topic.values()))["accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "bench-out" / "continued")
    parser.add_argument("--tokens-a", type=int, default=2_000_000)
    parser.add_argument("--tokens-b", type=int, default=1_000_000)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    root = f"run.root={json.dumps(str(work / 'runs'))}"
    budget_a = ["--set", "pretrain.budget.hours=0", "--set", f"pretrain.budget.tokens={args.tokens_a}"]
    for stage in ("tokenize", "pack", "pretrain"):
        cram("run", "pipeline.toml", "--name", "a", "--set", root, *budget_a, "--only", stage)
    cram("export", str(work / "runs" / "a"), "--to", str(work / "a-export"), "--force")

    corpus = work / "stdlib-docstrings.jsonl"
    print(f"corpus B: {stdlib_corpus(corpus)} docstrings in {corpus}", flush=True)
    config = config_b(work, work / "a-export" / "tokenizer.model", corpus)
    budget_b = ["--set", "pretrain.budget.hours=0", "--set", f"pretrain.budget.tokens={args.tokens_b}"]
    rows: dict[str, list[dict[str, float]]] = {"continued": [], "scratch": []}
    for seed in args.seeds.split(","):
        for row in rows:
            init = ["--set", f"pretrain.init={json.dumps(str(work / 'a-export'))}"] if row == "continued" else []
            name = f"b-{row}-{seed}"
            cram("run", str(config), "--name", name, "--set", root, "--set", f"run.seed={seed}", *budget_b, *init)
            rows[row].append(figures(work / "runs" / name))

    keys = ("val_start", "val_end", "mlm_loss", "topic_acc")
    print(f"\ncorpus B, {args.tokens_b:,} tokens, seeds {args.seeds} (median; then each seed)")
    print("| start | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
    for row, runs in rows.items():
        medians = " | ".join(f"{statistics.median(r[k] for r in runs):.3f}" for k in keys)
        each = "; ".join(" ".join(f"{r[k]:.3f}" for k in keys) for r in runs)
        print(f"| {row} | {medians} |   ({each})")


if __name__ == "__main__":
    main()
