"""A run says what it does: pretraining warns when its budget repeats a small data set many times or
when the data holds fewer held-out blocks than asked for, and fine-tuning writes progress lines to the
log (the only sign of life where no terminal draws a bar)."""

from __future__ import annotations

import numpy as np
import pytest
import structlog
import torch
from structlog.testing import capture_logs

from cram.stages import Upstream, pretrain
from cram.stages.pretraining.phases import Phase, plan
from cram.stages.pretraining.setup import planned_passes
from cram.stages.shared.precision import FP32
from cram.stages.shared.progress import Every
from cram.stages.shared.special import SPECIAL_IDS
from cram.stages.tasks.config import TaskSettings

pytestmark = pytest.mark.usefixtures("one_thread")
SEQ = 16


def small_pack(tmp_path, train: int, val: int) -> Upstream:
    folder = tmp_path / "pack"
    folder.mkdir()
    rng = np.random.default_rng(0)
    np.save(folder / "train.npy", rng.integers(5, 64, size=(train, SEQ), dtype=np.uint16))
    np.save(folder / "val.npy", rng.integers(5, 64, size=(val, SEQ), dtype=np.uint16))
    outputs = {"train": "train.npy", "val": "val.npy", "seq_len": SEQ, "vocab_size": 64, "special_ids": SPECIAL_IDS}
    return Upstream(folder, outputs)


def config(**kw) -> pretrain.Config:
    defaults = dict(
        model=pretrain.Architecture(hidden=16, layers=1, heads=2, intermediate=32),
        microbatch=4,
        batch_size=4,
        compile=False,
        log_every_steps=10,
        checkpoint_every_minutes=0,
        val_blocks=8,
        precision="fp32",
    )
    return pretrain.Config(**{**defaults, **kw})


def warnings_of(cfg: pretrain.Config, pack: Upstream, tmp_path, make_ctx) -> list[str]:
    with capture_logs() as logs:
        pretrain.run(cfg, {"pack": pack}, tmp_path / "out", make_ctx())
    return [e["event"] for e in logs if e["log_level"] == "warning"]


def test_a_budget_of_many_passes_and_a_cut_val_blocks_are_each_one_warning(tmp_path, make_ctx):
    # 12 steps of 4 sequences over 8 blocks: 6 passes; val holds 3 of the 8 blocks asked for.
    said = warnings_of(config(budget=pretrain.Budget(steps=12)), small_pack(tmp_path, 8, 3), tmp_path, make_ctx)
    assert said == [
        "pretrain.val_blocks = 8, but pack's val holds 3 blocks: the held-out loss uses those 3",
        "the budget makes about 6.0 passes over the 8 training blocks (more than 4): each block is seen "
        "that often; a larger corpus or a smaller budget repeats less",
    ]


def test_a_token_budget_and_the_ramp_count_the_passes(tmp_path):
    def setup(cfg: pretrain.Config):
        return type("Setup", (), {"blocks": np.zeros((10, SEQ)), "plan": plan(cfg, SEQ, SPECIAL_IDS, 64)})

    tokens = config(budget=pretrain.Budget(tokens=100 * SEQ))
    assert planned_passes(tokens, setup(tokens), 1) == pytest.approx(10)
    ramped = config(budget=pretrain.Budget(steps=100), batch_size=8, ramp=1.0)  # 1 then 2 microbatches
    assert planned_passes(ramped, setup(ramped), 1) == pytest.approx(100 * 1.5 * 4 / 10)
    hours = config(budget=pretrain.Budget(hours=1.0))
    assert planned_passes(hours, setup(hours), 1) is None
    # Phases: each step holds the same tokens, so a second phase at twice the length makes the same passes.
    phased = config(budget=pretrain.Budget(steps=100), phases=(Phase(SEQ, until=0.5), Phase(2 * SEQ)))
    assert planned_passes(phased, setup(phased), 1) == pytest.approx(100 * 4 / 10)


def test_a_time_budget_is_checked_once_spent(tmp_path, make_ctx):
    said = warnings_of(
        config(budget=pretrain.Budget(hours=0.5 / 3600), val_blocks=0), small_pack(tmp_path, 1, 1), tmp_path, make_ctx
    )
    assert len(said) == 1 and said[0].startswith("the budget made ") and "over the 1 training blocks" in said[0]


def test_every_is_due_once_a_period():
    now = [0.0]
    every = Every(30.0, clock=lambda: now[0])
    assert not every.due()
    now[0] = 29.0
    assert not every.due()
    now[0] = 31.0
    assert every.due() and not every.due()
    now[0] = 61.0
    assert every.due()


def test_fine_tuning_logs_its_start_and_progress(monkeypatch):
    from cram.stages.finetuning import finetune

    monkeypatch.setattr(finetune, "PROGRESS_EVERY_S", 0.0)  # a line at every step
    tuner = tiny_tuner()
    rows = [np.array([2, 5 + i % 7, 3]) for i in range(10)]
    train = (rows, np.array([3] * 10), np.array([i % 2 for i in range(10)]))
    with capture_logs() as logs:
        tuner.train(
            2,
            train,
            TaskSettings(epochs=2, seeds=1, lr=1e-3, max_length=16),
            seed=0,
            log=structlog.get_logger().bind(task="sent", seed=0),
        )
    lines = [(e["task"], e["seed"], e["step"], "loss" in e) for e in logs if e["event"] == "fine-tuning"]
    assert lines[0] == ("sent", 0, "0/6", False)  # 10 examples in batches of 4: 3 steps an epoch
    assert [line[2] for line in lines[1:]] == [f"{n}/6" for n in range(1, 7)] and all(line[3] for line in lines[1:])


def tiny_tuner():
    from cram import model
    from cram.stages import evaluate
    from cram.stages.finetuning.finetune import Tuner

    cfg = model.ModelConfig(vocab_size=16, hidden=16, layers=1, heads=2, intermediate=32, max_seq_len=16)
    ev = evaluate.Config(tasks=[], batch_size=4, buckets=(16,), max_length=16, compile=False, head_width=0).linked({})
    return Tuner.make(ev.tuning(), cfg, model.init(cfg, seed=0), SPECIAL_IDS, torch.device("cpu"), FP32)
