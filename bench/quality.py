"""Quality per budget: cram against transformers' BertForMaskedLM and ModernBertForMaskedLM.

    python bench/quality.py runs/default/pack [--config tiny] [--tokens N] [--lrs 1e-3,3e-3]
        [--variant NAME:key=value,...] [--models cram,bert,modernbert] [--device cpu|cuda] [--dtype fp32|bf16]

Every model gets the same dimensions (the preset, vocab and sequence length of the packed data), the
same training sequences in the same order with the same masks (the pipeline's masking rule), the
same AdamW (cramming's betas, eps, weight decay on matrices only, clipping at 0.5) and lr schedule
over the same token budget, and is evaluated on the identical masked held-out batches at regular
token counts. Each model trains once per lr of `--lrs`; its best final loss is its row.

1. Speed: every model's compiled training step (and cram's eager one, and the peers' dense-logit
   steps) timed in turn, one step of each per round (A, B, C, A, B, C ...), so load from other work
   hits all alike. The peers' sparse steps feed only the masked rows to their MLM head (BERT's
   `cls`, ModernBERT's `head` + `decoder`, as its `sparse_prediction`), as cram does.
2. Loss vs tokens: each model at each lr for `--tokens`, loss every `--tokens / --evals` (on a CPU
   the eager steps train: the same arithmetic without a compile per run). `--dtype bf16` on a CPU without
   bf16 units computes bf16's matrix products in fp32, rounded as bf16 units round (bench/bf16_emulation.py):
   its losses are bf16's, and it times nothing, so it needs `--no-speed`.
3. Loss at equal wall time: the time cram's first row needs for the whole budget; every other model
   trains (at its best lr) for the tokens its measured speed gives it in that time.

The budget must fit in `--max-epochs` passes over the packed training blocks (default 1: no block
is seen twice); a larger one is refused. Without `transformers` the peers are skipped with a note.
`--variant` adds a cram model with `ModelConfig` overrides (e.g. `rope:position=rope`), and
`pretrain.masking.rate` / `schedule` style keys `mask_rate=`, `schedule=`, `lrs=` per variant;
`optimizer=muon` (cram's `OptimizerConfig.kind`); and pretrain's options past 128 tokens: `end_rate=0.15`
(the masking rate moves linearly from `mask_rate` to it), `phases=128@0.9/512` (sequence-length phases:
128 until 0.9 of the budget, then 512, each step holding the same tokens) and `documents=true` (attention
within documents). Every model reads
pretrain's own stream (`stages/pretraining/phases.py`, `batches.py`); the held-out batches stay at
pack's length, masked at 0.25.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cram import model
from cram.stages import StageError
from cram.stages.pretraining import phases
from cram.stages.pretraining.batches import read_sequences
from cram.stages.pretraining.state import TrainState
from cram.stages.shared.blocks import blocks_of, boundary, document_ids
from cram.stages.shared.masking import Masking, mask_seed, mask_spec, mask_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bf16_emulation import Bf16Matmuls, needed  # noqa: E402  (bench/bf16_emulation.py, beside this file)

PEERS = ("bert", "modernbert")
# per-variant training settings; the rest is ModelConfig
RUN_KEYS = ("mask_rate", "end_rate", "phases", "documents", "schedule", "lrs", "dtype", "optimizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pack", type=Path, help="a pack stage's output folder (train.npy, val.npy, pack.json)")
    parser.add_argument("--config", choices=tuple(model.PRESETS), default="tiny")
    parser.add_argument("--models", default="cram,bert,modernbert", help="cram, bert, modernbert (comma-separated)")
    parser.add_argument("--variant", action="append", default=[], help="NAME:key=value,... a further cram model")
    parser.add_argument("--cram", default="", help="key=value,... overrides of the 'cram' row itself")
    parser.add_argument("--tokens", type=float, help="training tokens per model (default: one pass over the data)")
    parser.add_argument("--max-epochs", type=float, default=1.0, help="passes over the training blocks allowed")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lrs", default="1e-3,3e-3")
    parser.add_argument("--schedule", default="budget-triangle", help=f"one of {', '.join(model.SCHEDULES)}")
    parser.add_argument("--mask-rate", type=float, default=0.25)
    parser.add_argument("--evals", type=int, default=8, help="held-out evaluations over the budget")
    parser.add_argument("--val-blocks", type=int, default=128)
    parser.add_argument(
        "--val-batch",
        type=int,
        help="held-out sequences a batch (default --batch); fix it to compare two batches",
    )
    parser.add_argument("--speed-rounds", type=int, default=12)
    parser.add_argument("--no-wall", action="store_true", help="skip the equal-wall-time trainings")
    parser.add_argument("--no-speed", action="store_true", help="losses at equal tokens only (ablations)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="autocast of every model")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()
    try:
        models = build_models(args)
        data = Data(args)
        for spec in models:
            data.plan(spec)  # a phase or masking schedule that cannot run fails here, before any training
            if _emulates_bf16(spec.dtype, data.device) and not args.no_speed:
                raise ValueError(f"{spec.name}: bf16 on a CPU without bf16 units is emulated; pass --no-speed")
    except (ValueError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    report = run(args, models, data)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


# ---------------------------------------------------------------------------------------------- setup


@dataclasses.dataclass
class Spec:
    """One model row: its kind, ModelConfig overrides (cram) and training settings."""

    name: str
    kind: str  # "cram", "bert" or "modernbert"
    overrides: dict
    lrs: list[float]
    schedule: str
    mask_rate: float
    dtype: str
    end_rate: float | None = None  # the masking rate at the end of the budget; None: mask_rate throughout
    phases: str = ""  # "128@0.9/512": LEN@UNTIL/.../LEN; "": pack's length throughout
    documents: bool = False  # attention within documents
    optimizer: str = "adamw"  # cram's `OptimizerConfig.kind` (the peers train with AdamW)

    @property
    def stream(self) -> tuple:
        """What its training batches depend on: models that agree here train on the same batches."""
        return (self.mask_rate, self.end_rate, self.phases, self.documents)


def build_models(args: argparse.Namespace) -> list[Spec]:
    lrs = [float(x) for x in args.lrs.split(",")]
    specs = []
    for kind in args.models.split(","):
        if kind not in ("cram", *PEERS):
            raise ValueError(f"--models: unknown {kind!r}; allowed cram, bert, modernbert")
        if kind in PEERS and not _has_transformers():
            print(f"note: {kind} skipped: transformers is not installed (pip install -e '.[bench]')")
            continue
        specs.append(Spec(kind, kind, {}, lrs, args.schedule, args.mask_rate, args.dtype))
    rows = ([f"cram:{args.cram}"] if args.cram else []) + args.variant
    for text in rows:
        name, _, body = text.partition(":")
        spec = next((s for s in specs if s.name == name), None) if name == "cram" else None
        if spec is None:
            spec = Spec(name, "cram", {}, lrs, args.schedule, args.mask_rate, args.dtype)
            specs.append(spec)
        for item in filter(None, body.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--variant {text!r}: {item!r} is not key=value")
            if key == "lrs":
                spec.lrs = [float(x) for x in value.split("/")]
            elif key in RUN_KEYS:
                setattr(spec, key, value if key in ("schedule", "dtype", "phases", "optimizer") else _parse(value))
            elif key in {f.name for f in dataclasses.fields(model.ModelConfig)}:
                spec.overrides[key] = _parse(value)
            else:
                raise ValueError(f"--variant {text!r}: unknown key {key!r}; a ModelConfig field or {RUN_KEYS}")
        model.ModelConfig(**spec.overrides)  # a bad value fails here, before any training
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("--variant: model names must be unique")
    for spec in specs:
        if spec.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype {spec.dtype!r}: allowed fp32, bf16")
        if spec.schedule not in model.SCHEDULES:
            raise ValueError(f"schedule {spec.schedule!r}: allowed {', '.join(model.SCHEDULES)}")
        if (spec.documents or spec.optimizer != "adamw") and spec.kind != "cram":
            raise ValueError(f"{spec.name}: documents and optimizer are for cram models")
        model.optimizer_config(spec.optimizer)  # an unknown kind fails here
    if not specs:
        raise ValueError("no model to run")
    return specs


def _parse(value: str):
    if value in ("true", "false"):
        return value == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class Data:
    """The packed blocks, the training stream (identical for every model) and fixed held-out batches."""

    def __init__(self, args: argparse.Namespace):
        meta_path = args.pack / "pack.json"
        if not meta_path.is_file():
            raise ValueError(f"{meta_path}: not found; pass a pack stage's folder (cram run pipeline.toml --only pack)")
        self.meta = json.loads(meta_path.read_text())
        self.train = np.load(args.pack / self.meta["train"], mmap_mode="r")
        self.val = np.load(args.pack / self.meta["val"], mmap_mode="r")
        self.seq_len = int(self.meta["seq_len"])
        self.device = torch.device(args.device)
        self.seed = args.seed
        step_tokens = args.batch * self.seq_len
        available = len(self.train) * self.seq_len
        tokens = args.tokens or available
        self.steps = int(tokens // step_tokens)
        if self.steps < 1:
            raise ValueError(f"--tokens {tokens:.0f}: less than one batch ({step_tokens} tokens)")
        if self.steps * step_tokens > args.max_epochs * available:
            raise ValueError(
                f"--tokens {tokens:.0f}: the packed data holds {available:,} training tokens "
                f"({len(self.train):,} blocks), {args.max_epochs:g} pass(es) allowed: that budget would repeat "
                f"blocks; lower --tokens or allow --max-epochs {math.ceil(tokens / available)}"
            )
        self.batch = args.batch
        # The held-out masks are drawn per batch: one size keeps the held-out set identical across runs.
        self.val_batch = args.val_batch or args.batch
        if len(self.val) < self.val_batch:
            raise ValueError(f"{args.pack}: {len(self.val)} held-out blocks, fewer than one batch of {self.val_batch}")
        self.val_batches = min(args.val_blocks, len(self.val)) // self.val_batch
        self._masked: dict[tuple, list] = {}
        self.documents = boundary(self.meta["boundary"], self.meta["special_ids"]) if "boundary" in self.meta else None

    def plan(self, spec: Spec) -> phases.Plan:
        """pretrain's phases and masking for `spec`, one microbatch of `--batch` sequences a step."""
        try:
            masking = Masking(rate=spec.mask_rate, end_rate=spec.end_rate)
        except ValueError as e:
            raise ValueError(f"{spec.name}: {e}") from None
        settings = argparse.Namespace(
            phases=_phases(spec.phases), microbatch=self.batch, batch_size=self.batch, masking=masking
        )
        return phases.plan(settings, self.seq_len, self.meta["special_ids"], self.meta["vocab_size"])

    def train_batches(self, spec: Spec) -> list[dict]:
        """Every training batch, masked, in order, as pretrain's stream makes them (its phases, its masking
        schedule); built once per stream, shared by every model that trains on it."""
        key = (spec.stream, "train")
        if key not in self._masked:
            self._masked[key] = self._stream(spec)
        return self._masked[key]

    def _stream(self, spec: Spec) -> list[dict]:
        plan, state = self.plan(spec), TrainState(seed=self.seed)
        chunks, gen = blocks_of(self.train, plan.chunk), torch.Generator(device=self.device)
        batches = []
        for step in range(self.steps):
            progress = step / self.steps
            phases.enter(plan, state, progress)
            span = plan.spans[state.phase]
            first = plan.first_sequence(state)
            rows = read_sequences(chunks, self.seed, first, span.batch_size, {}, plan.chunk // span.seq_len)
            ids = torch.from_numpy(rows).to(self.device)
            gen.manual_seed(mask_seed(self.seed, first))
            batch = mask_tokens(ids, plan.spec_at(span, progress), gen)
            if spec.documents:
                batch["document_ids"] = document_ids(ids, self.documents)
            batches.append(_with_dense_labels(batch))
            state.sequences += span.batch_size
        return batches

    def val_batches_(self) -> list[dict]:
        """The held-out batches at the default rate (0.25), masked as pretrain's held-out loss masks them."""
        key = (0.25, "val")
        if key not in self._masked:
            spec, gen = self._masking(0.25)
            batches = []
            for i in range(self.val_batches):
                first = i * self.val_batch
                rows = self.val[first : first + self.val_batch]
                ids = torch.from_numpy(np.asarray(rows, dtype=np.int32)).to(self.device)
                gen.manual_seed(mask_seed(self.seed, first, stream=1))
                batch = mask_tokens(ids, spec, gen)
                if "boundary" in self.meta:
                    batch["document_ids"] = document_ids(ids, self.documents)
                batches.append(_with_dense_labels(batch))
            self._masked[key] = batches
        return self._masked[key]

    def _masking(self, rate: float):
        spec = mask_spec(Masking(rate=rate), self.meta["special_ids"], self.meta["vocab_size"], self.seq_len)
        return spec, torch.Generator(device=self.device)


def _phases(text: str) -> tuple[phases.Phase, ...]:
    """ "128@0.9/512" as pretrain's phases: 128 until 0.9 of the budget, then 512."""
    parts = [p.partition("@") for p in filter(None, text.split("/"))]
    try:
        return tuple(phases.Phase(int(length), float(until) if until else None) for length, _, until in parts)
    except ValueError as e:
        raise ValueError(f"phases={text!r}: {e}; expected LEN@UNTIL/.../LEN, e.g. 128@0.9/512") from None


def _with_dense_labels(batch: dict) -> dict:
    """Adds `labels` [B, S]: the masked rows' targets, -100 elsewhere (what transformers' dense loss reads)."""
    ids = batch["input_ids"]
    dense = torch.full((ids.numel(),), -100, dtype=torch.long, device=ids.device)
    dense[batch["mlm_positions"]] = batch["mlm_labels"]
    return {**batch, "labels": dense.view_as(ids)}


# ---------------------------------------------------------------------------------------------- models


class Trainer:
    """One model at one lr: `step(batch, lr)` trains (returns the loss tensor), `evaluate(batches)` -> mean loss."""

    def __init__(self, spec: Spec, args: argparse.Namespace, data: Data, *, compiled: bool = True, sparse: bool = True):
        self.spec, self.device = spec, data.device
        self.autocast = torch.bfloat16 if spec.dtype == "bf16" else None
        dims = dataclasses.replace(
            model.PRESETS[args.config],
            vocab_size=data.meta["vocab_size"],
            max_seq_len=data.plan(spec).chunk,
            pad_id=data.meta["special_ids"]["pad"],
            **spec.overrides,
        )
        self.cfg = dims
        build = {"cram": self._cram, "bert": self._bert, "modernbert": self._modernbert}[spec.kind]
        build(args, data, compiled, sparse)

    def _cram(self, args, data, compiled, sparse) -> None:
        params = {k: v.to(self.device) for k, v in model.init(self.cfg, seed=args.seed).items()}
        state = {"params": params, "opt": model.optimizer_init(model.AdamW(), params)}
        train = model.make_train_step(
            self.cfg,
            model.optimizer_config(self.spec.optimizer),
            model.Compilation(compile=compiled, backend=args.backend, autocast=self.autocast),
        )
        evaluate = model.make_eval_step(self.cfg, model.Compilation(compile=False, autocast=self.autocast))
        keys = ("input_ids", "mlm_positions", "mlm_labels") + (("document_ids",) if self.spec.documents else ())

        def step(batch, lr):
            state["params"], state["opt"], metrics = train(
                state["params"], state["opt"], {k: batch[k] for k in keys}, lr
            )
            return metrics["loss"]

        self.step = step
        self._eval = lambda batch: evaluate(state["params"], {k: batch[k] for k in keys})["loss"]
        self.lr_tensor = True

    def _bert(self, args, data, compiled, sparse) -> None:
        import transformers

        cfg = self.cfg
        torch.manual_seed(args.seed)
        net = transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden,
                num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.heads,
                intermediate_size=cfg.intermediate,
                max_position_embeddings=cfg.max_seq_len,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                pad_token_id=cfg.pad_id,
                type_vocab_size=1,
                attn_implementation="sdpa",
            )
        ).to(self.device)
        self._torch_model(args, net, lambda ids: net.bert(input_ids=ids).last_hidden_state, net.cls, compiled, sparse)

    def _modernbert(self, args, data, compiled, sparse) -> None:
        import transformers

        cfg, special = self.cfg, data.meta["special_ids"]
        torch.manual_seed(args.seed)
        net = transformers.ModernBertForMaskedLM(
            transformers.ModernBertConfig(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden,
                num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.heads,
                intermediate_size=cfg.ffn_inner,
                max_position_embeddings=cfg.max_seq_len,
                layer_types=["full_attention"] * cfg.layers,
                global_rope_theta=cfg.rope_theta,
                pad_token_id=special["pad"],
                cls_token_id=special["cls"],
                sep_token_id=special["sep"],
                bos_token_id=special["cls"],
                eos_token_id=special["sep"],
                attn_implementation="sdpa",
            )
        ).to(self.device)
        self._torch_model(
            args,
            net,
            lambda ids: net.model(input_ids=ids).last_hidden_state,
            lambda rows: net.decoder(net.head(rows)),
            compiled,
            sparse,
        )

    def _torch_model(self, args, net, encode, head, compiled, sparse) -> None:
        """transformers' way: the model compiled (as the Trainer does), torch.optim.AdamW outside it."""
        decay = [p for p in net.parameters() if p.ndim >= 2]
        rest = [p for p in net.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
            lr=1e-3,
            betas=(0.9, 0.98),
            eps=1e-12,
            foreach=True,
        )

        def loss_of(batch):
            with _autocast(self.device, self.autocast):
                if sparse:  # only the masked rows reach the head: cram's sparse prediction
                    rows = encode(batch["input_ids"]).flatten(0, 1).index_select(0, batch["mlm_positions"])
                    return F.cross_entropy(head(rows).float(), batch["mlm_labels"])
                logits = head(encode(batch["input_ids"]))
                return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

        forward = torch.compile(loss_of, backend=args.backend) if compiled else loss_of

        def step(batch, lr):
            for group in opt.param_groups:
                group["lr"] = lr
            loss = forward(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        self.step = step
        self._eval = loss_of
        self.lr_tensor = False

    def lr(self, value: float):
        return torch.tensor(value, device=self.device) if self.lr_tensor else value

    def evaluate(self, batches: list[dict]) -> float:
        with torch.no_grad():
            return torch.stack([self._eval(b).float() for b in batches]).mean().item()


def _autocast(device, dtype):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------- phases


def run(args: argparse.Namespace, specs: list[Spec], data: Data) -> dict:
    step_tokens = args.batch * data.seq_len
    cfg = model.PRESETS[args.config]
    hf = __import__("transformers").__version__ if _has_transformers() else "not installed"
    emulated = " (emulated: fp32 matrix products rounded to bf16)" if _emulates_bf16(args.dtype, data.device) else ""
    dtype = args.dtype + emulated
    print(
        f"# quality per budget: {args.config} (layers {cfg.layers}, hidden {cfg.hidden}, heads {cfg.heads}, "
        f"intermediate {cfg.intermediate}), vocab {data.meta['vocab_size']}, seq {data.seq_len}, batch {args.batch}; "
        f"{data.steps} steps = {data.steps * step_tokens / 1e6:.2f}M tokens "
        f"of {len(data.train) * data.seq_len / 1e6:.2f}M unique; {dtype} on {args.device} "
        f"({torch.get_num_threads()} threads), torch {torch.__version__}, "
        f"transformers {hf}; held-out: {data.val_batches} fixed masked batches\n",
        flush=True,
    )

    speed = {} if args.no_speed else measure_speed(args, specs, data)
    if speed:
        print(f"## tokens/s, interleaved (median step)\n\n| step | ms | tokens/s | vs {specs[0].name} compiled |")
        print("|---|---|---|---|")
        base = speed[f"{specs[0].name} compiled"]
        for row, seconds in speed.items():
            print(f"| {row} | {1e3 * seconds:.1f} | {step_tokens / seconds:,.0f} | {base / seconds:.2f}x |")
        print(flush=True)

    curves: dict[str, dict] = {}
    for spec in specs:
        for lr in spec.lrs:
            curve = train(args, spec, data, lr, data.steps, args.evals)
            curves.setdefault(spec.name, {})[lr] = curve
            print(f"  {spec.name} lr {lr:g}: final {curve['loss'][-1]:.3f} ({curve['seconds']:.0f} s)", flush=True)
    best = {name: min(by_lr, key=lambda lr: by_lr[lr]["loss"][-1]) for name, by_lr in curves.items()}
    tokens = curves[specs[0].name][best[specs[0].name]]["tokens"]
    print("\n## held-out MLM loss vs training tokens (each model at its best lr)\n")
    print("| model | best lr | " + " | ".join(f"{t / 1e6:.2f}M" for t in tokens) + " |")
    print("|---|---|" + "---|" * len(tokens))
    for name, lr in best.items():
        losses = curves[name][lr]["loss"]
        print(f"| {name} | {lr:g} | " + " | ".join(f"{x:.3f}" for x in losses) + " |")
    print(
        "\nfinal loss per lr: "
        + "; ".join(
            f"{name} " + ", ".join(f"{lr:g}: {c['loss'][-1]:.3f}" for lr, c in by_lr.items())
            for name, by_lr in curves.items()
        ),
        flush=True,
    )

    wall = {} if args.no_wall or args.no_speed else equal_wall_time(args, specs, data, speed, best, curves)
    return {
        "speed_s": speed,
        "curves": {n: {str(lr): c for lr, c in v.items()} for n, v in curves.items()},
        "best_lr": best,
        "equal_wall_time": wall,
    }


def measure_speed(args: argparse.Namespace, specs: list[Spec], data: Data) -> dict[str, float]:
    """Median seconds per step of each row, one step of each row per round."""
    rows = {}
    for spec in specs:
        if spec.kind == "cram" and spec is not specs[0] and args.no_wall:
            continue  # further cram variants are timed only for the equal-wall-time table
        rows[f"{spec.name} compiled"] = Trainer(spec, args, data)
        if spec.kind in PEERS:
            rows[f"{spec.name} compiled, dense logits"] = Trainer(spec, args, data, sparse=False)
        if spec is specs[0]:
            rows[f"{spec.name} eager"] = Trainer(spec, args, data, compiled=False)
    batches = data.train_batches(specs[0])[:4]
    for trainer in rows.values():  # compile, then two warm-up steps
        for batch in batches[:3]:
            trainer.step(batch, trainer.lr(1e-4)).item()
    times: dict[str, list[float]] = {row: [] for row in rows}
    for i in range(args.speed_rounds):
        for row, trainer in rows.items():
            times[row].append(_timed(trainer, batches[i % len(batches)]))
    return {row: statistics.median(t) for row, t in times.items()}


def _timed(trainer: Trainer, batch: dict) -> float:
    lr = trainer.lr(1e-4)
    start = time.perf_counter()
    loss = trainer.step(batch, lr)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    else:
        loss.item()
    return time.perf_counter() - start


def train(args: argparse.Namespace, spec: Spec, data: Data, lr: float, steps: int, evals: int) -> dict:
    """Trains a fresh model for `steps`, evaluating `evals` times at even intervals, the last at the end."""
    # Loss at equal tokens does not depend on compiling; on a CPU the eager step spares a compile per run.
    trainer = Trainer(spec, args, data, compiled=data.device.type == "cuda")
    batches, val = data.train_batches(spec), data.val_batches_()
    curve = {"tokens": [], "loss": [], "lr": lr}
    began = time.perf_counter()
    marks = {round(k * steps / evals) for k in range(1, evals)} - {0, steps}
    with Bf16Matmuls() if _emulates_bf16(spec.dtype, data.device) else contextlib.nullcontext():
        for step in range(steps):
            if step in marks:
                curve["tokens"].append(step * args.batch * data.seq_len)
                curve["loss"].append(trainer.evaluate(val))
            scale = model.lr_schedule(spec.schedule, step / steps)
            loss = trainer.step(batches[step], trainer.lr(lr * scale))
            if step % 50 == 0 and not math.isfinite(loss.item()):
                break
        curve["tokens"].append(steps * args.batch * data.seq_len)
        curve["loss"].append(trainer.evaluate(val))
    curve["seconds"] = time.perf_counter() - began
    return curve


def _emulates_bf16(dtype: str, device: torch.device) -> bool:
    """Whether a run in `dtype` ("fp32" or "bf16") on `device` multiplies bf16 through bench/bf16_emulation.py."""
    return dtype == "bf16" and needed(device)


def equal_wall_time(args, specs, data, speed, best, curves) -> dict:
    """Each other model, at its best lr, for the tokens it trains in the time the first row takes for the budget."""
    first = specs[0]
    budget_s = data.steps * speed[f"{first.name} compiled"]
    print(
        f"\n## held-out MLM loss at equal wall time: {budget_s:.0f} s of steps at the measured speeds "
        f"(the time {first.name} needs for the budget)\n"
    )
    print("| model | best lr | steps in that time | tokens | loss |\n|---|---|---|---|---|")
    out = {}
    for spec in specs:
        lr = best[spec.name]
        steps = min(data.steps, int(budget_s / speed[f"{spec.name} compiled"]))
        if steps == data.steps:
            loss = curves[spec.name][lr]["loss"][-1]
        else:
            loss = train(args, spec, data, lr, steps, 1)["loss"][-1]
        out[spec.name] = {"steps": steps, "loss": loss}
        note = "" if steps < data.steps else " (the whole budget: faster than the first row)"
        print(
            f"| {spec.name} | {lr:g} | {steps} | {steps * args.batch * data.seq_len / 1e6:.2f}M | {loss:.3f}{note} |",
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()
