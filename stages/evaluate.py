"""The evaluate stage: what pretraining bought, measured the way the cramming paper reports it.

- Masked-LM loss and accuracy on the pack stage's held-out blocks, masked as in pretraining but with a
  fixed seed, so a re-run gives the same numbers.
- Fine-tuning tasks (`stages/glue.py` loads them): the held-out Wikipedia articles' topics, GLUE, or a
  custom CSV / JSON-lines task. Every task and seed starts from the pretrained params with a fresh
  head; the median over seeds is reported beside the majority-class baseline.

Fine-tuning is compiled: the step (forward, loss, gradient, AdamW) is one graph and prediction
another. Every batch has `batch_size` rows (short batches are filled with zero-weight rows) and is
padded to the smallest length bucket that fits it, so each of the two compiles at most once per
bucket and nothing recompiles from step to step.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from stages import Context, StageError, Upstream
from stages import device as devices
from stages.glue import GLUE, METRICS, REGRESSION_METRICS

NAME = "evaluate"
VERSION = "2"
UPSTREAM = ("tokenize", "pack", "pretrain")
RESUMABLE = False


@dataclass(frozen=True)
class TaskConfig:
    """One fine-tuning task, an entry of `[[evaluate.tasks]]`."""

    kind: Literal["heldout-topic", "glue", "custom"] = "heldout-topic"
    name: str = "topic"  # glue: cola, sst2, mrpc, stsb, qqp, mnli, qnli or rte; otherwise the results' label
    path: str = ""  # glue: a local GLUE directory ("" = the hub); custom: a folder with train and test files
    text_fields: tuple[str, ...] = ()  # custom: the text field, or the two fields of a pair
    label_field: str = "label"  # custom
    # custom: accuracy, f1, macro_f1, matthews, pearson, spearman (these two: regression); the first is the main
    metrics: tuple[str, ...] = ()
    test_fraction: float = 0.2  # heldout-topic: share of each topic's articles kept for testing
    epochs: int | None = None  # None: the stage's; likewise seeds, lr and max_length
    seeds: int | None = None
    lr: float | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
        if self.kind == "glue" and self.name not in GLUE:
            raise ValueError(f"name: {self.name!r} is no GLUE task; choose one of {', '.join(GLUE)}")
        if self.kind == "custom":
            if not self.path:
                raise ValueError("path: a custom task needs the folder holding its train and test files")
            if len(self.text_fields) not in (1, 2):
                raise ValueError(f"text_fields: {list(self.text_fields)} must name one text field or two (a pair)")
            if not self.metrics:
                raise ValueError(f"metrics: a custom task needs at least one of {', '.join(METRICS)}")
            unknown = [m for m in self.metrics if m not in METRICS]
            if unknown:
                raise ValueError(f"metrics: unknown metric {unknown[0]!r}; choose from {', '.join(METRICS)}")
            if len({m in REGRESSION_METRICS for m in self.metrics}) > 1:
                raise ValueError(f"metrics: {list(self.metrics)} mixes regression "
                                 f"({', '.join(REGRESSION_METRICS)}) and classification")
        elif self.text_fields or self.metrics:
            raise ValueError(f"text_fields, metrics: only a custom task takes them; {self.kind} sets its own")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction: {self.test_fraction} must be in (0, 1)")
        for key in ("epochs", "seeds"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{key}: {getattr(self, key)} must be >= 1")
        if self.max_length is not None and self.max_length < 3:
            raise ValueError(f"max_length: {self.max_length} must be >= 3 ([CLS], a token, [SEP])")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr: {self.lr} must be > 0")


@dataclass(frozen=True)
class Config:
    # Fine-tuning follows cramming's GLUE rules: one set of hyper-parameters for every task.
    # The default: the held-out topics, sized for the default CPU pipeline (about a minute on 2
    # cores). Minutes of pretraining leave a tiny model that learns nothing at GLUE's 4e-5 in 2 epochs.
    tasks: list[TaskConfig] = field(
        default_factory=lambda: [TaskConfig(epochs=2, seeds=3, lr=1e-3, max_length=64)]
    )
    epochs: int = 5
    batch_size: int = 16
    lr: float = 4e-5
    warmup: float = 0.1  # cosine decay after a linear warm-up over this fraction of the steps
    weight_decay: float = 0.0  # cramming fine-tunes without weight decay
    max_length: int = 128  # tokens per example, [CLS] and [SEP]s included; longer texts are cut
    buckets: tuple[int, ...] = (32, 64, 128)  # padded batch lengths: one compiled graph each, at most
    pooling: Literal["first", "mean"] = "first"
    seeds: int = 5
    eval_batch_size: int = 128
    mlm: bool = True  # the held-out masked-LM loss and accuracy
    mlm_seed: int = 0  # masks the held-out blocks: fixed, so every re-run gives the same numbers
    mlm_batch_size: int = 128
    compile: bool = True
    backend: str = "inductor"
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU

    def __post_init__(self) -> None:
        positive = ("epochs", "batch_size", "max_length", "seeds", "eval_batch_size", "mlm_batch_size")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: {getattr(self, key)} must be >= 1")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(f"lr, weight_decay: {self.lr}, {self.weight_decay} must be > 0 and >= 0")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup: {self.warmup} must be in [0, 1)")
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 3:
            raise ValueError(f"buckets: {list(self.buckets)} must be increasing lengths of at least 3")
        lengths = {"max_length": self.max_length}
        lengths.update({f"tasks[{i}].max_length": t.max_length for i, t in enumerate(self.tasks)})
        for key, length in lengths.items():
            if length is not None and not 3 <= length <= self.buckets[-1]:
                raise ValueError(f"{key}: {length} must be in [3, the largest bucket {self.buckets[-1]}]")
        names = [t.name for t in self.tasks]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tasks: the name {repeated[0]!r} is used twice; results are keyed by name")

    def setting(self, task: TaskConfig, key: str) -> Any:
        """The task's own `key` (epochs, seeds, lr or max_length), or the stage's when it has none."""
        own = getattr(task, key)
        return getattr(self, key) if own is None else own


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    import torch

    tokenize, pack, pretrain = inputs["tokenize"], inputs["pack"], inputs["pretrain"]
    cfg, params, tokenizer = _load_checkpoint(pretrain, tokenize)
    for i, task_cfg in enumerate(config.tasks):
        max_length = config.setting(task_cfg, "max_length")
        if _bucket(max_length, config.buckets) > cfg.max_seq_len:
            key = "max_length" if task_cfg.max_length is None else f"tasks[{i}].max_length"
            raise StageError(f"evaluate.{key}: {max_length} pads to {_bucket(max_length, config.buckets)}, "
                             f"beyond the model's {cfg.max_seq_len} positions")
    special = tokenize.outputs["special_ids"]
    # Load and tokenize every task before training any: a bad task fails the stage at once.
    tasks = [(tc, _load_task(tc, i, tokenize)) for i, tc in enumerate(config.tasks)]
    encoded = [_encode(task, tokenizer, special, config.setting(tc, "max_length")) for tc, task in tasks]

    device = devices.resolve(ctx.device)
    autocast = devices.autocast_dtype(config.precision, device)
    params = {k: v.to(device) for k, v in params.items()}
    tuner = _Tuner.make(config, cfg, params, special, device, autocast)
    results: dict[str, Any] = {}
    # Tasks share the compiled steps, so tasks with the same head shape share graphs; each head shape
    # may add one per bucket. Past dynamo's default limit of 8 graphs it would fall back to eager
    # silently: the limit is raised to what the tasks can need, and hitting it is an error.
    limit = max(8, len(config.buckets) * len(tasks))
    with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        if config.mlm:
            masking = pretrain.outputs["masking"]
            results["mlm"] = _evaluate_mlm(config, cfg, params, pack, masking, special, device, autocast, ctx)
        results["tasks"] = {task.name: _finetune_task(tuner, tc, task, data, ctx)
                            for (tc, task), data in zip(tasks, encoded)}
    glue = {f"{name}/{test}": r["median"][test]
            for name, r in results["tasks"].items() if r["kind"] == "glue" for test in r["median"]}
    if glue:
        from stages.glue import glue_average

        results["glue"] = {"average": glue_average(glue), "sets": sorted(glue)}
    _write_json(out_dir / "results.json", results)
    return {"results": "results.json", **_headline(results)}


# -------------------------------------------------------------------------------------- checkpoint


def _load_checkpoint(pretrain: Upstream, tokenize: Upstream):
    import sentencepiece as spm
    from safetensors.torch import load_file

    from model import ModelConfig

    config_path = pretrain.path("model_config")
    try:
        cfg = ModelConfig(**json.loads(config_path.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise StageError(f"{config_path}: not a model config: {e}") from None
    tokenizer = spm.SentencePieceProcessor(model_file=str(tokenize.path("tokenizer")))
    if tokenizer.get_piece_size() != cfg.vocab_size:
        raise StageError(
            f"{config_path}: vocab_size {cfg.vocab_size} does not match the tokenizer's "
            f"{tokenizer.get_piece_size()} pieces ({tokenize.path('tokenizer')})"
        )
    params = load_file(pretrain.path("params"))
    embedding = params.get("embed.tokens.weight")
    if embedding is None or tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden):
        shape = None if embedding is None else list(embedding.shape)
        raise StageError(
            f"{pretrain.path('params')}: embed.tokens.weight has shape {shape}, the model config says "
            f"[{cfg.vocab_size}, {cfg.hidden}]"
        )
    return cfg, params, tokenizer




# ----------------------------------------------------------------------------------- masked LM


def _evaluate_mlm(config: Config, cfg, params, pack: Upstream, masking: dict, special, device, autocast,
                  ctx: Context) -> dict:
    """Mean loss and accuracy over every masked token of the held-out blocks, masked as in pretraining."""
    import numpy as np
    import torch

    import model
    from stages.batches import mask_seed, mask_tokens
    from stages.pretrain import Masking, mask_spec

    began = time.perf_counter()
    blocks = np.load(pack.path("val"), mmap_mode="r")
    if blocks.ndim != 2 or len(blocks) == 0:
        raise StageError(f"{pack.path('val')}: expected blocks [n, seq_len] with n > 0, got {list(blocks.shape)}")
    spec = mask_spec(Masking(**masking), special, cfg.vocab_size, blocks.shape[1])
    step = model.make_eval_step(cfg, compile=config.compile, backend=config.backend, autocast_dtype=autocast)
    # The last, shorter batch runs eagerly rather than compiling a second graph for one call.
    last_step = model.make_eval_step(cfg, compile=False, autocast_dtype=autocast)
    generator = torch.Generator(device=device)
    loss_sum = correct = count = 0.0
    for first in range(0, len(blocks), config.mlm_batch_size):
        ids = torch.from_numpy(blocks[first:first + config.mlm_batch_size].astype(np.int64)).to(device)
        generator.manual_seed(mask_seed(config.mlm_seed, first, stream=1))
        batch = mask_tokens(ids, spec, generator)
        metrics = (step if len(ids) == config.mlm_batch_size else last_step)(params, batch)
        k = batch["mlm_labels"].numel()
        loss_sum += float(metrics["loss"]) * k
        correct += float(metrics["accuracy"]) * k
        count += k
    result = {"loss": loss_sum / count, "accuracy": correct / count, "blocks": len(blocks),
              "masked_tokens": int(count), "time_s": round(time.perf_counter() - began, 3)}
    ctx.log.info("mlm", **result)
    return result


# ------------------------------------------------------------------------------------ fine-tuning


def _load_task(task_cfg: TaskConfig, index: int, tokenize: Upstream):
    from stages import glue

    where = f"evaluate.tasks[{index}]"
    if task_cfg.kind == "glue":
        return glue.load_glue(task_cfg.name, task_cfg.path, where)
    if task_cfg.kind == "custom":
        return glue.load_custom(task_cfg.name, task_cfg.path, task_cfg.text_fields, task_cfg.label_field,
                                task_cfg.metrics, where)
    heldout = tokenize.outputs.get("heldout")
    if heldout is None:
        raise StageError(
            f"{where}: kind 'heldout-topic' needs the tokenize stage's held-out articles, and it kept none "
            "(give tokenize labelled documents to hold out, or drop this task)"
        )
    return glue.load_topics(task_cfg.name, tokenize.dir / heldout, task_cfg.test_fraction)


@dataclass(frozen=True)
class _Encoded:
    """A task's examples as token ids: ragged rows, their lengths, and the labels."""

    train: tuple[list, Any, Any]  # (rows, lengths, labels)
    tests: dict[str, tuple[list, Any, Any]]


