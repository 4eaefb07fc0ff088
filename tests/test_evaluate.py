"""The evaluate stage end to end on a tiny random model: results, medians, the compiled graph count,
repeatable masked-LM numbers and bad input."""

import dataclasses
import io
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import save_file
from test_pretrain import PRECISIONS
from torch._dynamo.utils import counters

from cram import model
from cram.stages import StageError, Upstream, evaluate
from cram.stages.evaluate import Config, TaskConfig
from cram.stages.finetuning import finetune
from cram.stages.kept import batches
from cram.stages.shared.special import SPECIAL_IDS

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
TOPICS = {
    "Sports": "ball goal team match player league coach",
    "Music": "song guitar band album concert melody singer",
    "Science": "atom cell energy theory physics molecule gene",
}
FILLER = "the a of and in to was is it on with for as by at from".split()
CFG = dict(hidden=32, layers=1, heads=2, intermediate=64, max_seq_len=64)


def sentence(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) if rng.random() < 0.5 else rng.choice(FILLER) for _ in range(n))


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """tokenize, pack and pretrain outputs as the stages write them, for a tiny random model."""
    import datasets
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("upstream")
    rng = random.Random(0)
    lines = [sentence(rng, words.split(), 20) for words in TOPICS.values() for _ in range(100)]
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buffer,
        model_type="bpe",
        vocab_size=100,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        pad_piece="[PAD]",
        unk_piece="[UNK]",
        bos_piece="[CLS]",
        eos_piece="[SEP]",
        control_symbols=["[MASK]"],
        minloglevel=2,
        num_threads=1,
    )
    tokenize = root / "tokenize"
    tokenize.mkdir()
    (tokenize / "tokenizer.model").write_bytes(buffer.getvalue())
    docs = [(sentence(rng, words.split(), 30), topic) for topic, words in TOPICS.items() for _ in range(40)]
    docs += [("an article without a topic", "")] * 5
    datasets.Dataset.from_dict(
        {
            "text": [d[0] for d in docs],
            "title": [f"t{i}" for i in range(len(docs))],
            "label": [d[1] for d in docs],
        }
    ).save_to_disk(str(tokenize / "heldout"))

    sp = spm.SentencePieceProcessor(model_proto=buffer.getvalue())
    pack = root / "pack"
    pack.mkdir()
    stream = np.concatenate([sp.encode(line) for line in lines])
    np.save(pack / "val.npy", stream[: 24 * 32].reshape(24, 32).astype(np.uint16))

    pretrain = root / "pretrain"
    pretrain.mkdir()
    cfg = model.ModelConfig(vocab_size=100, **CFG)
    save_file(model.init(cfg, 0), str(pretrain / "params.safetensors"))
    (pretrain / "model.json").write_text(json.dumps(dataclasses.asdict(cfg)))

    sst2 = root / "glue" / "SST-2"
    sst2.mkdir(parents=True)
    for split, n in (("train", 40), ("dev", 12)):
        rows = [(sentence(rng, ["good", "great"] if i % 2 else ["bad", "awful"], 6), i % 2) for i in range(n)]
        (sst2 / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))

    custom = root / "lengths"
    custom.mkdir()
    for split, n in (("train", 24), ("test", 9)):
        # lengths 1..24 words: every bucket of (8, 16, 32) is needed
        # the test rows' word differs from the training rows': no test row is a training row
        word = "goal" if split == "train" else "aim"
        records = [{"text": " ".join([word] * (1 + i % 24)), "score": float(i % 24)} for i in range(n)]
        (custom / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    return {
        "root": root,
        "inputs": {
            "tokenize": Upstream(
                tokenize,
                {"tokenizer": "tokenizer.model", "heldout": "heldout", "special_ids": SPECIAL_IDS, "vocab_size": 100},
            ),
            "pack": Upstream(pack, {"val": "val.npy", "seq_len": 32, "special_ids": SPECIAL_IDS}),
            "pretrain": Upstream(
                pretrain,
                {
                    "params": "params.safetensors",
                    "model_config": "model.json",
                    "masking": {"rate": 0.25, "mask_token": 0.8, "random_token": 0.1},
                },
            ),
        },
    }


def fp32(**kw) -> Config:
    """An evaluate config pinned to fp32: "auto" would take bf16 on some CPUs and fp32 on others."""
    return Config(**{"precision": "fp32", **kw})


def run_stage(config, inputs, tmp_path, make_ctx, name="out"):
    out = tmp_path / name
    out.mkdir()
    figures = evaluate.run(config, inputs, out, make_ctx(seed=3))
    return figures, json.loads((out / figures["results"]).read_text())


@pytest.mark.slow
def test_topic_glue_and_custom_tasks_end_to_end(upstream, tmp_path, make_ctx):
    tasks = [
        TaskConfig(lr=3e-3, epochs=8),
        TaskConfig(kind="glue", name="sst2", path=str(upstream["root"] / "glue"), lr=3e-3),
        TaskConfig(
            kind="custom",
            name="lengths",
            path=str(upstream["root"] / "lengths"),
            text_fields=("text",),
            label_field="score",
            metrics=("spearman", "pearson"),
        ),
    ]
    config = fp32(tasks=tasks, epochs=2, seeds=3, max_length=32, buckets=(16, 32), compile=False)
    figures, results = run_stage(config, upstream["inputs"], tmp_path, make_ctx)

    topic = results["tasks"]["topic"]
    assert topic["seeds"] == [3, 4, 5] and topic["train_examples"] + topic["test_examples"]["test"] == 120
    # every hyper-parameter that produced the score is recorded beside it
    assert topic["settings"] == {
        "batch_size": config.batch_size,
        "warmup": config.warmup,
        "weight_decay": 0.0,
        "dropout": config.dropout,
        "pooling": "first",
        "head": "cramming",
        "head_width": config.head_width,
        "buckets": [16, 32],
        "betas": [0.9, 0.98],
        "eps": 1e-6,
        "clip_norm": 0.0,
        "schedule": "cosine",
    }
    for task in results["tasks"].values():
        for test, by_metric in task["scores"].items():
            for metric, per_seed in by_metric.items():
                assert len(per_seed) == 3
                assert task["median"][test][metric] == pytest.approx(float(np.median(per_seed)))
        assert task["time_s"] > 0 and set(task["baseline"]) == set(task["scores"])
    assert results["tasks"]["lengths"]["baseline"]["test"] == {"spearman": 0.0, "pearson": 0.0}
    # the topic words make the task easy: fine-tuning must beat always answering the commonest topic
    assert figures["topic_accuracy"] > figures["topic_baseline"] + 0.2
    assert results["glue"] == {
        "average": pytest.approx(results["tasks"]["sst2"]["median"]["test"]["accuracy"]),
        "sets": ["sst2/test"],
    }
    assert 0 < figures["mlm_loss"] < 2 * math.log(100)  # finite, at most about twice a uniform guess's
    for key in ("mlm_accuracy", "topic_macro_f1", "sst2_accuracy", "sst2_baseline", "glue_average"):
        assert 0 <= figures[key] <= 1, key
    assert -1 <= figures["lengths_spearman"] <= 1 and figures["lengths_baseline"] == 0.0
    assert results["mlm"]["masked_tokens"] == 24 * 8  # round(0.25 * 32) per block


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_compiled_graphs_are_bounded_by_the_buckets(upstream, tmp_path, make_ctx, precision):
    task = TaskConfig(
        kind="custom",
        name="lengths",
        path=str(upstream["root"] / "lengths"),
        text_fields=("text",),
        label_field="score",
        metrics=("pearson",),
    )
    # batch_size 1: each step's shape is its example's bucket, so all three buckets are trained on, in a
    # random order, over 2 seeds x 2 epochs x 24 steps.
    config = fp32(
        tasks=[task],
        epochs=2,
        seeds=2,
        batch_size=1,
        eval_batch_size=2,
        max_length=32,
        buckets=(8, 16, 32),
        mlm_batch_size=16,
        backend="aot_eager",
        precision=precision,
    )
    before = counters["stats"]["unique_graphs"]
    run_stage(config, upstream["inputs"], tmp_path, make_ctx)
    # 3 fine-tune graphs + 3 prediction graphs + 1 masked-LM graph (its last, short batch runs eagerly);
    # the canary runs the same fine-tune and prediction graphs (rate 0, prediction's rows): none of its own
    assert counters["stats"]["unique_graphs"] - before == 3 + 3 + 1


def test_masked_lm_numbers_repeat_exactly(upstream, tmp_path, make_ctx):
    config = fp32(tasks=[], compile=False, mlm_batch_size=16)
    first, _ = run_stage(config, upstream["inputs"], tmp_path, make_ctx, "a")
    second, _ = run_stage(config, upstream["inputs"], tmp_path, make_ctx, "b")
    other, _ = run_stage(dataclasses.replace(config, mlm_seed=1), upstream["inputs"], tmp_path, make_ctx, "c")
    assert first == second
    assert other["mlm_loss"] != first["mlm_loss"]


def test_held_out_blocks_are_masked_at_mlm_mask_rate_when_given(upstream, tmp_path, make_ctx):
    config = fp32(tasks=[], compile=False, mlm_batch_size=16)
    _, own = run_stage(config, upstream["inputs"], tmp_path, make_ctx, "own")  # pretraining's 0.25
    _, half = run_stage(dataclasses.replace(config, mlm_mask_rate=0.5), upstream["inputs"], tmp_path, make_ctx, "half")
    assert (own["mlm"]["mask_rate"], half["mlm"]["mask_rate"]) == (0.25, 0.5)
    assert half["mlm"]["masked_tokens"] == 2 * own["mlm"]["masked_tokens"]  # round(rate * 32) per block
    with pytest.raises(ValueError, match="mlm_mask_rate"):
        Config(mlm_mask_rate=1.0)


def test_a_length_past_the_largest_bucket_is_refused_naming_the_bucket_to_add():
    task = TaskConfig(kind="retrieval", name="scifact", path="beir/scifact", max_length=256)
    with pytest.raises(ValueError, match=r"tasks\[0\].max_length: 256 .* add 256 to buckets \(now \[32, 64, 128\]\)"):
        Config(tasks=[task])
    assert Config(tasks=[task], buckets=(32, 64, 128, 256)).tasks[0].max_length == 256
    with pytest.raises(ValueError, match=r"max_length: 2 must be in \[3, the largest bucket 128\]$"):
        Config(max_length=2)


def test_mlm_corruption_bert_masks_held_out_blocks_80_10_10_whatever_pretraining_used(upstream, tmp_path, make_ctx):
    config = fp32(tasks=[], compile=False, mlm_batch_size=16)
    pretrain = upstream["inputs"]["pretrain"]
    masking = {**pretrain.outputs["masking"], "mask_token": 1.0, "random_token": 0.0}
    all_mask = {**upstream["inputs"], "pretrain": Upstream(pretrain.dir, {**pretrain.outputs, "masking": masking})}
    bert, _ = run_stage(config, upstream["inputs"], tmp_path, make_ctx, "bert")  # pretrained at 80/10/10
    own, _ = run_stage(config, all_mask, tmp_path, make_ctx, "own")
    both, _ = run_stage(dataclasses.replace(config, mlm_corruption="bert"), all_mask, tmp_path, make_ctx, "both")
    assert both["mlm_loss"] == bert["mlm_loss"] != own["mlm_loss"]


def test_a_model_with_more_rows_than_tokens_is_evaluated_masking_within_the_tokenizer(
    upstream, tmp_path, make_ctx, monkeypatch
):

    from cram.stages.shared import masking

    # ModernBERT pads its 50280 tokens to 50368 rows: the extra rows are never an input.
    wider = _with_model(upstream, tmp_path, model.ModelConfig(vocab_size=128, **CFG), "wider")
    specs, mask_spec = [], masking.mask_spec
    monkeypatch.setattr(masking, "mask_spec", lambda *args: specs.append(mask_spec(*args)) or specs[-1])
    figures, _ = run_stage(fp32(tasks=[], compile=False, mlm_batch_size=16), wider, tmp_path, make_ctx)
    assert figures["mlm_loss"] > 0 and [spec.vocab_size for spec in specs] == [100]


def test_held_out_masked_lm_at_every_trained_length(upstream, tmp_path, make_ctx):
    config = fp32(tasks=[], compile=False, mlm_batch_size=16)
    two = _with(upstream, tmp_path, "pretrain", seq_lens=[16, 32])
    figures, results = run_stage(config, two, tmp_path, make_ctx, "two")
    at_32, _ = run_stage(config, upstream["inputs"], tmp_path, make_ctx, "one")
    assert figures["mlm_loss"] == figures["mlm_loss@16"] and figures["mlm_loss@32"] == at_32["mlm_loss"]
    assert results["mlm"]["by_length"]["16"]["blocks"] == 48 and "mlm_loss@32" not in at_32
    # A length the user lists: refused beyond sinusoidal (or learned) positions, or beyond the val data.
    with pytest.raises(StageError, match="128 is beyond the model's 64 sinusoidal positions"):
        run_stage(dataclasses.replace(config, mlm_lengths=(128,)), upstream["inputs"], tmp_path, make_ctx, "far")
    inputs = _with_model(upstream, tmp_path, model.ModelConfig(vocab_size=100, **{**CFG, "position": "rope"}), "rope")
    beyond, by = run_stage(dataclasses.replace(config, mlm_lengths=(32, 128)), inputs, tmp_path, make_ctx, "rope")
    # rope computes its positions at any length; a fresh model's loss is about ln(vocab 100) = 4.6
    for length, blocks in ((32, 24), (128, 6)):  # pack's 768 val tokens cut into blocks of each length
        assert 0 < beyond[f"mlm_loss@{length}"] < 2 * math.log(100)
        assert by["mlm"]["by_length"][str(length)]["blocks"] == blocks
    with pytest.raises(StageError, match="pack's val .768 tokens. holds no block that long"):
        run_stage(dataclasses.replace(config, mlm_lengths=(1024,)), inputs, tmp_path, make_ctx, "long")


def _with_model(upstream, tmp_path, cfg, name):
    """The upstream with pretrain's model replaced by a fresh one of `cfg`, saved as `name`.*."""

    save_file(model.init(cfg, 0), str(tmp_path / f"{name}.safetensors"))
    (tmp_path / f"{name}.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return _with(
        upstream,
        tmp_path,
        "pretrain",
        params=str(tmp_path / f"{name}.safetensors"),
        model_config=str(tmp_path / f"{name}.json"),
    )


def _with(upstream, tmp_path, stage, **outputs):
    inputs = dict(upstream["inputs"])
    inputs[stage] = Upstream(inputs[stage].dir, {**inputs[stage].outputs, **outputs})
    return inputs


def test_bad_input_is_a_stage_error(upstream, tmp_path, make_ctx):
    wrong_vocab = tmp_path / "model.json"
    wrong_vocab.write_text(json.dumps(dataclasses.asdict(model.ModelConfig(vocab_size=99, **CFG))))
    fits = fp32(tasks=[TaskConfig()], max_length=32, buckets=(16, 32))
    cases = [
        (
            fits,
            _with(upstream, tmp_path, "pretrain", model_config=str(wrong_vocab)),
            "vocab_size 99 is below the tokenizer's 100 tokens",
        ),
        (fits, _with(upstream, tmp_path, "tokenize", heldout=None), "needs the tokenize stage's held-out articles"),
        (
            dataclasses.replace(fits, tasks=[TaskConfig(kind="glue", name="rte", path=str(tmp_path))]),
            upstream["inputs"],
            r"evaluate.tasks\[0\].path: .* holds no GLUE rte data",
        ),
        (
            fp32(tasks=[TaskConfig()], max_length=100, buckets=(32, 128)),
            upstream["inputs"],
            r"evaluate.max_length: 100 pads to 128, beyond the model's 64 positions",
        ),
    ]
    for i, (config, inputs, message) in enumerate(cases):
        with pytest.raises(StageError, match=message):
            run_stage(config, inputs, tmp_path, make_ctx, f"case{i}")


def test_pairs_are_cut_longest_first_as_the_fast_tokenizer_does():
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(12)]
    fast = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    fast.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    for len_a in range(12):
        for len_b in range(12):
            for budget in range(1, 14):
                fast.enable_truncation(budget, strategy="longest_first")
                cut = fast.encode(" ".join(words[:len_a]), " ".join(words[:len_b]))
                kept_a = cut.sequence_ids.count(0)  # no special tokens here: every id is one text's
                assert batches.longest_first(len_a, len_b, budget) == (kept_a, len(cut.ids) - kept_a)
    row = batches.join(([10, 11, 12, 13], [20, 21]), SPECIAL_IDS, max_length=7)
    assert row.tolist() == [2, 10, 11, 3, 20, 21, 3]
    assert batches.join(([10, 11, 12, 13],), SPECIAL_IDS, max_length=4).tolist() == [2, 10, 11, 3]


