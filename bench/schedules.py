"""Masking-rate schedules, attention within documents and a final long phase, through the real pipeline.

    python bench/schedules.py [--work bench-out/schedules] [--tokens 2000000 | --hours 0.0583]
        [--seeds 0,1,2] [--variants m25,m40,m30-15,m40-20,docs,long512,m40+docs] [--set KEY=VALUE ...]
        [--base old|default] [--tasks]

Each variant is `pipeline.toml` with `BASE` (25% masking, attention across documents, one length; or
nothing with `--base default`: the pipeline as it is) and its overrides (`VARIANTS`; `a+b` joins them),
trained on the same budget: a fixed
token count (`--tokens`, the default: compares what each learns per token) or a fixed time (`--hours`:
what each learns per second, on this machine, under its load). Runs are interleaved (seed 0: every
variant, then seed 1: every variant, ...) so that load from other work hits all alike, and the
variants of one seed share its tokenize and pack through the store. Evaluate measures the held-out
masked-LM loss at 128 and 512 tokens at one masking rate (25%) for every variant, and no task (`--tasks`:
pipeline.toml's, the topic classifier and the retrieval fine-tune, each after the variant's pretraining).

Prints one row per variant: the median over seeds (then each seed) of evaluate's `mlm_loss@128` and
`mlm_loss@512` (with `--tasks`: `topic_accuracy` and `retrieval_ndcg@10`), pretrain's wall time (the budget
clock: compiling is before it) and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Every variant starts from this, `pipeline.toml` before the measurements below chose its defaults.
BASE = ["pretrain.masking.rate=0.25", "pretrain.document_attention=false", "pretrain.phases=[]"]
VARIANTS: dict[str, list[str]] = {
    "m25": [],  # 25% throughout
    "m40": ["pretrain.masking.rate=0.4"],
    "m30-15": ["pretrain.masking.rate=0.3", "pretrain.masking.end_rate=0.15"],
    "m40-20": ["pretrain.masking.rate=0.4", "pretrain.masking.end_rate=0.2"],
    "docs": ["pretrain.document_attention=true"],
    "long512": ["pretrain.phases=[{seq_len=128, until=0.9}, {seq_len=512}]"],
    # The 2025 encoder recipe (ModernBERT, Ettin, mmBERT, NeoBERT), each measured on `--base default`:
    "default": [],  # pipeline.toml as it is
    "stable": ["pretrain.optimizer.kind='stable_adamw'", "pretrain.optimizer.clip_norm=0"],
    "muon": ["pretrain.optimizer.kind='muon'"],  # issue 46's winner per token, here at equal wall time too
    # The default before Muon (issue 46): AdamW at batch 16, lr 5e-3
    "adamw16": [
        "pretrain.optimizer.kind='adamw'",
        "pretrain.batch_size=16",
        "pretrain.microbatch=16",
        "pretrain.optimizer.lr=5e-3",
    ],
    "wsd": ["pretrain.schedule='wsd'", "pretrain.decay_shape='1-sqrt'", "pretrain.decay_to=0.02"],
    "tri1sqrt": ["pretrain.decay_shape='1-sqrt'", "pretrain.decay_to=0.02"],  # budget-triangle's decay so
    "m30": ["pretrain.masking.rate=0.3"],
    "mphase": [  # three phases of one length: 40% -> 30% -> 20% at 60% and 85% of the budget
        "pretrain.phases=[{seq_len=128, until=0.6}, {seq_len=128, until=0.85}, {seq_len=128}]",
        "pretrain.masking.phase_rates=[0.4, 0.3, 0.2]",
    ],
    "allmask": ["pretrain.masking.mask_token=1.0", "pretrain.masking.random_token=0.0"],
    # Around the schedule (the lr was tuned for budget-triangle): a longer 1-sqrt decay, a higher peak.
    "decay40": ["pretrain.schedule_args={warmup=0.1, decay=0.4}"],  # with wsd: its decay over the last 40%
    "lr5": ["pretrain.optimizer.lr=5e-3"],
    "lr2": ["pretrain.optimizer.lr=2e-3"],
    "lr7": ["pretrain.optimizer.lr=7e-3"],
    # Past the 2025 recipe, toward issue 29's 4.75: a longer triangle decay, more and smaller steps, more masking.
    "tri50": ["pretrain.schedule_args={start=0.25, decay=0.5}"],  # budget-triangle decaying over the last half
    "b16": ["pretrain.batch_size=16", "pretrain.microbatch=16"],
    "m50": ["pretrain.masking.rate=0.5"],
    "b95": ["pretrain.optimizer.betas=[0.9, 0.95]"],
    "b32": ["pretrain.batch_size=32", "pretrain.microbatch=32", "pretrain.optimizer.lr=3e-3"],  # b16's and lr5's base
    # The step's precision pinned: a CPU without native bf16 (AVX2-only, Apple silicon) trains in fp32, and `auto`
    # falls back to fp32 where bf16's canary fails.
    "fp32": ["pretrain.precision='fp32'"],
    "bf16": ["pretrain.precision='bf16'"],
}
BASES = {"old": BASE, "default": []}
# The held-out loss at one masking rate and one corruption (80/10/10), whatever each variant trained with.
EVALUATE = [
    "evaluate.tasks=[]",
    "evaluate.mlm_mask_rate=0.25",
    "evaluate.mlm_lengths=[128, 512]",
    "evaluate.mlm_corruption='bert'",
]
FIGURES = ("mlm_loss@128", "mlm_loss@512", "wall_s", "tokens_per_s")
TASK_FIGURES = ("topic_accuracy", "retrieval_ndcg@10")  # with --tasks: each the median of its fine-tune seeds


def evaluate_overrides(tasks: bool) -> list[str]:
    """EVALUATE, keeping pipeline.toml's fine-tuning tasks where `tasks`."""
    return [item for item in EVALUATE if not (tasks and item.startswith("evaluate.tasks="))]


