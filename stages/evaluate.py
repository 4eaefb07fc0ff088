"""The evaluate stage: what pretraining bought, measured the way the cramming paper reports it.

- Masked-LM loss and accuracy on the pack stage's held-out blocks, masked as in pretraining but with a
  fixed seed, so a re-run gives the same numbers.
- Fine-tuning tasks, each of a kind that its own wing runs (stages/tasks/kind.py; the registry:
  stages/evaluating/kinds.py). Classification (`stages/finetuning/`): the held-out Wikipedia articles' topics,
  GLUE, or a custom CSV / JSON-lines task. Every task and seed starts from the pretrained params with a fresh
  head; the median over seeds is reported beside the majority-class baseline.
- Retrieval tasks (`stages/retrieval/`): a BEIR folder, or the held-out documents' titles against their
  texts; a contrastive fine-tune per seed, nDCG@10, Recall@100 and MRR@10 beside BM25's (docs/retrieval.md).
- Continuing a checkpoint (`[pretrain] init`), beside what the checkpoint scored before pretraining
  (`[evaluate] baseline`): the baseline stage's results, which this stage reads as an upstream.

Fine-tuning itself and the results it writes are `stages/evaluating/scoring.py`'s, shared with the
baseline stage.

Fine-tuning (`stages/finetuning/finetune.py`) is compiled: the step (forward, loss, gradient, AdamW) is one
graph and prediction another, each compiled at most once per length bucket.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from cram.stages import Context, Pipeline, StageError, Upstream, section
from cram.stages.evaluating import kinds
from cram.stages.evaluating.checks import (
    check_against_the_model,
    check_pooler,
    check_task,
    heldout_gap,
    task_gap,
)

# The stage's config lives in its wing; `evaluate.Config` and `evaluate.TaskConfig` name it here.
from cram.stages.evaluating.config import Config as Config
from cram.stages.evaluating.config import keyed_tasks
from cram.stages.evaluating.positions import init_model, task_positions
from cram.stages.evaluating.scoring import (
    Report,
    fitting_tasks,
    load_checkpoint,
    read_results,
    score,
    task_files,
)
from cram.stages.pretraining.config import Config as PretrainConfig
from cram.stages.shared import device as devices
from cram.stages.tasks.config import TaskConfig as TaskConfig
from cram.stages.tasks.kind import count

NAME = "evaluate"
VERSION = "6"
# baseline: the starting checkpoint's scores, with `baseline = "init"` alone (the planner leaves out a stage
# that has nothing to do, and an upstream it left out is no part of this stage's key).
UPSTREAM = ("tokenize", "pack", "pretrain", "baseline")
RESUMABLE = False
DISTRIBUTED = True  # under torchrun every rank fine-tunes a share of the (task, seed) pairs
# Added after the key was fixed: at its default it measures what evaluate measured before.
# What `baseline` adds is keyed as the baseline stage's key among the upstream ones (none for "none").
NOT_IN_KEY = ("baseline",)
NEW_OPTIONS = ("mlm_lengths", "canary_steps", "canary_tolerance", "keep", "head", "mlm_corruption")


def key_config(config: Config) -> dict[str, Any]:
    """Cramming's head, what evaluate fine-tuned before `head` existed, keyed as it was then: as the
    default "auto" (which `NEW_OPTIONS` leaves out), whether "auto" resolved to it (no `pretrain.init`)
    or it was set. A task's retrieval settings at their defaults are left out (`keyed_tasks`)."""
    config = dataclasses.replace(config, head="auto") if config.head == "cramming" else config
    return keyed_tasks(dataclasses.asdict(config))


def fingerprint(config: Config) -> list[list[Any]]:
    """What the runner adds to this stage's key besides the config: path, size and modification
    time of every file a task reads from disk (`scoring.task_files`), so that editing a task's data
    re-runs the stage."""
    return task_files(config.tasks)


def validate_runtime(config: Config, pipeline: Pipeline) -> None:
    """What `validate` leaves to a stage that runs in this invocation, since it loads torch: the device
    and the compile backend."""
    devices.check(pipeline.run.device)
    devices.check_backend(config.backend, "evaluate.backend")