EVALUATE_WORKER = """
import json, os, pickle, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import structlog
import torch.distributed as dist
from cram.stages import Context, evaluate
job = pickle.loads(Path(sys.argv[1]).read_bytes())
dist.init_process_group("gloo")
if os.environ.get("FAIL_ON_RANK") == str(dist.get_rank()):
    import cram.stages.finetuning.finetune as finetune
    def broken(*args, **kwargs):
        raise RuntimeError("injected")
    finetune.finetune_seed = broken
ctx = Context(seed=3, device="cpu", run_dir=Path(job["out_dir"]).parent, log=structlog.get_logger(),
              rank=dist.get_rank(), world_size=dist.get_world_size())
out = evaluate.run(job["config"], job["inputs"], Path(job["out_dir"]), ctx)
Path(job["out_dir"], f"rank{ctx.rank}.json").write_text(json.dumps(out))
# As the CLI does: the runner's barrier ends every stage, then the group is torn down. A rank that
# exits while its peer still works can abort in gloo's teardown ("terminate called without an
# active exception"), seen here about one run in ten without the barrier.
dist.barrier()
dist.destroy_process_group()
"""


def without_times(results: dict) -> dict:
    return {
        **results,
        "mlm": {k: v for k, v in results["mlm"].items() if k != "time_s"},
        "tasks": {n: {k: v for k, v in t.items() if k != "time_s"} for n, t in results["tasks"].items()},
    }


