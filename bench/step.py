"""Training-step benchmark: cram compiled and eager against transformers' BertForMaskedLM.

    python bench/step.py --config tiny|small|base --device cpu|cuda [--batch N] [--steps N] [--rows ...]

A step is forward, loss, backward, global-norm clipping at 0.5 and AdamW. Every row runs in a child
process of its own, with its own time limit (`--row-limit`) and its whole stderr in a log under `--out`,
and is printed (flushed) as soon as its child ends: a row that fails or hangs shows its reason and the last
40 lines of its log, and the rows after it still run. `--deadline` bounds the whole run: a row that would
start past it is skipped, with a line that says so. First a child measures the device's matmul peak.

In a row's child: "compile cold" is the first call minus one step (the inductor cache is empty for the
whole run), "compile warm" (`--compile-warm`, on by default on a CPU only) the recompile after
`torch._dynamo.reset()` with that cache filled; peak memory is CUDA max allocated over a few steps, or
on CPU the max RSS of that process (interpreter and compiler included); the step time is the median over
`--steps` steps after `--warmup`, each synced. With `--in-turn` (on by default on a CPU only), one more
child builds every row that worked and times them in turn, one step of each per round, so a machine
shared with other work slows every row alike: a second table.

Rows: `cram-*` is `model.make_train_step`; `-doc` rows attend within documents (a boolean [B, 1, S, S]
mask from `document_ids`, as the default pipeline does; on CUDA it rules out the flash kernel), `-written`
rows use the written-out attention (`[run] attention = "written"`) instead of SDPA. BERT gets the same
layers, hidden, heads, vocab, seq and intermediate (a plain GELU MLP where cram has a GELU-GLU over the
same width), SDPA attention, dropout off, and predicts every token (it has no sparse prediction).
FLOPs per token, for MFU: 6 per non-embedding parameter + 12·layers·hidden·seq, plus the decoder (and
head transform) over the tokens that reach it: the masked fraction for cram, all of them for BERT. MFU
is against the data-sheet bf16 peak of a known GPU (`model.flops.GPU_PEAK_BF16`: H200 SXM 989e12, NVL
835e12, ...; else the measured one, or `--peak`), and beside it against the matmul peak measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import children  # noqa: E402  (bench/children.py, beside this file)

ROWS = (
    "cram-compiled",
    "cram-eager",
    "cram-doc-compiled",
    "cram-doc-eager",
    "cram-written-compiled",
    "cram-doc-written-compiled",
    "bert-eager",
    "bert-compiled",
)
DEFAULT_ROWS = ("cram-compiled", "cram-eager", "cram-doc-compiled", "bert-eager", "bert-compiled")
MASK_RATE = 0.25  # cramming: round(0.25 * seq) masked tokens per sequence
DOCUMENT_START = 1 / 48  # chance that a token starts a document: about 3.7 documents per 128 tokens
MEMORY_STEPS = 3
MIN_START_S = 20.0  # a child is not started with less of the deadline left than this
PEAK_LIMIT_S = 120.0


def main() -> None:
    args = parse_args()
    rows = args.rows.split(",")
    if args.child is not None:
        children.dump_stacks_on_term()
        print(json.dumps(CHILDREN[args.child](args, rows)))
    else:
        children.stop_children_on_term()
        report(args, rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("tiny", "small", "base"), default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, help="sequences per step (default: 32 on cpu, 256 on cuda)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="autocast (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled rows")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {','.join(ROWS)}")
    parser.add_argument("--peak", type=float, help="peak FLOP/s for MFU (default: data sheet, else measured)")
    parser.add_argument("--out", help="folder for the children's logs (default: a new temporary folder)")
    parser.add_argument("--deadline", type=float, help="seconds for the whole run; later rows are skipped")
    parser.add_argument("--row-limit", type=float, default=300.0, help="seconds for each row's child")
    parser.add_argument("--compile-warm", action=argparse.BooleanOptionalAction, help="(default: on cpu only)")
    parser.add_argument("--in-turn", action=argparse.BooleanOptionalAction, help="(default: on cpu only)")
    parser.add_argument("--child", choices=("peak", "row", "time"), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    on_cpu = args.device == "cpu"
    args.batch = args.batch or (32 if on_cpu else 256)
    args.dtype = args.dtype or ("fp32" if on_cpu else "bf16")
    args.compile_warm = on_cpu if args.compile_warm is None else args.compile_warm
    args.in_turn = on_cpu if args.in_turn is None else args.in_turn
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; allowed {','.join(ROWS)}")
    return args


# ------------------------------------------------------------------------------------------ the parent


def report(args: argparse.Namespace, rows: list[str]) -> None:
    """Each row's child in turn, each row printed as its child ends; then, with `--in-turn`, the table of
    the rows timed in turn."""
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="cram-bench-"))
    deadline = children.Deadline(args.deadline)
    say(describe(args) + f"\nlogs: {out}")
    with tempfile.TemporaryDirectory(prefix="cram-bench-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        peaks = measure_peaks(args, env, out, deadline)
        say(TABLE_HEAD)
        results, skipped = {}, []
        for row in rows:
            if deadline.left() < MIN_START_S:
                skipped.append(row)
                continue
            outcome = children.run(
                command(args, "row", row), limit_s=deadline.limit(args.row_limit), log=out / f"{row}.log", env=env
            )
            results[row] = children.result(outcome, row)
            say(format_row(results[row], peaks, outcome))
        if skipped:
            say(f"\nskipped, past the overall deadline of {args.deadline:.0f} s: {', '.join(skipped)}")
        ready = [row for row, r in results.items() if "skipped" not in r]
        if args.in_turn and len(ready) > 1 and deadline.left() >= MIN_START_S:
            in_turn(args, env, out, deadline, ready, results, peaks)


def say(text: str) -> None:
    print(text, flush=True)


def describe(args: argparse.Namespace) -> str:
    cfg = _cfg(args)
    try:
        hf = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        hf = "not installed"
    return (
        f"config {args.config} (layers {cfg.layers}, hidden {cfg.hidden}, heads {cfg.heads}, "
        f"intermediate {cfg.intermediate}, vocab {cfg.vocab_size}, seq {cfg.max_seq_len}), batch {args.batch}, "
        f"{round(MASK_RATE * cfg.max_seq_len)} masked/seq, {args.dtype}, backend {args.backend}, "
        f"{args.steps} steps after {args.warmup}\ntorch {metadata.version('torch')}, transformers {hf}"
    )


def measure_peaks(args: argparse.Namespace, env: dict, out: Path, deadline: children.Deadline) -> dict:
    """{"sheet": FLOP/s for MFU, "matmul": measured FLOP/s or None}; the device and both peaks printed."""
    limit = deadline.limit(PEAK_LIMIT_S)
    outcome = children.run(command(args, "peak", ""), limit_s=limit, log=out / "peak.log", env=env)
    found = children.result(outcome, "peak")
    if "skipped" in found:
        say(f"peak: {found['skipped']}")
        found = {"device": "unknown", "sheet": None, "matmul": None}
    sheet = args.peak or found["sheet"] or found["matmul"]
    origin = "--peak" if args.peak else ("data sheet" if found["sheet"] else "measured")
    matmul = "-" if found["matmul"] is None else f"{found['matmul'] / 1e12:.3g} TFLOP/s"
    say(
        f"device {found['device']}; MFU against {'-' if sheet is None else f'{sheet / 1e12:.3g}'} TFLOP/s ({origin}); "
        f"matmul measured here ({args.dtype}): {matmul}\n"
    )
    return {"sheet": sheet, "matmul": found["matmul"]}


def command(args: argparse.Namespace, mode: str, rows: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--rows", rows or args.rows]
    for key in ("config", "device", "batch", "steps", "warmup", "dtype", "backend"):
        cmd += [f"--{key}", str(getattr(args, key))]
    return cmd + ["--compile-warm" if args.compile_warm else "--no-compile-warm"]


TABLE_HEAD = (
    "| row | step ms | tokens/s | MFU % | MFU % of matmul | peak mem MiB | compile cold s | compile warm s |\n"
    "|---|---|---|---|---|---|---|---|"
)


def format_row(r: dict, peaks: dict, outcome: children.Outcome | None = None) -> str:
    if "skipped" in r:
        line = f"| {r['row']} | {r['skipped']} | | | | | | |"
        if outcome is not None and not outcome.ok:
            line += f"\n\n```\n{outcome.tail()}\n```\n"
        return line
    cells = [f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}"]
    for peak in (peaks["sheet"], peaks["matmul"]):
        cells.append("-" if not peak else f"{100 * r['flops_per_token'] * r['tokens_per_s'] / peak:.1f}")
    cells.append("-" if r.get("peak_mem_mb") is None else f"{r['peak_mem_mb']:,.0f}")
    for key in ("compile_cold_s", "compile_warm_s"):
        cells.append("-" if r.get(key) is None else f"{r[key]:.1f}")
    return f"| {r['row']} | {' | '.join(cells)} |"


def in_turn(args, env: dict, out: Path, deadline: children.Deadline, ready: list[str], results, peaks) -> None:
    say("\ntimed in turn, one step of each row per round:\n" + TABLE_HEAD)
    limit = deadline.limit(args.row_limit)
    outcome = children.run(command(args, "time", ",".join(ready)), limit_s=limit, log=out / "in-turn.log", env=env)
    timing = children.result(outcome, "in turn")
    if "skipped" in timing:
        say(format_row(timing, peaks, outcome))
        return
    for row in ready:
        say(format_row({**results[row], **timing[row], "compile_cold_s": None, "compile_warm_s": None}, peaks))


# ------------------------------------------------------------------------------------------ the children


def peak_child(args: argparse.Namespace, rows: list[str]) -> dict:
    import torch

    from cram.model import flops

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return {
            "device": name,
            "sheet": flops.data_sheet_peak(name),
            "matmul": flops.measure_matmul_flops(device, dtype, size=8192),
        }
    name = f"cpu ({torch.get_num_threads()} threads)"
    return {"device": name, "sheet": None, "matmul": flops.measure_matmul_flops(device, dtype)}


def row_child(args: argparse.Namespace, rows: list[str]) -> dict:
    """One row: compile (cold, and warm with `--compile-warm`), peak memory, then its own timing."""
    import torch

    row = rows[0]
    device = torch.device(args.device)
    batches = make_batches(args, device, documents="-doc" in row)
    try:
        make_step, flops = build(args, row, device)
    except ImportError:
        return {"row": row, "skipped": "transformers not installed"}
    compiled = row.endswith("compiled")
    step = make_step()
    first = timed(step, batches[0], device)
    warm = None
    if compiled and args.compile_warm:
        torch._dynamo.reset()
        step = make_step()
        warm = timed(step, batches[0], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(MEMORY_STEPS):
        timed(step, batches[i % len(batches)], device)
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(device)
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for i in range(args.warmup):
        step(batches[i % len(batches)])
    step_s = statistics.median(timed(step, batches[i % len(batches)], device) for i in range(args.steps))
    tokens = args.batch * _cfg(args).max_seq_len
    return {
        "row": row,
        "step_ms": 1e3 * step_s,
        "tokens_per_s": tokens / step_s,
        "peak_mem_mb": peak_mem / 2**20,
        "compile_cold_s": max(first - step_s, 0.0) if compiled else None,
        "compile_warm_s": None if warm is None else max(warm - step_s, 0.0),
        "flops_per_token": flops,
    }


def time_in_turn(args: argparse.Namespace, rows: list[str]) -> dict:
    import torch

    device = torch.device(args.device)
    batches = {row: make_batches(args, device, documents="-doc" in row) for row in rows}
    steps = {row: build(args, row, device)[0]() for row in rows}
    for row, step in steps.items():
        for i in range(args.warmup + 1):  # + 1: the compiling call
            step(batches[row][i % len(batches[row])])
    times = {row: [] for row in rows}
    for i in range(args.steps):
        for row, step in steps.items():
            times[row].append(timed(step, batches[row][i % len(batches[row])], device))
    tokens = args.batch * _cfg(args).max_seq_len
    medians = {row: statistics.median(t) for row, t in times.items()}
    return {row: {"step_ms": 1e3 * s, "tokens_per_s": tokens / s} for row, s in medians.items()}


CHILDREN = {"peak": peak_child, "row": row_child, "time": time_in_turn}


def build(args: argparse.Namespace, row: str, device):
    import torch

    autocast = torch.bfloat16 if args.dtype == "bf16" else None
    if row.startswith("bert"):
        return bert_row(_cfg(args), device, autocast, args.backend, compiled=row.endswith("compiled"))
    attention = "written" if "-written" in row else "auto"
    return cram_row(_cfg(args), device, autocast, args.backend, row.endswith("compiled"), attention)


def make_batches(args: argparse.Namespace, device, documents: bool = False) -> list[dict]:
    return [make_batch(_cfg(args), args.batch, device, seed, documents) for seed in range(4)]


def _cfg(args: argparse.Namespace):
    from cram import model

    return model.PRESETS[args.config]


def make_batch(cfg, batch: int, device, seed: int, documents: bool = False) -> dict:
    """Random tokens with round(MASK_RATE * seq) masked positions per sequence, in both label layouts;
    with `documents`, each token's document as the pipeline counts them (`document_ids`), each token
    starting a new one with chance DOCUMENT_START."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    S = cfg.max_seq_len
    per_seq = round(MASK_RATE * S)
    input_ids = torch.randint(5, cfg.vocab_size, (batch, S), generator=gen)
    chosen = torch.rand(batch, S, generator=gen).argsort(dim=1)[:, :per_seq]
    positions = (chosen + S * torch.arange(batch)[:, None]).flatten()
    labels = torch.randint(5, cfg.vocab_size, (positions.numel(),), generator=gen)
    dense_labels = torch.full((batch * S,), -100, dtype=torch.long)
    dense_labels[positions] = labels
    out = {
        "input_ids": input_ids,
        "mlm_positions": positions,
        "mlm_labels": labels,
        "labels": dense_labels.view(batch, S),
    }
    if documents:
        starts = torch.rand(batch, S, generator=gen) < DOCUMENT_START
        out["document_ids"] = starts.to(torch.int32).cumsum(dim=1, dtype=torch.int32)
    return {key: value.to(device) for key, value in out.items()}


