"""Fine-tuning for the evaluate stage: a task's examples as padded batches, the fine-tune loop per
seed, and the scores of its predictions.

Every task and seed starts from the pretrained params with a fresh head. Every batch has `batch_size`
rows (short batches are filled with zero-weight rows) and is padded to the smallest length bucket
that fits it, so the compiled step and prediction each compile at most once per bucket and nothing
recompiles from step to step; eager steps, which compile nothing, pad to the batch's longest row.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from cram.stages import Context, StageError, Upstream
from cram.stages.kept.batches import Padding, join
from cram.stages.shared.device import to_device
from cram.stages.shared.precision import stepped_difference
from cram.stages.shared.progress import Every, track
from cram.stages.tasks.config import FINETUNE_OPTIMIZER, PROGRESS_EVERY_S

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    import torch
    from structlog.stdlib import BoundLogger

    from cram.model.config import ModelConfig
    from cram.stages.finetuning.tasks import Examples, Task
    from cram.stages.shared.precision import Difference, Precision
    from cram.stages.shared.tokenizer import Tokenizer
    from cram.stages.tasks.config import TaskConfig, TaskSettings, Tuning

    Split: TypeAlias = tuple[list[np.ndarray], np.ndarray, np.ndarray]  # (rows, lengths, labels)

# The stage-wide hyper-parameters of every fine-tune, recorded beside each task's own (epochs, lr,
# max_length, seeds) so that a score says everything that produced it.
FINETUNE_SETTINGS = ("batch_size", "warmup", "weight_decay", "dropout", "pooling", "head", "head_width", "buckets")
# What of a batch the model reads (`Tuner.batch`): prediction is given these alone.
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def model_inputs(batch: dict) -> dict:
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def load_task(task_cfg: TaskConfig, index: int, tokenize: Upstream | None) -> Task:
    from cram.stages.finetuning import tasks

    where = f"evaluate.tasks[{index}]"
    if task_cfg.kind == "glue":
        return tasks.load_glue(task_cfg.name, task_cfg.path, where)
    if task_cfg.kind == "custom":
        return tasks.load_custom(
            task_cfg.name, task_cfg.path, task_cfg.text_fields, task_cfg.label_field, task_cfg.metrics, where
        )
    heldout = tokenize.outputs.get("heldout")
    if heldout is None:
        raise StageError(
            f"{where}: kind 'heldout-topic' needs the tokenize stage's held-out articles, and it kept none "
            "(give tokenize labelled documents to hold out, or drop this task)"
        )
    return tasks.load_topics(task_cfg.name, tokenize.dir / heldout, task_cfg.test_fraction)


@dataclass(frozen=True)
class Encoded:
    """A task's examples as token ids: ragged rows, their lengths, and the labels."""

    train: Split
    tests: dict[str, Split]


def encode(task: Task, tokenizer: Tokenizer, special: dict, max_length: int) -> Encoded:
    """The task's texts as [CLS] a [SEP] (b [SEP]) rows of at most `max_length` ids, with their labels."""
    import numpy as np

    def split(examples: Examples) -> Split:
        if not examples.texts:
            raise StageError(f"task {task.name}: a split has no examples")
        columns = [tokenizer.encode([t[i] for t in examples.texts]) for i in range(len(examples.texts[0]))]
        rows = [join(parts, special, max_length) for parts in zip(*columns)]
        return rows, np.array([len(r) for r in rows]), examples.labels

    return Encoded(split(task.train), {name: split(test) for name, test in task.tests.items()})


@dataclass(frozen=True)
class ClassificationLoaded:
    """A task ready to fine-tune: its config entry, its examples, them encoded, and its own settings."""

    config: TaskConfig
    task: Task
    data: Encoded
    settings: TaskSettings


