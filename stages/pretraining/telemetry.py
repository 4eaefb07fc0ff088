"""What pretraining reports while it runs: interval metrics, `metrics.jsonl`, the progress bar, MFU
and peak memory. Nothing here decides anything about training."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cram.stages.shared.collectives import mean_over_ranks
from cram.stages.shared.files import write_atomic

if TYPE_CHECKING:
    import torch

    from cram.stages.pretraining.state import TrainState

# The fields of the per-step console line (metrics.jsonl keeps every field of a record).
LOGGED = ("step", "loss", "accuracy", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_gb", "data_wait")


class MetricsLog:
    """`metrics.jsonl`: one JSON record per log step. `write` is the one place a record goes out."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def truncate(self, step: int) -> None:
        """Drop the lines a killed run wrote after its last checkpoint (all of them on a fresh start)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except json.JSONDecodeError:  # the half-written last line of a killed run
                pass
        write_atomic(self.path, "".join(line + "\n" for line in kept))


class Interval:
    """The per-step metrics since the last log line, kept on the device until they are needed."""

    def __init__(self, state: TrainState, wait_s: float, rows: list[list[float]] = ()):
        self.restart(state, wait_s, rows)

    def restart(self, state: TrainState, wait_s: float, rows: list[list[float]] = ()) -> None:
        """Start over after the step `state` is at; `rows`: the fetched rows of the steps up to it, which
        the interval then begins with (those a checkpoint kept unlogged)."""
        self.rows = list(rows)  # [loss, accuracy, grad_norm] per step, fetched
        self.pending: list = []  # the same, still on the device
        self.first_step = state.step + 1 - len(self.rows)
        self.tokens, self.flops = state.tokens_seen, state.flops_seen
        self.optimizer_flops = state.optimizer_flops_seen
        self.started = time.perf_counter()
        self.wait_s = wait_s

    def add(self, row) -> None:
        self.pending.append(row)

    def first_bad_step(self) -> int | None:
        for i, row in enumerate(self.fetch()):
            if not all(math.isfinite(v) for v in row):
                return self.first_step + i
        return None

    def close(self, state: TrainState, wait_s: float, world_size: int, device: torch.device) -> dict[str, float]:
        """Loss and accuracy averaged over the interval (and the ranks), the last gradient norm, tokens/s,
        model FLOPs per token (each phase's, weighted by its tokens), hardware FLOPs per token (the model's
        and the optimizer's matmuls) and the fraction of the time spent waiting for data."""
        rows = self.fetch()
        loss = sum(r[0] for r in rows) / len(rows)
        accuracy = sum(r[1] for r in rows) / len(rows)
        if world_size > 1:  # every rank reaches each log step, so a collective is safe here
            loss, accuracy = mean_over_ranks([loss, accuracy], world_size, device)
        seconds = time.perf_counter() - self.started
        tokens = state.tokens_seen - self.tokens
        ran = hardware_flops(state, self.flops, self.optimizer_flops)
        return {
            "loss": loss,
            "accuracy": accuracy,
            "grad_norm": rows[-1][2],
            "tokens_per_s": tokens / seconds,
            "flops_per_token": (state.flops_seen - self.flops) / tokens if tokens else 0.0,
            "hardware_flops_per_token": ran / tokens if tokens else 0.0,
            "data_wait": (wait_s - self.wait_s) / seconds,
        }

    def fetch(self) -> list[list[float]]:
        import torch

        if self.pending:
            self.rows += torch.stack(self.pending).tolist()
            self.pending = []
        return self.rows


class ProgressBar:
    """A progress bar against the budget with ETA, for people: rank 0, in a terminal only."""

    def __init__(self, enabled: bool):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

        console = Console(stderr=True)
        self.bar = Progress(
            TextColumn("pretrain"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            disable=not (enabled and console.is_terminal),
        )
        self.task = self.bar.add_task("pretrain", total=1.0, info="")

    def __enter__(self) -> ProgressBar:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def update(self, r: dict) -> None:
        p, elapsed = r["progress"], r["elapsed_s"]
        eta = elapsed * (1 - p) / p if p > 0 else float("nan")
        mfu = "" if r["mfu"] is None else f"  mfu {100 * r['mfu']:.1f}%"
        info = (
            f"step {r['step']}  loss {r['loss']:.3f}  {r['tokens_per_s']:,.0f} tok/s{mfu}  "
            f"ETA {duration(max(eta, 0.0))}"
        )
        self.bar.update(self.task, completed=min(p, 1.0), info=info)


def duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "?"
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}"


def short(value: object) -> object:
    """Four significant digits: what a person reads in a log line (metrics.jsonl keeps them all)."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def hardware_flops(state: TrainState, flops_before: float = 0.0, optimizer_flops_before: float = 0.0) -> float:
    """The FLOPs that ran since the counts `*_before`: the model's (MFU's) and the optimizer's matmuls (HFU's)."""
    return state.flops_seen - flops_before + state.optimizer_flops_seen - optimizer_flops_before


def peak_memory_gb(device: torch.device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


# The best peak FLOP/s this process has seen per (device, dtype): measured at start-up, and again (and
# raised to the rate a step reached) whenever a step ran faster than it, so that MFU stays a fraction.
_PEAKS: dict[tuple[str, Any], float] = {}


def peak_flops(device, dtype=None) -> float:
    """The device's peak FLOP/s in `dtype` (autocast's, None: fp32), the best known to this process; on a
    CPU the first is measured, which takes seconds, so once per process (before the budget clock)."""
    from cram.model import peak_flops as measure

    key = (str(device), dtype)
    if key not in _PEAKS:
        _PEAKS[key] = measure(device, dtype)
    return _PEAKS[key]


def mfu(flops_per_token: float, tokens_per_s: float, device, world_size: int, dtype=None) -> float:
    """Model FLOPs utilisation (PaLM's convention): against the bf16 dense peak on a GPU, a matmul
    measured in the step's precision on a CPU. The step log's and the stage's figure alike are against
    the best peak seen: a CPU matmul measured once under a passing load can be slower than the step
    itself (`mfu=1.242` logged beside a stage figure of 0.43), and a rate above the peak measures it
    again, now, under the step's own conditions; the peak is then at least the rate the step reached."""
    reached = flops_per_token * tokens_per_s / world_size
    peak = peak_flops(device, dtype)
    if reached > peak:
        from cram.model import peak_flops as measure

        peak = _PEAKS[(str(device), dtype)] = max(peak, measure(device, dtype), reached)
    return round(reached / peak, 5)