def run_under_torchrun(config, inputs, tmp_path, port: int, **env):
    """evaluate's `run` on 2 gloo ranks (EVALUATE_WORKER); returns (completed process, output folder)."""
    import pickle
    import subprocess
    import sys

    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    job = tmp_path / "job.pkl"
    job.write_bytes(pickle.dumps({"config": config, "inputs": inputs, "out_dir": str(out_dir)}))
    (tmp_path / "worker.py").write_text(EVALUATE_WORKER)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(port),
            str(tmp_path / "worker.py"),
            str(job),
            str(REPO),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    return result, out_dir


@pytest.mark.slow
def test_under_torchrun_ranks_share_the_seeds_and_match_one_process(upstream, tmp_path, make_ctx, free_port):
    from cram.stages.evaluating.scoring import share_out

    assert sorted(share_out([5, 1, 4, 2, 3, 3], 2)) == [0, 0, 0, 1, 1, 1]  # 9 and 9: balanced
    tasks = [TaskConfig(lr=3e-3, epochs=1), TaskConfig(kind="glue", name="sst2", path=str(upstream["root"] / "glue"))]
    config = fp32(tasks=tasks, epochs=1, seeds=3, max_length=32, buckets=(32,), compile=False, mlm_batch_size=16)
    figures, alone = run_stage(config, upstream["inputs"], tmp_path, make_ctx)

    result, out_dir = run_under_torchrun(config, upstream["inputs"], tmp_path, free_port())
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads((out_dir / "results.json").read_text())
    assert without_times(ranks) == without_times(alone)
    assert json.loads((out_dir / "rank1.json").read_text()) == {"results": "results.json"}
    # The kept classifiers are the best across ranks, written once, by the rank that trained each.
    import torch
    from safetensors.torch import load_file

    kept = json.loads((out_dir / "rank0.json").read_text())["classifiers"]
    assert kept == figures["classifiers"] and set(kept) == {"topic", "sst2"}
    files = {p.relative_to(tmp_path / "out") for p in (tmp_path / "out" / "classifiers").rglob("*") if p.is_file()}
    assert files == {p.relative_to(out_dir) for p in (out_dir / "classifiers").rglob("*") if p.is_file()}
    assert len(files) == 6  # two tasks, one seed each, three files
    for name in (f for f in files if f.suffix == ".safetensors"):
        alone_params, rank_params = load_file(tmp_path / "out" / name), load_file(out_dir / name)
        assert all(torch.equal(alone_params[k], rank_params[k]) for k in alone_params)