def finetune_seed(
    tuner: Tuner, loaded: ClassificationLoaded, seed: int, ctx: Context, keep: Callable | None = None
) -> dict:
    """Fine-tune one seed of one task from the pretrained params and score it on each test set; `keep`,
    when given, is called with the fine-tuned params and the run's record (`keeping.Keeper.offer`)."""
    from cram.stages.finetuning.metrics import score

    began = time.perf_counter()
    task, data, settings = loaded.task, loaded.data, loaded.settings
    label, log = f"{task.name} seed {seed}", ctx.log.bind(task=task.name, seed=seed)
    params, loss = tuner.train(task.num_outputs, data.train, settings, seed, label, log)
    scores = {}
    for test, (rows, lengths, labels) in data.tests.items():
        outputs = tuner.outputs(params, rows, lengths)
        scores[test] = score(task.metrics, outputs[:, 0] if task.regression else outputs.argmax(-1), labels)
    ctx.log.info(
        "finetuned",
        task=task.name,
        seed=seed,
        train_loss=round(loss, 4),
        **{f"{t}_{m}": round(v, 4) for t, ms in scores.items() for m, v in ms.items()},
    )
    run = {"train_loss": loss, "scores": scores, "time_s": time.perf_counter() - began}
    if keep is not None:
        keep(params, run)
    return run


def task_result(tuning: Tuning, loaded: ClassificationLoaded, seeds: list[int], runs: list[dict], ctx: Context) -> dict:
    """A task's results from its seeds' runs (in seed order): per-seed scores, medians, the baseline."""
    import numpy as np

    from cram.stages.finetuning.tasks import majority_baseline

    task, data = loaded.task, loaded.data
    scores = {t: {m: [r["scores"][t][m] for r in runs] for m in task.metrics} for t in task.tests}
    result = {
        "kind": loaded.config.kind,
        "metrics": list(task.metrics),
        "labels": list(task.label_names),
        "train_examples": len(data.train[0]),
        "test_examples": {t: len(rows) for t, (rows, _, _) in data.tests.items()},
        "epochs": loaded.settings.epochs,
        "lr": loaded.settings.lr,
        "max_length": loaded.settings.max_length,
        "seeds": seeds,
        "settings": _json_values({**{key: getattr(tuning, key) for key in FINETUNE_SETTINGS}, **FINETUNE_OPTIMIZER}),
        "train_loss": [r["train_loss"] for r in runs],
        "scores": scores,
        "median": {t: {m: float(np.median(v)) for m, v in ms.items()} for t, ms in scores.items()},
        "baseline": {t: majority_baseline(task, test) for t, test in task.tests.items()},
        "time_s": round(sum(r["time_s"] for r in runs), 3),  # fine-tuning time, summed over seeds
    }
    ctx.log.info("task", task=task.name, median=result["median"], baseline=result["baseline"], time_s=result["time_s"])
    return result


