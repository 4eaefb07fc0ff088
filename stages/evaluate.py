"""The evaluate stage: what pretraining bought, measured the way the cramming paper reports it.

- Masked-LM loss and accuracy on the pack stage's held-out blocks, masked as in pretraining but with a
  fixed seed, so a re-run gives the same numbers.
- Fine-tuning tasks (`stages/finetuning/tasks.py` loads them): the held-out Wikipedia articles' topics, GLUE, or a
  custom CSV / JSON-lines task. Every task and seed starts from the pretrained params with a fresh
  head; the median over seeds is reported beside the majority-class baseline.

Fine-tuning (`stages/finetuning/finetune.py`) is compiled: the step (forward, loss, gradient, AdamW) is one
graph and prediction another, each compiled at most once per length bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from cram.stages import Context, StageError, Upstream
from cram.stages.finetuning.checks import (
    check_against_the_model,
    check_lengths,
    check_pooler,
    check_task,
    init_model,
    topic_gap,
)
from cram.stages.finetuning.finetune import load_task
from cram.stages.finetuning.heldout import HeldOut, evaluate_mlm
from cram.stages.finetuning.metrics import METRICS, REGRESSION_METRICS
from cram.stages.finetuning.tasks import GLUE
from cram.stages.shared import device as devices
from cram.stages.shared import precision as precisions
from cram.stages.shared.files import files_under, write_atomic
from cram.stages.shared.files import fingerprint as fingerprint_files

NAME = "evaluate"
VERSION = "4"
UPSTREAM = ("tokenize", "pack", "pretrain")
RESUMABLE = False
DISTRIBUTED = True  # under torchrun every rank fine-tunes a share of the (task, seed) pairs
# Added after the key was fixed: at its default it measures what evaluate measured before.
NEW_OPTIONS = ("mlm_lengths", "canary_steps", "canary_tolerance", "keep", "head", "mlm_corruption")


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
                raise ValueError(
                    f"metrics: {list(self.metrics)} mixes regression "
                    f"({', '.join(REGRESSION_METRICS)}) and classification"
                )
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


DEFAULT_TASK = TaskConfig(epochs=2, seeds=3, lr=1e-3, max_length=64)


@dataclass(frozen=True)
class Config:
    # Fine-tuning follows cramming's GLUE rules: one set of hyper-parameters for every task.
    # The default: the held-out topics, sized for the default CPU pipeline (about a minute on 2
    # cores). Minutes of pretraining leave a tiny model that learns nothing at GLUE's 4e-5 in 2 epochs.
    # Without labelled held-out articles it is left out (`_fitting_tasks`): a default must fit any corpus.
    tasks: list[TaskConfig] = field(default_factory=lambda: [DEFAULT_TASK])
    epochs: int = 5
    batch_size: int = 16
    lr: float = 4e-5
    warmup: float = 0.1  # cosine decay after a linear warm-up over this fraction of the steps
    weight_decay: float = 0.0  # cramming fine-tunes without weight decay
    max_length: int = 128  # tokens per example, [CLS] and [SEP]s included; longer texts are cut
    buckets: tuple[int, ...] = (32, 64, 128)  # padded batch lengths: one compiled graph each, at most
    # first: the [CLS] token; mean: the mean over real tokens; pooler: the first token through a head whose
    # dense layer starts as the checkpoint's pooler (BERT's; head_width = 0). auto: the pooling of
    # pretrain.init's sentence-transformers folder where it names one, else first (resolved at load, `linked`).
    pooling: Literal["auto", "first", "mean", "pooler"] = "auto"
    head_width: int = 1024  # the classifier head's dense layer (cramming's); 0: the model's hidden size
    dropout: float = 0.1  # fine-tuning only: embeddings, attention, hidden and the head (cramming's)
    seeds: int = 5
    eval_batch_size: int = 128
    mlm: bool = True  # the held-out masked-LM loss and accuracy
    mlm_seed: int = 0  # masks the held-out blocks: fixed, so re-runs agree; 0 is pretrain's val-loss masking
    # 0: mask the held-out blocks at pretraining's rate; else at this one, so that runs trained at
    # different masking rates (a sweep) compare on one held-out loss.
    mlm_mask_rate: float = 0.0
    # "pretrain": corrupt the held-out masked tokens as pretraining did (pretrain.masking.mask_token and
    # random_token); "bert": BERT's 80/10/10 whatever pretraining used, so that runs trained with other
    # corruptions (all [MASK]) compare on one held-out loss.
    mlm_corruption: Literal["pretrain", "bert"] = "pretrain"
    mlm_batch_size: int = 128
    # The held-out masked-LM at each of these block lengths (`mlm_loss@L` when more than one); empty:
    # the lengths pretrain trained at. `mlm_loss` stays the first length's.
    mlm_lengths: tuple[int, ...] = ()
    compile: bool = True
    backend: str = "inductor"
    # auto: bf16 autocast on CUDA and on CPUs with native bf16, where the compiled fine-tune step agrees
    # with eager (the canary), else fp32 (stages/shared/precision.py)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Before the first fine-tune: this many steps of the first task compiled and eagerly from the same
    # params (dropout off), and their predictions; a relative difference above the tolerance tries the
    # next precision, or stops the stage. 0: off (and off when compile is false).
    canary_steps: int = 2
    canary_tolerance: float = 0.02
    # Per task, the fine-tuned classifier (encoder and head) of its best seed by the reported score,
    # of every seed, or of none: outputs `classifiers/` (stages/finetuning/kept.py), which
    # `cram export RUN --task NAME` and `cram predict RUN --task NAME` read.
    keep: Literal["best", "all", "none"] = "best"
    # The classifier head (model/classifier.py): cramming's (`head_width` wide, the default), or the one
    # of transformers' BERT, RoBERTa or ModernBERT ...ForSequenceClassification (the hidden size wide),
    # which export exactly; "auto": the head of the family the model maps onto (model/hf.py), else cramming's.
    head: Literal["cramming", "auto", "bert", "roberta", "modernbert"] = "cramming"

    def __post_init__(self) -> None:
        positive = ("epochs", "batch_size", "max_length", "seeds", "eval_batch_size", "mlm_batch_size")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: {getattr(self, key)} must be >= 1")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(f"lr, weight_decay: {self.lr}, {self.weight_decay} must be > 0 and >= 0")
        if self.head_width < 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"head_width, dropout: {self.head_width}, {self.dropout} must be >= 0 and in [0, 1)")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup: {self.warmup} must be in [0, 1)")
        if self.canary_steps < 0 or not self.canary_tolerance > 0:
            raise ValueError(
                f"canary_steps, canary_tolerance: {self.canary_steps}, {self.canary_tolerance} must be >= 0 and > 0"
            )
        if any(length < 1 for length in self.mlm_lengths):
            raise ValueError(f"mlm_lengths: {list(self.mlm_lengths)} must be lengths of at least 1")
        if not 0 <= self.mlm_mask_rate < 1:
            raise ValueError(f"mlm_mask_rate: {self.mlm_mask_rate} must be in [0, 1); 0 keeps pretraining's rate")
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

    def linked(self, sections: dict[str, Any]) -> Config:
        """`pooling = "auto"` is the pooling that `pretrain.init`'s sentence-transformers folder names ("mean"
        or "first"), else "first": resolved here, so the cache key holds the pooling that runs."""
        if self.pooling != "auto":
            return self
        from cram.stages.shared import pretrained

        init, pooling = getattr(sections.get("pretrain"), "init", ""), None
        if init:
            try:
                pooling = pretrained.locate(Path(init)).pooling
            except pretrained.PretrainedError:  # pretrain's validate names it
                pass
        return dataclasses.replace(self, pooling=pooling or "first")

    def setting(self, task: TaskConfig, key: str) -> Any:
        """The task's own `key` (epochs, seeds, lr or max_length), or the stage's when it has none."""
        own = getattr(task, key)
        return getattr(self, key) if own is None else own


def fingerprint(config: Config) -> list[list[Any]]:
    """What the runner adds to this stage's key besides the config: path, size and modification
    time of every file a task reads from disk (a custom task's folder, a local GLUE folder), so that
    editing a task's data re-runs the stage. A folder that is missing now is left to `validate`."""
    files = []
    for task in config.tasks:
        root = Path(task.path).expanduser()
        if task.kind != "heldout-topic" and task.path and root.is_dir():
            files += fingerprint_files(files_under(root))
    return files


def validate_runtime(config: Config, pipeline: Any) -> None:
    """What `validate` leaves to a stage that runs in this invocation, since it loads torch: the device
    and the compile backend."""
    devices.check(pipeline.run.device)
    devices.check_backend(config.backend, "evaluate.backend")


def validate(config: Config, pipeline: Any) -> None:
    """What `run` would reject before it fine-tunes anything, checked by the runner before the first
    stage runs, with no torch: the held-out masking seed, each local task's files (read in full:
    fields, labels, encoding), a held-out-topic task that the tokenize stage's settings leave without
    articles (the default task is then left out, not refused), and the lengths and masking rate
    against the model (`check_against_the_model`)."""
    tokenize, pack = pipeline.stages.get("tokenize"), pipeline.stages.get("pack")
    if not 0 <= config.mlm_seed < 2**63:
        raise StageError(f"evaluate.mlm_seed: {config.mlm_seed} must be in [0, 2**63 - 1]")
    if tokenize is not None:
        config = _fitting_tasks(config, lambda: topic_gap(tokenize))
    for i, task in enumerate(config.tasks):
        check_task(config, task, f"evaluate.tasks[{i}]", i, tokenize, pack)
    if pack is not None:
        check_against_the_model(config, pipeline.stages.get("pretrain"), pack.seq_len)
    if config.pooling == "pooler":
        pretrain = pipeline.stages.get("pretrain")
        started = "pretrain.init's checkpoint" if getattr(pretrain, "init", "") else "a model pretrained from scratch"
        check_pooler(config, init_model(pretrain), started)


def describe(config: Config, pipeline: Any) -> str:
    """For a dry run: each task's fine-tune steps per seed (epochs x ceil(train examples / batch_size)),
    where its local files tell them; a held-out-topic task's examples are known only after tokenize,
    a GLUE task's from the hub once fetched."""
    if (tokenize := pipeline.stages.get("tokenize")) is not None:
        config = _fitting_tasks(config, lambda: topic_gap(tokenize))
    parts = []
    for i, task in enumerate(config.tasks):
        epochs, seeds = config.setting(task, "epochs"), config.setting(task, "seeds")
        if task.kind == "heldout-topic":
            steps = "steps known after tokenize"
        elif not task.path:
            steps = "steps known once fetched from the hub"
        else:
            batches = math.ceil(len(load_task(task, i, None).train.labels) / config.batch_size)
            steps = f"{_count(epochs * batches, 'step')} ({_count(epochs, 'epoch')} x {_count(batches, 'batch')}"
            steps += f" of {config.batch_size})"
        parts.append(f"{task.name} {steps} x {_count(seeds, 'seed')}")
    return "fine-tunes " + "; ".join(parts) if parts else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('ch') else 's'}"


