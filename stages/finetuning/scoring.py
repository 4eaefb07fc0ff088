"""Fine-tuning an encoder on the evaluate tasks, every (task, seed) pair from the same params with a
fresh head, and the results it writes: what the evaluate stage does with pretrain's model, and the
baseline stage with the checkpoint that pretraining started from (`[evaluate] baseline`), alike.

    checkpoint = load_checkpoint(inputs["pretrain"], inputs["tokenize"])
    outputs = score(config, inputs, out_dir, ctx, checkpoint, Report("evaluate", steps))  # writes results.json
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cram.stages import Context, StageError, Upstream
from cram.stages.finetuning.checks import check_lengths, check_pooler
from cram.stages.finetuning.config import RETRIEVAL_KINDS, Config, TaskConfig, Tuning
from cram.stages.finetuning.finetune import Loaded, load_task
from cram.stages.finetuning.heldout import HeldOut, MlmSteps, evaluate_mlm, mlm_canary
from cram.stages.finetuning.versus import beside_start, start_figures
from cram.stages.retrieval.tuning import RetrievalLoaded
from cram.stages.shared import device as devices
from cram.stages.shared import precision as precisions
from cram.stages.shared.files import files_under, write_atomic
from cram.stages.shared.files import fingerprint as fingerprint_files

if TYPE_CHECKING:
    import torch
    from structlog.stdlib import BoundLogger

    from cram.model.config import ModelConfig
    from cram.stages.finetuning.finetune import Tuner
    from cram.stages.finetuning.kept import Keeper
    from cram.stages.retrieval.tuning import Embedders
    from cram.stages.shared.tokenizer import Tokenizer

RESULTS = "results.json"


@dataclass(frozen=True)
class Checkpoint:
    """The encoder fine-tuned from: its ModelConfig, fp32 params and tokenizer, and the file its ModelConfig
    is in (named in errors, copied beside a kept classifier)."""

    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer
    model_config: Path


@dataclass(frozen=True)
class Report:
    """Who scores, and what the results are reported beside: `stage` names the stage in the precision's
    log lines, `steps` is pretraining's step count the headline figures are logged at, and `start` the
    starting checkpoint's results, which each task is set beside (versus.py)."""

    stage: str
    steps: int = 0
    start: dict | None = None


def fitting_tasks(config: Config, gap: Callable[[TaskConfig], str | None], log: BoundLogger | None = None) -> Config:
    """`config` without those of its default tasks (the held-out topics, the held-out retrieval) for which
    `gap(task)` says why the corpus gives them nothing (noted in `log`): a default must fit any corpus.
    A task the config names itself is kept, to be refused; `gap` is asked only about the config class's
    own default tasks."""
    if config.tasks != type(config)().tasks:
        return config
    fitting = []
    for task in config.tasks:
        reason = gap(task)
        if reason is None:
            fitting.append(task)
        elif log is not None:
            what = "retrieval" if task.kind in RETRIEVAL_KINDS else "topic"
            log.info(f"no {what} task", reason=f"the default task, kind '{task.kind}', {reason}")
    return dataclasses.replace(config, tasks=fitting)


def score(
    config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context, checkpoint: Checkpoint, report: Report
) -> dict[str, Any]:
    """Fine-tune `checkpoint` on `config`'s tasks; rank 0 writes results.json, set beside `report.start`
    where given, and logs the headline figures at `report.steps`. Returns the stage's outputs."""
    from cram.stages.finetuning.kept import Keeper, best_jobs, kept_outputs

    cfg = checkpoint.cfg
    check_lengths(config, cfg.max_seq_len)
    if config.pooling == "pooler":
        check_pooler(config, cfg, str(checkpoint.model_config))
    jobs = [(i, ctx.seed + k) for i, tc in enumerate(config.tasks) for k in range(config.task_settings(tc).seeds)]
    keeper = Keeper(config.keep, out_dir, checkpoint.model_config, {})
    scoring = _Scoring(config, config.tuning(), inputs, ctx, checkpoint, report.stage, out_dir)
    work = functools.partial(_work, scoring, jobs, keeper)
    mlm, runs, prepared = work() if ctx.world_size == 1 else _on_every_rank(work, ctx)
    # every rank: the one holding a best writes it
    kept = keeper.finish(jobs, best_jobs(jobs, runs, [t.task for t in prepared.loaded]))
    if not ctx.is_main:
        return {"results": RESULTS}  # rank 0 writes them
    results = _results(scoring.tuning, ctx, mlm, prepared.loaded, jobs, runs)
    if report.start is not None:
        results = beside_start(results, report.start)
    results["precision"] = {"name": prepared.choice.precision.name, "reason": prepared.choice.reason}
    write_json(out_dir / RESULTS, results)
    ctx.metrics.log(report.steps, headline(results))  # at the end of pretraining
    precision = {"precision": prepared.choice.precision.name, "precision_reason": prepared.choice.reason}
    return {"results": RESULTS, **headline(results), **precision, **kept_outputs(kept)}


