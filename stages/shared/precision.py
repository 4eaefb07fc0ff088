"""The precision a torch stage computes in, chosen so that its compiled steps are right on this machine.

`precision = "auto"` is the fastest candidate whose compiled steps agree with the same steps run eagerly
(the canary): bf16 autocast where the device multiplies bf16 natively, then bf16 with inductor's CPU
code generated for 256-bit vectors, then fp32. The middle one exists because inductor's 512-bit CPU
vector code miscompiles the backward of some bf16 encoder layouts on some CPUs (NaN gradients on an AMX
Xeon, torch 2.13; bench/README.md, "bf16 on AMX"), while the same graph built for 256-bit vectors is
right. A stage whose steps are several graphs (evaluate: a fine-tune step and a prediction per head shape and
length, the held-out masked LM per length) checks each; the reason names the graph that failed. A candidate
whose compile or canary raises (an inductor C++ failure) has failed as one that differs has, its error kept
in the reason; the ranks of a torchrun job decide together. An explicit "bf16"
keeps bf16 (with that code-generation fallback) and fails rather than train in fp32; an explicit "fp32"
is fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from cram.stages import StageError
from cram.stages.shared import device as devices

if TYPE_CHECKING:
    import torch

    from cram.stages.protocols import Log

TORCH_VECTOR_OPTION = "cpp.simdlen"  # inductor's config key for the CPU vector width, in bits


# A canary is a check before the run, a few steps each way: more than this is a typo (1000000), which
# would run compiled and eager steps until killed, not a stricter check.
MAX_CANARY_STEPS = 100


def check_canary(steps: int, tolerance: float) -> None:
    """A stage config's `canary_steps` and `canary_tolerance`; ValueError naming the bad one."""
    if not 0 <= steps <= MAX_CANARY_STEPS:
        raise ValueError(f"canary_steps: {steps} must be between 0 (off) and {MAX_CANARY_STEPS}")
    if not tolerance > 0:
        raise ValueError(f"canary_tolerance: {tolerance} must be > 0")


class CanaryError(RuntimeError):
    """The compiled steps disagree with the same steps run eagerly, in every precision allowed."""


class GraphError(RuntimeError):
    """One compiled graph of a stage's canary raised while compiling or running: the message names the
    graph, then the error (`graph_named`)."""


@contextmanager
def graph_named(graph: str) -> Iterator[None]:
    """Inside, an error other than bad input (StageError) is raised again as a GraphError naming `graph`."""
    try:
        yield
    except StageError:
        raise
    except Exception as e:
        raise GraphError(f"{graph}: {_one_line(e)}") from e


@dataclass(frozen=True)
class Difference:
    """A canary's largest relative difference, and the graph it was found in ("": the stage's one step)."""

    value: float
    graph: str = ""

    def worse(self, other: Difference) -> Difference:
        """The larger of the two (a NaN is the larger)."""
        return self if math.isnan(self.value) or other.value <= self.value else other

    def where(self) -> str:
        return f" ({self.graph})" if self.graph else ""


class NamedGraph(Protocol):
    """A compiled graph a canary checks, by the name its reason gives."""

    @property
    def name(self) -> str: ...


G = TypeVar("G", bound=NamedGraph)


def worst_graph(graphs: Iterable[G], difference: Callable[[G], float], tolerance: float) -> Difference:
    """The largest `difference(graph)` over `graphs` in turn (each a compiled graph's relative difference from
    eager), stopping at the first past `tolerance`; a graph that raises, raised again naming it."""
    worst = Difference(0.0)
    for graph in graphs:
        with graph_named(graph.name):
            worst = worst.worse(Difference(difference(graph), graph.name))
        if not worst.value <= tolerance:
            break
    return worst


@dataclass(frozen=True)
class Precision:
    """What the forward autocasts to, and the vector width inductor generates CPU code for."""

    name: str  # "bf16" (autocast, fp32 master weights) or "fp32"
    vector_bits: int | None = None  # None: inductor's own choice, the widest this CPU has

    @property
    def label(self) -> str:
        return self.name if self.vector_bits is None else f"{self.name} with {self.vector_bits}-bit vector code"

    def autocast(self) -> torch.dtype | None:
        """The autocast dtype (`torch.bfloat16`), or None for fp32."""
        import torch

        return torch.bfloat16 if self.name == "bf16" else None

    def compile_options(self) -> dict[str, int] | None:
        """The inductor options that build this precision's graphs (for cram's graphs alone)."""
        return None if self.vector_bits is None else {TORCH_VECTOR_OPTION: self.vector_bits}


BF16, BF16_256, FP32 = Precision("bf16"), Precision("bf16", 256), Precision("fp32")


@dataclass(frozen=True)
class Choice:
    """The precision a stage computes in, and why (a figure of the stage, shown by `cram inspect`)."""

    precision: Precision
    reason: str
    canary_diff: float | None  # the chosen precision's canary difference; None: no canary ran


def candidates(precision: str, device: torch.device, backend: str, compiled: bool) -> list[Precision]:
    """The precisions to try, fastest first, for the `precision` setting on `device`."""
    if devices.autocast_dtype(precision, device) is None:
        return [FP32]
    tried = [BF16]
    if compiled and device.type == "cpu" and backend == "inductor":
        tried.append(BF16_256)
    if precision == "auto":
        tried.append(FP32)
    return tried


