"""`[pretrain] average_last`: the output is the mean of the last checkpoints' params, the final state stays in
its checkpoint, a resumed run averages the same checkpoints, the cadence is in the key only while averaging,
and what cannot be averaged is refused before any stage runs with one line naming the key."""

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_bad_inputs import cram, write_workspace
from test_pretrain import pack, same_tensors, small  # noqa: F401 (pack: a fixture)

from cram.pipeline.planning import keyed_config
from cram.stages import pretrain
from cram.stages.pretraining import averaging, checkpoint, phases
from cram.stages.shared.special import SPECIAL_IDS

pytestmark = pytest.mark.usefixtures("one_thread")

AVERAGED = dict(budget=pretrain.Budget(steps=6), checkpoint_every_steps=2, average_last=3, keep_checkpoints=1)


def test_the_output_is_the_mean_of_the_last_checkpoints_and_the_final_state_stays_in_its_own(pack, tmp_path, make_ctx):  # noqa: F811
    out = pretrain.run(small(**AVERAGED), {"pack": pack}, tmp_path, make_ctx())
    root = tmp_path / "checkpoints"
    # keep_checkpoints = 1 is raised to the 3 that are averaged: steps 2, 4 and the end (6).
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4", "step-6"]
    assert out["averaged_steps"] == [2, 4, 6]
    saved = [load_file(root / f"step-{step}" / checkpoint.PARAMS) for step in (2, 4, 6)]
    output = load_file(tmp_path / "params.safetensors")
    assert output.keys() == saved[0].keys()
    for name, p in output.items():
        by_hand = (saved[0][name] + saved[1][name] + saved[2][name]) / 3
        assert torch.allclose(p, by_hand, rtol=1e-6, atol=1e-7), name
    assert not torch.equal(output["embed.tokens.weight"], saved[2]["embed.tokens.weight"])
    # The figures: the held-out loss of what is output, and of the final state it averaged.
    assert out["val_loss_unaveraged"] is not None and out["val_loss_end"] != out["val_loss_unaveraged"]


def test_the_final_state_alone_is_the_default(pack, tmp_path, make_ctx):  # noqa: F811
    out = pretrain.run(small(checkpoint_every_steps=2), {"pack": pack}, tmp_path, make_ctx())
    assert "averaged_steps" not in out and "val_loss_unaveraged" not in out
    assert same_tensors(tmp_path / "params.safetensors", tmp_path / "checkpoints" / "step-6" / checkpoint.PARAMS)


@pytest.mark.slow
def test_a_resumed_run_averages_the_same_checkpoints(pack, tmp_path, make_ctx):  # noqa: F811
    config = small(**AVERAGED)
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    pretrain.run(config, {"pack": pack}, straight_dir, make_ctx())
    # Stopped after step 2: its checkpoint alone in a fresh folder.
    shutil.copytree(straight_dir / "checkpoints" / "step-2", resumed_dir / "checkpoints" / "step-2")
    resumed = pretrain.run(config, {"pack": pack}, resumed_dir, make_ctx())
    assert resumed["averaged_steps"] == [2, 4, 6]
    assert same_tensors(resumed_dir / "params.safetensors", straight_dir / "params.safetensors")


def test_the_planned_steps_are_the_steps_a_tokens_budget_takes_through_the_ramp(pack, tmp_path, make_ctx):  # noqa: F811
    config = small(budget=pretrain.Budget(tokens=6000), batch_size=16, microbatch=8, ramp=0.5)
    plan = phases.plan(config, pack.outputs["seq_len"], SPECIAL_IDS, pack.outputs["vocab_size"])
    planned = averaging.planned_steps(config, plan)
    assert planned == pretrain.run(config, {"pack": pack}, tmp_path, make_ctx())["steps"]
    assert planned != 6000 // (16 * pack.outputs["seq_len"])  # the ramp's one-microbatch steps count


@pytest.mark.parametrize("steps, every, written", [(6, 2, 3), (7, 2, 4), (1, 5, 1), (0, 3, 0)])
def test_the_checkpoints_a_run_writes_are_the_cadence_and_the_end(steps, every, written):
    assert averaging.checkpoints_written(steps, every) == written


def test_the_cadence_is_in_the_key_only_while_averaging():
    plain, every = small(), small(checkpoint_every_steps=5)
    assert keyed_config(pretrain, plain) == keyed_config(pretrain, every)
    assert "average_last" not in keyed_config(pretrain, plain)
    averaged = dataclasses.replace(every, average_last=2)
    other_cadence = dataclasses.replace(averaged, checkpoint_every_steps=3)
    assert keyed_config(pretrain, averaged) != keyed_config(pretrain, other_cadence)
    assert keyed_config(pretrain, averaged)["checkpoint_every_steps"] == 5


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(average_last=0), "average_last: 0 must be >= 1"),
        (dict(average_last=2), "average_last: 2 averages the checkpoints at checkpoint_every_steps, and it is 0"),
        (dict(average_last=2, checkpoint_every_steps=1, checkpoint_every_minutes=5.0), "checkpoint_every_minutes: 5.0"),
        (dict(average_last=2, checkpoint_every_steps=1, budget=pretrain.Budget(hours=1, steps=4)), "budget.hours: 1"),
    ],
)
def test_what_names_no_checkpoints_is_refused_by_the_config(kw, message):
    with pytest.raises(ValueError, match=message):
        small(**kw)


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """test_bad_inputs' workspace (a steps = 2 budget, nothing run yet), as the cwd."""
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    return tmp_path


AVERAGING = ["--set", "pretrain.checkpoint_every_minutes=0", "--set", "pretrain.checkpoint_every_steps=1"]


def test_more_checkpoints_than_the_budget_writes_is_refused_before_any_stage(ws):
    result = cram("run", "pipeline.toml", *AVERAGING, "--set", "pretrain.average_last=3")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        "error: pretrain.average_last: 3, but the budget writes 2 checkpoints (2 steps, one every "
        "checkpoint_every_steps = 1 and one at the end): lower average_last or checkpoint_every_steps"
    )
    assert not (ws / "runs").exists()  # refused before tokenize ran
    assert cram("run", "pipeline.toml", *AVERAGING, "--set", "pretrain.average_last=2", "--dry-run").exit_code == 0


def test_a_config_refusal_is_one_line_naming_the_key(ws):
    result = cram("run", "pipeline.toml", "--set", "pretrain.average_last=2", "--dry-run")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "average_last: 2 averages the checkpoints at checkpoint_every_steps" in result.output