def run(name: str, overrides: list[str]) -> None:
    args = [sys.executable, "-m", "cram.pipeline.commands.cli", "run", "pipeline.toml", "--name", name]
    for item in overrides:
        args += ["--set", item]
    print("$", " ".join(args[2:]), flush=True)
    subprocess.run(args, check=True, cwd=REPO)


def figures(run_dir: Path) -> dict[str, float]:
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    pretrain, evaluate = stages["pretrain"]["outputs"], stages["evaluate"]["outputs"]
    return {
        "mlm_loss@128": evaluate["mlm_loss@128"],
        "mlm_loss@512": evaluate["mlm_loss@512"],
        "wall_s": pretrain["wall_s"],
        "tokens_per_s": pretrain["tokens_per_s"],
        **{name: evaluate[name] for name in TASK_FIGURES if name in evaluate},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "bench-out" / "schedules")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=int, default=2_000_000)
    budget.add_argument("--hours", type=float)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--set", action="append", default=[], help="a further override for every variant")
    parser.add_argument(
        "--tasks", action="store_true", help="keep pipeline.toml's fine-tuning tasks: topic accuracy, retrieval nDCG@10"
    )
    parser.add_argument(
        "--base", choices=tuple(BASES), default="old", help="old: BASE under every variant; default: pipeline.toml"
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [part for v in variants for part in v.split("+") if part not in VARIANTS]
    if unknown:
        parser.error(f"--variants: {unknown[0]!r} is not one of {', '.join(VARIANTS)} (or several joined by +)")
    limit = f"pretrain.budget.hours={args.hours}" if args.hours else f"pretrain.budget.tokens={args.tokens}"
    off = "pretrain.budget.tokens=0" if args.hours else "pretrain.budget.hours=0"
    work = args.work.resolve()
    common = [f"run.root={json.dumps(str(work / 'runs'))}", off, limit, *evaluate_overrides(args.tasks), *args.set]
    shown = FIGURES + TASK_FIGURES if args.tasks else FIGURES
    budget_name = f"{args.hours}h" if args.hours else f"{args.tokens}t"
    runs = {  # seed by seed, every variant: interleaved
        f"{variant.replace('+', '_')}-{budget_name}-s{seed}": (
            variant,
            [*common, f"run.seed={seed}", *BASES[args.base], *(o for p in variant.split("+") for o in VARIANTS[p])],
        )
        for seed in args.seeds.split(",")
        for variant in variants
    }
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for name, (variant, overrides) in runs.items():
        run(name, overrides)
        figured = figures(work / "runs" / name)
        rows[variant].append(figured)
        print(f"= {name}: " + " ".join(f"{k} {v:.3f}" for k, v in figured.items()), flush=True)

    print(f"\nbudget {budget_name}, seeds {args.seeds} (median; then each seed)")
    print("| variant | " + " | ".join(shown) + " |\n|---|" + "---:|" * len(shown))
    for variant, measured in rows.items():
        medians = " | ".join(f"{statistics.median(r[k] for r in measured):.3f}" for k in shown)
        each = "; ".join(" ".join(f"{r[k]:.3f}" for k in (*FIGURES[:2], *shown[4:])) for r in measured)
        print(f"| {variant} | {medians} |   ({each})", flush=True)


if __name__ == "__main__":
    main()