def unchecked(precision: str, device: torch.device, why: str) -> Choice:
    """The first candidate, taken without a canary (eager steps, the canary off, nothing to train)."""
    first = candidates(precision, device, "", compiled=False)[0]
    return Choice(first, f"{_setting(precision, device)}; {why}", None)


@dataclass(frozen=True)
class Canary:
    """How a stage checks a candidate precision. `check(candidate)`: its compiled steps' largest relative
    difference from the same steps run eagerly (it compiles them first), a Difference where it names the
    graph; `keys`: the config section whose
    settings the messages name ("evaluate" for the baseline stage too, which runs on evaluate's settings);
    `world_size`: the torchrun ranks, which decide together."""

    check: Callable[[Precision], float | Difference]
    tolerance: float
    keys: str
    world_size: int = 1


def choose(precision: str, device: torch.device, backend: str, canary: Canary, log: Log, stage: str) -> Choice:
    """The first candidate whose canary difference is within the tolerance on every rank. A candidate
    whose compile or canary raises (an inductor C++ failure, say) is a failed candidate too, its error
    kept in the reason. A fallback is one warning naming what failed and what was chosen; when every
    candidate fails, `CanaryError` names each failure and the settings to change."""
    failed: list[tuple[Precision, Difference, str | None]] = []
    for candidate in candidates(precision, device, backend, compiled=True):
        diff, error = _tried(canary, candidate, log)
        if error is None and diff.value <= canary.tolerance:
            reason = f"{_setting(precision, device)}; compile canary {diff.value:.3g}"
            if failed:
                reason = f"{_failures(failed, canary.tolerance)}; {candidate.label} passed it ({diff.value:.3g})"
                log.warning(f"{stage}: {reason}: computing in {candidate.label}")
            return Choice(candidate, reason, diff.value)
        failed.append((candidate, diff, error))
    differ = [(p, diff) for p, diff, error in failed if error is None]
    found = []
    if differ:
        found.append(
            f"the compiled step ({backend}) differs from eager by "
            + ", by ".join(f"{diff.value:.3g} in {p.label}{diff.where()}" for p, diff in differ)
            + f" (relative), above canary_tolerance {canary.tolerance}"
        )
    raise CanaryError(
        f"{stage}: compile canary: {'; '.join(found + _raised(failed))}; nothing was trained. "
        + _remedies(precision, canary.keys)
    )


def _tried(canary: Canary, candidate: Precision, log: Log) -> tuple[Difference, str | None]:
    """(the candidate's canary difference, the error its compile or canary raised or None), agreed by
    every rank: the worst difference, the first error. Bad input (StageError) is no candidate's failure."""
    from cram.stages.shared.collectives import all_gather

    try:
        found, error = canary.check(candidate), None
    except StageError:
        raise
    except Exception as e:  # a compiler's own error types: any is this candidate's failure
        log.info("canary failed", precision=candidate.label, exc_info=True)
        found, error = math.inf, _one_line(e)
    diff = found if isinstance(found, Difference) else Difference(found)
    shared = all_gather((diff, error), canary.world_size)
    errors = [error for _, error in shared if error is not None]
    worst = shared[0][0]
    for other, _ in shared[1:]:
        worst = worst.worse(other)
    return worst, (errors[0] if errors else None)


def _one_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    if isinstance(error, GraphError):  # it names its graph and the error already
        text = lines[0] if lines else type(error).__name__
    else:
        text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _setting(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return f"{precision}, as set"
    if device.type == "cuda":
        return "auto: bf16 on CUDA"
    if devices.native_cpu_bf16():
        return "auto: bf16, which this CPU multiplies natively"
    return "auto: fp32, since this CPU has no native bf16"


def _failures(failed: list[tuple[Precision, Difference, str | None]], tolerance: float) -> str:
    differ = ", ".join(f"{p.label} by {diff.value:.3g}{diff.where()}" for p, diff, error in failed if error is None)
    found = [f"the compiled step differs from eager beyond canary_tolerance {tolerance} in {differ}"] if differ else []
    return "; ".join(found + _raised(failed))


def _raised(failed: list[tuple[Precision, Difference, str | None]]) -> list[str]:
    return [f"{p.label} failed to compile or run ({error})" for p, _, error in failed if error is not None]


def _remedies(precision: str, keys: str) -> str:
    choices = f'{keys}.precision = "auto" (which falls back to fp32) or "fp32", ' if precision == "bf16" else ""
    return f"Try {choices}another {keys}.backend, {keys}.compile = false, or {keys}.canary_steps = 0 to train anyway"


def stepped_difference(
    steps: tuple[Callable, Callable], start: dict, batch: dict, lr: torch.Tensor, count: int
) -> torch.Tensor:
    """A compiled step and its eager twin (`steps`), each run `count` times from the same `start` params and a
    fresh AdamW state on `batch`: [count * 2] relative differences of their loss and gradient norm. The
    canaries' common part (the fine-tuner's, the contrastive fine-tune's)."""
    import torch

    from cram import model

    states = [(start, model.optimizer_init(model.AdamW(), start)) for _ in steps]
    diffs = []
    for _ in range(count):
        readings = []
        for k, step in enumerate(steps):
            params, opt_state, metrics = step(*states[k], batch, lr)
            states[k] = params, opt_state
            readings.append(torch.stack([metrics["loss"], metrics["grad_norm"]]))
        diffs.append((readings[0] - readings[1]).abs() / readings[1].abs().clamp(min=1e-6))
    return torch.cat(diffs)