def _fitting_tasks(config: Config, gap: Callable[[], str | None], log: Any = None) -> Config:
    """`config` without its default topic task when `gap()` says why the corpus gives it nothing to
    classify (noted in `log`): only the masked-LM numbers then. A topic task the config names itself
    is kept, to be refused; `gap` is asked only about the default task."""
    if config.tasks != [DEFAULT_TASK]:
        return config
    reason = gap()
    if reason is None:
        return config
    if log is not None:
        log.info("no topic task", reason=f"the default task, kind 'heldout-topic', {reason}")
    return dataclasses.replace(config, tasks=[])


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    from cram.model.hf import family_head
    from cram.stages.finetuning.kept import Keeper, best_jobs

    config = _fitting_tasks(config, lambda: _heldout_gap(inputs["tokenize"]), ctx.log).linked({})
    cfg, params, tokenizer = _load_checkpoint(inputs["pretrain"], inputs["tokenize"])
    if config.head == "auto":
        config = dataclasses.replace(config, head=family_head(cfg) or "cramming")
    check_lengths(config, cfg.max_seq_len)
    if config.pooling == "pooler":
        check_pooler(config, cfg, str(inputs["pretrain"].path("model_config")))
    seeds = [[ctx.seed + k for k in range(config.setting(tc, "seeds"))] for tc in config.tasks]
    jobs = [(i, seed) for i, task_seeds in enumerate(seeds) for seed in task_seeds]
    keeper = Keeper(config.keep, out_dir, inputs["pretrain"].path("model_config"), {})
    work = functools.partial(_work, config, inputs, ctx, cfg, params, tokenizer, jobs, keeper)
    mlm, runs, prepared = work() if ctx.world_size == 1 else _on_every_rank(work, ctx)
    kept = keeper.finish(jobs, best_jobs(jobs, runs, prepared.tasks))  # every rank: the one holding a best writes it
    if not ctx.is_main:
        return {"results": "results.json"}  # rank 0 writes them
    results = _results(config, ctx, mlm, prepared.tasks, prepared.encoded, seeds, jobs, runs)
    results["precision"] = {"name": prepared.choice.precision.name, "reason": prepared.choice.reason}
    _write_json(out_dir / "results.json", results)
    ctx.metrics.log(inputs["pretrain"].outputs.get("steps", 0), _headline(results))  # at the end of pretraining
    precision = {"precision": prepared.choice.precision.name, "precision_reason": prepared.choice.reason}
    classifiers = {"classifiers": kept} if kept else {}
    return {"results": "results.json", **_headline(results), **precision, **classifiers}


