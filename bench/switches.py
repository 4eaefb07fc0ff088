"""Issue 46's switches, one change per row against the default pipeline, at equal tokens, through the real pipeline.

    python bench/switches.py [--work bench-out/switches] [--tokens 2000000] [--seeds 0,1,2]
        [--rows default,qk_norm,zero_init_out,deep_thin] [--tasks] [--table]

Each row is `pipeline.toml` with its overrides (`ROWS`; `a+b` joins rows, e.g. the winners combined), trained
on `--tokens` tokens. Runs are interleaved (seed 0: every row, then seed 1: every row, ...) so that load from
other work hits all rows alike. Evaluate measures the held-out masked-LM loss at 128 and 512 tokens at one
masking rate (25%, 80/10/10) for every row, and no fine-tuning task (`evaluate.tasks=[]`; `--tasks`:
pipeline.toml's, the topic classifier and the retrieval fine-tune, in runs named `...-tasks` whose pretraining
is reused from the store where the row already ran at those tokens and seed).

Each finished run's figures are appended to `WORK/results.jsonl` as it ends, and a run already there is not
run again: a killed measurement resumes, and a partial table can be printed at any time with `--table`.
The table (of the runs with or without `--tasks`, as asked): per row, the mean over seeds of `mlm_loss@128`
and `mlm_loss@512` (with `--tasks`, of `topic_accuracy` and `retrieval_ndcg@10` too), each seed's value, the
seeds the row beats its baseline in (a lower loss, a higher score, at the same seed) and each seed's
difference, tokens/s (the median over seeds: one run slowed by other work moves it least) and the parameter
count. A row's baseline is `default`, or `small` for a row joined to it (`small+adamw` against `small`): one
change per row, at each preset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The same held-out loss (one masking rate, 80/10/10, whatever a row trained with) and runner as the recipe's
from schedules import REPO, TASK_FIGURES, evaluate_overrides, run  # noqa: E402  (bench/schedules.py, beside this file)

HIGH_LR = "pretrain.optimizer.lr=1e-2"  # above the default's lr: QK-norm and Muon are said to take more
ROWS: dict[str, list[str]] = {
    "default": [],  # pipeline.toml as it is: tiny preset, Muon at batch 32, lr 7e-3
    # The second preset (4 layers, hidden 256): joined to a row, e.g. small+adamw+batch16+lr5e-3
    "small": ["pretrain.model.preset='small'"],
    "qk_norm": ["pretrain.model.qk_norm=true"],
    "qk_norm_lr1e-2": ["pretrain.model.qk_norm=true", HIGH_LR],
    "zero_init_out": ["pretrain.model.zero_init_out=true"],
    "muon": ["pretrain.optimizer.kind='muon'"],
    "adamw": ["pretrain.optimizer.kind='adamw'"],  # adamw+batch16+lr5e-3: the default before Muon
    "muon_lr1e-2": ["pretrain.optimizer.kind='muon'", HIGH_LR],
    # Joined to a row with +: Newton-Schulz costs a step the same at any batch, so its share of a step's time
    # falls as the tokens per step grow; the lr may move with the batch.
    "batch16": ["pretrain.microbatch=16", "pretrain.batch_size=16"],
    "batch32": ["pretrain.microbatch=32", "pretrain.batch_size=32"],
    "batch48": ["pretrain.microbatch=48", "pretrain.batch_size=48"],
    "batch64": ["pretrain.microbatch=64", "pretrain.batch_size=64"],
    # Cramming's batch ramp: batch_size (32) stays the target, one microbatch of 16 a step for the first 30%
    # of the budget and two after (`ramp = 0.6`): more steps while the loss falls fastest, batch 32's
    # Newton-Schulz share after.
    "ramp16": ["pretrain.microbatch=16"],
    "lr5e-3": ["pretrain.optimizer.lr=5e-3"],
    "lr7e-3": ["pretrain.optimizer.lr=7e-3"],
    # `auto` falls back to fp32 where its canary fails: a row pinned to bf16 compares with bf16 rows as they ran.
    "bf16": ["pretrain.precision='bf16'"],
    "lr1e-2": [HIGH_LR],
    # Twice the layers at 0.69x the width, at the default's encoder parameters (its layers: 2 x 163,840 =
    # 327,680 weights): hidden 88 (2 heads of 44), intermediate 386, 4 layers of 4 x 88^2 + 1.5 x 88 x 386
    # = 81,928 weights each, 327,712 in all. The embeddings (vocab x hidden) shrink with the width.
    "deep_thin": ["pretrain.model.layers=4", "pretrain.model.hidden=88", "pretrain.model.intermediate=386"],
    # The same shape change at the small preset (joined to it: small+deep_thin_small): its layers are 4 x
    # 655,360 = 2,621,440 weights; 8 layers at hidden 176 (4 heads of 44), intermediate 772: 8 x (4 x 176^2 +
    # 1.5 x 176 x 772) = 2,621,696.
    "deep_thin_small": ["pretrain.model.layers=8", "pretrain.model.hidden=176", "pretrain.model.intermediate=772"],
}
LOSSES = ("mlm_loss@128", "mlm_loss@512")
PRESET_ROWS = ("small",)  # a row joined to one of these is measured against it, not against the default


def baseline_of(row: str) -> str | None:
    """The row `row` is measured against: the preset's where it is joined to one, else the default; None for
    those baselines themselves."""
    if row == "default" or row in PRESET_ROWS:
        return None
    first = row.split("+")[0]
    return first if first in PRESET_ROWS else "default"


def overrides_of(row: str) -> list[str]:
    return [o for part in row.split("+") for o in ROWS[part]]


def figures(run_dir: Path) -> dict[str, float | str | bool]:
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    pretrain, evaluate = stages["pretrain"]["outputs"], stages["evaluate"]["outputs"]
    return {
        **{k: evaluate[k] for k in LOSSES},
        "tokens_per_s": pretrain["tokens_per_s"],
        "wall_s": pretrain["wall_s"],
        "num_params": pretrain["num_params"],
        "precision": pretrain["precision"],
        # A `--tasks` run takes its pretraining from the store only where the row already ran under this --work:
        # the record says which, since its tokens/s then dates from that run.
        "pretraining_reused": stages["pretrain"].get("reused") is not None,
        **{k: evaluate[k] for k in TASK_FIGURES if k in evaluate},
    }


def load(results: Path) -> list[dict]:
    if not results.exists():
        return []
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def table(results: list[dict]) -> str:
    """The markdown table of `results`: per row, mean and per-seed losses (and task scores where the runs have
    them), wins against its baseline."""
    by_row: dict[str, dict[int, dict]] = {}
    for r in results:
        by_row.setdefault(r["row"], {})[r["seed"]] = r
    keys = [*LOSSES, *(k for k in TASK_FIGURES if all(k in r for r in results))] if results else list(LOSSES)
    lines = [
        f"| row | seeds | {' | '.join(f'{k} mean (per seed)' for k in keys)} | wins vs baseline "
        f"{'; '.join(keys)} (per-seed difference) | tokens/s | params |",
        "|---|---|" + "---|" * len(keys) + "---|---:|---:|",
    ]
    for row, seeds in by_row.items():
        cells = []
        for key in keys:
            values = [seeds[s][key] for s in sorted(seeds)]
            cells.append(f"{statistics.mean(values):.3f} ({', '.join(f'{v:.3f}' for v in values)})")
        baseline = baseline_of(row)
        base = by_row.get(baseline, {}) if baseline else {}
        shared = sorted(s for s in seeds if s in base)
        parts = []
        for key in keys if shared else ():
            diffs = [seeds[s][key] - base[s][key] for s in shared]
            better = -1 if key in LOSSES else 1  # a loss wins lower, a task score higher
            wins = sum(d * better > 0 for d in diffs)
            parts.append(f"{wins}/{len(diffs)} ({', '.join(f'{d:+.3f}' for d in diffs)})")
        speed = statistics.median(seeds[s]["tokens_per_s"] for s in seeds)
        params = seeds[next(iter(seeds))]["num_params"]
        lines.append(
            f"| {row} | {','.join(map(str, sorted(seeds)))} | {' | '.join(cells)} | {'; '.join(parts)} | "
            f"{speed:,.0f} | {params:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "bench-out" / "switches")
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument(
        "--tasks", action="store_true", help="keep pipeline.toml's fine-tuning tasks: topic accuracy, retrieval nDCG@10"
    )
    parser.add_argument("--table", action="store_true", help="print the table of the results so far, run nothing")
    args = parser.parse_args()
    work = args.work.resolve()
    results_path = work / "results.jsonl"
    if args.table:
        asked = (args.tokens, args.tasks)
        print(table([r for r in load(results_path) if (r["tokens"], r.get("tasks", False)) == asked]))
        return
    rows = args.rows.split(",")
    unknown = [part for row in rows for part in row.split("+") if part not in ROWS]
    if unknown:
        parser.error(f"--rows: {unknown[0]!r} is not one of {', '.join(ROWS)} (or several joined by +)")
    common = [
        f"run.root={json.dumps(str(work / 'runs'))}",
        "pretrain.budget.hours=0",
        f"pretrain.budget.tokens={args.tokens}",
        *evaluate_overrides(args.tasks),
    ]
    done = {r["name"] for r in load(results_path)}
    for seed in map(int, args.seeds.split(",")):
        for row in rows:
            name = f"{row.replace('+', '_')}-{args.tokens}t-s{seed}" + ("-tasks" if args.tasks else "")
            if name in done:
                continue
            run(name, [*common, f"run.seed={seed}", *overrides_of(row)])
            record = {"name": name, "row": row, "seed": seed, "tokens": args.tokens, "tasks": args.tasks}
            record.update(figures(work / "runs" / name))
            with open(results_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            print(f"= {json.dumps(record)}", flush=True)


if __name__ == "__main__":
    main()
