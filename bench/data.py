"""Throughput of the data stages on the default corpus (targets on the 2-core CPU machine:
tokenize >= 5 MB/s of text, pack >= 50M tokens/s).

    python bench/data.py [CONFIG] [--set k=v ...] [--repeat 3]

Runs the tokenize and pack stages of CONFIG (default pipeline.toml) directly, in this process,
into a temporary folder, `--repeat` times each, and prints the medians. Tokenize is reported twice:
encoding alone (the part that grows with the corpus) and the whole stage (reading, held-out split,
tokenizer training, encoding, writing). Pack is timed after its imports, as the stage figures are.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import structlog

from pipeline import config as cfg
from pipeline import runner
from stages import Context, Upstream, pack, tokenize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="pipeline.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    config = cfg.load(args.config, runner.config_classes(runner.default_stages()), args.overrides)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up

    with tempfile.TemporaryDirectory(prefix="cram-bench-data-") as tmp:
        ctx = Context(seed=config.run.seed, device="cpu", run_dir=Path(tmp), log=structlog.get_logger())
        tokenized = [_run(tokenize, config.stages["tokenize"], {}, Path(tmp) / f"tokenize-{i}", ctx)
                     for i in range(args.repeat)]
        upstream = {"tokenize": Upstream(Path(tmp) / "tokenize-0", tokenized[0])}
        packed = [_run(pack, config.stages["pack"], upstream, Path(tmp) / f"pack-{i}", ctx)
                  for i in range(args.repeat)]

    first = tokenized[0]
    print(f"corpus: {first['documents']:,} training documents, {first['text_mb']} MB of text, "
          f"{first['total_tokens']:,} tokens (vocab {first['vocab_size']}, {first['model_type']}); "
          f"{args.repeat} runs each, medians")
    print("| stage | figure | median | min | max |\n|---|---|---|---|---|")
    rows = [
        ("tokenize", "encode MB/s", [t["mb_per_s"] for t in tokenized]),
        ("tokenize", "whole stage MB/s", [t["text_mb"] / t["seconds"] for t in tokenized]),
        ("tokenize", "whole stage s", [t["seconds"] for t in tokenized]),
        ("tokenize", "tokenizer training s", [t["train_seconds"] for t in tokenized]),
        ("pack", "M tokens/s", [p["tokens_per_s"] / 1e6 for p in packed]),
        ("pack", "stage s", [p["seconds"] for p in packed]),
    ]
    for stage, figure, values in rows:
        print(f"| {stage} | {figure} | {statistics.median(values):.3g} | {min(values):.3g} | {max(values):.3g} |")


def _run(stage, config, inputs: dict, out_dir: Path, ctx: Context) -> dict:
    out_dir.mkdir()
    return stage.run(config, inputs, out_dir, ctx)


if __name__ == "__main__":
    main()