def _heldout_gap(tokenize: Upstream) -> str | None:
    """Why tokenize's outputs give a held-out-topic task no articles to classify; None when they do not."""
    from cram.stages.finetuning.tasks import has_topics

    heldout = tokenize.outputs.get("heldout")
    if heldout is None:
        return "classifies the articles tokenize holds out, and it held out none"
    if not has_topics(tokenize.dir / heldout):
        return "needs labelled documents, and the held-out articles have no labels"
    return None


@dataclass(frozen=True)
class _Prepared:
    """What every rank makes alike before fine-tuning: the tasks, their encoded examples, the precision."""

    tasks: list  # (task config, task)
    encoded: list  # each task's Encoded
    choice: precisions.Choice


def _work(
    config: Config,
    inputs: dict[str, Upstream],
    ctx: Context,
    cfg: Any,
    params: dict,
    tokenizer: Any,
    jobs: list,
    keeper: Any,
) -> tuple[dict | None, dict[int, dict], _Prepared]:
    """This rank's share: the masked-LM numbers (rank 0) and its (task, seed) fine-tunes, each offered
    to `keeper` (kept.Keeper)."""
    import torch

    from cram.stages.finetuning.finetune import encode, finetune_seed, share_out
    from cram.stages.finetuning.kept import describe

    tokenize, special = inputs["tokenize"], inputs["tokenize"].outputs["special_ids"]
    # Load and tokenize every task before training any: a bad task fails the stage at once.
    tasks = [(tc, load_task(tc, i, tokenize)) for i, tc in enumerate(config.tasks)]
    encoded = [encode(task, tokenizer, special, config.setting(tc, "max_length")) for tc, task in tasks]
    keeper.meta.update({i: describe(config, tc, task, tokenize) for i, (tc, task) in enumerate(tasks)})
    costs = [len(encoded[i].train[0]) * config.setting(config.tasks[i], "epochs") for i, _ in jobs]
    owner = share_out(costs, ctx.world_size)
    device = devices.resolve(ctx.device)
    on_device = {k: v.to(device) for k, v in params.items()}
    mlm, runs = None, {}
    # Tasks share the compiled steps, so tasks with the same head shape share graphs; each head shape
    # may add one per bucket. Past dynamo's default limit of 8 graphs it would fall back to eager
    # silently: the limit is raised to what the tasks can need, and hitting it is an error.
    limit = max(8, len(config.buckets) * len(tasks))
    with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        choice, tuner = _tuner(config, cfg, on_device, special, device, tasks, encoded, ctx)
        if config.mlm and ctx.is_main and not _untrained_head(inputs["pretrain"], ctx):
            held_out = HeldOut.of(config, inputs)
            mlm = evaluate_mlm(config, cfg, on_device, held_out, device, choice.precision, ctx)
        for j, (i, seed) in enumerate(jobs):
            if owner[j] == ctx.rank:
                keep = functools.partial(keeper.offer, i, seed, tasks[i][1])
                runs[j] = finetune_seed(tuner, tasks[i][0], tasks[i][1], encoded[i], seed, ctx, keep)
    return mlm, runs, _Prepared(tasks, encoded, choice)


