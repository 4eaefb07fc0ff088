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
from cram.stages.evaluating import kinds
from cram.stages.evaluating.checks import check_lengths, check_pooler
from cram.stages.evaluating.config import Config
from cram.stages.evaluating.heldout import HeldOut, MlmSteps, evaluate_mlm, mlm_canary
from cram.stages.evaluating.versus import beside_start, start_figures
from cram.stages.shared import device as devices
from cram.stages.shared import precision as precisions
from cram.stages.shared.files import fingerprint as fingerprint_files
from cram.stages.shared.files import write_atomic
from cram.stages.tasks.config import TaskConfig, Tuning, task_seeds
from cram.stages.tasks.kind import Kind, Loaded, Runner, Start

if TYPE_CHECKING:
    import torch
    from structlog.stdlib import BoundLogger

    from cram.model.config import ModelConfig
    from cram.stages.evaluating.keeping import Keeper
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
            # a default task's name says what it does: "no topic task", "no retrieval task"
            log.info(f"no {task.name} task", reason=f"the default task, kind '{task.kind}', {reason}")
    return dataclasses.replace(config, tasks=fitting)


def score(
    config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context, checkpoint: Checkpoint, report: Report
) -> dict[str, Any]:
    """Fine-tune `checkpoint` on `config`'s tasks; rank 0 writes results.json, set beside `report.start`
    where given, and logs the headline figures at `report.steps`. Returns the stage's outputs."""
    from cram.stages.evaluating.keeping import Keeper, best_jobs, kept_outputs

    cfg = checkpoint.cfg
    check_lengths(config, cfg.max_seq_len)
    if config.pooling == "pooler":
        check_pooler(config, cfg, str(checkpoint.model_config))
    jobs = [(i, seed) for i, tc in enumerate(config.tasks) for seed in task_seeds(ctx.seed, config.task_settings(tc))]
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
    """Path, size and modification time of every file the tasks read from disk (`Kind.files`: a custom task's
    folder, a local GLUE folder, a BEIR folder and a retrieval task's pairs file): part of a scoring stage's
    key. A folder that is missing now is left to evaluate's `validate`."""
    return [found for task in tasks for found in fingerprint_files(kinds.of(task.kind).files(task))]


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

    loaded: list[Loaded]
    choice: precisions.Choice


def _work(
    scoring: _Scoring, jobs: list[tuple[int, int]], keeper: Keeper
) -> tuple[dict | None, dict[int, dict], _Prepared]:
    """This rank's share: the masked-LM numbers (rank 0) and its (task, seed) fine-tunes, each offered
    to `keeper`."""
    import torch

    from cram.stages.evaluating.keeping import tokenizer_fields

    config, ctx, inputs = scoring.config, scoring.ctx, scoring.inputs
    # Load and tokenize every task before training any: a bad task fails the stage at once.
    loaded = [_load(scoring, tc, i) for i, tc in enumerate(config.tasks)]
    tokenizer = tokenizer_fields(inputs["tokenize"])
    keeper.meta.update({i: _kind(t).meta(t, scoring.tuning, tokenizer) for i, t in enumerate(loaded)})
    owner = share_out([_kind(loaded[i]).cost(loaded[i]) for i, _ in jobs], ctx.world_size)
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
        runners = _runners(scoring, loaded, on_device, device)
        choice, mlm_steps = _choose(scoring, on_device, device, list(runners.values()), held_out)
        if held_out is not None and mlm_steps is not None:
            mlm = evaluate_mlm(held_out, scoring.checkpoint.cfg, on_device, device, mlm_steps, ctx)
        for j, (i, seed) in enumerate(jobs):
            if owner[j] == ctx.rank:
                task = loaded[i]
                keep = functools.partial(keeper.offer, i, seed, task.task)
                runs[j] = runners[_kind(task)].run_seed(choice.precision, task, seed, ctx, keep)
    return mlm, runs, _Prepared(loaded, choice)


def _load(scoring: _Scoring, task_cfg: TaskConfig, index: int) -> Loaded:
    """Task `index`, loaded and tokenized by its kind (`Kind.load`)."""
    tokenize, settings = scoring.inputs["tokenize"], scoring.config.settings(task_cfg)
    return kinds.of(task_cfg.kind).load(task_cfg, index, settings, tokenize, scoring.checkpoint.tokenizer)


def _kind(loaded: Loaded) -> Kind:
    return kinds.of(loaded.config.kind)


def _runners(scoring: _Scoring, loaded: list[Loaded], params: dict, device: torch.device) -> dict[Kind, Runner]:
    """What fine-tunes each kind's tasks (`Kind.runner`), in the registry's order, from `params` on `device`."""
    ctx, cfg = scoring.ctx, scoring.checkpoint.cfg
    special = scoring.inputs["tokenize"].outputs["special_ids"]
    start = Start(scoring.tuning, cfg, params, special, device, ctx.attention, ctx.seed, scoring.out_dir)
    mine = {kind: [t for t in loaded if _kind(t) is kind] for kind in kinds.KINDS}
    return {kind: kind.runner(tasks, start) for kind, tasks in mine.items() if tasks}


