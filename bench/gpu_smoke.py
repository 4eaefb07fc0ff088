"""The pipeline's own CUDA path in one short run: `pretrain.run` as the default pipeline runs it (document
attention, the compile canary, compiled, the recompile limit, bf16 autocast), for 30 steps of the tiny
preset on random packed blocks.

    python bench/gpu_smoke.py                          # on CUDA; without CUDA it says so and exits 0
    python bench/gpu_smoke.py --attention written      # the same with the written-out attention
    python bench/gpu_smoke.py --device cpu --backend aot_eager --microbatch 4   # its CPU path (tests)

It prints which SDPA kernels run (profiled ops of one eager forward and backward under torch.func, as the
step computes them) with and without the document mask, the stage's figures (canary difference, compile
seconds, tokens/s, MFU), and the host syncs over steps 5-30 (`torch.cuda.set_sync_debug_mode`: every
synchronising CUDA call warns), counted and by where they come from: about one per log step is expected
(`log_every_steps = 5`: the report's one `tolist`). Exit 0 when the run trained, 1 when it failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import children  # noqa: E402  (bench/children.py, beside this file)

SEQ, VOCAB = 128, 4096  # the tiny preset's
SYNC_FROM, SYNC_TO = 5, 30  # steps whose host syncs are counted
DOCUMENT_START = 1 / 48  # chance that a token starts a document ([CLS], pack's "cls-sep" boundary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--attention", choices=("auto", "sdpa", "written"), default="auto")
    parser.add_argument("--steps", type=int, default=SYNC_TO)
    parser.add_argument("--microbatch", type=int, default=32)
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_smoke: CUDA is not available here (torch {torch.__version__}): nothing to run on a GPU", flush=True)
        return 0
    children.dump_stacks_on_term()
    device = torch.device(args.device)
    print(f"gpu_smoke: torch {torch.__version__}, {device_name(device)}, attention {args.attention}", flush=True)
    with tempfile.TemporaryDirectory(prefix="cram-gpu-smoke-") as folder:
        try:
            figures, syncs = train(args, Path(folder))
        except Exception as e:
            traceback.print_exc()
            print(f"gpu_smoke: pretrain.run failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            if args.attention != "written":
                print("gpu_smoke: if it failed in SDPA, run again with --attention written", flush=True)
            return 1
    report(figures, syncs, device)
    print_backends(device, args)
    return 0


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def train(args: argparse.Namespace, folder: Path) -> tuple[dict, SyncCount]:
    """Run the pretrain stage on a fake pack in `folder`; its figures and the syncs counted."""
    from cram.stages import Context, pretrain
    from cram.stages.pretraining import loop

    config = pretrain.Config(
        model=pretrain.Architecture(preset="tiny"),
        budget=pretrain.Budget(steps=args.steps),
        microbatch=args.microbatch,
        batch_size=args.microbatch,
        ramp=0.0,
        document_attention=True,
        compile=True,
        backend=args.backend,
        log_every_steps=5,
        checkpoint_every_minutes=0,
        val_blocks=2 * args.microbatch,
    )
    syncs = SyncCount(enabled=args.device.startswith("cuda"))
    real_train = loop.train

    def train_counting(course, ctx, steps, state, data, hooks):
        return real_train(course, ctx, steps, state, data, [*hooks, syncs])

    loop.train = train_counting  # the stage imports `train` from the module when it runs
    ctx = Context(seed=0, device=args.device, run_dir=folder / "run", log=PrintLog(), attention=args.attention)
    (folder / "run").mkdir()
    try:
        figures = pretrain.run(config, {"pack": fake_pack(folder / "pack")}, folder / "out", ctx)
    finally:
        loop.train = real_train
        syncs.stop()
    return figures, syncs


def fake_pack(folder: Path):
    """Random packed blocks with [CLS] starting documents, laid out as `stages.pack` writes them."""
    import numpy as np

    from cram.stages import Upstream
    from cram.stages.shared.special import SPECIAL_IDS

    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, blocks in (("train", 4096), ("val", 128)):
        ids = rng.integers(len(SPECIAL_IDS), VOCAB, size=(blocks, SEQ), dtype=np.uint16)
        ids[rng.random((blocks, SEQ)) < DOCUMENT_START] = SPECIAL_IDS["cls"]
        np.save(folder / f"{name}.npy", ids)
    outputs = {
        "train": "train.npy",
        "val": "val.npy",
        "seq_len": SEQ,
        "vocab_size": VOCAB,
        "special_ids": SPECIAL_IDS,
        "boundary": "cls-sep",
    }
    return Upstream(folder, outputs)


class SyncCount:
    """A training-loop hook, called after every step: from step SYNC_FROM to SYNC_TO, every synchronising
    CUDA call warns (`torch.cuda.set_sync_debug_mode`), and the warnings are counted by where they came from."""

    def __init__(self, enabled: bool):
        self.enabled, self.where = enabled, collections.Counter()
        self._catch: warnings.catch_warnings | None = None
        self._seen: list | None = None

    def due(self, info) -> bool:
        return self.enabled

    def __call__(self, info) -> None:
        step = info.state.step
        if step == SYNC_FROM - 1 and not info.final and self._catch is None:
            self._start()
        elif step >= SYNC_TO or info.final:
            self.stop()

    def _start(self) -> None:
        import torch

        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self._catch is None:
            return
        import torch

        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)
        for w in self._seen:
            if "synchroniz" in str(w.message):
                self.where[f"{w.filename}:{w.lineno}"] += 1
        self._catch = None

    @property
    def total(self) -> int:
        return sum(self.where.values())


class PrintLog:
    """`ctx.log` without structlog (not on every GPU machine): one JSON line per event, on stderr."""

    def _emit(self, level: str, event: str, **kw) -> None:
        print(json.dumps({"level": level, "event": event, **kw}, default=str), file=sys.stderr, flush=True)

    def info(self, event: str, **kw) -> None:
        self._emit("info", event, **kw)

    def warning(self, event: str, **kw) -> None:
        self._emit("warning", event, **kw)

    def error(self, event: str, **kw) -> None:
        self._emit("error", event, **kw)


def report(figures: dict, syncs: SyncCount, device) -> None:
    keys = ("steps", "precision", "canary_diff", "compile_s", "tokens_per_s", "mfu", "final_loss", "val_loss_end")
    print("gpu_smoke: trained: " + ", ".join(f"{k} {figures.get(k)}" for k in keys), flush=True)
    if device.type != "cuda":
        print("gpu_smoke: host syncs: not counted off CUDA", flush=True)
        return
    log_steps = len(range(SYNC_FROM, SYNC_TO + 1, 5))
    print(
        f"gpu_smoke: host syncs over steps {SYNC_FROM}-{SYNC_TO}: {syncs.total} "
        f"(log steps in that window: {log_steps}; about one each is expected)",
        flush=True,
    )
    for where, count in syncs.where.most_common(10):
        print(f"  {count:4d}  {where}", flush=True)


def print_backends(device, args: argparse.Namespace) -> None:
    """The SDPA kernels of one eager forward and backward (torch.func, as the step) without and with the
    document mask, read from the profiler's op names."""
    for documents in (False, True):
        label = "document mask" if documents else "no mask"
        try:
            ops = attention_ops(device, documents, args.attention)
        except Exception as e:  # the backends are a diagnosis: their failure is printed, not fatal
            ops = [f"failed: {type(e).__name__}: {str(e)[:300]}"]
        print(f"gpu_smoke: SDPA, {label}: {', '.join(ops) or 'no SDPA op (written-out attention)'}", flush=True)


def attention_ops(device, documents: bool, attention: str) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cram import model

    cfg = model.PRESETS["tiny"]
    params = {k: v.to(device) for k, v in model.init(cfg, seed=0).items()}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (8, SEQ), generator=gen)
    batch = {"input_ids": ids, "mlm_positions": torch.arange(0, 8 * SEQ, 4), "mlm_labels": ids.flatten()[::4]}
    if documents:
        batch["document_ids"] = (torch.rand(8, SEQ, generator=gen) < DOCUMENT_START).int().cumsum(1, dtype=torch.int32)
    batch = {k: v.to(device) for k, v in batch.items()}
    autocast = torch.bfloat16 if device.type == "cuda" else None
    step = model.make_train_step(
        cfg, model.AdamW(), model.Compilation(compile=False, autocast=autocast, attention=attention)
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(params, model.optimizer_init(model.AdamW(), params), batch, torch.tensor(1e-3, device=device))
    names = {event.key for event in prof.key_averages()}
    return sorted(n for n in names if n.startswith("aten::") and ("scaled_dot_product" in n or "attention" in n))


if __name__ == "__main__":
    sys.exit(main())