def _untrained_head(pretrain: Upstream, ctx: Context) -> bool:
    """Whether pretrain made a masked-LM head for a checkpoint without one and trained it not a step (a
    zero budget): its masked-LM figures would measure a random head, so there are none."""
    made = pretrain.outputs.get("head_initialised")
    if made and not pretrain.outputs.get("steps"):
        ctx.log.info("no mlm figures", reason="pretrain.init's checkpoint has no masked-LM head, and none was trained")
        return True
    return False


def _tuner(
    config: Config, cfg: Any, params: dict, special: dict, device: Any, tasks: list, encoded: list, ctx: Context
):
    """(the precision chosen, the fine-tuner in it). Compiled, each candidate precision's fine-tune step
    and prediction are checked against eager on the first task's first batch (`Tuner.canary`), and the
    first that agrees is kept (`precision.choose`)."""
    from cram.stages.finetuning.finetune import Tuner

    def make(candidate: precisions.Precision, compile: bool = config.compile):
        settings = dataclasses.replace(config, compile=compile)
        return Tuner.make(settings, cfg, params, special, device, candidate, ctx.attention)

    if not config.compile or not config.canary_steps or not tasks:
        why = "eager steps" if not config.compile else "canary_steps = 0" if not config.canary_steps else "no task"
        choice = precisions.unchecked(config.precision, device, f"{why}: no compile canary")
        return choice, make(choice.precision)

    checked: dict[precisions.Precision, Tuner] = {}  # the compiled tuner of each candidate tried

    def check(candidate: precisions.Precision) -> float:
        checked[candidate] = make(candidate)
        diff = checked[candidate].canary(
            make(candidate, compile=False), tasks[0][1].num_outputs, encoded[0].train, config.canary_steps, ctx.seed
        )
        ctx.log.info("canary", precision=candidate.label, steps=config.canary_steps, max_relative_diff=diff)
        return diff

    choice = precisions.choose(config.precision, device, config.backend, check, config.canary_tolerance, ctx.log, NAME)
    return choice, checked[choice.precision]