def task_files(tasks: list[TaskConfig]) -> list[list[Any]]:
    """Path, size and modification time of every file the tasks read from disk (a custom task's folder, a
    local GLUE folder, a BEIR folder and a retrieval task's pairs file): part of a scoring stage's key. A
    folder that is missing now is left to evaluate's `validate`."""
    files = []
    for task in tasks:
        root = Path(task.path).expanduser()
        if task.kind != "heldout-topic" and task.path and root.is_dir():
            files += fingerprint_files(files_under(root))
        pairs = Path(task.pairs).expanduser()
        if task.pairs and pairs.is_file() and not pairs.resolve().is_relative_to(root.resolve()):
            files += fingerprint_files([pairs])
    return files


def read_results(upstream: Upstream) -> dict:
    """A finished scoring stage's results.json."""
    return json.loads(upstream.path("results").read_text(encoding="utf-8"))


@dataclass(frozen=True)
class _Scoring:
    """What every step of a scoring reads, made once: the stage's config and the fine-tuner's part of it,
    the upstreams, the run's context, the checkpoint, and the stage's name."""

    config: Config
    tuning: Tuning
    inputs: dict[str, Upstream]
    ctx: Context
    checkpoint: Checkpoint
    stage: str
    out_dir: Path  # the stage's: a retrieval seed's corpus embeddings are written in a scratch folder here


@dataclass(frozen=True)
class _Prepared:
    """What every rank makes alike before fine-tuning: the tasks, loaded and encoded, and the precision."""

    loaded: list[Loaded | RetrievalLoaded]
    choice: precisions.Choice


def _work(
    scoring: _Scoring, jobs: list[tuple[int, int]], keeper: Keeper
) -> tuple[dict | None, dict[int, dict], _Prepared]:
    """This rank's share: the masked-LM numbers (rank 0) and its (task, seed) fine-tunes, each offered
    to `keeper`."""
    import torch

    from cram.stages.finetuning.finetune import finetune_seed, share_out
    from cram.stages.retrieval.results import retrieve_seed
    from cram.stages.retrieval.tuning import Embedder, Embedders

    config, ctx, inputs = scoring.config, scoring.ctx, scoring.inputs
    special = inputs["tokenize"].outputs["special_ids"]
    # Load and tokenize every task before training any: a bad task fails the stage at once.
    loaded = [_load(scoring, tc, i) for i, tc in enumerate(config.tasks)]
    keeper.meta.update({i: _meta(scoring, t) for i, t in enumerate(loaded)})
    costs = [_cost(loaded[i]) for i, _ in jobs]
    owner = share_out(costs, ctx.world_size)
    device = devices.resolve(ctx.device)
    on_device = {k: v.to(device) for k, v in scoring.checkpoint.params.items()}
    mlm, runs = None, {}
    # Tasks share the compiled steps, so tasks with the same head shape share graphs; each head shape
    # (each retrieval task's query length) may add one per bucket. Past dynamo's default limit of 8 graphs
    # it would fall back to eager silently: the limit is raised to what the tasks can need, and hitting it
    # is an error.
    limit = max(8, len(config.buckets) * len(loaded))
    held_out = None
    if config.mlm and ctx.is_main and not _untrained_head(inputs["pretrain"], ctx):
        held_out = HeldOut.of(config.mlm_settings(), inputs)
    with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        make = functools.partial(Embedder.make, scoring.tuning, scoring.checkpoint.cfg, on_device, special, device)
        embedders = Embedders(
            make, [t for t in loaded if isinstance(t, RetrievalLoaded)], config.compile, ctx.attention
        )
        classified = [t for t in loaded if isinstance(t, Loaded)]
        choice, tuner, mlm_steps = _tuner(scoring, on_device, device, classified, embedders, held_out)
        if held_out is not None and mlm_steps is not None:
            mlm = evaluate_mlm(held_out, scoring.checkpoint.cfg, on_device, device, mlm_steps, ctx)
        for j, (i, seed) in enumerate(jobs):
            if owner[j] == ctx.rank:
                task = loaded[i]
                keep = functools.partial(keeper.offer, i, seed, task.task)
                if isinstance(task, RetrievalLoaded):
                    embedder = embedders.of(choice.precision, task.settings.pooling)
                    runs[j] = retrieve_seed(embedder, task, seed, ctx, scoring.out_dir, keep)
                else:
                    runs[j] = finetune_seed(tuner, task, seed, ctx, keep)
    return mlm, runs, _Prepared(loaded, choice)


