"""Training-step benchmark: cram compiled and eager against transformers' BertForMaskedLM.

    python bench/step.py --config tiny|small|base --device cpu|cuda [--batch N] [--steps N]

A step is forward, loss, backward, global-norm clipping at 0.5 and AdamW. Each row first runs in a
process of its own: "compile cold" is its first compile, "compile warm" the recompile after
`torch._dynamo.reset()` with the inductor cache filled (both: first call minus one step), and peak
memory is CUDA max allocated over a few steps, or on CPU the max RSS of that process (interpreter
and compiler included). Then one process builds every row (from the warm cache) and times them in
turn, one step of each per round, so a machine shared with other work slows every row alike: the
step time is the median over `--steps` rounds after `--warmup`, each step synced.

BERT gets the same layers, hidden, heads, vocab, seq and intermediate (a plain GELU MLP where cram
has a GELU-GLU over the same width), SDPA attention, dropout off, and predicts every token (it has
no sparse prediction). FLOPs per token, for MFU: 6 per non-embedding parameter + 12·layers·hidden·seq,
plus the decoder (and head transform) over the tokens that reach it: the masked fraction for cram,
all of them for BERT. Peak: bf16 data-sheet figure for known GPUs (H100/H200 989e12); on CPU a fp32
matmul measured at the start of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROWS = ("cram-compiled", "cram-eager", "bert-eager", "bert-compiled")
MASK_RATE = 0.25  # cramming: round(0.25 * seq) masked tokens per sequence
MEMORY_STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("tiny", "small", "base"), default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, help="sequences per step (default: 32 on cpu, 256 on cuda)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="autocast (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled rows")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--peak", type=float, help="peak FLOP/s for MFU (default: table or measured)")
    parser.add_argument("--child", choices=("compile", "time"), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    args.batch = args.batch or (256 if args.device == "cuda" else 32)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; allowed {','.join(ROWS)}")
    if args.child == "compile":
        print(json.dumps(compile_and_memory(args, rows[0])))
    elif args.child == "time":
        print(json.dumps(time_in_turn(args, rows)))
    else:
        import torch

        from cram import model

        args.peak = args.peak or model.peak_flops(args.device, torch.bfloat16 if args.dtype == "bf16" else None)
        print_table(args, run_rows(args, rows))


def run_rows(args: argparse.Namespace, rows: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="cram-bench-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        results = {row: child(args, env, "compile", row) for row in rows}
        ready = [row for row in rows if "skipped" not in results[row]]
        if ready:
            timing = child(args, env, "time", ",".join(ready))
            for row in ready:
                results[row] |= timing[row] if row in timing else {"skipped": timing["skipped"]}
    return list(results.values())


def child(args: argparse.Namespace, env: dict, mode: str, rows: str) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--rows", rows]
    for key in ("config", "device", "batch", "steps", "warmup", "dtype", "backend"):
        command += [f"--{key}", str(getattr(args, key))]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"row": rows, "skipped": f"failed (exit {done.returncode}): {last_line}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_and_memory(args: argparse.Namespace, row: str) -> dict:
    import torch

    device = torch.device(args.device)
    batches = make_batches(args, device)
    try:
        make_step, flops = build(args, row, device)
    except ImportError:
        return {"row": row, "skipped": "transformers not installed"}
    step = make_step()
    first = timed(step, batches[0], device)
    warm = None
    if row.endswith("compiled"):
        torch._dynamo.reset()
        step = make_step()
        warm = timed(step, batches[0], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s = statistics.median(timed(step, batches[i % len(batches)], device) for i in range(MEMORY_STEPS))
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(device)
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "row": row,
        "peak_mem_mb": peak_mem / 2**20,
        "compile_cold_s": None if warm is None else max(first - step_s, 0.0),
        "compile_warm_s": None if warm is None else max(warm - step_s, 0.0),
        "flops_per_token": flops,
    }


def time_in_turn(args: argparse.Namespace, rows: list[str]) -> dict:
    import torch

    device = torch.device(args.device)
    batches = make_batches(args, device)
    steps = {row: build(args, row, device)[0]() for row in rows}
    for row, step in steps.items():
        for i in range(args.warmup + 1):  # + 1: the compiling call
            step(batches[i % len(batches)])
    times = {row: [] for row in rows}
    for i in range(args.steps):
        for row, step in steps.items():
            times[row].append(timed(step, batches[i % len(batches)], device))
    tokens = args.batch * _cfg(args).max_seq_len
    medians = {row: statistics.median(t) for row, t in times.items()}
    return {row: {"step_ms": 1e3 * s, "tokens_per_s": tokens / s} for row, s in medians.items()}


def build(args: argparse.Namespace, row: str, device):
    import torch

    autocast = torch.bfloat16 if args.dtype == "bf16" else None
    make = bert_row if row.startswith("bert") else cram_row
    return make(_cfg(args), device, autocast, args.backend, compiled=row.endswith("compiled"))


def make_batches(args: argparse.Namespace, device) -> list[dict]:
    return [make_batch(_cfg(args), args.batch, device, seed) for seed in range(4)]


def _cfg(args: argparse.Namespace):
    from cram import model

    return model.PRESETS[args.config]


def make_batch(cfg, batch: int, device, seed: int) -> dict:
    """Random tokens with round(MASK_RATE * seq) masked positions per sequence, in both label layouts."""
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
    return {key: value.to(device) for key, value in out.items()}


def cram_row(cfg, device, autocast, backend: str, compiled: bool):
    import torch

    from cram import model

    params = {name: p.to(device) for name, p in model.init(cfg, seed=0).items()}
    state = {"params": params, "opt": model.adamw_init(params)}
    lr = torch.tensor(1e-3, device=device)

    def make_step():
        train_step = model.make_train_step(
            cfg, model.OptimizerConfig(), compile=compiled, backend=backend, autocast_dtype=autocast
        )

        def step(batch):
            sparse = {k: batch[k] for k in ("input_ids", "mlm_positions", "mlm_labels")}
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


def print_table(args: argparse.Namespace, results: list[dict]) -> None:
    import torch

    from cram import model

    cfg = model.PRESETS[args.config]
    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = "not installed"
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(
        f"config {args.config} (layers {cfg.layers}, hidden {cfg.hidden}, heads {cfg.heads}, "
        f"intermediate {cfg.intermediate}, vocab {cfg.vocab_size}, seq {cfg.max_seq_len}), batch {args.batch}, "
        f"{round(MASK_RATE * cfg.max_seq_len)} masked/seq, {args.dtype}, backend {args.backend}\n"
        f"device {device}, torch {torch.__version__}, transformers {hf}, peak {args.peak / 1e12:.3g} TFLOP/s\n"
    )
    print("| row | step ms | tokens/s | MFU % | peak mem MiB | compile cold s | compile warm s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "skipped" in r:
            print(f"| {r['row']} | {r['skipped']} | | | | | |")
            continue
        cold = "-" if r["compile_cold_s"] is None else f"{r['compile_cold_s']:.1f}"
        warm = "-" if r["compile_warm_s"] is None else f"{r['compile_warm_s']:.1f}"
        mfu = r["flops_per_token"] * r["tokens_per_s"] / args.peak
        print(
            f"| {r['row']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {100 * mfu:.1f} | "
            f"{r['peak_mem_mb']:,.0f} | {cold} | {warm} |"
        )


if __name__ == "__main__":
    main()
