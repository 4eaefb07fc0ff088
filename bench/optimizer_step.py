"""The default pipeline's compiled training step under each optimizer and batch, timed in turn.

    python bench/optimizer_step.py [--arms adamw@16,muon@16,muon@32,adamw@32] [--rounds 30] [--dtype bf16]

An arm is `KIND@BATCH`: `OptimizerConfig.kind` and sequences a step. Every arm is the default pipeline's
model (the tiny preset at vocab 8,192, 128-token blocks, attention within documents, bf16 autocast where
`--dtype bf16`), compiled with inductor, on bench/step.py's random batches (25% masked). After each arm's compile and
warm-up, the rounds run one step of each arm in turn (A, B, C, A, B, C ...), so load from other work hits
every arm alike. Printed per arm: the median step time, tokens/s and its ratio to the first arm's.

Muon's Newton-Schulz costs a step the same whatever the batch, so its share of the step falls as the
tokens per step grow: the arms say at which batch it fits a given fraction of the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from cram import model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import cram_row, make_batch  # noqa: E402  (bench/step.py, beside this file)

VOCAB = 8192  # the default pipeline's tokenizer


@dataclasses.dataclass(frozen=True)
class Arm:
    kind: str
    batch: int

    @classmethod
    def parse(cls, text: str) -> Arm:
        kind, _, batch = text.partition("@")
        if kind not in model.OPTIMIZERS or not batch.isdigit() or int(batch) < 1:
            raise ValueError(f"--arms: {text!r} is not KIND@BATCH with KIND one of {', '.join(model.OPTIMIZERS)}")
        return cls(kind, int(batch))

    def __str__(self) -> str:
        return f"{self.kind}@{self.batch}"


def build(arm: Arm, cfg: model.ModelConfig, autocast: torch.dtype | None):
    """step(batch) -> loss: the arm's compiled train step (bench/step.py's cram row) over a state of its own."""
    make_step, _ = cram_row(cfg, torch.device("cpu"), autocast, "inductor", compiled=True, optimizer=arm.kind)
    return make_step(), [make_batch(cfg, arm.batch, "cpu", seed, documents=True) for seed in range(4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="adamw@16,muon@16,muon@32,adamw@32")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    try:
        arms = [Arm.parse(text) for text in args.arms.split(",")]
    except ValueError as e:
        parser.error(str(e))
    cfg = dataclasses.replace(model.PRESETS["tiny"], vocab_size=VOCAB)
    autocast = torch.bfloat16 if args.dtype == "bf16" else None
    built = {arm: build(arm, cfg, autocast) for arm in arms}
    for step, batches in built.values():
        for i in range(args.warmup + 1):  # + 1: the compiling call
            step(batches[i % len(batches)]).item()
    times: dict[Arm, list[float]] = {arm: [] for arm in arms}
    for i in range(args.rounds):
        for arm, (step, batches) in built.items():
            start = time.perf_counter()
            step(batches[i % len(batches)]).item()
            times[arm].append(time.perf_counter() - start)
    first = None
    print(f"| arm ({args.dtype}, {args.rounds} rounds in turn) | step ms | tokens/s | vs {arms[0]} |")
    print("|---|---:|---:|---:|")
    for arm in arms:
        seconds = statistics.median(times[arm])
        tokens_per_s = arm.batch * cfg.max_seq_len / seconds
        first = first or tokens_per_s
        print(f"| {arm} | {1e3 * seconds:.1f} | {tokens_per_s:,.0f} | {tokens_per_s / first:.3f}x |")


if __name__ == "__main__":
    main()