@pytest.mark.slow
def test_under_torchrun_a_failing_rank_fails_every_rank_without_hanging(upstream, tmp_path, free_port):
    config = fp32(tasks=[TaskConfig(epochs=1)], seeds=2, max_length=32, buckets=(32,), compile=False)
    result, out_dir = run_under_torchrun(config, upstream["inputs"], tmp_path, free_port(), FAIL_ON_RANK="1")
    # Rank 1 fails in its first fine-tune; rank 0 learns it at the gather and fails alike.
    assert result.returncode != 0 and result.stderr.count("rank 1: RuntimeError: injected") >= 2
    assert not (out_dir / "results.json").exists()


def test_auto_precision_falls_back_when_the_compiled_fine_tune_step_is_wrong(upstream, tmp_path, make_ctx, monkeypatch):
    from structlog.testing import capture_logs
    from test_precision import wrong_in_bf16

    from cram.model import classifier
    from cram.stages.shared import device as devices

    monkeypatch.setattr(devices, "native_cpu_bf16", lambda: True)
    monkeypatch.setattr(classifier, "make_finetune_step", wrong_in_bf16(classifier.make_finetune_step, True))
    eager_predict = classifier.make_classify_eval_step  # right in every precision; nothing compiles
    monkeypatch.setattr(
        classifier,
        "make_classify_eval_step",
        lambda cfg, how, **kw: eager_predict(cfg, how.eager(), **kw),
    )
    config = Config(
        tasks=[TaskConfig(kind="heldout-topic", name="topic", epochs=1, seeds=1)],
        batch_size=8,
        buckets=(32,),
        max_length=32,
        mlm=False,
        backend="inductor",
        precision="auto",
    )
    with capture_logs() as logs:
        out, results = run_stage(config, upstream["inputs"], tmp_path, make_ctx)
    assert out["precision"] == "fp32" and "in bf16 by inf" in out["precision_reason"]
    assert [e["precision"] for e in logs if e["event"] == "canary"] == ["bf16", "bf16 with 256-bit vector code", "fp32"]
    assert results["precision"] == {"name": "fp32", "reason": out["precision_reason"]}
    assert np.isfinite(results["tasks"]["topic"]["train_loss"][0])