def _on_every_rank(work: Callable, ctx: Context) -> tuple[dict | None, dict[int, dict], _Prepared]:
    """`work` on every torchrun rank, each fine-tuning its share of the (task, seed) pairs; the one
    collective is the gather at the end, which waits only for the slowest rank's last job. A rank's
    failure is gathered too, so no rank is left waiting for one that gave up."""
    from cram.stages.shared.collectives import all_gather

    failure, mlm, runs, local = None, None, {}, None
    try:
        mlm, runs, local = work()
    except StageError as e:
        failure = (str(e), True)
    except Exception as e:  # reported by every rank below; the traceback stays in this rank's log
        ctx.log.error("evaluate raised", exc_info=True)
        failure = (f"rank {ctx.rank}: {type(e).__name__}: {e}", False)
    shared = all_gather((failure, mlm, runs), ctx.world_size)
    failures = [f for f, _, _ in shared if f is not None]
    if failures:
        message, bad_input = failures[0]
        raise StageError(message) if bad_input else RuntimeError(message)
    return shared[0][1], {j: r for _, _, rank_runs in shared for j, r in rank_runs.items()}, local


def _results(
    config: Config, ctx: Context, mlm: dict | None, tasks: list, encoded: list, seeds: list, jobs: list, runs: dict
) -> dict[str, Any]:
    """results.json: the masked-LM numbers, each task's scores over its seeds, and the GLUE average."""
    from cram.stages.finetuning.finetune import task_result
    from cram.stages.finetuning.tasks import glue_average

    results: dict[str, Any] = {} if mlm is None else {"mlm": mlm}
    results["tasks"] = {
        task.name: task_result(
            config, tc, task, encoded[i], seeds[i], [runs[j] for j, (t, _) in enumerate(jobs) if t == i], ctx
        )
        for i, (tc, task) in enumerate(tasks)
    }
    glue = {
        f"{name}/{test}": r["median"][test]
        for name, r in results["tasks"].items()
        if r["kind"] == "glue"
        for test in r["median"]
    }
    if glue:
        results["glue"] = {"average": glue_average(glue), "sets": sorted(glue)}
    return results


