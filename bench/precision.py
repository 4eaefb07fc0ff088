"""What each candidate precision of `precision = "auto"` gives on this CPU: is its compiled train step
right (against the same step run eagerly), and how fast is it.

    python bench/precision.py [--preset tiny] [--vocab 8192] [--batch 32] [--seq 128] [--rounds 5]
                              [--model position=learned --model glu=false ...] [--mask-rate 0.4] [--documents]

Compiles the train step once per candidate (bf16 with inductor's own vector width, bf16 with 256-bit
vector code, fp32: `stages/shared/precision.py`) in this one process (each candidate's inductor options
apply to its graphs alone), checks its first step's loss and gradient norm against eager in the same
precision, then times them interleaved (A, B, C, A, B, C, ...) and prints one row per candidate.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from cram import model
from cram.pipeline.config import parse_value
from cram.stages.shared.masking import Masking, mask_spec, mask_tokens
from cram.stages.shared.precision import BF16, BF16_256, FP32
from cram.stages.shared.special import SPECIAL_IDS


def override(pair: str) -> tuple[str, object]:
    """A `--model KEY=VALUE` pair, VALUE read as `--set` reads it (a TOML value, else the text)."""
    key, _, value = pair.partition("=")
    return key, parse_value(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--model", action="append", default=[], type=override, help="KEY=VALUE: a ModelConfig field (repeatable)"
    )
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mask-rate", type=float, default=0.4)
    parser.add_argument("--documents", action="store_true", help="attention within 4 documents a block")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    cfg = dataclasses.replace(
        model.PRESETS[args.preset], vocab_size=args.vocab, max_seq_len=args.seq, **dict(args.model)
    )
    params = model.init(cfg, 0)
    state = model.optimizer_init(model.AdamW(), params)
    spec = mask_spec(Masking(rate=args.mask_rate), dict(SPECIAL_IDS), args.vocab, args.seq)
    ids = torch.randint(5, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = mask_tokens(ids, spec, torch.Generator().manual_seed(1))
    if args.documents:
        batch["document_ids"] = (torch.arange(args.seq) * 4 // args.seq).expand(args.batch, -1).contiguous()
    lr, opt = torch.tensor(1e-3), model.AdamW()
    tokens = args.batch * args.seq

    steps, rows = {}, {}
    for candidate in (BF16, BF16_256, FP32):
        how = model.Compilation(autocast=candidate.autocast(), options=candidate.compile_options())
        eager = model.make_train_step(cfg, opt, how.eager())(params, state, batch, lr)[2]
        step = model.make_train_step(cfg, opt, how)
        began = time.perf_counter()
        got = step(params, state, batch, lr)[2]
        compile_s = time.perf_counter() - began
        diff = max(float((got[k] - eager[k]).abs() / eager[k].abs()) for k in ("loss", "grad_norm"))
        steps[candidate] = step
        rows[candidate] = {"grad_norm": float(got["grad_norm"]), "eager": float(eager["grad_norm"]), "diff": diff}
        rows[candidate].update(compile_s=compile_s, tokens_per_s=[])
        print(f"compiled {candidate.label}: {compile_s:.1f} s, relative difference from eager {diff:.3g}", flush=True)

    for _ in range(args.rounds):
        for candidate, step in steps.items():
            p, s = params, state
            began = time.perf_counter()
            for _ in range(args.steps):
                p, s, m = step(p, s, batch, lr)
            m["loss"].item()
            rows[candidate]["tokens_per_s"].append(args.steps * tokens / (time.perf_counter() - began))

    shape = f"vocab {args.vocab}, {args.batch}x{args.seq}, masking {args.mask_rate}, documents {args.documents}"
    layout = ", ".join(f"{k}={v}" for k, v in args.model) or "the preset's layout"
    print(f"\n{args.preset} ({layout}), {shape}, torch {torch.__version__}")
    print("| candidate | grad norm compiled | eager | relative diff | compile s | tokens/s (median) |")
    print("|---|---|---|---|---|---|")
    for candidate, row in rows.items():
        print(
            f"| {candidate.label} | {row['grad_norm']:.4f} | {row['eager']:.4f} | {row['diff']:.2g} | "
            f"{row['compile_s']:.1f} | {statistics.median(row['tokens_per_s']):,.0f} |"
        )


if __name__ == "__main__":
    main()
