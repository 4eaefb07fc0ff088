"""The written-out attention's scores under bf16 autocast: kept in bf16 (model/bert.py `_attend`) against an fp32
copy of them (the formula before: `scores.float()`, `masked_fill`, the probabilities cast back to bf16), timed on
cram's eager contrastive step of all-MiniLM-L6-v2, one batch of 32 queries and their 32 documents from
bench/retrieval_quality.py's `descriptions` set cut at `--max-length` tokens, the two interleaved in one process.

    python bench/attention_scores.py --work bench-out/retrieval-quality [--max-length 256] [--rounds 3]

WORK: a bench/retrieval_quality.py folder run with `--init minilm` (its encoder and its descriptions set).
Prints each round's seconds a step (two steps, from the same params) and the loss, then the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import retrieval_quality  # noqa: E402

from cram import model  # noqa: E402
from cram.model import bert  # noqa: E402


def fp32_scores(q, k, v, mask, rate, attention):
    """The written-out attention with its scores copied to fp32 for the mask and the softmax."""
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(bert.dropout(scores.softmax(dim=-1), rate).to(v.dtype), v)


def tuner_and_batch(work: Path, max_length: int):
    """cram's eager EmbeddingTuner of MiniLM (bench/retrieval_quality.py's), and the set's first batch."""
    settings = dict(set="descriptions", init="minilm", pairs=32, batch=32, lr=2e-5, max_length=max_length)
    tuner, loaded, precision = retrieval_quality.cram_tuner(argparse.Namespace(work=work, **settings))
    return tuner, tuner.batch(loaded, list(range(32)), 0.1), precision.label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tuner, batch, precision = tuner_and_batch(args.work, args.max_length)
    print(f"{precision}; documents {tuple(batch['doc_ids'].shape)}, queries {tuple(batch['query_ids'].shape)}")
    variants = {"bf16 scores (cram)": bert._attend, "fp32 scores (before)": fp32_scores}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name, attend in variants.items():
            bert._attend = attend
            params = {k: v.clone() for k, v in tuner.params.items()}
            state = model.optimizer_init(model.AdamW(), params)
            torch.manual_seed(0)
            began = time.perf_counter()
            for _ in range(2):
                params, state, metrics = tuner.step(params, state, batch, torch.tensor(2e-5), donate=True)
            loss = float(metrics["loss"])
            times[name].append((time.perf_counter() - began) / 2)
            print(f"round {round_}: {name}: {times[name][-1]:.3f} s a step, loss {loss:.6f}", flush=True)
    print({name: round(statistics.median(t), 3) for name, t in times.items()})


if __name__ == "__main__":
    main()