def _json_values(settings: dict) -> dict:
    """Tuples as lists: results read back from results.json (other ranks, a cached run) compare equal."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}


@dataclass(frozen=True)
class Graph:
    """A compiled graph that fine-tuning runs, and one batch of its shape for the canary: the fine-tune
    step (`batch_size` rows) or prediction (`eval_batch_size`), for a head of `num_outputs`, at `bucket`."""

    prediction: bool
    num_outputs: int
    bucket: int
    split: Split
    index: np.ndarray  # the batch's rows of `split`, each padded to `bucket`

    @property
    def name(self) -> str:
        what = "prediction" if self.prediction else "fine-tune step"
        return f"{what}, {self.num_outputs} outputs, length {self.bucket}"


def graphs(loaded: list[ClassificationLoaded], tuning: Tuning) -> list[Graph]:
    """Every graph the tasks' fine-tunes and test predictions may run, once each: a (head, bucket) shape
    that a training row (the step) or a test row (prediction) falls in, with the first rows of it."""
    import numpy as np

    found: dict[tuple[bool, int, int], Graph] = {}
    for t in loaded:
        splits = [(False, t.data.train, tuning.batch_size)]
        splits += [(True, test, tuning.eval_batch_size) for test in t.data.tests.values()]
        for prediction, split, size in splits:
            in_bucket = np.searchsorted(np.asarray(tuning.buckets), split[1])  # the first bucket that holds it
            for b in np.unique(in_bucket):
                key = (prediction, t.task.num_outputs, tuning.buckets[b])
                index = np.flatnonzero(in_bucket == b)[:size]
                found.setdefault(key, Graph(prediction, t.task.num_outputs, tuning.buckets[b], split, index))
    return list(found.values())


@dataclass(frozen=True)
class Tuner:
    """What every fine-tune of a run shares: pretrained params, the compiled steps, batch making."""

    config: Tuning
    cfg: ModelConfig
    params: dict  # pretrained, on the device
    special: dict
    device: torch.device
    step: Callable  # (params, opt_state, batch, lr, donate=False) -> (params, opt_state, metrics)
    predict: Callable  # (params, batch) -> logits

    @classmethod
    def make(
        cls,
        config: Tuning,
        cfg: ModelConfig,
        params: dict,
        special: dict,
        device: torch.device,
        precision: Precision,
        attention: str = "auto",
    ) -> Tuner:
        from cram import model
        from cram.model.classifier import make_classify_eval_step, make_finetune_step

        fixed = {k: v for k, v in FINETUNE_OPTIMIZER.items() if k != "schedule"}
        opt_cfg = model.AdamW(lr=config.lr, weight_decay=config.weight_decay, **fixed)
        options = precision.compile_options() if config.compile else None
        how = model.Compilation(config.compile, config.backend, precision.autocast(), attention, options)
        kw = dict(pooling=config.pooling, head=config.head)
        cfg = dataclasses.replace(cfg, dropout=0.0)  # the fine-tune step's rate comes with each batch
        step, predict = make_finetune_step(cfg, opt_cfg, how, **kw), make_classify_eval_step(cfg, how, **kw)
        return cls(config, cfg, params, special, device, step, predict)

    def train(
        self,
        num_outputs: int,
        train: Split,
        settings: TaskSettings,
        seed: int,
        label: str = "fine-tune",
        log: BoundLogger | None = None,
    ) -> tuple[dict, float]:
        """Params fine-tuned from the pretrained ones with a fresh head, and the last epoch's mean loss:
        `settings.epochs` epochs at the task's `settings.lr`. `log` (bound to the task and seed) gets a
        progress line at the start and every PROGRESS_EVERY_S."""
        import numpy as np
        import torch

        from cram import model

        rows, lengths, labels = train
        epochs, lr = settings.epochs, settings.lr
        size = self.config.batch_size
        head = self.head(num_outputs, seed)
        torch.manual_seed(seed)  # dropout's masks: a seed's fine-tune is the same wherever it runs
        # the loop's own copy, which its steps may overwrite (`donate`): every seed starts from self.params
        params = {**{k: v.clone() for k, v in self.params.items()}, **head}
        opt_state = model.optimizer_init(model.AdamW(), params)  # the fine-tune's optimizer: AdamW
        rng = np.random.default_rng(seed)
        steps_per_epoch = math.ceil(len(rows) / size)
        total = steps_per_epoch * epochs
        every = Every(PROGRESS_EVERY_S)
        if log is not None:
            log.info("fine-tuning", step=f"0/{total}", epochs=epochs, examples=len(rows))
        for epoch in range(epochs):
            order = rng.permutation(len(rows))
            losses = []
            for i in track(range(steps_per_epoch), label, total, done=epoch * steps_per_epoch):
                batch = self.batch(rows, lengths, labels, order[i * size : (i + 1) * size], size, self.config.dropout)
                progress = (epoch * steps_per_epoch + i) / total
                factor = model.lr_schedule(FINETUNE_OPTIMIZER["schedule"], progress, warmup=self.config.warmup)
                lr_now = to_device(torch.tensor(lr * factor, dtype=torch.float32), self.device)
                params, opt_state, metrics = self.step(params, opt_state, batch, lr_now, donate=True)
                losses.append(metrics["loss"])
                if log is not None and every.due():  # the loss read here is the one host sync in 30 s
                    step = epoch * steps_per_epoch + i + 1
                    log.info("fine-tuning", step=f"{step}/{total}", loss=round(float(metrics["loss"]), 4))
        return params, float(torch.stack(losses).mean())

    def canary(self, eager: Tuner, graphs: list[Graph], steps: int, seed: int, tolerance: float) -> Difference:
        """The largest relative difference between this tuner's compiled graphs and `eager`'s, the same
        steps run eagerly, over `graphs` in turn (`graph_difference`, `precision.worst_graph`). The compiled
        graphs are the ones fine-tuning then uses."""
        from cram.stages.shared.precision import worst_graph

        return worst_graph(graphs, lambda graph: self.graph_difference(eager, graph, steps, seed), tolerance)

    def graph_difference(self, eager: Tuner, graph: Graph, steps: int, seed: int) -> float:
        """One graph's largest relative difference from eager, from the same fresh head, dropout off: `steps`
        fine-tune steps on its batch (loss and gradient norm), or a prediction of it (logits, relative to
        their largest); inf when one is not finite."""
        import torch

        rows, lengths, labels = graph.split
        start = {**self.params, **self.head(graph.num_outputs, seed)}
        tuners = (self, eager)
        if graph.prediction:
            inputs = model_inputs(self.batch(rows, lengths, labels, graph.index, self.config.eval_batch_size))
            logits = [tuner.predict(start, inputs).float() for tuner in tuners]
            worst = (logits[0] - logits[1]).abs().max() / logits[1].abs().max().clamp(min=1e-6)
            return float(worst) if torch.isfinite(worst) else float("inf")
        batch = self.batch(rows, lengths, labels, graph.index, self.config.batch_size, dropout=0.0)
        lr = to_device(torch.tensor(self.config.lr, dtype=torch.float32), self.device)
        diffs = stepped_difference((self.step, eager.step), start, batch, lr, steps)
        worst = diffs.double().max()
        return float(worst) if torch.isfinite(worst) else float("inf")

    def outputs(self, params: dict, rows: list, lengths, label: str | None = None, report: Callable | None = None):
        """Model outputs [N, num_outputs] for every row, in the rows' order. With `label`, a progress bar
        (on a terminal), and `report(rows done)` every PROGRESS_EVERY_S."""
        import numpy as np
        import torch

        size = self.config.eval_batch_size
        order = np.argsort(lengths, kind="stable")  # similar lengths together: less padding
        no_labels = np.zeros(len(rows), dtype=np.int64)
        outputs = []
        starts, every = range(0, len(rows), size), Every(PROGRESS_EVERY_S)
        for start in starts if label is None else track(starts, label, len(starts)):
            if report is not None and every.due():
                report(start)
            batch = self.batch(rows, lengths, no_labels, order[start : start + size], size)
            logits = self.predict(params, model_inputs(batch))
            outputs.append(logits[: len(order[start : start + size])])
        unsorted = np.empty_like(order)
        unsorted[order] = np.arange(len(order))
        return torch.cat(outputs).cpu().numpy()[unsorted]  # one host sync, after the last batch

    def batch(self, rows: list, lengths, labels, index, size: int, dropout: float = 0.0) -> dict:
        """`size` rows padded to the bucket of the longest (eager: to the longest); rows past `len(index)`
        are weightless fillers; `dropout`: the fine-tune step's rate."""
        import numpy as np
        import torch

        buckets = self.config.buckets if self.config.compile else ()  # eager: each batch to its longest row
        padding = Padding(self.special, buckets, self.cfg.token_types > 1)
        arrays = padding.inputs(rows, lengths, index, size)
        padded_labels = np.zeros(size, dtype=labels.dtype)
        padded_labels[: len(index)] = labels[index]
        weights = np.zeros(size, dtype=np.float32)
        weights[: len(index)] = 1.0
        arrays.update(labels=padded_labels, weights=weights)
        arrays["dropout"] = np.array(dropout, dtype=np.float32)
        return {k: to_device(torch.from_numpy(v), self.device) for k, v in arrays.items()}

    def head(self, num_outputs: int, seed: int) -> dict:
        """A fresh head on the device; with `pooling = "pooler"` its dense layer is the checkpoint's pooler."""
        from cram.model.classifier import init_head_params, pooler_head

        head = init_head_params(self.cfg, num_outputs, seed, self.config.head_width, self.config.head)
        if self.config.pooling == "pooler":
            head = pooler_head(head, self.params)
        return {k: v.to(self.device) for k, v in head.items()}