def _load(scoring: _Scoring, task_cfg: TaskConfig, index: int) -> Loaded | RetrievalLoaded:
    """Task `index`, loaded and tokenized: a classification task (`finetune.load_task`) or a retrieval one."""
    from cram.stages.finetuning.finetune import encode
    from cram.stages.retrieval import results as retrieval

    tokenize, tokenizer = scoring.inputs["tokenize"], scoring.checkpoint.tokenizer
    special = tokenize.outputs["special_ids"]
    if task_cfg.kind in RETRIEVAL_KINDS:
        settings = scoring.config.retrieval_settings(task_cfg)
        task = retrieval.load_task(task_cfg, index, tokenize, settings)
        return retrieval.loaded(task_cfg, task, tokenizer, special, settings)
    settings = scoring.config.task_settings(task_cfg)
    task = load_task(task_cfg, index, tokenize)
    return Loaded(task_cfg, task, encode(task, tokenizer, special, settings.max_length), settings)


def _meta(scoring: _Scoring, task: Loaded | RetrievalLoaded) -> dict:
    """What a task's kept seeds share: classifier.json's fields, or embedder.json's."""
    from cram.stages.finetuning.kept import describe, tokenizer_fields
    from cram.stages.retrieval.results import embedder_meta

    tokenize = scoring.inputs["tokenize"]
    if isinstance(task, RetrievalLoaded):
        return embedder_meta(task, scoring.tuning.buckets, tokenizer_fields(tokenize))
    return describe(scoring.tuning, task.config, task.task, task.settings.max_length, tokenize)


def _cost(task: Loaded | RetrievalLoaded) -> float:
    """A seed's cost in examples read, for sharing jobs out across ranks: a pair reads two texts."""
    if isinstance(task, RetrievalLoaded):
        return 2 * len(task.data.texts) * task.settings.epochs
    return len(task.data.train[0]) * task.settings.epochs


def _untrained_head(pretrain: Upstream, ctx: Context) -> bool:
    """Whether pretrain made a masked-LM head for a checkpoint without one and trained it not a step (a
    zero budget): its masked-LM figures would measure a random head, so there are none."""
    made = pretrain.outputs.get("head_initialised")
    if made and not pretrain.outputs.get("steps"):
        ctx.log.info("no mlm figures", reason="pretrain.init's checkpoint has no masked-LM head, and none was trained")
        return True
    return False


