"""Embedding a BEIR corpus with cram's eager EmbeddingTuner (what evaluate runs for every seed's test search and
for the encoder as it came): the attention written out (the CPU's default) against SDPA, under bf16 autocast
(evaluate's `auto` on a CPU with native bf16) and in fp32, 128 rows a batch (evaluate's `eval_batch_size`),
beside sentence-transformers' own `encode` of the same texts (fp32, batch 128: bench/retrieval_quality.py's
`st_search`, which scores the sentence-transformers side of bench/beir_versus.py), interleaved round by round
in one process.

    python bench/embed_speed.py --encoder DIR --set DIR [--documents 512] [--max-length 256] [--rounds 3]

DIR: a sentence-transformers folder (bench/adapt.encoder_minilm writes all-MiniLM-L6-v2's) and a BEIR folder;
its first `--documents` documents, cut at `--max-length` tokens. Prints each arm's seconds per round and the
largest difference of its embeddings from the first arm's, then the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ARMS = (("written", "bf16"), ("sdpa", "bf16"), ("written", "fp32"), ("sdpa", "fp32"))
BATCH = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder", type=Path, required=True)
    parser.add_argument("--set", type=Path, required=True)
    parser.add_argument("--documents", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    arms, rows, texts = cram_arms(args)
    st = st_encoder(args.encoder, args.max_length)
    seconds: dict[str, list[float]] = {}
    for r in range(args.rounds):
        first = None
        for name, embed in arms.items():
            t = time.perf_counter()
            out = embed(*rows)
            seconds.setdefault(name, []).append(time.perf_counter() - t)
            first = out if first is None else first
            print(
                f"round {r} {name}: {seconds[name][-1]:.2f} s, max |diff| {np.abs(out - first).max():.2e}", flush=True
            )
        t = time.perf_counter()
        st.encode(texts, batch_size=BATCH, convert_to_numpy=True)
        seconds.setdefault("sentence-transformers encode, fp32", []).append(time.perf_counter() - t)
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.2f} s ({', '.join(f'{v:.2f}' for v in values)})")


def cram_arms(args: argparse.Namespace):
    """Each arm's embedding function of (rows, lengths), the corpus's first documents as cram tokenizes them,
    and their texts as sentence-transformers reads them."""
    from cram.stages import evaluate
    from cram.stages.retrieval import results
    from cram.stages.retrieval.tuning import EmbeddingTuner, Making
    from cram.stages.shared.precision import BF16, FP32
    from cram.stages.shared.pretrained import load, locate
    from cram.stages.shared.tokenizer import load as load_tokenizer
    from cram.stages.tasks.config import TaskConfig

    found = locate(args.encoder)
    cfg, params = load(found)
    tokenizer = load_tokenizer(found.tokenizer)
    entry = TaskConfig(kind="retrieval", name=args.set.name, path=str(args.set), max_length=args.max_length)
    buckets = tuple(sorted({32, 64, 128, args.max_length}))
    config = evaluate.Config(tasks=[entry], compile=False, buckets=buckets).linked({})
    settings = config.settings(config.tasks[0])
    loaded = results.loaded(
        entry, results.load_task(entry, 0, None, settings), tokenizer, tokenizer.special_ids, settings
    )
    corpus_rows, corpus_lengths = loaded.data.corpus
    rows, lengths = corpus_rows[: args.documents], np.asarray(corpus_lengths[: args.documents])
    texts = [doc.full_text for doc in list(loaded.task.corpus.values())[: args.documents]]
    tuning = dataclasses.replace(config.tuning(), eval_batch_size=BATCH)
    arms = {}
    for attention, precision in ARMS:
        how = Making({"bf16": BF16, "fp32": FP32}[precision], False, attention, "mean")
        tuner = EmbeddingTuner.make(tuning, cfg, params, tokenizer.special_ids, torch.device("cpu"), how)
        arms[f"cram {attention}, {precision}"] = lambda r, n, t=tuner: t.embedded(t.params, r, n)
    return arms, (rows, lengths), texts


def st_encoder(folder: Path, max_length: int):
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(str(folder), device="cpu")
    encoder.max_seq_length = max_length
    return encoder


if __name__ == "__main__":
    main()