def cram_row(cfg, device, autocast, backend: str, compiled: bool, attention: str = "auto", optimizer: str = "adamw"):
    import torch

    from cram import model

    params = {name: p.to(device) for name, p in model.init(cfg, seed=0).items()}
    state = {"params": params, "opt": model.optimizer_init(model.AdamW(), params)}
    lr = torch.tensor(1e-3, device=device)
    keys = ("input_ids", "mlm_positions", "mlm_labels", "document_ids")

    def make_step():
        train_step = model.make_train_step(
            cfg,
            model.optimizer_config(optimizer),
            model.Compilation(compile=compiled, backend=backend, autocast=autocast, attention=attention),
        )

        def step(batch):
            sparse = {k: batch[k] for k in keys if k in batch}
            state["params"], state["opt"], metrics = train_step(state["params"], state["opt"], sparse, lr)
            return metrics["loss"]

        return step

    return make_step, model.flops_per_token(cfg, MASK_RATE)


def bert_row(cfg, device, autocast, backend: str, compiled: bool):
    import contextlib

    import torch
    from transformers import BertConfig, BertForMaskedLM

    bert_cfg = BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        intermediate_size=cfg.intermediate,
        max_position_embeddings=cfg.max_seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    net = BertForMaskedLM(bert_cfg).to(device).train()
    decay = [p for p in net.parameters() if p.ndim >= 2]
    no_decay = [p for p in net.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.98),
        eps=1e-12,
        foreach=True,
    )

    def make_step():
        forward = torch.compile(net, backend=backend) if compiled else net

        def step(batch):
            context = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
            with context:
                loss = forward(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    H, V = cfg.hidden, cfg.vocab_size
    encoder = sum(p.numel() for p in net.bert.encoder.parameters())
    head = sum(p.numel() for p in net.cls.predictions.transform.parameters())
    flops = 6 * (encoder + head + H * V) + 12 * cfg.layers * H * cfg.max_seq_len
    return make_step, flops


def timed(step, batch, device) -> float:
    import torch

    start = time.perf_counter()
    loss = step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        loss.item()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