# -------------------------------------------------------------------------------------- checkpoint


def _load_checkpoint(pretrain: Upstream, tokenize: Upstream):
    from cram.model.config import ModelConfig, ModelConfigError
    from cram.stages.shared.tensors import nonfinite, read_tensors
    from cram.stages.shared.tokenizer import TokenizerError, load

    config_path = pretrain.path("model_config")
    try:
        cfg = ModelConfig.from_json(config_path)
        tokenizer = load(tokenize.path("tokenizer"))
    except (ModelConfigError, TokenizerError) as e:
        raise StageError(str(e)) from None
    # More embedding rows than tokens is fine (ModernBERT pads 50280 tokens to 50368 rows); fewer would
    # leave ids without a row.
    if tokenizer.vocab_size > cfg.vocab_size:
        raise StageError(
            f"{config_path}: vocab_size {cfg.vocab_size} is below the tokenizer's "
            f"{tokenizer.vocab_size} tokens ({tokenize.path('tokenizer')})"
        )
    params = read_tensors(pretrain.path("params"))
    if (bad := nonfinite(params)) is not None:
        raise StageError(f"{pretrain.path('params')}: {bad} holds NaN or inf values; no figure of it means anything")
    embedding = params.get("embed.tokens.weight")
    if embedding is None or tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden):
        shape = None if embedding is None else list(embedding.shape)
        raise StageError(
            f"{pretrain.path('params')}: embed.tokens.weight has shape {shape}, the model config says "
            f"[{cfg.vocab_size}, {cfg.hidden}]"
        )
    return cfg, params, tokenizer


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
        for length, r in results["mlm"].get("by_length", {}).items():
            figures[f"mlm_loss@{length}"] = round(r["loss"], 4)
            figures[f"mlm_accuracy@{length}"] = round(r["accuracy"], 4)
    for name, r in results["tasks"].items():
        for test, medians in r["median"].items():
            prefix = name if len(r["median"]) == 1 else f"{name}_{test}"
            figures.update({f"{prefix}_{m}": round(v, 4) for m, v in medians.items()})
            figures[f"{prefix}_baseline"] = round(r["baseline"][test][r["metrics"][0]], 4)
        figures[f"{name}_time_s"] = round(r["time_s"], 1)
    return figures


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1) + "\n")
