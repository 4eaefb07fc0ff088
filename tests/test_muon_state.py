"""Muon keeps no second moment for its matrices (issue 60): a fresh state has none, the update is the same
as with the zeros it used to carry, and a checkpoint written with those zeros still resumes, bit for bit."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cram import model
from cram.model import ModelConfig, Muon, muon
from cram.stages import Upstream, pretrain
from cram.stages.pretraining import checkpoint
from cram.stages.shared.files import content_hash
from cram.stages.shared.special import SPECIAL_IDS
from cram.stages.shared.tensors import write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

MUON = Muon()
CFG = ModelConfig(vocab_size=256, hidden=32, layers=2, heads=2, intermediate=64, max_seq_len=16)


def batch_of(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(5, 256, (4, 16), generator=gen),
        "mlm_positions": torch.arange(16) * 4,
        "mlm_labels": torch.randint(5, 256, (16,), generator=gen),
    }


def test_a_fresh_muon_state_has_no_second_moment_for_the_matrices_and_updates_as_with_the_zeros():
    params = model.init(CFG, seed=0)
    lean, old = model.optimizer_init(model.Muon(), params), model.optimizer_init(model.AdamW(), params)
    matrices = [name for name in params if muon.takes(name)]
    assert len(matrices) == 8 and set(old) - set(lean) == {f"exp_avg_sq.{name}" for name in matrices}
    assert set(model.optimizer_init(model.AdamW(), params)) == set(old)
    step = model.make_train_step(CFG, MUON, model.EAGER)
    runs = {}
    for layout, state in (("lean", lean), ("old", old)):
        p = params
        for i in range(3):
            p, state, _ = step(p, state, batch_of(i), torch.tensor(1e-3))
        runs[layout] = p, state
    assert all(torch.equal(runs["lean"][0][k], runs["old"][0][k]) for k in params)
    assert list(runs["lean"][1]) == list(lean)  # the layout stays as it came: no recompile
    assert list(runs["old"][1]) == list(old) and all(not runs["old"][1][f"exp_avg_sq.{n}"].any() for n in matrices)
    assert list(model.drop_unused(model.Muon(), runs["old"][1])) == list(lean)
    assert model.drop_unused(model.AdamW(), old) == old


def test_a_second_moment_that_is_not_zero_is_never_dropped():
    params = model.init(CFG, seed=0)
    state = model.optimizer_init(model.AdamW(), params)
    name = next(n for n in params if muon.takes(n))
    state[f"exp_avg_sq.{name}"] += 1.0
    assert f"exp_avg_sq.{name}" in model.drop_unused(model.Muon(), state)


@pytest.fixture
def pack(tmp_path) -> Upstream:
    folder = tmp_path / "pack"
    folder.mkdir()
    rng = np.random.default_rng(0)
    np.save(folder / "train.npy", rng.integers(5, 256, size=(256, 32), dtype=np.uint16))
    np.save(folder / "val.npy", rng.integers(5, 256, size=(32, 32), dtype=np.uint16))
    outputs = {"train": "train.npy", "val": "val.npy", "seq_len": 32, "vocab_size": 256, "special_ids": SPECIAL_IDS}
    return Upstream(folder, outputs)


def test_a_muon_checkpoint_written_with_the_zeros_resumes_bit_identical(pack, tmp_path, make_ctx):
    config = pretrain.Config(
        model=pretrain.Architecture(hidden=32, layers=1, heads=2, intermediate=64),
        optimizer=MUON,
        budget=pretrain.Budget(steps=4),
        microbatch=8,
        batch_size=8,
        ramp=0.0,
        compile=True,
        backend="aot_eager",
        checkpoint_every_steps=2,
        checkpoint_every_minutes=0,
        log_every_steps=1,
        val_blocks=0,
        precision="fp32",
    )
    pretrain.run(config, {"pack": pack}, tmp_path / "straight", make_ctx())
    saved = tmp_path / "straight" / "checkpoints"
    written = load_file(saved / "step-4" / checkpoint.OPTIMIZER)
    assert not [key for key in written if key.startswith("exp_avg_sq.") and muon.takes(key[len("exp_avg_sq.") :])]

    # The step-2 checkpoint as the code before issue 60 wrote it: a zero second moment for every Muon matrix.
    old = tmp_path / "resumed" / "checkpoints" / "step-2"
    shutil.copytree(saved / "step-2", old)
    state = load_file(old / checkpoint.OPTIMIZER)
    params = load_file(old / checkpoint.PARAMS)
    state |= {f"exp_avg_sq.{n}": torch.zeros_like(p) for n, p in params.items() if muon.takes(n)}
    write_tensors(old / checkpoint.OPTIMIZER, state)
    sums = {name: content_hash(old / name) for name in (checkpoint.PARAMS, checkpoint.OPTIMIZER, checkpoint.STATE)}
    (old / checkpoint.CHECKSUMS).write_text(json.dumps(sums))

    pretrain.run(config, {"pack": pack}, tmp_path / "resumed", make_ctx())
    logged = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [3, 4]  # it resumed from the old checkpoint, which passed its checksums
    for name in (checkpoint.PARAMS, checkpoint.OPTIMIZER):
        ours, theirs = (
            load_file(tmp_path / "resumed" / "checkpoints" / "step-4" / name),
            load_file(saved / "step-4" / name),
        )
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name
