"""Continuing a checkpoint (`pretrain.init`): what the stage does for a run that starts from an existing
encoder rather than the preset's random init.

Before any stage runs: the checkpoint is there, is not the run's own result, has a tokenizer, and its
architecture agrees with `[pretrain.model]`, the tokenizer and the block length; its files' contents are
part of the key (`fingerprint`). At the start: its params, with a masked-LM head made from the run's seed
where it has none; the head warm-up that a made head gets (`head_warmup.py`); the peak lr that continuing
it trains at. The checkpoint itself is read by `stages/shared/pretrained.py`, which the stages share.

A checkpoint's files do not say whether the masked-LM head they hold was ever trained: a sentence encoder
re-saved by `transformers` as `BertForMaskedLM` carries a head it initialised at random. So before training
the run measures that head's held-out loss (`start.py`), and one no better than the uniform guess
(`untrained`) is continued as a checkpoint without a head: the head made anew, warmed up as "auto" warms
a made head, at a sentence encoder's rate. The decision is made at run time, not when the key is made,
because it needs pack's held-out blocks, which do not exist before pack runs; the key holds the lr and
warm-up that the files alone give (`peak_lr` and `warmup_setting` without a verdict); a run resolves them with
it (`resolved.Resolved`). It still determines the result: the verdict is a function of the checkpoint's
contents, the held-out data, the seed and the masking, all in the key, measured in fp32, eagerly, agreed from
rank 0, and kept in checkpoints for a resume. The run says it in one warning line and in its `init_head`
figure, and `peak_lr` and `head_warmup_until` are what trained. A number given as `init_lr` or `head_warmup`
is used as given whatever the measurement.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cram.stages import Context, StageError
from cram.stages.pretraining.config import Config
from cram.stages.pretraining.head_warmup import HeadWarmup, head_names
from cram.stages.shared import pretrained

if TYPE_CHECKING:
    from torch import Tensor

    from cram.model.config import ModelConfig
    from cram.stages import pack as pack_stage
    from cram.stages import tokenize as tokenize_stage
    from cram.stages.pretraining.state import Params

# Peak lrs of continuing a checkpoint on its task's text, as measured (bench/README.md, "adapt"). A masked-LM
# encoder 128 wide gained most at 1.5e-3 (+15.0 and +16.2 points over not continuing, own head and headless;
# 5e-4 within the seeds' spread); wider ones get that rate times 128 / hidden, as peak lrs shrink with width
# (2.5e-4 at 768, between TAPT's 1e-4 for RoBERTa-base and BioClinical ModernBERT's 3e-4). A sentence
# encoder gained at no rate tried and lost nothing beyond the spread at 3.3e-5 (all-MiniLM-L6-v2: +0.4;
# 1e-4: -4.0).
MASKED_LM_LR = 1.5e-3
MASKED_LM_LR_WIDTH = 128
SENTENCE_ENCODER_LR = 1e-4 / 3
# `init_optimizer = "auto"`: every rate above was measured with AdamW.
CONTINUED_OPTIMIZER = "adamw"
# `head_warmup = "auto"` for a run whose checkpoint lacks its head: this fraction of the budget.
AUTO_FRACTION = 0.1
# A checkpoint's own masked-LM head within this many nats of the uniform guess over its vocabulary
# (ln vocab_size), or above it, predicts nothing: continued as a headless checkpoint. A random head lies
# above uniform (all-MiniLM-L6-v2 re-saved as a masked LM: 10.83 against 10.33), a trained one nats below
# it on text of its language; the margin keeps a random head that lands a little under uniform by chance
# from passing as trained.
UNTRAINED_MARGIN = 0.1

# The layout switches that add parameters (model/bert.py: `attn.q_norm`, `attn.k_norm`): on a checkpoint
# without them, refused unless `init_switch_params` says to make them (`switched`).
PARAM_SWITCHES = ("qk_norm",)


def locate(init: str) -> pretrained.Pretrained:
    """Where the checkpoint files of `init` (`pretrain.init`) are."""
    try:
        return pretrained.locate(Path(init))
    except pretrained.PretrainedError as e:
        raise StageError(f"pretrain.init: {e}") from None


def fingerprint(init: str) -> list[list[str]] | None:
    """The contents of the checkpoint `init` (`pretrain.init`), which the stage's output depends on; None
    without one. One that cannot be found gives its error instead: `validate` reports it."""
    if not init:
        return None
    try:
        return pretrained.fingerprint(pretrained.locate(Path(init)))
    except pretrained.PretrainedError as e:
        return [["unavailable", f"pretrain.init: {e}"]]


def _read(found: pretrained.Pretrained, shapes_only: bool) -> tuple[ModelConfig, dict[str, Tensor]]:
    """`init`'s architecture and params (`shapes_only`: from the files' headers); StageError naming the key."""
    try:
        return pretrained.load(found, shapes_only=shapes_only)
    except pretrained.PretrainedError as e:
        raise StageError(f"pretrain.init: {e}") from None


def check_not_its_own(init: str, run_dir: Path) -> None:
    """Refuse an `init` (`pretrain.init`) that is the run's own directory, or lies in it or in the entry its
    pretrain links to: the stage would start from its own result, so its key (which holds init's contents) would change
    with every result and each identical `cram run` would train again."""
    given = Path(init).expanduser()
    stage_dir = run_dir / "pretrain"  # the run's link to the store entry its pretrain finished in
    inside = [Path(os.path.abspath(run_dir)), Path(os.path.realpath(run_dir)), Path(os.path.realpath(stage_dir))]
    seen = (Path(os.path.abspath(given)), Path(os.path.realpath(given)))
    if any(path == folder or folder in path.parents for path in seen for folder in inside):
        raise StageError(
            f"pretrain.init: {init} is this run's own directory ({run_dir}) or inside it: pretrain would "
            "start from its own result and train again at every run; give another run directory or an export"
        )


def check_has_tokenizer(init: str, tokenize: tokenize_stage.Config | None) -> None:
    """A checkpoint `init` (`pretrain.init`) that is there, and a tokenizer for it: its own (tokenize's
    default), or one given (`tokenize`: the tokenize stage's config, None where the pipeline has none)."""
    from cram.stages.shared.tokenizer import FILE_NAMES as tokenizer_files

    locate(init)
    if tokenize is not None and not tokenize.tokenizer:
        raise StageError(
            f"pretrain.init: {init} holds no tokenizer ({' or '.join(tokenizer_files)}) and "
            "tokenize.tokenizer is not set; a tokenizer trained anew would not match the checkpoint's "
            "embeddings: set tokenize.tokenizer to the one the checkpoint was trained with"
        )


def architecture(config: Config, vocab_size: int, seq_len: int, pad_id: int) -> ModelConfig:
    """`init`'s architecture, checked against `[pretrain.model]`, the tokenizer and the block length; its
    weights are read from the files' headers only; with the switches whose parameters the run makes (`switched`)."""
    own, _ = _read(locate(config.init), shapes_only=True)
    cfg = switched(config, own)
    if config.model.preset != type(config.model)().preset:
        raise StageError(
            f"pretrain.model.preset: {config.model.preset!r}, but the architecture is pretrain.init's "
            f"checkpoint ({config.init}); leave the preset out"
        )
    for key, value in dataclasses.asdict(config.model).items():
        if key != "preset" and value is not None and value != getattr(cfg, key):
            makes = ", or set pretrain.init_switch_params = true to make its weights" if key in PARAM_SWITCHES else ""
            raise StageError(
                f"pretrain.model.{key}: {value!r} contradicts the checkpoint's {getattr(cfg, key)!r} "
                f"(pretrain.init = {config.init}); leave it out{makes}"
            )
    if vocab_size > cfg.vocab_size:
        raise StageError(
            f"tokenize.tokenizer: {vocab_size:,} tokens, more than the {cfg.vocab_size:,} embedding rows of "
            f"pretrain.init's checkpoint ({config.init}): it is not the tokenizer the checkpoint was trained with"
        )
    if cfg.position == "learned" and seq_len > cfg.max_seq_len:
        raise StageError(
            f"pack.seq_len: {seq_len} is beyond the {cfg.max_seq_len} positions of pretrain.init's "
            f"checkpoint ({config.init})"
        )
    try:
        return dataclasses.replace(cfg, pad_id=pad_id)
    except ValueError as e:
        raise StageError(f"pretrain.init: {e}") from None


def untrained(loss: float | None, vocab_size: int) -> bool:
    """Whether a checkpoint's own masked-LM head, of held-out loss `loss` (None: not measured), predicts
    no better than the uniform guess over `vocab_size` tokens (`UNTRAINED_MARGIN`)."""
    return loss is not None and loss >= math.log(vocab_size) - UNTRAINED_MARGIN


def head_figure(loss: float, vocab_size: int) -> str:
    """The `init_head` figure: the verdict on the checkpoint's own head, its held-out loss and uniform's."""
    verdict = "untrained" if untrained(loss, vocab_size) else "trained"
    return f"{verdict}: loss {loss:.2f}, uniform {math.log(vocab_size):.2f}"


def made_head(config: Config, untrained: bool = False) -> list[str]:
    """The masked-LM head's parameters that the stage makes (from the files' headers): those `init`'s
    checkpoint lacks, or its whole head where that measured `untrained`; none without a checkpoint."""
    from cram.model.hf import missing_head

    if not config.init:
        return []
    cfg, params = _read(locate(config.init), shapes_only=True)
    return list(head_names(cfg)) if untrained else missing_head(cfg, params)


def warmup_setting(config: Config, untrained: bool = False) -> float:
    """`head_warmup` as it runs: "auto" warms a head the stage made (`AUTO_FRACTION`), for a checkpoint
    without one or whose own measured `untrained`, none for one that brought a head; nothing without `init`
    or for a zero budget."""
    if not config.init or config.budget.tokens == 0:
        return 0.0
    if config.head_warmup == "auto":
        return AUTO_FRACTION if untrained or made_head(config) else 0.0
    return float(config.head_warmup)


def warmup_of(config: Config, cfg: ModelConfig, peak_lr: float, untrained: bool = False) -> HeadWarmup | None:
    """The head warm-up this run takes, None for none: below 1 a fraction of the budget, else tokens; its lr
    is `head_lr`, or the run's `peak_lr`."""
    value, names = warmup_setting(config, untrained), head_names(cfg)
    lr = config.head_lr or peak_lr
    if not value:
        return None
    if value < 1:
        return HeadWarmup(names, lr, until=value)
    return HeadWarmup(names, lr, tokens=int(value))


def check_head_warmup(config: Config, cfg: ModelConfig, pack: pack_stage.Config | None) -> None:
    """A head warm-up needs a head of the model's own to train, and a budget longer than itself (a token
    budget, or a step budget's most tokens at `pack`'s block length; `pack`: the pack stage's config, None
    where the pipeline has none); without `init`, the config refused it."""
    given, value = config.head_warmup, warmup_setting(config)
    if not value:
        return
    if not head_names(cfg):
        raise StageError(
            f"pretrain.head_warmup: {given}, but the model has no masked-LM head params of its own (its decoder "
            "is the tied token embeddings, with no transform or bias): set head_warmup = 0"
        )
    budget, seq_len = config.budget, pack.seq_len if pack is not None else 0
    most = [budget.tokens] if budget.tokens is not None else []
    if budget.steps is not None and seq_len:
        most.append(budget.steps * config.batch_size * seq_len)
    if value >= 1 and most and value >= min(most):
        raise StageError(
            f"pretrain.head_warmup: {int(value)} tokens is not shorter than the budget ({min(most)} tokens at most): "
            "give fewer tokens or a fraction of the budget below 1"
        )


def peak_lr(config: Config, asked: float, untrained: bool = False) -> float:
    """The peak lr the run trains at: `asked` (`optimizer.lr`, or `[pretrain.fp32]`'s where that applies:
    `resolved.Batch`), except in a run that continues `init`'s checkpoint. There a number given as `init_lr`
    is the peak, and `init_lr = "auto"` caps `asked` at the checkpoint's continuation rate
    (`continuation_lr`), a sentence encoder's where its own head measured `untrained` (an encoder whose head
    never learned was trained for something else): a rate for training from scratch, such as the default
    pipeline's, would overwrite what the checkpoint learned. A zero budget trains nothing: as given."""
    if not config.init or config.budget.tokens == 0:
        return asked
    if config.init_lr != "auto":
        return config.init_lr
    if untrained:
        return min(asked, SENTENCE_ENCODER_LR)
    found = locate(config.init)
    try:
        cfg = pretrained.architecture(found)
    except pretrained.PretrainedError as e:
        raise StageError(f"pretrain.init: {e}") from None
    return min(asked, continuation_lr(found, cfg))


def continuation_lr(found: pretrained.Pretrained, cfg: ModelConfig) -> float:
    """The measured peak lr of continuing the checkpoint `found` (of architecture `cfg`) with masked LM."""
    if found.sentence:
        return SENTENCE_ENCODER_LR
    return MASKED_LM_LR * min(1.0, MASKED_LM_LR_WIDTH / cfg.hidden)


def optimizer_kind(config: Config) -> str:
    """The optimizer the run trains with: `optimizer.kind`, except in a run that continues `init`'s checkpoint:
    there `init_optimizer`, and "auto" is AdamW, with which the continuation rates were measured."""
    if not config.init:
        return config.optimizer.kind
    return CONTINUED_OPTIMIZER if config.init_optimizer == "auto" else config.init_optimizer


def switched(config: Config, cfg: ModelConfig) -> ModelConfig:
    """The checkpoint's architecture `cfg` with the `PARAM_SWITCHES` that `[pretrain.model]` turns on, where
    `init_switch_params` makes their parameters; `cfg` as it is otherwise."""
    if not config.init_switch_params:
        return cfg
    return dataclasses.replace(cfg, **{key: True for key in PARAM_SWITCHES if getattr(config.model, key)})


@dataclass(frozen=True)
class Checkpoint:
    """`init`'s checkpoint as read: where it is, its architecture, its params under cram's names."""

    found: pretrained.Pretrained
    cfg: ModelConfig
    params: dict[str, Tensor]

    @property
    def has_head(self) -> bool:
        """It holds every param of a masked-LM head of its own (a tied decoder alone is none)."""
        from cram.model.hf import missing_head

        return bool(head_names(self.cfg)) and not missing_head(self.cfg, self.params)


def load(init: str, ctx: Context) -> Checkpoint:
    """The checkpoint `init` (`pretrain.init`), read whole."""
    import time

    started = time.perf_counter()
    found = locate(init)
    cfg, loaded = _read(found, shapes_only=False)
    ctx.log.info("init", checkpoint=str(found.folder), kind=found.kind, seconds=round(time.perf_counter() - started, 2))
    return Checkpoint(found, cfg, loaded)


def params(config: Config, ctx: Context, checkpoint: Checkpoint, head_loss: float | None, asked_lr: float) -> Params:
    """The checkpoint's params, with a masked-LM head made from the run's seed where it has none (a base
    model, a sequence classifier) or where its own, of held-out loss `head_loss`, measured `untrained`: the
    decoder is tied to the token embeddings as transformers ties it, the head's transform, norm and bias
    start fresh, and one warning names them, with the peak lr continuing trains at from `asked_lr` (none for
    a zero budget, which trains nothing). The parameters
    of the switches it lacks (`switched`) are made as a fresh init makes them, and an info line names them."""
    from cram import model
    from cram.model.bert import shapes
    from cram.model.hf import missing_head

    cfg, loaded = switched(config, checkpoint.cfg), checkpoint.params
    remade = untrained(head_loss, cfg.vocab_size)
    made = list(head_names(cfg)) if remade else missing_head(cfg, loaded)
    if made and config.budget.tokens != 0 and ctx.is_main:
        ctx.log.warning(_made_head_message(config, checkpoint, made, head_loss if remade else None, asked_lr))
    added = [name for name in shapes(cfg) if name not in shapes(checkpoint.cfg)]
    if added and ctx.is_main:
        ctx.log.info("init", made=", ".join(added), by="pretrain.init_switch_params")
    made_params = model.init(cfg, ctx.seed, names=made + added)
    return {name: made_params[name] if name in made_params else loaded[name] for name in shapes(cfg)}


def _made_head_message(
    config: Config, checkpoint: Checkpoint, made: list[str], head_loss: float | None, asked_lr: float
) -> str:
    """The one line that says the stage made a head: for a checkpoint without one, or (`head_loss`) for one
    whose own predicts no better than uniform, with the warm-up and the rate it then trains at."""
    remade = head_loss is not None
    value = warmup_setting(config, remade)
    how = (
        f"they train alone, the encoder frozen, for pretrain.head_warmup ({value:g}), then with it"
        if value
        else "they train with the encoder from the first step (pretrain.head_warmup = 0)"
    )
    folder = checkpoint.found.folder
    if not remade:
        return (
            f"pretrain.init: {folder} has no masked-LM head; initialised {', '.join(made)} from the run's "
            f"seed (the decoder is tied to the token embeddings); {how}"
        )
    vocab = checkpoint.cfg.vocab_size
    return (
        f"pretrain.init: {folder}'s masked-LM head predicts no better than uniform (held-out loss "
        f"{head_loss:.2f}, uniform ln {vocab:,} = {math.log(vocab):.2f}): continued as a checkpoint without one; "
        f"initialised {', '.join(made)} from the run's seed (the decoder is tied to the token embeddings); "
        f"{how}; peak lr {peak_lr(config, asked_lr, remade):.3g} (pretrain.init_lr)"
    )