@pytest.mark.parametrize("keep", ["best", "all", "none"])
def test_keep_writes_the_best_every_or_no_seed_classifier(upstream, tmp_path, make_ctx, keep):
    import torch
    from safetensors.torch import load_file

    from cram.stages.shared.precision import FP32
    from cram.stages.shared.tokenizer import load as load_tokenizer

    config = fp32(
        tasks=[TaskConfig(lr=3e-3, epochs=2)], seeds=2, max_length=32, buckets=(32,), compile=False, keep=keep
    )
    config = dataclasses.replace(config, mlm=False, head="auto")
    figures, results = run_stage(config, upstream["inputs"], tmp_path, make_ctx)
    folder = tmp_path / "out" / "classifiers" / "0-topic"
    if keep == "none":
        assert "classifiers" not in figures and not folder.exists()
        return
    scores = results["tasks"]["topic"]["scores"]["test"]["accuracy"]
    best = results["tasks"]["topic"]["seeds"][scores.index(max(scores))]
    assert figures["classifiers"] == {"topic": f"classifiers/0-topic/seed-{best}"}
    seeds = results["tasks"]["topic"]["seeds"] if keep == "all" else [best]
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"seed-{s}" for s in seeds)
    kept = tmp_path / "out" / figures["classifiers"]["topic"]
    meta = json.loads((kept / "classifier.json").read_text())
    assert meta["seed"] == best and meta["score"] == max(scores) and meta["labels"] == sorted(TOPICS)
    assert meta["head"] == "cramming"  # "auto": the test model (cramming's layout) maps onto no transformers family
    assert (meta["text_fields"], meta["max_length"], meta["tokenizer"]["file"]) == (["text"], 32, "tokenizer.model")
    params = load_file(kept / "params.safetensors")
    assert not any(k.startswith("head.") for k in params) and params["classifier.out.weight"].shape[0] == 3
    # The kept params are the fine-tuned ones: they reproduce the reported test accuracy.
    cfg = model.ModelConfig.from_json(kept / "model.json")
    settings = dataclasses.replace(config.linked({}), head=meta["head"])
    tuner = finetune.Tuner.make(settings.tuning(), cfg, params, SPECIAL_IDS, torch.device("cpu"), FP32)
    task = finetune.load_task(config.tasks[0], 0, upstream["inputs"]["tokenize"])
    tokenizer = load_tokenizer(upstream["inputs"]["tokenize"].path("tokenizer"))
    rows, lengths, labels = finetune.encode(task, tokenizer, SPECIAL_IDS, 32).tests["test"]
    assert float((tuner.outputs(params, rows, lengths).argmax(-1) == labels).mean()) == pytest.approx(max(scores))