def _encode(task, tokenizer, special: dict, max_length: int) -> _Encoded:
    import numpy as np

    def split(examples) -> tuple[list, Any, Any]:
        if not examples.texts:
            raise StageError(f"task {task.name}: a split has no examples")
        columns = [tokenizer.encode([t[i] for t in examples.texts]) for i in range(len(examples.texts[0]))]
        rows = [_join(parts, special, max_length) for parts in zip(*columns)]
        return rows, np.array([len(r) for r in rows]), examples.labels

    return _Encoded(split(task.train), {name: split(test) for name, test in task.tests.items()})


def _join(parts: tuple[list[int], ...], special: dict, max_length: int):
    """[CLS] a [SEP] or [CLS] a [SEP] b [SEP], cut to `max_length` the way BERT does ("longest first")."""
    import numpy as np

    budget = max_length - 1 - len(parts)
    if len(parts) == 1:
        a, b = parts[0][:budget], None
    else:
        a, b = parts
        keep_a, keep_b = _longest_first(len(a), len(b), budget)
        a, b = a[:keep_a], b[:keep_b]
    row = [special["cls"], *a, special["sep"]] + ([] if b is None else [*b, special["sep"]])
    return np.asarray(row, dtype=np.int64)


def _longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths after removing tokens one at a time from the longer text (the second on ties)."""
    if len_a + len_b <= budget:
        return len_a, len_b
    if min(len_a, len_b) <= budget // 2:
        return (len_a, budget - len_a) if len_a <= len_b else (budget - len_b, len_b)
    return (budget + 1) // 2, budget // 2


def _finetune_task(tuner: _Tuner, task_cfg: TaskConfig, task, data: _Encoded, ctx: Context) -> dict:
    """Fine-tune and score every seed of one task; the medians, the baseline and the time it took."""
    import numpy as np

    from stages.glue import majority_baseline, score

    began = time.perf_counter()
    config = tuner.config
    epochs, lr = config.setting(task_cfg, "epochs"), config.setting(task_cfg, "lr")
    seeds = [ctx.seed + i for i in range(config.setting(task_cfg, "seeds"))]
    scores: dict[str, dict[str, list[float]]] = {t: {m: [] for m in task.metrics} for t in task.tests}
    train_loss = []
    for seed in seeds:
        params, loss = tuner.train(task.num_outputs, data.train, epochs, lr, seed)
        train_loss.append(loss)
        for test, (rows, lengths, labels) in data.tests.items():
            outputs = tuner.outputs(params, rows, lengths)
            predictions = outputs[:, 0] if task.regression else outputs.argmax(-1)
            for metric, value in score(task.metrics, predictions, labels).items():
                scores[test][metric].append(value)
        ctx.log.info("finetuned", task=task.name, seed=seed, train_loss=round(loss, 4),
                     **{f"{t}_{m}": round(v[-1], 4) for t, ms in scores.items() for m, v in ms.items()})
    result = {
        "kind": task_cfg.kind,
        "metrics": list(task.metrics),
        "labels": list(task.label_names),
        "train_examples": len(data.train[0]),
        "test_examples": {t: len(rows) for t, (rows, _, _) in data.tests.items()},
        "epochs": epochs,
        "lr": lr,
        "max_length": config.setting(task_cfg, "max_length"),
        "seeds": seeds,
        "train_loss": train_loss,
        "scores": scores,
        "median": {t: {m: float(np.median(v)) for m, v in ms.items()} for t, ms in scores.items()},
        "baseline": {t: majority_baseline(task, test) for t, test in task.tests.items()},
        "time_s": round(time.perf_counter() - began, 3),
    }
    ctx.log.info("task", task=task.name, median=result["median"], baseline=result["baseline"],
                 time_s=result["time_s"])
    return result


@dataclass(frozen=True)
class _Tuner:
    """What every fine-tune of a run shares: pretrained params, the compiled steps, batch making."""

    config: Config
    cfg: Any  # model.ModelConfig
    params: dict  # pretrained, on the device
    special: dict
    device: Any
    step: Callable  # (params, opt_state, batch, lr) -> (params, opt_state, metrics)
    predict: Callable  # (params, batch) -> logits

    @classmethod
    def make(cls, config: Config, cfg, params: dict, special: dict, device, autocast) -> _Tuner:
        import model
        from model.classifier import make_classify_eval_step, make_finetune_step

        # cramming's fine-tuning AdamW: betas (0.9, 0.98), eps 1e-6, no gradient clipping.
        opt_cfg = model.OptimizerConfig(lr=config.lr, eps=1e-6, weight_decay=config.weight_decay, clip_norm=0.0)
        kw = dict(pooling=config.pooling, compile=config.compile, backend=config.backend, autocast_dtype=autocast)
        return cls(config, cfg, params, special, device, make_finetune_step(cfg, opt_cfg, **kw),
                   make_classify_eval_step(cfg, **kw))

    def train(self, num_outputs: int, train, epochs: int, lr: float, seed: int):
        """Params fine-tuned from the pretrained ones with a fresh head, and the last epoch's mean loss."""
        import numpy as np
        import torch

        import model
        from model.classifier import init_head

        rows, lengths, labels = train
        size = self.config.batch_size
        head = init_head(self.cfg, num_outputs, seed)
        params = {**self.params, **{k: v.to(self.device) for k, v in head.items()}}
        opt_state = model.adamw_init(params)
        rng = np.random.default_rng(seed)
        steps_per_epoch = math.ceil(len(rows) / size)
        total = steps_per_epoch * epochs
        for epoch in range(epochs):
            order = rng.permutation(len(rows))
            losses = []
            for i in range(steps_per_epoch):
                batch = self.batch(rows, lengths, labels, order[i * size:(i + 1) * size], size)
                progress = (epoch * steps_per_epoch + i) / total
                lr_now = torch.tensor(lr * model.lr_schedule("cosine", progress, warmup=self.config.warmup),
                                      device=self.device)
                params, opt_state, metrics = self.step(params, opt_state, batch, lr_now)
                losses.append(metrics["loss"])
        return params, float(torch.stack(losses).mean())

    def outputs(self, params: dict, rows: list, lengths):
        """Model outputs [N, num_outputs] for every row, in the rows' order."""
        import numpy as np

        size = self.config.eval_batch_size
        order = np.argsort(lengths, kind="stable")  # similar lengths together: less padding
        no_labels = np.zeros(len(rows), dtype=np.int64)
        outputs = []
        for start in range(0, len(rows), size):
            batch = self.batch(rows, lengths, no_labels, order[start:start + size], size)
            logits = self.predict(params, {k: batch[k] for k in ("input_ids", "attention_mask")})
            outputs.append(logits[: len(order[start:start + size])].cpu().numpy())
        unsorted = np.empty_like(order)
        unsorted[order] = np.arange(len(order))
        return np.concatenate(outputs)[unsorted]

    def batch(self, rows: list, lengths, labels, index, size: int) -> dict:
        """`size` rows padded to the bucket of the longest; rows past `len(index)` are weightless fillers."""
        import numpy as np
        import torch

        pad, cls, sep = self.special["pad"], self.special["cls"], self.special["sep"]
        length = _bucket(int(lengths[index].max()), self.config.buckets)
        ids = np.full((size, length), pad, dtype=np.int64)
        ids[:, :2] = cls, sep  # fillers are [CLS] [SEP]: no row is all padding, which attention cannot take
        mask = np.zeros((size, length), dtype=bool)
        mask[:, :2] = True
        for row, i in enumerate(index):
            ids[row, : lengths[i]] = rows[i]
            mask[row, : lengths[i]] = True
        padded_labels = np.zeros(size, dtype=labels.dtype)
        padded_labels[: len(index)] = labels[index]
        weights = np.zeros(size, dtype=np.float32)
        weights[: len(index)] = 1.0
        arrays = {"input_ids": ids, "attention_mask": mask, "labels": padded_labels, "weights": weights}
        return {k: torch.from_numpy(v).to(self.device) for k, v in arrays.items()}


def _bucket(length: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= length)


# ------------------------------------------------------------------------------------------ output


def _headline(results: dict) -> dict[str, float]:
    """The figures `cram status` shows, in this order: the GLUE average, the masked-LM loss and
    accuracy, then per task its median scores, its baseline's main score and its time."""
    figures = {}
    if "glue" in results:
        figures["glue_average"] = round(results["glue"]["average"], 4)
    if "mlm" in results:
        figures["mlm_loss"] = round(results["mlm"]["loss"], 4)
        figures["mlm_accuracy"] = round(results["mlm"]["accuracy"], 4)
    for name, r in results["tasks"].items():
        for test, medians in r["median"].items():
            prefix = name if len(r["median"]) == 1 else f"{name}_{test}"
            figures.update({f"{prefix}_{m}": round(v, 4) for m, v in medians.items()})
            figures[f"{prefix}_baseline"] = round(r["baseline"][test][r["metrics"][0]], 4)
        figures[f"{name}_time_s"] = round(r["time_s"], 1)
    return figures


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
