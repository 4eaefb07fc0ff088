"""The baseline stage: what the checkpoint that pretraining continues (`[pretrain] init`) scores before
pretraining, so that every continued run says what continuing bought (`[evaluate] baseline = "init"`).

The checkpoint is loaded as pretrain loads it (`stages/shared/pretrained.py`, a masked-LM head made from
the run's seed where it has none, the tokenizer's padding id) and fine-tuned as evaluate fine-tunes the
continued model (`stages/evaluating/scoring.py`): the same tasks, seeds and settings, so its scores are
those a zero-budget run of the checkpoint gets. Evaluate reads its results as an upstream and sets each
task's continued score beside the starting one (`stages/evaluating/versus.py`).

A stage of its own, rather than a part of evaluate, for its cache key: evaluate's settings, the run's
seed, the checkpoint's contents (`fingerprint`) and tokenize's key, but not pretrain's. A second run
that changes how pretrain trains (its lr, its budget) finds the baseline in the store and fine-tunes
the checkpoint no second time. It has no TOML section: `config_of` makes its config from evaluate's and
pretrain's sections, and says None (the planner then leaves the stage out) unless evaluate asks for it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cram.stages import Context, Pipeline, StageError, Upstream, section
from cram.stages.evaluating.checks import heldout_gap
from cram.stages.evaluating.config import Config as EvaluateConfig
from cram.stages.evaluating.config import keyed_tasks
from cram.stages.evaluating.scoring import Checkpoint, Report, fitting_tasks, score, task_files
from cram.stages.pretraining.config import Config as PretrainConfig
from cram.stages.shared import device as devices
from cram.stages.shared import pretrained
from cram.stages.shared.files import write_atomic

NAME = "baseline"
VERSION = "3"
UPSTREAM = ("tokenize",)  # its tokenizer, and the held-out articles of a heldout-topic task
RESUMABLE = False
DISTRIBUTED = True  # under torchrun every rank fine-tunes a share of the (task, seed) pairs, as in evaluate
# Where the checkpoint lies is not keyed, its contents are (`fingerprint`); nor are evaluate's settings of
# what this stage does not measure: the held-out masked LM, the classifiers evaluate keeps, this stage's switch.
NOT_IN_KEY = (
    "init",
    "evaluate.baseline",
    "evaluate.keep",
    "evaluate.mlm",
    "evaluate.mlm_seed",
    "evaluate.mlm_mask_rate",
    "evaluate.mlm_corruption",
    "evaluate.mlm_batch_size",
    "evaluate.mlm_lengths",
)
RUNS_WITH = 'evaluate.baseline = "init" (the default, "auto", with pretrain.init on a budget that is not zero)'
MODEL_CONFIG = "model.json"  # the starting checkpoint's ModelConfig, as the fine-tunes read it


@dataclass(frozen=True)
class Config:
    """What is scored: `init`'s checkpoint (pretrain.init) on `evaluate`'s tasks and settings (evaluate's Config)."""

    init: str = ""
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)


def config_of(pipeline: Pipeline) -> Config | None:
    """The stage's config, from evaluate's and pretrain's sections; None where `evaluate.baseline` is not "init"."""
    evaluate = section(pipeline.stages, "evaluate", EvaluateConfig)
    pretrain = section(pipeline.stages, "pretrain", PretrainConfig)
    if evaluate is None or evaluate.baseline != "init":
        return None
    return Config(init=pretrain.init if pretrain is not None else "", evaluate=evaluate)


def key_config(config: Config) -> dict[str, Any]:
    """A task's retrieval settings at their defaults left out of the key, as evaluate leaves them
    (`keyed_tasks`)."""
    plain = dataclasses.asdict(config)
    keyed_tasks(plain["evaluate"])
    return plain


def fingerprint(config: Config) -> list[list[Any]]:
    """The checkpoint's contents (as pretrain keys them) and the files the tasks read; a checkpoint that
    cannot be found gives its error instead, which pretrain's `validate` reports."""
    try:
        found = pretrained.fingerprint(pretrained.locate(Path(config.init))) if config.init else []
    except pretrained.PretrainedError as e:
        found = [["unavailable", f"pretrain.init: {e}"]]
    return found + task_files(config.evaluate.tasks)


def validate(config: Config, pipeline: Pipeline) -> None:
    """A baseline asked for with no checkpoint to score; evaluate's and pretrain's `validate` check the rest."""
    if not config.init:
        raise StageError(
            'evaluate.baseline: "init" fine-tunes pretrain.init\'s checkpoint beside the continued model, and '
            'pretrain.init is not set; set it, or choose baseline = "none" or "auto"'
        )


def validate_runtime(config: Config, pipeline: Pipeline) -> None:
    devices.check(pipeline.run.device)
    devices.check_backend(config.evaluate.backend, "evaluate.backend")


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    settings = dataclasses.replace(config.evaluate, mlm=False, keep="none")
    checkpoint = _starting_checkpoint(config, inputs["tokenize"], out_dir, ctx)
    gap = heldout_gap(inputs["tokenize"], settings, checkpoint.cfg.max_seq_len)
    settings = fitting_tasks(settings, gap, ctx.log)
    outputs = score(settings, inputs, out_dir, ctx, checkpoint, Report(NAME))
    # Its figures are evaluate's to show, beside the continued model's (`{task}_start`): a figure of the
    # same name here would make evaluate's ambiguous in `cram compare`.
    kept = ("results", "precision", "precision_reason")
    return {"model_config": MODEL_CONFIG, **{k: v for k, v in outputs.items() if k in kept}}


def _starting_checkpoint(config: Config, tokenize: Upstream, out_dir: Path, ctx: Context) -> Checkpoint:
    """`init`'s checkpoint as a zero-budget pretrain writes it: its params under cram's names with a
    masked-LM head from the run's seed where it has none, its ModelConfig with the tokenizer's padding id
    (written to `out_dir`)."""
    from cram import model
    from cram.model.bert import shapes
    from cram.model.hf import missing_head
    from cram.stages.shared.tokenizer import TokenizerError, load

    try:
        found = pretrained.locate(Path(config.init))
        cfg, params = pretrained.load(found)
        tokenizer = load(tokenize.path("tokenizer"))
    except (pretrained.PretrainedError, TokenizerError) as e:
        raise StageError(f"pretrain.init: {e}") from None
    cfg = dataclasses.replace(cfg, pad_id=tokenize.outputs["special_ids"]["pad"])
    made = model.init(cfg, ctx.seed, names=missing_head(cfg, params))
    params = {name: params[name] if name in params else made[name] for name in shapes(cfg)}
    ctx.log.info("starting checkpoint", checkpoint=str(found.folder), kind=found.kind)
    if ctx.is_main:
        write_atomic(out_dir / MODEL_CONFIG, json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
    return Checkpoint(cfg, params, tokenizer, out_dir / MODEL_CONFIG)
