"""The GPU step explained, in one command that keeps its deadline (issue 61; bench/README.md, "gpu profile").

    python bench/gpu_profile.py --out DIR [--seconds 540] [--rows floors,adamw,...] [--cache DIR]
    python bench/gpu_profile.py --device cpu --seconds 60      # the rehearsal: small shapes, same code

Rows, most telling first, each in a child process of its own with its own limit, printed (a JSON line, then a
line for people) and flushed as its child ends; a row that fails or hangs says why and the next one runs; a
row that would start past the deadline is skipped with a line that says so:

    floors         the environment; bf16 matmul peak, fp32 with TF32 off and on; the GEMM floor: every matrix
                   product of the base step (forward and backward, `model.step_gemms`) timed alone and summed,
                   the best MFU a step with no other work and no overhead could reach
    adamw          base preset, AdamW, batch 256 x 128: step time synced and back to back, MFU and hardware
                   FLOPs utilisation (HFU: Muon's Newton-Schulz counted), peak memory, cold compile; a
                   torch.profiler trace of 3 steps (top-10 kernels, time by category, device-idle fraction);
                   the optimizer's share: the update alone (`make_apply_step`) compiled and timed
    muon           the same with Muon (the default optimizer)
    tiny           the default pipeline's step: tiny preset, microbatch 32, document attention, Muon
    tiny-graphs    the same replayed as CUDA graphs (`Compilation.cuda_graphs`); CUDA only
    modernbert     transformers' ModernBertForMaskedLM, sparse prediction, compiled, the base shape and batch
    big            base at batch 1024 (512 where 1024 runs out of memory)

Named in --rows only (`LEVERS`): `bert` (transformers' BertForMaskedLM, bench/step.py's row) and the lever
rows, base with one `Compilation` setting changed (adamw-foreach, adamw-lean-logits, adamw-bf16-residual,
adamw-graphs, adamw-combo, adamw-autotune, muon-bf16-ns, muon-foreach), measured against `adamw` or `muon`.

Everything goes to --out: `rows.jsonl` (one result per row), `report.md` (what was printed), `traces/` (the
profiles, gzipped chrome traces: chrome://tracing or ui.perfetto.dev), `logs/` (each child's stderr), and the
inductor cache (`--cache`, default DIR/inductor-cache), which a rerun on the same machine reads warm.

`--device cpu` rehearses every row on small shapes (`--shapes rehearsal`, the default there): a 2-layer
model, small batches, small matmuls; what needs CUDA is skipped with its reason. A bare GPU machine needs no
install: without an installed `cram`, the repository's folders are linked into a temporary package.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata, util
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import children  # noqa: E402  (bench/children.py, beside this file)
import gpu_hf_rows  # noqa: E402
import profile_trace  # noqa: E402
from gpu_measure import (  # noqa: E402
    MASK_RATE,
    SHAPES,
    WARMUP,
    autocast,
    base_config,
    make_batch,
    sheet_peak,
    sync,
    timing,
)

REPO = Path(__file__).resolve().parents[1]
PROFILED_STEPS = 3


@dataclass(frozen=True)
class Row:
    """A row: what its child runs (`kind`), its own limit in seconds on a GPU, and the settings it changes."""

    kind: str
    limit_s: float
    optimizer: str = "adamw"
    profile: bool = False
    compilation: dict = field(default_factory=dict)  # Compilation fields over the row's default


ROWS: dict[str, Row] = {
    "floors": Row("floors", 60),
    "adamw": Row("cram", 180, profile=True),
    "muon": Row("cram", 160, optimizer="muon", profile=True),
    "tiny": Row("tiny", 60, optimizer="muon"),
    "tiny-graphs": Row("tiny", 75, optimizer="muon", compilation={"cuda_graphs": True}),
    "modernbert": Row("modernbert", 150),
    "big": Row("big", 150),
}
# Not in the default rows: BERT was measured in the first window (bench/RESULTS.md), and each lever row is
# base with one setting changed, what the decision rules (bench/README.md, "gpu profile") pick from.
LEVERS: dict[str, Row] = {
    "bert": Row("bert", 110),
    "adamw-foreach": Row("cram", 150, profile=True, compilation={"foreach_update": True}),
    "adamw-lean-logits": Row("cram", 150, compilation={"fp32_logits": False}),
    "adamw-bf16-residual": Row("cram", 150, profile=True, compilation={"autocast_residual": True}),
    "adamw-graphs": Row("cram", 150, compilation={"cuda_graphs": True}),
    "adamw-combo": Row("cram", 150, compilation={"combo_kernels": True}),
    "adamw-autotune": Row("cram", 300, compilation={"max_autotune": True}),
    "muon-bf16-ns": Row("cram", 160, optimizer="muon", profile=True, compilation={"bf16_newton_schulz": True}),
    "muon-foreach": Row("cram", 160, optimizer="muon", compilation={"foreach_update": True}),
}
ALL_ROWS = {**ROWS, **LEVERS}
CUDA_ONLY = {"cuda_graphs": "CUDA graphs replay on a CUDA device"}
MIN_START_S = {"cuda": 30.0, "cpu": 4.0}  # a row is not started with less of the deadline left


def main() -> None:
    args = parse_args()
    if args.child:
        children.dump_stacks_on_term()
        print(json.dumps(CHILDREN[ALL_ROWS[args.child].kind](args, args.child)), flush=True)
        return
    children.stop_children_on_term()
    run(args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seconds", type=float, default=540.0, help="the whole run's deadline (default 540)")
    parser.add_argument("--out", help="output folder (default bench-out/gpu-profile-<UTC time>)")
    parser.add_argument("--cache", help="inductor cache folder (default OUT/inductor-cache)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {','.join(ALL_ROWS)}")
    parser.add_argument("--shapes", choices=tuple(SHAPES), help="full (default on cuda) or rehearsal (on cpu)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="autocast (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--steps", type=int, help="timed steps of each row (default 20 on cuda, 3 on cpu)")
    parser.add_argument("--child", choices=tuple(ALL_ROWS), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    args.shapes = args.shapes or ("full" if args.device == "cuda" else "rehearsal")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.steps = args.steps or (20 if args.device == "cuda" else 3)
    unknown = [row for row in args.rows.split(",") if row not in ALL_ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; allowed {','.join(ALL_ROWS)}")
    return args


# ------------------------------------------------------------------------------------------ the parent


def run(args: argparse.Namespace) -> None:
    deadline = children.Deadline(args.seconds)
    out = Path(args.out or REPO / "bench-out" / time.strftime("gpu-profile-%Y%m%d-%H%M%S", time.gmtime()))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "traces").mkdir(exist_ok=True)
    cache = Path(args.cache) if args.cache else out / "inductor-cache"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache.resolve()), "PYTHONUNBUFFERED": "1"}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **importable(env)}
    report = open(out / "report.md", "a", encoding="utf-8")
    say = Say(report, out / "rows.jsonl")
    say.line(
        f"# bench/gpu_profile.py: device {args.device}, shapes {args.shapes}, {args.dtype}, backend {args.backend}, "
        f"{args.seconds:.0f} s in all, rows {args.rows}; commit {commit()}; out {out}; inductor cache {cache}"
    )
    for row in args.rows.split(","):
        left = deadline.left()
        if left < MIN_START_S[args.device]:
            say.row({"row": row, "skipped": f"{left:.0f} s left of the overall {args.seconds:.0f} s"})
            continue
        # the child's limit ends early enough for its SIGTERM, grace and SIGKILL to end inside the deadline
        limit = min(ALL_ROWS[row].limit_s, left - children.GRACE_S - 2)
        outcome = children.run(child_command(args, row, out), limit_s=limit, log=out / "logs" / f"{row}.log", env=env)
        say.row(children.result(outcome, row), outcome)
    say.line(f"# done: {args.seconds - deadline.left():.0f} s of {args.seconds:.0f}")


class Say:
    """Prints a line for people and appends it to report.md; a row also goes to rows.jsonl as JSON."""

    def __init__(self, report, rows_path: Path):
        self.report, self.rows_path = report, rows_path

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.report.write(text + "\n")
        self.report.flush()

    def row(self, result: dict, outcome: children.Outcome | None = None) -> None:
        with open(self.rows_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
        self.line(json.dumps(result))
        self.line(describe(result))
        if outcome is not None and not outcome.ok:
            self.line("```\n" + outcome.tail() + "\n```")


def importable(env: dict) -> dict:
    """{} when `cram` imports; else PYTHONPATH to a temporary package of the repository's folders (a bare
    GPU machine, nothing installed)."""
    if util.find_spec("cram") is not None:
        return {}
    shim = Path(tempfile.mkdtemp(prefix="cram-shim-"))
    (shim / "cram").mkdir()
    for folder in ("model", "pipeline", "stages"):
        (shim / "cram" / folder).symlink_to(REPO / folder)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))}


def commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return os.environ.get("CRAM_COMMIT") or found.stdout.strip() or "unknown"


def child_command(args: argparse.Namespace, row: str, out: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", row, "--out", str(out)]
    for key in ("device", "shapes", "backend", "dtype", "steps"):
        cmd += [f"--{key}", str(getattr(args, key))]
    return cmd


def describe(r: dict) -> str:
    """One line for people."""
    if "skipped" in r:
        return f"{r['row']}: skipped: {r['skipped']}"
    if r.get("kind") == "floors":
        return f"{r['row']}: " + "; ".join(f"{k} {v}" for k, v in r.get("summary", {}).items())
    parts = [f"{r['row']}: {r['step_ms']:.1f} ms synced, {r['step_ms_back_to_back']:.1f} ms back to back"]
    parts.append(f"{r['tokens_per_s']:,.0f} tokens/s, batch {r['batch']}")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}% (HFU {100 * r['hfu']:.1f}%)")
    parts.append(f"peak {r['peak_mem_mb']:,.0f} MiB, compile {r['compile_s']:.1f} s")
    if "profile" in r:
        p = r["profile"]
        shares = ", ".join(
            f"{k} {100 * v:.0f}%" for k, v in sorted(p["categories_share"].items(), key=lambda kv: -kv[1])
        )
        parts.append(f"{shares} (accounted {100 * p['accounted_fraction']:.0f}% of the step)")
        parts.append(f"device idle {100 * p['idle_fraction']:.0f}%, {p['kernels_per_step']:.0f} kernels/step")
    if r.get("optimizer_share") is not None:
        parts.append(f"update alone {r['optimizer_ms']:.2f} ms ({100 * r['optimizer_share']:.0f}% of the step)")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------ the children


def floors_child(args: argparse.Namespace, row: str) -> dict:
    """The environment, the matmul peaks and the GEMM floor of the base step."""
    import torch

    from cram import model

    device, shapes = torch.device(args.device), SHAPES[args.shapes]
    cfg = base_config(args)
    masked = round(MASK_RATE * cfg.max_seq_len)
    peaks = matmul_peaks(device, shapes.matmul)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gemms = model.step_gemms(cfg, shapes.batch, masked)
    seconds = {g.name: g.count * time_gemm(g, device, dtype) for g in gemms}
    floor_s = sum(seconds.values())
    step_flops = model.flops_per_token(cfg, masked / cfg.max_seq_len) * shapes.batch * cfg.max_seq_len
    sheet = sheet_peak(device)
    result = {
        "row": row,
        "kind": "floors",
        "environment": environment(device),
        "peaks_tflops": {k: None if v is None else v / 1e12 for k, v in peaks.items()},
        "sheet_peak_tflops": None if sheet is None else sheet / 1e12,
        "gemm_floor_ms": 1e3 * floor_s,
        "gemm_floor_tflops": sum(g.flops for g in gemms) / floor_s / 1e12,
        "gemm_floor_mfu": None if sheet is None else step_flops / floor_s / sheet,
        "gemm_ms": {name: 1e3 * s for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])},
    }
    best = "-" if sheet is None else f"{100 * result['gemm_floor_mfu']:.1f}%"
    result["summary"] = {
        "peaks TFLOP/s": ", ".join(
            f"{k} {'-' if v is None else f'{v:.3g}'}" for k, v in result["peaks_tflops"].items()
        ),
        "GEMM floor": f"{result['gemm_floor_ms']:.2f} ms at batch {shapes.batch} "
        f"({result['gemm_floor_tflops']:.3g} TFLOP/s; best MFU {best})",
    }
    return result


def environment(device) -> dict:
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    found["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        found["transformers"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        found["transformers"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        found |= {"device": torch.cuda.get_device_name(device), "capability": f"{p.major}.{p.minor}"}
        found |= {"sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1)}
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=driver_version,power.limit,clocks.max.sm", "--format=csv,noheader"]
            found["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    else:
        found |= {"device": platform.processor() or "cpu", "threads": torch.get_num_threads()}
    return found


def matmul_peaks(device, size: int) -> dict[str, float | None]:
    """Square-matmul FLOP/s in bf16, in fp32 with TF32 off and (CUDA only) on."""
    import torch

    from cram.model.flops import measure_matmul_flops

    peaks = {"bf16": measure_matmul_flops(device, torch.bfloat16, size), "fp32": None, "tf32": None}
    if device.type != "cuda":
        peaks["fp32"] = measure_matmul_flops(device, torch.float32, size)
        return peaks  # TF32 is a mode of CUDA's tensor cores
    matmul = torch.backends.cuda.matmul
    for key, precision in (("fp32", "ieee"), ("tf32", "tf32")):
        matmul.fp32_precision = precision
        peaks[key] = measure_matmul_flops(device, torch.float32, size)
    matmul.fp32_precision = "ieee"
    return peaks


def time_gemm(g, device, dtype, repeats: int = 10) -> float:
    """Seconds of one of `g`'s products, the best of three back-to-back runs of `repeats`."""
    import torch

    shape = (g.batch,) if g.batch > 1 else ()
    a = torch.randn(*shape, g.m, g.k, device=device, dtype=dtype)
    b = torch.randn(*shape, g.k, g.n, device=device, dtype=dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(3):
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(a, b)
        sync(device)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def cram_child(args: argparse.Namespace, row: str) -> dict:
    """A cram row at the base shape: timing, and for profiled rows the trace and the update's share."""
    spec = ALL_ROWS[row]
    return measure_cram(args, row, base_config(args), SHAPES[args.shapes].batch, spec, documents=False)


def tiny_child(args: argparse.Namespace, row: str) -> dict:
    from cram import model

    return measure_cram(args, row, model.PRESETS["tiny"], SHAPES[args.shapes].tiny_batch, ALL_ROWS[row], True)


def big_child(args: argparse.Namespace, row: str) -> dict:
    """Base at the largest batch of `big_batches` that fits."""
    import torch

    batches = SHAPES[args.shapes].big_batches
    for batch in batches:
        try:
            return measure_cram(args, row, base_config(args), batch, ALL_ROWS[row], documents=False)
        except torch.OutOfMemoryError as e:
            print(f"batch {batch}: out of memory ({str(e)[:200]})", file=sys.stderr, flush=True)
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    return {"row": row, "skipped": f"out of memory at every batch of {batches}"}


def measure_cram(args: argparse.Namespace, row: str, cfg, batch: int, spec: Row, documents: bool) -> dict:
    import torch

    from cram import model

    device = torch.device(args.device)
    needs = [why for key, why in CUDA_ONLY.items() if spec.compilation.get(key)]
    if needs and device.type != "cuda":
        return {"row": row, "skipped": f"{needs[0]}; this run's device is {device.type}"}
    if spec.profile and device.type == "cpu":  # inductor's C++ kernels as named events: set before it compiles
        torch._inductor.config.cpp.enable_kernel_profile = True
    how = model.Compilation(backend=args.backend, autocast=autocast(args), **spec.compilation)
    opt = model.optimizer_config(spec.optimizer)
    state, step = cram_step(cfg, opt, how, device)
    batches = [make_batch(cfg, batch, device, seed, documents) for seed in range(4)]
    result = {"row": row, "batch": batch, **timing(step, batches, device, args.steps)}
    result |= figures(result, cfg, opt, batch, device)
    if spec.profile:
        result["profile"] = profiled(step, batches, device, Path(args.out) / "traces" / f"{row}.json.gz")
        result |= update_share(state, opt, how, device, result["step_ms_back_to_back"], args.steps)
    return result


def cram_step(cfg, opt, how, device):
    """({"params", "opt"}, step(batch) -> loss) of cram's compiled train step on `device`."""
    import torch

    from cram import model

    params = {name: p.to(device) for name, p in model.init(cfg, seed=0).items()}
    state = {"params": params, "opt": model.optimizer_init(opt, params)}
    lr = torch.tensor(1e-3, device=device)
    train_step = model.make_train_step(cfg, opt, how)
    keys = ("input_ids", "mlm_positions", "mlm_labels", "document_ids")

    def step(batch):
        sparse = {k: batch[k] for k in keys if k in batch}
        state["params"], state["opt"], metrics = train_step(state["params"], state["opt"], sparse, lr)
        return metrics["loss"]

    return state, step


def figures(result: dict, cfg, opt, batch: int, device) -> dict:
    """tokens/s, and against the data-sheet peak (None off a known GPU) MFU and HFU (Newton-Schulz counted)."""
    from cram import model

    tokens = batch * cfg.max_seq_len
    step_s = result["step_ms_back_to_back"] / 1e3
    model_flops = model.flops_per_token(cfg, MASK_RATE) * tokens
    hardware_flops = model_flops + model.optimizer_flops(cfg, opt)
    peak = sheet_peak(device)
    return {
        "tokens_per_s": tokens / step_s,
        "model_tflop_per_step": model_flops / 1e12,
        "hardware_tflop_per_step": hardware_flops / 1e12,
        "mfu": None if peak is None else model_flops / step_s / peak,
        "hfu": None if peak is None else hardware_flops / step_s / peak,
    }


def profiled(step, batches: list, device, path: Path) -> dict:
    """The breakdown of `PROFILED_STEPS` steps under torch.profiler; the trace written gzipped to `path`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        sync(device)
        start = time.perf_counter()
        for i in range(PROFILED_STEPS):
            step(batches[i % len(batches)])
        sync(device)
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(raw))
        text = raw.read_text(encoding="utf-8")
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text)
    events = profile_trace.device_events(json.loads(text), device.type)
    return {"trace": str(path), **profile_trace.breakdown(events, wall, PROFILED_STEPS)}


def update_share(state: dict, opt, how, device, step_ms: float, steps: int) -> dict:
    """The optimizer update alone (clipping and AdamW or Muon: `make_apply_step`), compiled as the step is,
    timed back to back: its milliseconds and share of the step's."""
    import torch

    from cram import model

    apply = model.make_apply_step(opt, how)
    grads = {k: torch.randn_like(v) * 1e-3 for k, v in state["params"].items()}
    one, lr = torch.tensor(1.0, device=device), torch.tensor(1e-3, device=device)
    params, opt_state = state["params"], state["opt"]
    for _ in range(WARMUP + 1):
        params, opt_state, metrics = apply(params, opt_state, grads, one, lr)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, metrics = apply(params, opt_state, grads, one, lr)
    metrics["grad_norm"].item()
    ms = 1e3 * (time.perf_counter() - start) / steps
    return {"optimizer_ms": ms, "optimizer_share": ms / step_ms}


CHILDREN = {
    "floors": floors_child,
    "cram": cram_child,
    "tiny": tiny_child,
    "big": big_child,
    "modernbert": gpu_hf_rows.modernbert_child,
    "bert": gpu_hf_rows.bert_child,
}


if __name__ == "__main__":
    main()