def validate(config: Config, pipeline: Pipeline) -> None:
    """What `run` would reject before it fine-tunes anything, checked by the runner before the first
    stage runs, with no torch: the held-out masking seed, each local task's files (read in full:
    fields, labels, encoding), a held-out-topic task that the tokenize stage's settings leave without
    articles (the default task is then left out, not refused), and the lengths and masking rate
    against the model (`check_against_the_model`)."""
    tokenize, pack = pipeline.stages.get("tokenize"), pipeline.stages.get("pack")
    pretrain = section(pipeline.stages, "pretrain", PretrainConfig)
    if not 0 <= config.mlm_seed < 2**63:
        raise StageError(f"evaluate.mlm_seed: {config.mlm_seed} must be in [0, 2**63 - 1]")
    positions = task_positions(pretrain, pack)
    length = None if positions is None else positions.length
    gap = (lambda task: None) if tokenize is None else task_gap(tokenize, config, length)
    config = fitting_tasks(config, gap)
    for i, task in enumerate(config.tasks):
        check_task(config, task, i, gap(task), positions)
    if pack is not None:
        check_against_the_model(config, pretrain, pack.seq_len)
    if config.pooling == "pooler":
        from_init = pretrain is not None and pretrain.init
        started = "pretrain.init's checkpoint" if from_init else "a model pretrained from scratch"
        check_pooler(config, init_model(pretrain), started)


def describe(config: Config, pipeline: Pipeline) -> str:
    """For a dry run: each task's fine-tune steps per seed (epochs x ceil(train examples / batch_size)),
    where its local files tell them; a held-out-topic task's examples are known only after tokenize,
    a GLUE task's from the hub once fetched."""
    pretrain = section(pipeline.stages, "pretrain", PretrainConfig)
    if (tokenize := pipeline.stages.get("tokenize")) is not None:
        positions = task_positions(pretrain, pipeline.stages.get("pack"))
        config = fitting_tasks(config, task_gap(tokenize, config, None if positions is None else positions.length))
    parts = []
    for i, task in enumerate(config.tasks):
        steps = kinds.of(task.kind).steps(task, i, config.settings(task), config.batch_size)
        parts.append(f"{task.name} {steps} x {count(config.task_settings(task).seeds, 'seed')}")
    takes_head = any(kinds.of(task.kind).takes_head for task in config.tasks)
    head = _head_choice(config, pretrain) if takes_head else []
    return "fine-tunes " + "; ".join([*parts, *head]) if parts else ""


def _head_choice(config: Config, pretrain: PretrainConfig | None) -> list[str]:
    """The head a run from `pretrain.init` fine-tunes with and why (nothing from scratch, where it is
    cramming's unless set), with what an export to transformers would need instead."""
    from cram.stages.evaluating.config import auto_head
    from cram.stages.shared import pretrained

    if pretrain is None or not pretrain.init:
        return []
    try:
        found = pretrained.locate(Path(pretrain.init))
    except pretrained.PretrainedError:  # pretrain's validate names it
        return []
    if config.head != auto_head(found):
        why = "evaluate.head's"
    elif config.head != "cramming":
        why = "pretrain.init's family's"
    elif found.kind == "cram":
        why = "cramming's, as from scratch: pretrain.init is a cram checkpoint"
    else:
        why = "cramming's: pretrain.init's model maps onto no transformers family"
    chosen = f'head "{config.head}" ({why}'
    from cram.model import hf

    cfg = init_model(pretrain)
    if cfg is None or hf.family_head(cfg) is None:
        return [f"{chosen})"]
    family = hf.layout(cfg)
    if blockers := hf.classifier_blockers(cfg, config.head, config.head_width, config.pooling):
        return [f"{chosen}; an export to transformers' {family} classifier needs {', '.join(blockers)})"]
    return [f"{chosen}, which `cram export --format transformers` writes as {family}'s classifier)"]


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    checkpoint = load_checkpoint(inputs["pretrain"], inputs["tokenize"])
    gap = heldout_gap(inputs["tokenize"], config, checkpoint.cfg.max_seq_len)
    config = fitting_tasks(config, gap, ctx.log).linked({})
    start = read_results(inputs["baseline"]) if "baseline" in inputs else None
    steps = inputs["pretrain"].outputs.get("steps", 0)
    return score(config, inputs, out_dir, ctx, checkpoint, Report(NAME, steps, start))
