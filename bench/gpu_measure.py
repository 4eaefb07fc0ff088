"""What every row of `bench/gpu_profile.py` measures with: the shapes it runs at (full on a GPU, the small
rehearsal on a CPU), the batches, and a step's timing (the compile, synced and back to back, peak memory)."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

MASK_RATE = 0.25  # cramming: round(0.25 * seq) masked tokens per sequence
WARMUP = 3


@dataclass(frozen=True)
class Shapes:
    """The sizes every row runs at: the base model and its batches, the pipeline's tiny step, the peak matmul."""

    base: dict = field(default_factory=dict)  # ModelConfig fields over model.PRESETS["base"]
    batch: int = 256
    big_batches: tuple[int, ...] = (1024, 512)
    tiny_batch: int = 32
    matmul: int = 8192


SHAPES = {
    "full": Shapes(),
    "rehearsal": Shapes(
        base=dict(vocab_size=1024, hidden=64, layers=2, heads=2, intermediate=256, max_seq_len=32),
        batch=4,
        big_batches=(16, 8),
        tiny_batch=2,
        matmul=256,
    ),
}


def base_config(args: argparse.Namespace):
    import dataclasses

    from cram import model

    return dataclasses.replace(model.PRESETS["base"], **SHAPES[args.shapes].base)


def make_batch(cfg, batch: int, device, seed: int, documents: bool = False) -> dict:
    import step as step_bench  # bench/step.py: random tokens, round(0.25 * seq) masked per sequence

    return step_bench.make_batch(cfg, batch, device, seed, documents)


def autocast(args: argparse.Namespace):
    import torch

    return torch.bfloat16 if args.dtype == "bf16" else None


def sheet_peak(device) -> float | None:
    import torch

    from cram.model.flops import data_sheet_peak

    return data_sheet_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def timing(step, batches: list, device, steps: int) -> dict:
    """The first call (the compile), then the step synced each time (median) and back to back (mean)."""
    import torch

    first = timed(step, batches[0], device)
    for i in range(WARMUP):
        step(batches[i % len(batches)])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synced = statistics.median(timed(step, batches[i % len(batches)], device) for i in range(steps))
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        loss = step(batches[i % len(batches)])
    loss.item()
    back_to_back = (time.perf_counter() - start) / steps
    return {
        "step_ms": 1e3 * synced,
        "step_ms_back_to_back": 1e3 * back_to_back,
        "compile_s": max(first - synced, 0.0),
        "peak_mem_mb": peak_memory(device) / 2**20,
    }


def timed(step, batch, device) -> float:
    start = time.perf_counter()
    step(batch).item()
    return time.perf_counter() - start


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device) -> float:
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
