"""Eager dropout on this CPU: cram's (`model/bert.py` `dropout` at a number: 16 random bits an element, read
from the generator's 64-bit words) against `F.dropout` (a bernoulli draw an element), forward alone and forward
with backward, on the attention probabilities of a MiniLM batch of 32 documents of 233 tokens
([32, 12, 233, 233]), in bf16 and fp32, interleaved round by round.

    python bench/dropout.py [--rounds 5] [--shape 32,12,233,233] [--rate 0.1]

Prints each row's median milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from cram.model import bert


def timed(run) -> float:
    began = time.perf_counter()
    run()
    return (time.perf_counter() - began) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", default="32,12,233,233")
    parser.add_argument("--rate", type=float, default=0.1)
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.shape.split(","))
    ways = {"cram": lambda x: bert.dropout(x, args.rate), "F.dropout": lambda x: F.dropout(x, args.rate)}
    rows: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            upstream = torch.randn(shape, dtype=dtype)
            for name, drop in ways.items():
                label = f"{name}, {str(dtype).removeprefix('torch.')}"
                rows.setdefault(f"{label}, forward", []).append(timed(lambda: drop(x)))
                both = timed(lambda: torch.autograd.grad(drop(x), x, upstream))
                rows.setdefault(f"{label}, forward + backward", []).append(both)
    print(f"{torch.__version__}, {torch.get_num_threads()} threads, shape {shape}, rate {args.rate}")
    print("| row | ms (median) |\n|---|---:|")
    for label, times in rows.items():
        print(f"| {label} | {statistics.median(times):.1f} |")


if __name__ == "__main__":
    main()
