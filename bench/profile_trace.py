"""What a torch.profiler trace (`export_chrome_trace`) of a few training steps says: where the device's time
went, by kernel and by category, and how much of the wall it sat idle.

On CUDA the device's work is the trace's kernels, copies and sets. On a CPU the host is the device: its work
is the operators that call no other operator (a matmul, an inductor C++ kernel with
`cpp.enable_kernel_profile`), so a CPU rehearsal reads the same tables from the same code.

Categories, by kernel name, first match wins: the optimizer's (lerp is AdamW's and Muon's moment update, the
vector norm the clipping's), inductor's GEMM templates (max-autotune), inductor's other kernels (the fused
elementwise, norm and reduction work: "elementwise"), attention (cuDNN, flash, memory-efficient), GEMMs
(cuBLAS, CUTLASS, oneDNN, aten's matmuls), copies, and the rest. Names are approximate where inductor fuses
across them (a clipping norm folded into a norm's backward kernel counts as elementwise): the optimizer's
share that decides is its update timed alone (`bench/gpu_profile.py`), the category a cross-check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("optimizer", r"lerp|adam|foreach|^(?!.*backward).*linalg_vector_norm"),
    ("gemm", r"^triton_tem_"),
    ("elementwise", r"^triton_|cpp_fused"),
    ("attention", r"flash|fmha|attention|attn|sdpa|scaled_dot_product"),
    (
        "gemm",
        r"gemm|cutlass|nvjet|xmma|wgmma|cublas|sm90_|sm80_|ampere_|mkl|dnnl|^aten::(mm|addmm|bmm|_addmm|baddbmm)$",
    ),
    ("copy", r"memcpy|memset|^aten::(copy_|clone|contiguous)$"),
)
CUDA_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATEGORIES = ("cpu_op", "user_annotation")
TOP = 10


@dataclass(frozen=True)
class Event:
    name: str
    start_us: float
    duration_us: float
    thread: object = 0

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


def category(name: str) -> str:
    return next((kind for kind, pattern in CATEGORIES if re.search(pattern, name, re.IGNORECASE)), "other")


def device_events(trace: dict, device: str) -> list[Event]:
    """The device's work in a chrome trace: CUDA's kernels, copies and sets; on a CPU the leaf operators."""
    cats = CUDA_CATEGORIES if device == "cuda" else CPU_CATEGORIES
    events = [
        Event(e["name"], float(e["ts"]), float(e["dur"]), e.get("tid", 0))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in cats and "dur" in e
    ]
    return events if device == "cuda" else leaves(events)


def leaves(events: list[Event]) -> list[Event]:
    """The events that contain no other event of their thread: sorted by start (the longer first at a tie),
    an event has a child exactly when the next one of its thread starts before it ends."""
    ordered = sorted(events, key=lambda e: (str(e.thread), e.start_us, -e.duration_us))
    kept = []
    for event, after in zip(ordered, [*ordered[1:], None]):
        if after is None or after.thread != event.thread or after.start_us >= event.end_us:
            kept.append(event)
    return kept


def busy_us(events: list[Event]) -> float:
    """The length of the union of the events' intervals: time the device was doing something."""
    total, reach = 0.0, float("-inf")
    for event in sorted(events, key=lambda e: e.start_us):
        if event.end_us > reach:
            total += event.end_us - max(event.start_us, reach)
            reach = event.end_us
    return total


def breakdown(events: list[Event], wall_s: float, steps: int) -> dict:
    """Per step: the top kernels, milliseconds by category and their share of the wall, the busy and idle
    fractions of the wall, and how much of it the categories account for."""
    wall_ms = 1e3 * wall_s / steps
    by_name: dict[str, list[float]] = {}
    for event in events:
        by_name.setdefault(event.name, []).append(event.duration_us)
    kernels = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    categories: dict[str, float] = {}
    for name, durations in kernels:
        categories[category(name)] = categories.get(category(name), 0.0) + sum(durations) / 1e3 / steps
    busy = busy_us(events) / 1e3 / steps
    return {
        "wall_ms": wall_ms,
        "top": [
            {
                "name": name[:160],
                "category": category(name),
                "ms": sum(d) / 1e3 / steps,
                "calls": len(d) / steps,
                "share": sum(d) / 1e3 / steps / wall_ms,
            }
            for name, d in kernels[:TOP]
        ],
        "categories_ms": categories,
        "categories_share": {kind: ms / wall_ms for kind, ms in categories.items()},
        "busy_fraction": busy / wall_ms,
        "idle_fraction": max(0.0, 1 - busy / wall_ms),
        "accounted_fraction": sum(categories.values()) / wall_ms,
        "kernels_per_step": len(events) / steps,
    }
