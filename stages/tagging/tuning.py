"""The token-classification fine-tune: a fresh head per seed on the pretrained encoder, each step's
`batch_size` sentences packed into few rows (stages/tagging/packing.py: one compiled graph per row count), and
every word's tag read where its row put it (`Rows.reads`) from rows batched as the classifiers' are (each batch
padded to the smallest length bucket that holds it: one compiled graph per bucket)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from cram.stages.kept.batches import Padding
from cram.stages.shared.device import to_device
from cram.stages.shared.precision import stepped_difference
from cram.stages.shared.progress import Every, track
from cram.stages.tagging.packing import Packing, shuffled_batches, step_shapes
from cram.stages.tagging.windows import Rows
from cram.stages.tasks.config import FINETUNE_OPTIMIZER, PROGRESS_EVERY_S

# The classifiers' AdamW with its gradients clipped at norm 1, as transformers' Trainer clips them: on WNUT-17
# from all-MiniLM-L6-v2 at lr 2e-4 it raised every seed's validation F1 (bench/README.md, "token classification").
TAGGER_OPTIMIZER = {**FINETUNE_OPTIMIZER, "clip_norm": 1.0}

if TYPE_CHECKING:
    import torch
    from structlog.stdlib import BoundLogger

    from cram.model.config import ModelConfig
    from cram.model.tagger import TagHead
    from cram.stages.shared.precision import Precision
    from cram.stages.tasks.config import Tuning
    from cram.stages.tasks.kind import Start


@dataclass(frozen=True)
class TagGraph:
    """A compiled graph a fine-tune runs, and one batch of its shape for the canary: the fine-tune step (on
    packed rows: `Packing`) or prediction (on rows padded to `length`), for `num_labels` tags."""

    prediction: bool
    num_labels: int
    length: int  # prediction: the bucket; the step: the packed rows' width
    rows: Rows
    index: np.ndarray
    packed_rows: int = 0  # the step: how many packed rows

    @property
    def name(self) -> str:
        if self.prediction:
            return f"tagging, {self.num_labels} tags, length {self.length}"
        return f"tagger fine-tune step, {self.num_labels} tags, {self.packed_rows} rows of {self.length}"


@dataclass(frozen=True)
class TaggedSplits:
    """What a task's fine-tunes run on: its number of tags, training rows, epochs and seeds, and the rows it
    predicts."""

    num_labels: int
    train: Rows
    epochs: int
    seeds: list[int]
    scored: Rows


def tag_graphs(tasks: list[TaggedSplits], tuning: Tuning) -> list[TagGraph]:
    """Every graph the tasks' fine-tunes and predictions will run, once each, with the first rows of each shape."""
    found: dict[tuple, TagGraph] = {}
    for task in tasks:
        packing = Packing.of(task.train.lengths, tuning.batch_size, tuning.buckets)
        shapes = step_shapes(task.train.lengths, packing, tuning.batch_size, task.epochs, task.seeds)
        for count, index in sorted(shapes.items()):
            graph = TagGraph(False, task.num_labels, packing.width, task.train, index, count)
            found.setdefault((False, task.num_labels, packing.width, count), graph)
        in_bucket = np.searchsorted(np.asarray(tuning.buckets), task.scored.lengths)
        for b in np.unique(in_bucket):
            index = np.flatnonzero(in_bucket == b)[: tuning.eval_batch_size]
            graph = TagGraph(True, task.num_labels, tuning.buckets[b], task.scored, index)
            found.setdefault((True, task.num_labels, tuning.buckets[b]), graph)
    return list(found.values())