def share_out(costs: list[float], world_size: int) -> list[int]:
    """The rank of each job: the costliest first, each to the least loaded rank (a greedy balance that
    keeps the ranks' finishing times close, so the gather at the end waits little). Same on every rank."""
    load = [0.0] * world_size
    owner = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[job] = rank
        load[rank] += costs[job]
    return owner


def _untrained_head(pretrain: Upstream, ctx: Context) -> bool:
    """Whether pretrain made a masked-LM head for a checkpoint without one and trained it not a step (a
    zero budget): its masked-LM figures would measure a random head, so there are none."""
    made = pretrain.outputs.get("head_initialised")
    if made and not pretrain.outputs.get("steps"):
        ctx.log.info("no mlm figures", reason="pretrain.init's checkpoint has no masked-LM head, and none was trained")
        return True
    return False


def _choose(
    scoring: _Scoring, params: dict, device: torch.device, runners: list[Runner], held_out: HeldOut | None
) -> tuple[precisions.Choice, MlmSteps | None]:
    """(the precision chosen, and the held-out masked LM's steps in it; None without `held_out`). Compiled,
    each candidate precision's graphs are checked against eager, each once: every kind's (`Runner.canary`: a
    classifier's fine-tune step and prediction at every head shape and bucket its rows fall in, a retrieval
    task's contrastive steps and embeddings at every bucket theirs fall in), then the masked LM's at each
    length (`mlm_canary`); the first candidate whose every graph agrees is kept (`precision.choose`), and its
    compiled graphs are the ones the stage runs."""
    config, ctx, cfg = scoring.config, scoring.ctx, scoring.checkpoint.cfg

    def steps_in(candidate: precisions.Precision) -> MlmSteps | None:
        return None if held_out is None else MlmSteps.make(held_out, cfg, candidate, ctx.attention)

    if not config.compile or not config.canary_steps or not (runners or held_out):
        why = "eager steps" if not config.compile else "canary_steps = 0" if not config.canary_steps else "no task"
        choice = precisions.unchecked(config.precision, device, f"{why}: no compile canary")
        return choice, steps_in(choice.precision)

    checked: dict[precisions.Precision, MlmSteps | None] = {}  # the masked LM's compiled steps of each tried

    def check(candidate: precisions.Precision) -> precisions.Difference:
        steps = checked[candidate] = steps_in(candidate)
        worst, tolerance = precisions.Difference(0.0), config.canary_tolerance
        for runner in runners:
            if worst.value <= tolerance:
                worst = worst.worse(runner.canary(candidate, config.canary_steps, tolerance))
        if steps is not None and worst.value <= tolerance:
            worst = worst.worse(mlm_canary(held_out, steps, cfg, params, device))
        ctx.log.info(
            "canary",
            precision=candidate.label,
            steps=config.canary_steps,
            graphs=sum(runner.graphs() for runner in runners) + (0 if steps is None else len(steps.compiled)),
            max_relative_diff=worst.value,
            worst_graph=worst.graph,
        )
        return worst

    canary = precisions.Canary(check, config.canary_tolerance, "evaluate", ctx.world_size)
    choice = precisions.choose(config.precision, device, config.backend, canary, ctx.log, scoring.stage)
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
    tuning: Tuning,
    ctx: Context,
    mlm: dict | None,
    loaded: list[Loaded],
    jobs: list[tuple[int, int]],
    runs: dict[int, dict],
) -> dict[str, Any]:
    """results.json: the masked-LM numbers, each task's scores over its seeds (`Kind.result`), and each kind's
    figures over its tasks (`Kind.totals`: the GLUE average)."""
    results: dict[str, Any] = {} if mlm is None else {"mlm": mlm}
    results["tasks"] = {}
    for i, t in enumerate(loaded):
        seeds = [seed for k, seed in jobs if k == i]
        task_runs = [runs[j] for j, (k, _) in enumerate(jobs) if k == i]
        results["tasks"][t.task.name] = _kind(t).result(t, seeds, task_runs, tuning, ctx)
    for kind in kinds.KINDS:
        results.update(kind.totals(results["tasks"]))
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
    starting checkpoint's where it was scored too (`versus.start_figures`), the figures its kind adds
    (`figures`: a retrieval task's hybrid and its encoder as it was), and its time."""
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
        figures.update({f"{name}_{figure}": value for figure, value in r.get("figures", {}).items()})  # a kind's own
        figures[f"{name}_time_s"] = round(r["time_s"], 1)
    return figures


def write_json(path: Path, obj: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(obj, indent=1) + "\n")
