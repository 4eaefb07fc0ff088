"""What starting from an existing checkpoint adds to pretrain's start: base-size checkpoints read by
`pretrain.init` (stages/shared/pretrained.py), timed.

    python bench/import_cost.py [--work DIR] [--repeats 3]

Builds random base-size `ModernBertForMaskedLM` and `BertForMaskedLM` checkpoints with `transformers`
(saved once to DIR, default a temporary folder), then times, interleaved, for each: `locate` + the
content hash that enters the cache key (`fingerprint`), the check before any stage runs (a load from
the safetensors headers alone), and the full load into cram's fp32 params with every byte read (the
files are memory-mapped, so a load alone reads nothing yet; the first round reads them from disk,
later ones from the page cache). Prints one row per checkpoint: the median seconds of each over
`--repeats` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def build(work: Path) -> dict[str, Path]:
    """Random base-size checkpoints (the published configs' shapes), saved once."""
    import transformers as tf

    made = {}
    configs = {
        "modernbert-base": tf.ModernBertConfig(vocab_size=50368, global_attn_every_n_layers=3, local_attention=128),
        "bert-base": tf.BertConfig(vocab_size=30522),
    }
    classes = {"modernbert-base": tf.ModernBertForMaskedLM, "bert-base": tf.BertForMaskedLM}
    for name, config in configs.items():
        folder = work / name
        if not (folder / "model.safetensors").is_file():
            classes[name](config).save_pretrained(folder)
        made[name] = folder
    return made


def read_all(params: dict) -> float:
    """Touch every byte: safetensors maps the file, and a tensor's pages are read when first used."""
    return sum(float(t.sum()) for t in params.values())


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    from cram.stages.shared import pretrained

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoints are saved (kept)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="cram-import-"))
    folders = build(work)
    steps = {
        "key (hash)": lambda f: pretrained.fingerprint(pretrained.locate(f)),
        "check (headers)": lambda f: pretrained.load(pretrained.locate(f), shapes_only=True),
        "load + read (fp32)": lambda f: read_all(pretrained.load(pretrained.locate(f))[1]),
    }
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for name, folder in folders.items():
            for step, fn in steps.items():
                seconds.setdefault((name, step), []).append(timed(lambda: fn(folder)))
    print(f"| checkpoint | size MB | {' | '.join(steps)} | all |")
    print("|---|---:|" + "---:|" * (len(steps) + 1))
    for name, folder in folders.items():
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6
        medians = [statistics.median(seconds[(name, step)]) for step in steps]
        cells = " | ".join(f"{m:.2f}" for m in medians)
        print(f"| {name} | {size:,.0f} | {cells} | {sum(medians):.2f} |")


if __name__ == "__main__":
    main()