def read_positions(
    graph: Callable, params: dict, rows: Rows, padding: Padding, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """graph(params, batch) -> logits [B, S, tags] over `rows`, `size` rows a batch, longest first, on the device
    of `params`: [rows, longest] of each position's most likely tag id and its probability (fp32 softmax). One
    graph per bucket; past dynamo's recompile limit it would fall back to eager silently, so that is an error."""
    import torch

    device = next(iter(params.values())).device
    lengths = rows.lengths
    order = np.argsort(-lengths, kind="stable")
    best = np.zeros((len(rows.ids), int(lengths.max())), dtype=np.int64)
    chance = np.zeros(best.shape, dtype=np.float32)
    with torch._dynamo.config.patch(recompile_limit=max(8, len(padding.buckets)), fail_on_recompile_limit_hit=True):
        for start in range(0, len(order), size):
            index = order[start : start + size]
            arrays = padding.inputs(rows.ids, lengths, index, size)
            batch = {k: to_device(torch.from_numpy(v), device) for k, v in arrays.items()}
            p, tag = graph(params, batch).float().softmax(-1).max(-1)
            width = min(p.shape[1], best.shape[1])
            best[index, :width] = tag[: len(index), :width].cpu().numpy()
            chance[index, :width] = p[: len(index), :width].cpu().numpy()
    return best, chance


@dataclass(frozen=True)
class Tagger:
    """What every token fine-tune of a stage shares in one precision: the pretrained params, the head's kind,
    the compiled step and prediction, and batch making."""

    config: Tuning
    cfg: ModelConfig
    params: dict
    special: dict
    device: torch.device
    head: TagHead
    step: Callable  # (params, opt_state, batch, lr, donate=False) -> (params, opt_state, metrics)
    predict: Callable  # (params, batch) -> logits [B, S, tags]

    @classmethod
    def make(cls, start: Start, precision: Precision, compile: bool) -> Tagger:
        from cram import model
        from cram.model.tagger import make_tag_eval_step, make_tag_step, tag_head_of

        config = dataclasses.replace(start.tuning, compile=compile)
        fixed = {k: v for k, v in TAGGER_OPTIMIZER.items() if k != "schedule"}
        opt_cfg = model.AdamW(lr=config.lr, weight_decay=config.weight_decay, **fixed)
        options = precision.compile_options() if compile else None
        how = model.Compilation(compile, config.backend, precision.autocast(), start.attention, options)
        cfg = dataclasses.replace(start.cfg, dropout=0.0)  # the step's rate comes with each batch
        head = tag_head_of(cfg)
        step, predict = make_tag_step(cfg, opt_cfg, how, head=head), make_tag_eval_step(cfg, how, head=head)
        return cls(config, cfg, start.params, start.special, start.device, head, step, predict)

    def fresh(self, num_labels: int, seed: int) -> dict:
        """The pretrained params (copies: a donated step overwrites them) with a fresh head, on the device."""
        from cram.model.tagger import init_tag_head

        head = init_tag_head(self.cfg, num_labels, seed, self.head)
        return {**{k: v.clone() for k, v in self.params.items()}, **{k: v.to(self.device) for k, v in head.items()}}

    def packing(self, rows: Rows) -> Packing:
        """How the fine-tune on `rows` packs its steps' sentences (eager: rows as wide as the longest)."""
        return Packing.of(rows.lengths, self.config.batch_size, self.config.buckets if self.config.compile else ())

    def batch(self, rows: Rows, index: np.ndarray, dropout: float = 0.0, packing: Packing | None = None) -> dict:
        """The fine-tune step's batch of the sentences `rows[index]`, packed (by `packing`, made once a fine-tune,
        else `self.packing(rows)`); `dropout`: the step's rate."""
        import torch

        packing = packing or self.packing(rows)
        arrays = packing.inputs(rows, index, self.special, self.cfg.token_types > 1)
        arrays["dropout"] = np.array(dropout, dtype=np.float32)
        return {k: to_device(torch.from_numpy(v), self.device) for k, v in arrays.items()}

    def train(
        self, num_labels: int, rows: Rows, schedule: tuple[int, float, int], label: str, log: BoundLogger | None
    ) -> tuple[dict, float]:
        """Params fine-tuned with a fresh head (`schedule`: epochs, peak lr, seed) and the last epoch's mean loss;
        `log` gets a progress line at the start and every PROGRESS_EVERY_S."""
        import torch

        from cram import model

        epochs, lr, seed = schedule
        size = self.config.batch_size
        params = self.fresh(num_labels, seed)
        torch.manual_seed(seed)  # dropout's masks
        opt_state = model.optimizer_init(model.AdamW(), params)  # the fine-tune's optimizer: AdamW
        per_epoch, packing = math.ceil(len(rows.ids) / size), self.packing(rows)
        total, every = per_epoch * epochs, Every(PROGRESS_EVERY_S)
        if log is not None:
            log.info("fine-tuning", step=f"0/{total}", epochs=epochs, rows=len(rows.ids))
        for epoch, batches in enumerate(shuffled_batches(len(rows.ids), size, epochs, seed)):
            losses = []
            for i in track(range(per_epoch), label, total, done=epoch * per_epoch):
                batch = self.batch(rows, batches[i], self.config.dropout, packing)
                factor = model.lr_schedule(
                    TAGGER_OPTIMIZER["schedule"], (epoch * per_epoch + i) / total, warmup=self.config.warmup
                )
                lr_now = to_device(torch.tensor(lr * factor, dtype=torch.float32), self.device)
                params, opt_state, metrics = self.step(params, opt_state, batch, lr_now, donate=True)
                losses.append(metrics["loss"])
                if log is not None and every.due():
                    done = epoch * per_epoch + i + 1
                    log.info("fine-tuning", step=f"{done}/{total}", loss=round(float(metrics["loss"]), 4))
        return params, float(torch.stack(losses).mean())

    def tags(self, params: dict, rows: Rows) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each sentence's words' tag ids and their probabilities, read where `rows.reads` says."""
        ids, probabilities = self.positions(params, rows)
        words = [ids[r[:, 0], r[:, 1]] if len(r) else np.zeros(0, np.int64) for r in rows.reads]
        return words, [probabilities[r[:, 0], r[:, 1]] for r in rows.reads]

    def positions(self, params: dict, rows: Rows) -> tuple[np.ndarray, np.ndarray]:
        """[rows, longest] of each position's most likely tag id and its probability (`read_positions`)."""
        return read_positions(self.predict, params, rows, self.padding(), self.config.eval_batch_size)

    def padding(self) -> Padding:
        """How predicted rows are batched: padded to their bucket (eager: to the longest of a batch)."""
        return Padding(self.special, self.config.buckets if self.config.compile else (), self.cfg.token_types > 1)

    def graph_difference(self, eager: Tagger, graph: TagGraph, steps: int, seed: int) -> float:
        """One graph's largest relative difference from eager, from the same fresh head, dropout off: `steps`
        fine-tune steps (loss and gradient norm), or a prediction (logits, relative to their largest)."""
        import torch

        start = self.fresh(graph.num_labels, seed)
        if graph.prediction:
            rows = graph.rows
            arrays = self.padding().inputs(rows.ids, rows.lengths, graph.index, self.config.eval_batch_size)
            inputs = {k: to_device(torch.from_numpy(v), self.device) for k, v in arrays.items()}
            logits = [t.predict(start, inputs).float() for t in (self, eager)]
            worst = (logits[0] - logits[1]).abs().max() / logits[1].abs().max().clamp(min=1e-6)
        else:
            batch = self.batch(graph.rows, graph.index)
            lr = to_device(torch.tensor(self.config.lr, dtype=torch.float32), self.device)
            worst = stepped_difference((self.step, eager.step), start, batch, lr, steps).double().max()
        return float(worst) if torch.isfinite(worst) else float("inf")