def _tuner(
    scoring: _Scoring,
    params: dict,
    device: torch.device,
    loaded: list[Loaded],
    embedders: Embedders,
    held_out: HeldOut | None,
) -> tuple[precisions.Choice, Tuner, MlmSteps | None]:
    """(the precision chosen, the fine-tuner and the held-out masked LM's steps in it; None without
    `held_out`). Compiled, each candidate precision's graphs are checked against eager, each once: the
    fine-tune step and prediction at every head shape and bucket the tasks' rows fall in (`Tuner.canary`),
    the masked LM at each length (`mlm_canary`) and the retrieval tasks' contrastive steps and embeddings at
    every bucket theirs fall in (`Embedders.check`); the first candidate whose every graph agrees is kept
    (`precision.choose`), and its compiled graphs are the ones the stage runs."""
    from cram.stages.finetuning.finetune import Tuner, graphs
    from cram.stages.retrieval.tuning import embedder_graphs

    config, ctx = scoring.config, scoring.ctx
    cfg, special = scoring.checkpoint.cfg, scoring.inputs["tokenize"].outputs["special_ids"]

    def make(candidate: precisions.Precision, compile: bool = config.compile) -> tuple[Tuner, MlmSteps | None]:
        settings = dataclasses.replace(scoring.tuning, compile=compile)
        tuner = Tuner.make(settings, cfg, params, special, device, candidate, ctx.attention)
        return tuner, None if held_out is None else MlmSteps.make(held_out, cfg, candidate, ctx.attention)

    if not config.compile or not config.canary_steps or not (loaded or held_out or embedders.tasks):
        why = "eager steps" if not config.compile else "canary_steps = 0" if not config.canary_steps else "no task"
        choice = precisions.unchecked(config.precision, device, f"{why}: no compile canary")
        return (choice, *make(choice.precision))

    checked: dict[precisions.Precision, tuple[Tuner, MlmSteps | None]] = {}  # the compiled graphs of each tried
    shapes = graphs(loaded, scoring.tuning)
    retrieval_shapes = embedder_graphs(embedders.tasks, scoring.tuning, ctx.seed)

    def check(candidate: precisions.Precision) -> precisions.Difference:
        tuner, steps = checked[candidate] = make(candidate)
        eager = make(candidate, compile=False)[0]
        worst = tuner.canary(eager, shapes, config.canary_steps, ctx.seed, config.canary_tolerance)
        if steps is not None and worst.value <= config.canary_tolerance:
            worst = worst.worse(mlm_canary(held_out, steps, cfg, params, device))
        if retrieval_shapes and worst.value <= config.canary_tolerance:
            retrieval = embedders.check(candidate, retrieval_shapes, config.canary_steps, config.canary_tolerance)
            worst = worst.worse(retrieval)
        ctx.log.info(
            "canary",
            precision=candidate.label,
            steps=config.canary_steps,
            graphs=len(shapes) + (0 if steps is None else len(steps.compiled)) + len(retrieval_shapes),
            max_relative_diff=worst.value,
            worst_graph=worst.graph,
        )
        return worst

    canary = precisions.Canary(check, config.canary_tolerance, "evaluate", ctx.world_size)
    choice = precisions.choose(config.precision, device, config.backend, canary, ctx.log, scoring.stage)
    return (choice, *checked[choice.precision])


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
    tuning: Tuning,
    ctx: Context,
    mlm: dict | None,
    loaded: list[Loaded | RetrievalLoaded],
    jobs: list[tuple[int, int]],
    runs: dict[int, dict],
) -> dict[str, Any]:
    """results.json: the masked-LM numbers, each task's scores over its seeds, and the GLUE average."""
    from cram.stages.finetuning.finetune import task_result
    from cram.stages.finetuning.tasks import glue_average
    from cram.stages.retrieval.results import retrieval_result

    results: dict[str, Any] = {} if mlm is None else {"mlm": mlm}
    results["tasks"] = {}
    for i, t in enumerate(loaded):
        seeds = [seed for k, seed in jobs if k == i]
        task_runs = [runs[j] for j, (k, _) in enumerate(jobs) if k == i]
        if isinstance(t, RetrievalLoaded):
            results["tasks"][t.task.name] = retrieval_result(t, seeds, task_runs, ctx)
        else:
            results["tasks"][t.task.name] = task_result(tuning, t, seeds, task_runs, ctx)
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


def load_checkpoint(pretrain: Upstream, tokenize: Upstream) -> Checkpoint:
    """The encoder a finished pretrain stage wrote, and tokenize's tokenizer, checked against each other."""
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
    return Checkpoint(cfg, params, tokenizer, config_path)


# ------------------------------------------------------------------------------------------ output


def headline(results: dict) -> dict[str, float]:
    """The figures `cram status` shows, in this order: the GLUE average, the masked-LM loss and
    accuracy, then per task its median scores, its majority-class baseline's main score, beside the
    starting checkpoint's where it was scored too (`versus.start_figures`), and its time."""
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
            figures.update(start_figures(r, test, prefix))
        figures[f"{name}_time_s"] = round(r["time_s"], 1)
    return figures


def write_json(path: Path, obj: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(obj, indent=1) + "\n")
